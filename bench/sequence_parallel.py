"""What sequence parallelism saves: the activations each tensor-parallel worker keeps for backward, and the
seconds of a forward-backward, with TP alone vs TP + sequence parallelism (actor.sequence_parallel), beside
one worker holding the whole model.

    python -m bench.sequence_parallel                 # ~25M-parameter model, 8 rows x 256 tokens, TP 2
    python -m bench.sequence_parallel --seq 64 --repeats 3   # quicker

Saved activations are counted exactly (torch.autograd.graph.saved_tensors_hooks: the bytes of every distinct
storage autograd keeps, a DTensor's local shard, the weights left out), not sampled from the process's RSS,
which at these sizes is noise. Each setting runs in fresh processes (gloo on CPU) with the same total
threads; seconds are medians over --repeats forward-backward passes, the settings alternated. Prints a
Markdown table and writes bench/results/sequence_parallel.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from components.data.io import write_json

SETTINGS = {  # name -> (tensor-parallel workers, sequence parallel)
    "1 worker": (1, False),
    "tp2": (2, False),
    "tp2 + sequence parallel": (2, True),
}


def _storage(t: torch.Tensor):
    from torch.distributed.tensor import DTensor

    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


def saved_bytes(fn, params) -> tuple[int, object]:
    """Bytes of the distinct storages autograd saves for backward while `fn()` runs (a DTensor's local
    shard), the parameters' own storages left out: activations only. Returns them and fn()'s result."""
    weights = {_storage(p.detach()).data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = _storage(t)
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _worker(rank: int, world: int, port: int, a, setting: str, out: str) -> None:
    import torch.distributed as dist

    from components.models import build_char_tokenizer, build_tiny_model
    from components.training.logprobs import sequence_inputs
    from components.training.tensor_parallel import parallelize

    tp, sp = SETTINGS[setting]
    torch.set_num_threads(max(1, a.threads // world))
    model = build_tiny_model(
        build_char_tokenizer(),
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=max(1, a.hidden // 64),
        intermediate_size=4 * a.hidden,
        max_positions=a.seq,
        seed=0,
    )
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        parallelize(model, init_device_mesh("cpu", (world,)), sequence_parallel=sp)
    g = torch.Generator().manual_seed(0)
    half = a.seq // 2
    prompts, responses = (torch.randint(3, 90, (a.rows, half), generator=g) for _ in range(2))
    ids, mask, pos = sequence_inputs(prompts, torch.ones_like(prompts), responses, torch.ones_like(responses))

    def forward():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits

    times, saved = [], 0
    for i in range(a.repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        saved, logits = saved_bytes(forward, list(model.parameters()))
        logits.float().logsumexp(-1).mean().backward()
        if i:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    torch.save({"saved_bytes": saved, "seconds": times}, f"{out}/{setting}-{rank}.pt")
    if tp > 1:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=256, help="tokens per row (prompt + response)")
    p.add_argument("--threads", type=int, default=2, help="torch threads in all, split over the workers")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="times each setting runs, alternated")
    p.add_argument("--out", default="bench/results/sequence_parallel.json")
    a = p.parse_args(argv)

    import torch.multiprocessing as mp

    from components.training.distributed import free_port

    tmp = tempfile.mkdtemp(prefix="bench_sp_")
    seconds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    saved: dict[str, list[int]] = {}
    for _ in range(a.rounds):
        for name, (tp, _sp) in SETTINGS.items():
            mp.spawn(_worker, args=(tp, free_port(), a, name, tmp), nprocs=tp, join=True)
            parts = [torch.load(Path(tmp) / f"{name}-{r}.pt") for r in range(tp)]
            saved[name] = [part["saved_bytes"] for part in parts]
            seconds[name] += [max(s) for s in zip(*(part["seconds"] for part in parts))]
    base_saved, base_s = saved["1 worker"][0], statistics.median(seconds["1 worker"])
    rows = []
    print(f"{a.rows} rows x {a.seq} tokens, hidden {a.hidden}, {a.layers} layers, {a.threads} threads in all")
    print(
        "| setting | saved activations per worker (MiB) | vs 1 worker | s per forward-backward | vs 1 worker |"
    )
    print("|---|---|---|---|---|")
    for name in SETTINGS:
        mib = max(saved[name]) / 2**20
        s = statistics.median(seconds[name])
        rows.append({"setting": name, "saved_bytes_per_worker": saved[name], "s_median": s})
        print(f"| {name} | {mib:.1f} | {max(saved[name]) / base_saved:.2f}x | {s:.3f} | {s / base_s:.2f}x |")
    write_json({"args": vars(a), "rows": rows}, Path(a.out))


if __name__ == "__main__":
    main()
