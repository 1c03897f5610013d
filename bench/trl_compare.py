"""Seconds per GRPO step, ours against TRL's `GRPOTrainer`, same machine, same run, same model, data, reward
and hyper-parameters; alternated A B A B.

    python -m bench.trl_compare                          # W1 (beta 0 and 0.04) and W2, 2 pairs each
    python -m bench.trl_compare --workloads w1 --pairs 1 --steps 10      # quicker
    python -m bench.trl_compare --modes sync one_step_off bounded_staleness --betas 0   # async modes

Needs the `bench` extra (`pip install -e '.[bench]'`: TRL). W1: the default tiny model after SFT, 16 prompts x 8
samples, up to 16 new tokens. W2: a ~25M-parameter model of the same architecture (wider, deeper; randomly
initialised, so it samples the full 64 new tokens), 8 prompts x 8 samples. Temperature 1.0, one optimizer
step per generation batch, AdamW at a constant learning rate, token-mean loss, clip 0.2, group-std scaled
advantages; TRL runs on the CPU with `use_vllm=False`.

Each run is its own process (ours: `reinforge train`, as a user types it, so Prefect tasks, Ray actors and MLflow
logging are inside every step; TRL: a script around its trainer), and its wall time, CPU seconds and peak memory
are of that process with all its descendants. A step's time is the wall time between the ends of consecutive steps
(ours from the MLflow timestamps of each step's metrics), the first step (warm-up) and our last one (which
also runs the held-out test) left out. Held-out greedy accuracy of the start and of each final model is
measured by the same evaluator. Prints Markdown tables and writes bench/results/trl_compare.json and
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from bench.memory import PeakSampler, pss_of_tree

WORKLOADS = {
    "w1": {"prompts": 16, "n": 8, "max_new": 16, "betas": (0.0, 0.04), "model": "sft"},
    "w2": {"prompts": 8, "n": 8, "max_new": 64, "betas": (0.0,), "model": "wide", "hidden": 512, "layers": 6},
}
LR, CLIP, SEED = 1e-4, 0.2, 0
WORK = Path("checkpoints/bench_trl")
CONFIG = "configs/arith_grpo.yaml"


def model_dir(w: str) -> Path:
    return Path("checkpoints/sft") if WORKLOADS[w]["model"] == "sft" else WORK / f"{w}_model"


def ensure_models(workloads: list[str]) -> None:
    """The default data and SFT model (the flows `dvc repro` runs) and, for W2, the wide model."""
    from components.models import build_char_tokenizer, build_tiny_model, save_pretrained
    from components.validate import load_checked

    cfg = load_checked(CONFIG, [])
    if not Path(cfg.data.train_path).is_file():
        from flows.data import data_flow

        data_flow(CONFIG, [])
    if not (Path(cfg.sft.output_dir) / "config.json").is_file():
        from flows.sft import sft_flow

        sft_flow(CONFIG, [])
    for w in workloads:
        spec, out = WORKLOADS[w], model_dir(w)
        if spec["model"] == "wide" and not (out / "config.json").is_file():
            tok = build_char_tokenizer()
            model = build_tiny_model(
                tok,
                hidden_size=spec["hidden"],
                num_layers=spec["layers"],
                num_heads=spec["hidden"] // 64,
                intermediate_size=4 * spec["hidden"],
                max_positions=128,
                seed=SEED,
            )
            save_pretrained(model, tok, out)


def mean_prompt_tokens(w: str) -> float:
    """Prompt tokens per row, averaged over the training data (as both trainers tokenize it)."""
    from components.data.io import read_rows, to_plain
    from components.data.prompts import encode_prompts
    from components.models.loading import load_tokenizer
    from components.settings import PromptSettings
    from components.validate import load_checked

    rows = [to_plain(r) for r in read_rows(load_checked(CONFIG, []).data.train_path).to_dict("records")]
    prompts = [r["prompt"] for r in rows]
    return statistics.mean(map(len, encode_prompts(load_tokenizer(model_dir(w)), prompts, PromptSettings())))


def n_params(path: Path) -> int:
    from components.models.loading import load_model

    return sum(p.numel() for p in load_model(path).parameters())


def peak_memory(tree, pss: PeakSampler) -> dict:
    """Peak RSS (GiB) of the run's process with its descendants (Ray's workers among them) and its split by
    role at that moment, from `tree` (bench.startup.TreeTimeline: RSS read every 200 ms, a light touch on a
    2-core machine); their peak PSS (shared pages counted once), from `pss`."""
    return {
        "peak_rss_gib": tree.peak_rss / 2**30,
        "peak_rss_by_role_gib": {role: held / 2**30 for role, held in tree.rss_at_peak.items()},
        "peak_pss_gib": pss.peak[0] / 2**30,
    }


# ---------------------------------------------------------------- the runs: one process each


def ours_command(w: str, beta: float, steps: int, out: Path, extra: list[str]) -> list[str]:
    """`reinforge train` for `steps` iterations, as a user types it; `extra`: more overrides."""
    spec = WORKLOADS[w]
    overrides = [
        f"actor.model.path={model_dir(w)}",
        f"data.batch_size={spec['prompts']}",
        f"engine.n={spec['n']}",
        f"engine.max_new_tokens={spec['max_new']}",
        "engine.temperature=1.0",
        f"algorithm.kl_loss_coef={beta}",
        f"algorithm.clip_epsilon={CLIP}",
        f"actor.optimizer.lr={LR}",
        f"trainer.iterations={steps}",
        f"trainer.save_interval={steps}",
        f"trainer.test_interval={steps}",
        "trainer.eval_size=16",
        "trainer.eval_k=1",
        "trainer.save_optimizer=false",
        "trainer.resume_mode=disable",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        "trainer.experiment_name=bench-trl",
        f"actor.model.max_seq_len={16 + spec['max_new']}",
        *extra,
    ]
    reinforge = Path(sys.executable).with_name("reinforge")
    return [str(reinforge), "train", "--config", CONFIG, *overrides, "--json"]


def ours_result(info: dict, w: str, steps: int) -> dict:
    """The per-step figures of our run `info` (what `reinforge train --json` printed), from its MLflow run."""
    import mlflow

    from components.tracking.mlflow_tracker import default_tracking_uri

    spec = WORKLOADS[w]
    client = mlflow.tracking.MlflowClient(default_tracking_uri())
    run_metrics = client.get_run(info["run_id"]).data.metrics  # the last value of each
    names = [
        k
        for k in run_metrics
        if k.startswith(("timing_s/", "perf/")) or k in ("critic/score/mean", "response_length/mean", *ASYNC)
    ]
    hist = {m: {x.step: x for x in client.get_metric_history(info["run_id"], m)} for m in names}
    ends = {s: x.timestamp / 1000 for s, x in hist["critic/score/mean"].items()}
    step_s = [ends[s] - ends[s - 1] for s in range(2, steps)]  # not the first (warm-up) nor the last (test)
    stages = {
        k: statistics.median(h[s].value for s in range(2, steps) if s in h)
        for k, h in hist.items()
        if (k.startswith(("timing_s/", "perf/")) or k in ASYNC) and any(s in h for s in range(2, steps))
    }
    rows = spec["prompts"] * spec["n"]
    return {
        "step_s": step_s,
        "reward": [hist["critic/score/mean"][s].value for s in sorted(ends)],
        "gen_tokens": [hist["response_length/mean"][s].value * rows for s in sorted(ends)],
        "stages": stages,
        "final_model": info["final_model"],
        # the run's two ends: process start -> first rollout, and the final save and logged model (their own
        # timings); last step -> exit is the bench's, from the last step's logged time
        "ends": {
            "first_rollout_s": run_metrics.get("timing_s/startup/first_gen", float("nan")),
            "finalize_s": run_metrics.get("timing_s/finalize", float("nan")),
            "last_step_at": max(ends.values()),
        },
    }


def child_trl(w: str, beta: float, steps: int, out: Path) -> dict:
    """TRL's GRPOTrainer on the CPU (use_vllm=False) with the same model, data, reward and settings."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from components.data.io import read_rows, to_plain
    from components.data.prompts import render_prompt
    from components.models.loading import load_tokenizer
    from components.rewards.registry import scorer_for
    from components.settings import PromptSettings
    from components.validate import load_checked

    spec = WORKLOADS[w]
    cfg = load_checked(CONFIG, [])
    tok = load_tokenizer(model_dir(w))
    rows = [to_plain(r) for r in read_rows(cfg.data.train_path).to_dict("records")]
    data = Dataset.from_list(
        [
            {
                "prompt": render_prompt(tok, r["prompt"], PromptSettings()),
                "ground_truth": r["reward_model"]["ground_truth"],
            }
            for r in rows
        ]
    )
    score = scorer_for("arith", cfg)

    def reward(completions, ground_truth, **_):
        return [score(c, g, {}) for c, g in zip(completions, ground_truth)]

    timing = {"gen": [], "ends": []}

    class Clock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            timing["ends"].append(time.perf_counter())

    rows_per_step = spec["prompts"] * spec["n"]
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=SEED,
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        per_device_train_batch_size=rows_per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=spec["n"],
        max_completion_length=spec["max_new"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=beta,
        epsilon=CLIP,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_vllm=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir(w), dtype="float32", attn_implementation="sdpa")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    generate = trainer._generate  # timed, not changed

    def timed_generate(*a, **k):
        start = time.perf_counter()
        result = generate(*a, **k)
        timing["gen"].append(time.perf_counter() - start)
        return result

    trainer._generate = timed_generate
    start = time.perf_counter()
    trainer.train()
    ends = [start] + timing["ends"]
    step_s = [ends[i] - ends[i - 1] for i in range(2, len(ends))]  # not the first (warm-up)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    final = out / "final"
    trainer.save_model(str(final))
    tok.save_pretrained(str(final))
    lengths = [h["completions/mean_length"] * rows_per_step for h in logs]
    return {
        "step_s": step_s,
        "reward": [h["reward"] for h in logs],
        "gen_tokens": lengths,
        "stages": {"timing_s/gen": statistics.median(timing["gen"][1:])},
        "final_model": str(final),
    }


