"""Policy-update throughput, peak memory per worker and bytes per weight sync: 1 vs 2 workers (ddp, fsdp),
LoRA against full fine-tuning, model parallelism and each memory and precision option, on a model big enough
to be compute-bound on this CPU; padding processed by fixed-count vs token-budget micro-batches on
mixed-length responses; the measured all-reduce bandwidth and the gradient compression it picks.

    python -m bench.distributed                  # ~25M-parameter model, 3 timed updates per setting
    python -m bench.distributed --hidden 256 --layers 2 --repeats 2   # quicker

Every setting runs the real worker group (Ray actors, one gloo process group) on the same batch. Total
threads are the same in every setting (trainer.num_threads = threads / workers), so 1 vs 2 workers compares
how the work is split, not how many cores it gets. Prints a Markdown table (medians) and writes
bench/results/distributed.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.memory import PeakSampler, rss_of
from components.batch import Batch
from components.data.io import write_json
from components.models import build_char_tokenizer, build_tiny_model, save_pretrained
from components.training.loop import micro_batches, padded_tokens
from components.validate import load_checked


def mixed_batch(vocab: int, rows: int, prompt_len: int, max_resp: int, seed: int = 0) -> Batch:
    """Rows with prompts of 1/2..1 x prompt_len and responses of 1/8..1 x max_resp tokens (mixed lengths)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (rows, prompt_len), generator=g)
    p_len = torch.randint(prompt_len // 2, prompt_len + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(prompt_len)[None, :] >= prompt_len - p_len[:, None]).long()  # left padding
    responses = torch.randint(3, vocab, (rows, max_resp), generator=g)
    r_len = torch.randint(max(1, max_resp // 8), max_resp + 1, (rows,), generator=g)
    response_mask = (torch.arange(max_resp)[None, :] < r_len[:, None]).long()
    adv = torch.randn(rows, generator=g)[:, None] * response_mask
    return Batch(
        {
            "prompts": prompts,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "advantages": adv,
        },
        meta={"iteration": 1},
    )


def timed_updates(cfg, batch: Batch, n_workers: int, repeats: int) -> dict:
    """Median seconds per update (after one warm-up) and the peak RSS growth of each worker during them."""
    from components.plan import make_plan
    from components.training.ray_workers import policy_group

    group = policy_group(make_plan(cfg), n_workers)
    pids = group.pids
    try:
        setup = rss_of(pids)()  # model (and reference) loaded, no optimizer state yet
        group.update(batch)  # warm-up
        peaks = PeakSampler(rss_of(pids), 0.02)
        times = []
        with peaks:
            for _ in range(repeats):
                start = time.perf_counter()
                metrics = group.update(batch)
                times.append(time.perf_counter() - start)
        import ray

        # what one weight sync sends the rollout engine (every rank joins the gather; rank 0 answers)
        sent = ray.get([a.get_weights.remote() for a in group.actors])[0][0]
        return {
            "sync_mib": sum(t.numel() * t.element_size() for t in sent.values()) / 2**20,
            "s_per_update": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "peak_rss_gib": [round(p / 2**30, 3) for p in peaks.peak],
            "update_rss_gib": [round((p - s) / 2**30, 3) for p, s in zip(peaks.peak, setup)],
            "metrics": metrics,
        }
    finally:
        group.stop()


SETTINGS = [  # (name, workers, overrides)
    ("1 worker", 1, []),
    ("2 workers ddp", 2, ["trainer.strategy=ddp", "trainer.grad_compression=none"]),
    ("2 workers fsdp", 2, ["trainer.strategy=fsdp"]),
    ("1 worker + gradient_checkpointing", 1, ["memory_optim.gradient_checkpointing=true"]),
    ("1 worker + bf16 autocast", 1, ["mixed_precision.enabled=true", "mixed_precision.dtype=bf16"]),
    ("2 workers fsdp + bf16 params", 2, ["trainer.strategy=fsdp", "mixed_precision.enabled=true"]),
    (
        "2 workers fsdp + param/optimizer offload",
        2,
        ["trainer.strategy=fsdp", "memory_optim.param_offload=true", "memory_optim.optimizer_offload=true"],
    ),
    ("1 worker, token-budget micro-batches", 1, ["actor.ppo_max_token_len_per_worker={budget}"]),
    ("2 workers tensor parallel (tp2)", 2, ["actor.tensor_model_parallel_size=2"]),
    (
        "4 workers tensor parallel x fsdp (tp2 x dp2)",
        4,
        ["actor.tensor_model_parallel_size=2", "trainer.strategy=fsdp"],
    ),
    ("1 worker LoRA r16 (adapters synced)", 1, ["actor.lora.rank=16", "actor.optimizer.lr=1e-3"]),
    (
        "1 worker LoRA r16, merged weights synced",
        1,
        ["actor.lora.rank=16", "actor.optimizer.lr=1e-3", "engine.lora_merge_on_sync=true"],
    ),
    (
        "2 workers tensor parallel + sequence parallel (tp2, sp)",
        2,
        ["actor.tensor_model_parallel_size=2", "actor.sequence_parallel=true"],
    ),
    (
        "2 workers pipeline parallel (pp2, 1f1b, 4 micro-batches)",
        2,
        ["actor.pipeline_model_parallel_size=2", "actor.pipeline_microbatches=4"],
    ),
    (
        "4 workers pipeline x data parallel (pp2 x dp2)",
        4,
        ["actor.pipeline_model_parallel_size=2", "actor.pipeline_microbatches=4"],
    ),
    (
        "4 workers pipeline x tensor parallel (pp2 x tp2)",
        4,
        [
            "actor.pipeline_model_parallel_size=2",
            "actor.pipeline_microbatches=4",
            "actor.tensor_model_parallel_size=2",
        ],
    ),
]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rows", type=int, default=32, help="responses per update")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-resp", type=int, default=48)
    p.add_argument("--micro", type=int, default=8, help="fixed-count micro-batch rows")
    p.add_argument("--threads", type=int, default=2, help="torch threads in all, split over the workers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", nargs="*", help="run only settings whose name contains one of these")
    p.add_argument(
        "--skip",
        nargs="*",
        help="skip settings whose name contains one of these (bf16 on a CPU "
        "without bf16 matmul units takes minutes per update)",
    )
    p.add_argument("--out", default="bench/results/distributed.json")
    a = p.parse_args(argv)

    from components.training import distributed as D
    from components.training.ray_workers import ensure_ray

    tok = build_char_tokenizer()
    model = build_tiny_model(
        tok,
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=max(1, a.hidden // 64),
        intermediate_size=4 * a.hidden,
        max_positions=a.prompt_len + a.max_resp,
        seed=0,
    )
    n_params = sum(p.numel() for p in model.parameters())
    tmp = Path(tempfile.mkdtemp(prefix="bench_dist_"))
    save_pretrained(model, tok, tmp / "model")
    batch = mixed_batch(len(tok), a.rows, a.prompt_len, a.max_resp)
    real_tokens = int(batch.tensors["prompt_mask"].sum() + batch.tensors["response_mask"].sum())
    seq = a.prompt_len + a.max_resp
    budget = a.micro * seq  # as many padded tokens as a fixed micro-batch of full-length rows

    # padding processed: fixed-count micro-batches vs packed to the same token budget
    fixed = micro_batches(batch, a.micro)
    packed = micro_batches(batch, None, budget)
    untrimmed = len(batch) * seq
    pad = {
        "real_tokens": real_tokens,
        "untrimmed_padded": untrimmed,
        "fixed_count_padded": sum(padded_tokens(m) for m in fixed),
        "token_budget_padded": sum(padded_tokens(m) for m in packed),
        "fixed_count_micro_batches": len(fixed),
        "token_budget_micro_batches": len(packed),
    }
    pad["padding_fixed"] = pad["fixed_count_padded"] - real_tokens
    pad["padding_budget"] = pad["token_budget_padded"] - real_tokens
    pad["padding_untrimmed"] = untrimmed - real_tokens

    ensure_ray()
    base = [
        f"actor.model.path={tmp / 'model'}",
        f"data.batch_size={a.rows // 8}",
        "engine.n=8",
        f"actor.ppo_micro_batch_size={a.micro}",
        f"actor.model.max_seq_len={seq}",
        f"data.max_prompt_len={a.prompt_len}",
        f"engine.max_new_tokens={a.max_resp}",
    ]
    rows = []
    for name, n, extra in SETTINGS:
        if (a.only and not any(o in name for o in a.only)) or (a.skip and any(o in name for o in a.skip)):
            continue
        extra = [e.format(budget=budget) for e in extra]
        cfg = load_checked(
            None, base + extra + [f"trainer.num_workers={n}", f"trainer.num_threads={max(1, a.threads // n)}"]
        )
        r = timed_updates(cfg, batch, n, a.repeats)
        r.update(setting=name, workers=n, tokens_per_s=real_tokens / r["s_per_update"])
        rows.append(r)
        print(
            f"{name}: {r['s_per_update']:.2f} s/update, {r['tokens_per_s']:.0f} tokens/s, peak RSS per worker "
            f"{r['peak_rss_gib']} GiB, {r['sync_mib']:.2f} MiB per weight sync",
            flush=True,
        )

    # all-reduce bandwidth between two workers, as measured, and under a simulated 0.05 GB/s link
    comp = {}
    for label, cap in (("measured", None), ("capped 0.05 GB/s", 0.05)):
        cfg = load_checked(
            None,
            base
            + ["trainer.num_workers=2", "trainer.strategy=ddp", "trainer.num_threads=1"]
            + ([f"trainer.simulated_bandwidth_gbps={cap}"] if cap else []),
        )
        r = timed_updates(cfg, batch, 2, 1)
        m = r["metrics"]
        comp[label] = {
            "allreduce_gbps": m["perf/allreduce_gbps"],
            "choice": {0: "none", 1: "fp16", 2: "powersgd"}[int(m["perf/grad_compression"])],
            "rank": int(m["perf/grad_compression_rank"]),
            "s_per_update": r["s_per_update"],
        }
        print(f"all-reduce {label}: {comp[label]}", flush=True)

    print(
        f"\nmodel: {n_params / 1e6:.1f} M parameters; batch {a.rows} rows, {real_tokens} real tokens; "
        f"{a.threads} threads in all\n"
    )
    print(
        "| setting | workers | s / update (median) | tokens/s | vs 1 worker | peak RSS per worker (GiB) | "
        "of it, above the loaded model (GiB) | sent per weight sync (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ref = next((r for r in rows if r["setting"] == "1 worker"), rows[0] if rows else None)
    for r in rows:
        print(
            f"| {r['setting']} | {r['workers']} | {r['s_per_update']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{ref['s_per_update'] / r['s_per_update']:.2f}x | {', '.join(map(str, r['peak_rss_gib']))} | "
            f"{', '.join(map(str, r['update_rss_gib']))} | {r['sync_mib']:.2f} |"
        )
    print(
        f"\npadding tokens computed in one update over {a.rows} mixed-length rows: untrimmed "
        f"{pad['padding_untrimmed']}, fixed {a.micro}-row micro-batches {pad['padding_fixed']}, token budget "
        f"{budget} {pad['padding_budget']} ({pad['padding_budget'] / max(1, pad['padding_fixed']):.2f}x of fixed)"
    )
    for label, c in comp.items():
        print(
            f"all-reduce {label}: {c['allreduce_gbps']:.3f} GB/s -> {c['choice']}"
            + (f" (rank {c['rank']})" if c["choice"] == "powersgd" else "")
        )
    for r in rows:
        r.pop("metrics", None)
    write_json(
        {
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
            "params": n_params,
            "args": vars(a),
            "settings": rows,
            "padding": pad,
            "compression": comp,
            "strategies": D.STRATEGIES.names(),
        },
        a.out,
    )


if __name__ == "__main__":
    main()