# the asynchronous modes' per-step figures the report gives beside the stages
ASYNC = ("async/staleness/mean", "async/staleness/max", "async/partial_samples")


def setting_cells(r: dict) -> str:
    """A result's first cells in every table: its workload, beta and our async_mode."""
    return f"| {r['workload']} | {r['beta']:g} | {r.get('mode', 'config')} |"


def stage_table(results: list[dict], keys: list[str]) -> list[str]:
    """A markdown table of our runs' per-step medians of `keys`, one row per workload, beta and mode."""
    lines = ["| workload | beta | mode | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    for r in results:
        st = [p["ours"]["stages"] for p in r["pairs"]]
        lines.append(
            f"{setting_cells(r)} "
            + " | ".join(f"{_med(s.get(k, float('nan')) for s in st):.4f}" for k in keys)
            + " |"
        )
    return lines


# trainer.async_mode -> our overrides for it (each mode's runs are a "framework" of their own in a pair)
MODES = {
    "sync": ["trainer.async_mode=sync"],
    "one_step_off": ["trainer.async_mode=one_step_off", "algorithm.rollout_correction.mode=tis"],
    "bounded_staleness": [
        "trainer.async_mode=bounded_staleness",
        "trainer.max_staleness=2",
        "algorithm.rollout_correction.mode=tis",
    ],
    # bounded_staleness whose updates land mid-rollout, between two of its decode steps
    "partial": [
        "trainer.async_mode=bounded_staleness",
        "trainer.max_staleness=2",
        "trainer.partial_rollouts=true",
        "algorithm.rollout_correction.mode=tis",
    ],
}


def framework_of(name: str) -> tuple[str, list[str]]:
    """("trl" | "ours", overrides) of a run name: "trl", "ours" (the config's mode) or "ours:<async_mode>"."""
    if name.startswith("ours:"):
        return "ours", MODES[name.split(":", 1)[1]]
    return name, []


def run_child(name: str, w: str, beta: float, steps: int, tag: str, extra: list[str]) -> dict:
    framework, mode = framework_of(name)
    extra = extra + mode
    out = WORK / f"{name.replace(':', '_')}_{w}_b{beta:g}_{tag}"
    res = out / "result.json"
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "TOKENIZERS_PARALLELISM": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "RAY_DEDUP_LOGS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    trl = [sys.executable, "-m", "bench.trl_compare", "--child", "trl", "--workload", w]
    trl += ["--beta", str(beta), "--steps", str(steps), "--child-out", str(out)]
    cmd = ours_command(w, beta, steps, out, extra) if framework == "ours" else trl
    from bench.startup import TreeTimeline, cpu_by_role

    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the whole process tree: Ray's and Prefect's processes too; PSS costs far more to read than RSS
    pss = PeakSampler(partial(pss_of_tree, proc.pid), 5.0)
    with TreeTimeline(proc.pid) as cpu, pss:
        printed, err = proc.communicate()
    wall, exited = time.perf_counter() - started, time.time()
    if proc.returncode != 0 or (framework == "trl" and not res.is_file()):
        raise RuntimeError(f"{framework} {w} beta={beta} failed (exit {proc.returncode}):\n{err[-4000:]}")
    cpu_s = sum(cpu_by_role(cpu.samples, float("inf")).values())
    if framework == "ours":
        result = ours_result(json.loads(printed[("\n" + printed).index("\n{") :]), w, steps)
    else:
        result = json.loads(res.read_text())
    process = {"wall_s": wall, "cpu_s": cpu_s}
    if framework == "ours":
        ends = result.pop("ends")
        process |= {
            "first_rollout_s": ends["first_rollout_s"],
            "teardown_s": exited - ends["last_step_at"],  # last step -> exit
            "finalize_s": ends["finalize_s"],
        }
    return {**result, **peak_memory(cpu, pss), "process": process}


# ---------------------------------------------------------------- figures


def matmul_flops(threads: int, size: int = 1024, seconds: float = 2.0) -> float:
    """The machine's float32 matmul FLOP/s with `threads` threads (median of repeated timings)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * size**3 / statistics.median(times)


def evaluate_acc(path: str, n_eval: int, max_new: int) -> float:
    from components.data.io import read_rows, to_plain
    from components.evaluation import evaluate
    from components.rewards.registry import score_with_config
    from components.rollout.worker import RolloutWorker
    from components.validate import load_checked

    cfg = load_checked(CONFIG, [])
    rows = [to_plain(r) for r in read_rows(cfg.data.eval_path).to_dict("records")][:n_eval]
    worker = RolloutWorker(path)
    return evaluate(
        lambda chunk, params, seed: worker.generate(chunk, params, seed, iteration=-1),
        worker.decode,
        lambda *batch: score_with_config(*batch, cfg),
        rows,
        1,
        max_new,
        SEED,
    )["val/acc"]


def summarize(r: dict, rows_per_step: int, prompt_tokens: float, params: int, flops: float) -> dict:
    """Medians of a run: s/step, rollout tokens/s (generated tokens over generation time) and its fraction of
    the compute bound (2 x params FLOPs per generated token), update tokens/s (prompt + response tokens over
    the rest of the step) and its fraction of the bound (6 x params per token)."""
    step = statistics.median(r["step_s"])
    gen_s = r["stages"].get("timing_s/gen", float("nan"))
    gen_tokens = statistics.median(r["gen_tokens"])
    rollout_tps = gen_tokens / gen_s
    upd_s = r["stages"].get("timing_s/update_actor", step - gen_s)
    upd_tps = (gen_tokens + rows_per_step * prompt_tokens) / upd_s
    return {
        "s_per_step": step,
        "min_s": min(r["step_s"]),
        "max_s": max(r["step_s"]),
        "rollout_tps": rollout_tps,
        "rollout_frac": rollout_tps * 2 * params / flops,
        "update_tps": upd_tps,
        "update_frac": upd_tps * 6 * params / flops,
        "peak_rss_gib": r["peak_rss_gib"],
        "peak_pss_gib": r.get("peak_pss_gib", float("nan")),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["w1", "w2"], choices=sorted(WORKLOADS))
    p.add_argument("--pairs", type=int, default=2, help="A B pairs per setting")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps per run (W1)")
    p.add_argument("--w2-steps", type=int, default=6, help="GRPO steps per run (W2)")
    p.add_argument("--eval-rows", type=int, default=200)
    p.add_argument("--out", default="bench/results/trl_compare.json")
    p.add_argument("--doc", default="docs/benchmarks.md")
    p.add_argument("--ours-overrides", nargs="*", default=[], help="extra key=value overrides for our runs")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=sorted(MODES),
        help="our runs in each of these trainer.async_mode (each beside TRL in every pair); default: the "
        "config's mode only",
    )
    p.add_argument("--betas", nargs="+", type=float, help="only these of each workload's betas")
    p.add_argument("--child", choices=["trl"], help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--beta", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        out = Path(a.child_out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(child_trl(a.workload, a.beta, a.steps, out)))
        return

    import torch
    import transformers
    import trl

    ensure_models(a.workloads)
    flops = matmul_flops(2)
    print(f"matmul: {flops / 1e9:.1f} GFLOP/s (float32, 2 threads)", flush=True)
    results = []
    for w in a.workloads:
        spec = WORKLOADS[w]
        params, steps = n_params(model_dir(w)), a.steps if w == "w1" else a.w2_steps
        prompt_tokens = mean_prompt_tokens(w)
        start_acc = evaluate_acc(str(model_dir(w)), a.eval_rows, spec["max_new"])
        ours = [f"ours:{m}" for m in a.modes] if a.modes else ["ours"]
        for beta in [b for b in spec["betas"] if a.betas is None or b in a.betas]:
            pairs = []
            for i in range(a.pairs):
                pair = {}
                order = ["trl", *ours]
                for fw in order if i % 2 == 0 else order[::-1]:  # A B C, then C B A
                    r = run_child(fw, w, beta, steps, str(i), a.ours_overrides)
                    r["summary"] = summarize(r, spec["prompts"] * spec["n"], prompt_tokens, params, flops)
                    r["acc"] = evaluate_acc(r.pop("final_model"), a.eval_rows, spec["max_new"])
                    pair[fw] = r
                    print(
                        f"{w} beta={beta:g} pair {i} {fw}: {r['summary']['s_per_step']:.3f} s/step, "
                        f"acc {start_acc:.3f} -> {r['acc']:.3f}",
                        flush=True,
                    )
                pairs.append(pair)
            for name in ours:  # one result row per mode of ours, its own pairs with TRL's runs
                mine = [{"trl": p["trl"], "ours": p[name]} for p in pairs]
                for p in mine:
                    p["ratio"] = p["ours"]["summary"]["s_per_step"] / p["trl"]["summary"]["s_per_step"]
                results.append(
                    {
                        "workload": w,
                        "beta": beta,
                        "mode": name.split(":", 1)[1] if ":" in name else "config",
                        "params": params,
                        "steps": steps,
                        "start_acc": start_acc,
                        "pairs": mine,
                        "median_ratio": statistics.median(p["ratio"] for p in mine),
                    }
                )
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "matmul_gflops": flops / 1e9,
        "command": "python -m bench.trl_compare " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    text = report(results, meta)
    print("\n" + text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    Path(a.doc).parent.mkdir(parents=True, exist_ok=True)
    Path(a.doc).write_text(with_kept_notes(text, Path(a.doc)))


# in the report file, what follows this line is written by hand and kept when a run rewrites the tables
NOTES_MARK = "<!-- written by hand: bench.trl_compare keeps everything below this line -->"


def with_kept_notes(text: str, doc: Path) -> str:
    """`text` (a run's tables), then the hand-written notes of the report it replaces, from NOTES_MARK on."""
    old = doc.read_text() if doc.exists() else ""
    return text if NOTES_MARK not in old else f"{text.rstrip()}\n\n{old[old.index(NOTES_MARK) :]}"


def orchestration(stages: dict) -> tuple[float, float]:
    """(seconds, fraction of the step) of our step spent outside the workers' rollout and update compute."""
    step = stages["timing_s/step"]
    rest = step - stages.get("timing_s/gen_compute", 0.0) - stages.get("timing_s/update_actor_compute", 0.0)
    return rest, rest / step


def _med(values) -> float:
    return statistics.median(list(values))


def whole_process_table(results: list[dict]) -> list[str]:
    """The whole run, process start to exit, of each framework: wall seconds, CPU seconds of the process tree
    (sampled every 200 ms: up to that much of a process's last moments is not counted) and peak memory of
    the tree; medians over the pairs."""
    lines = [
        "\n## The whole process (start to exit), medians over the pairs\n",
        "| workload | beta | our async_mode | steps | wall s TRL / ours | ours/TRL | CPU s TRL / ours | ours/TRL | "
        "peak RSS GiB TRL / ours | ours/TRL | peak PSS GiB TRL / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        pairs = [p for p in r["pairs"] if "process" in p["trl"] and "process" in p["ours"]]
        if not pairs:
            continue

        def med(fw: str, key: str, where: str = "process", pairs: list = pairs) -> float:
            return _med(p[fw][where][key] if where else p[fw][key] for p in pairs)

        wall, cpu = (med("trl", "wall_s"), med("ours", "wall_s")), (med("trl", "cpu_s"), med("ours", "cpu_s"))
        rss = (med("trl", "peak_rss_gib", ""), med("ours", "peak_rss_gib", ""))
        pss = (med("trl", "peak_pss_gib", ""), med("ours", "peak_pss_gib", ""))
        lines.append(
            f"{setting_cells(r)} {r['steps']} | "
            f"{wall[0]:.1f} / {wall[1]:.1f} | **{wall[1] / wall[0]:.2f}** | {cpu[0]:.1f} / {cpu[1]:.1f} | "
            f"{cpu[1] / cpu[0]:.2f} | {rss[0]:.2f} / {rss[1]:.2f} | {rss[1] / rss[0]:.2f} | "
            f"{pss[0]:.2f} / {pss[1]:.2f} |"
        )
    return lines


def ends_table(results: list[dict]) -> list[str]:
    """Our run's two ends (issue 39's start-up and teardown targets), medians over the pairs: process start ->
    first rollout (timing_s/startup/first_gen), and last step -> process exit, split into the work that must
    happen (timing_s/finalize: the final model's save, the logged model, the plots, run.json) and the rest
    (MLflow's run end, Ray's and Prefect's stops, the interpreter's exit)."""
    lines = [
        "\n## Our run's ends, medians over the pairs\n",
        "| workload | beta | our async_mode | process start -> first rollout s | last step -> exit s | "
        "of which the final model, logged model and plots s | the rest s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ours = [p["ours"]["process"] for p in r["pairs"] if "teardown_s" in p["ours"].get("process", {})]
        if not ours:
            continue
        first, down, final = (
            _med(o[k] for o in ours) for k in ("first_rollout_s", "teardown_s", "finalize_s")
        )
        rest = _med(o["teardown_s"] - o["finalize_s"] for o in ours)
        lines.append(f"{setting_cells(r)} {first:.2f} | {down:.2f} | {final:.2f} | {rest:.2f} |")
    return lines


def memory_split_table(results: list[dict]) -> list[str]:
    """Where our run's peak RSS sits, by process role (bench.startup's roles), at the moment the tree held
    the most, against TRL's one process; medians over the pairs. The floor issue 39's memory target meets:
    Ray's services and Prefect's server are held whatever the model."""
    from bench.startup import ROLE_COLUMNS

    lines = [
        "\n## Our peak RSS by process, at the run's peak, medians over the pairs (GiB)\n",
        f"| workload | beta | our async_mode | TRL | ours | {' | '.join(ROLE_COLUMNS)} |",
        "|---|---|---|---|---|" + "---|" * len(ROLE_COLUMNS),
    ]
    for r in results:
        pairs = [p for p in r["pairs"] if "peak_rss_by_role_gib" in p["ours"]]
        if not pairs:
            continue
        split = [_med(p["ours"]["peak_rss_by_role_gib"].get(c, 0.0) for p in pairs) for c in ROLE_COLUMNS]
        lines.append(
            f"{setting_cells(r)} "
            f"{_med(p['trl']['peak_rss_gib'] for p in pairs):.2f} | "
            f"{_med(p['ours']['peak_rss_gib'] for p in pairs):.2f} | {' | '.join(f'{g:.2f}' for g in split)} |"
        )
    return lines


def report(results: list[dict], meta: dict) -> str:
    lines = [
        "# reinforge vs TRL GRPOTrainer\n",
        f"{meta['date']}, {meta['machine']}, Python {meta['python']}, "
        f"torch {meta['torch']}, transformers {meta['transformers']}, TRL {meta['trl']}; float32 matmul "
        f"{meta['matmul_gflops']:.1f} GFLOP/s (2 threads). Command: `{meta['command']}`.\n",
        "Medians over steps, then over the A/B pairs; ratio = ours / TRL seconds per step, per pair.\n",
        "| workload | beta | our async_mode | params | s/step TRL (min-max) | s/step ours (min-max) | ours/TRL | "
        "overlap / step (ours) | rollout tok/s TRL / ours | ours % of rollout bound | update tok/s TRL / ours | "
        "ours % of update bound | peak RSS GiB TRL / ours | peak PSS GiB TRL / ours | held-out acc start -> "
        "TRL / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = [p["trl"]["summary"] for p in r["pairs"]]
        o = [p["ours"]["summary"] for p in r["pairs"]]
        overlap = _med(
            p["ours"]["stages"].get("timing_s/overlap", 0.0) / p["ours"]["stages"]["timing_s/step"]
            for p in r["pairs"]
        )
        lines.append(
            f"{setting_cells(r)} {r['params'] / 1e6:.1f} M | "
            f"{_med(s['s_per_step'] for s in t):.3f} "
            f"({min(s['min_s'] for s in t):.3f}-{max(s['max_s'] for s in t):.3f}) | "
            f"{_med(s['s_per_step'] for s in o):.3f} ({min(s['min_s'] for s in o):.3f}-"
            f"{max(s['max_s'] for s in o):.3f}) | **{r['median_ratio']:.2f}** | {100 * overlap:.0f} % | "
            f"{_med(s['rollout_tps'] for s in t):.0f} / {_med(s['rollout_tps'] for s in o):.0f} | "
            f"{100 * _med(s['rollout_frac'] for s in o):.0f} % | {_med(s['update_tps'] for s in t):.0f} / "
            f"{_med(s['update_tps'] for s in o):.0f} | {100 * _med(s['update_frac'] for s in o):.0f} % | "
            f"{max(s['peak_rss_gib'] for s in t):.2f} / {max(s['peak_rss_gib'] for s in o):.2f} | "
            f"{max(s['peak_pss_gib'] for s in t):.2f} / {max(s['peak_pss_gib'] for s in o):.2f} | "
            f"{r['start_acc']:.3f} -> {_med(p['trl']['acc'] for p in r['pairs']):.3f} / "
            f"{_med(p['ours']['acc'] for p in r['pairs']):.3f} |"
        )
    lines += whole_process_table(results) + ends_table(results) + memory_split_table(results)
    lines += ["\n## Our step, stage by stage (median seconds)\n"]
    keys = sorted({k for r in results for p in r["pairs"] for k in p["ours"]["stages"]} - set(ASYNC))
    lines += stage_table(results, keys)
    if any(k in p["ours"]["stages"] for r in results for p in r["pairs"] for k in ASYNC):
        lines += ["\n## Staleness of what our asynchronous modes train on (median per step)\n"]
        lines += stage_table(results, list(ASYNC))
    lines += [
        "\nOrchestration = timing_s/step - timing_s/gen_compute - timing_s/update_actor_compute (the rollout "
        "and the update as timed inside the worker; the reward stage, whose scoring takes well under a "
        "millisecond here, counts as orchestration):\n"
    ]
    for r in results:
        orch = [orchestration(p["ours"]["stages"]) for p in r["pairs"]]
        lines.append(
            f"- {r['workload']} beta {r['beta']:g} {r.get('mode', 'config')}: "
            f"{_med(o[0] for o in orch):.4f} s per step, "
            f"{100 * _med(o[1] for o in orch):.1f} % of the step"
        )
    lines += [
        "\n## Reward per step (first pair)\n",
        "| workload | beta | framework | rewards |",
        "|---|---|---|---|",
    ]
    for r in results:
        for fw in ("trl", "ours"):
            rw = r["pairs"][0][fw]["reward"]
            name = f"ours ({r.get('mode', 'config')})" if fw == "ours" else fw
            lines.append(f"| {r['workload']} | {r['beta']:g} | {name} | {' '.join(f'{x:.2f}' for x in rw)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
