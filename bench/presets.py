"""Each `algorithm.name` preset trained from the same SFT start, same seed, same iterations: held-out
greedy accuracy before and after, one process, one table.

    python -m bench.presets                       # ppo grpo dapo rloo, the default config's iterations
    python -m bench.presets --presets remax gspo --iterations 40

Prepares the data and the SFT model of the config first if they are missing (the same flows `dvc repro`
runs), then runs the real training flow (Prefect, Ray, MLflow) once per preset and the evaluation task on the
SFT model and on each final model. Prints a Markdown table and writes bench/results/presets.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from components.data.io import write_json
from components.validate import load_checked


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/arith_grpo.yaml")
    p.add_argument("--presets", nargs="+", default=["ppo", "grpo", "dapo", "rloo"])
    p.add_argument("--iterations", type=int, default=None, help="trainer.iterations (default: the config's)")
    p.add_argument("--out", default="bench/results/presets.json")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    a = p.parse_args(argv)

    from flows.data import data_flow
    from flows.sft import sft_flow
    from flows.train import train_flow
    from tasks.evaluate import evaluate_model

    base = (
        list(a.overrides)
        + ([f"trainer.iterations={a.iterations}"] if a.iterations else [])
        + ["trainer.experiment_name=bench-presets", "trainer.resume_mode=disable"]
    )
    cfg = load_checked(a.config, base)
    if not Path(cfg.data.train_path).is_file():
        data_flow(a.config, base)
    if not (Path(cfg.sft.output_dir) / "config.json").is_file():
        sft_flow(a.config, base)
    sft = evaluate_model.fn(cfg.sft.output_dir, cfg.data.eval_path, cfg)
    rows = []
    for name in a.presets:
        out_dir = f"checkpoints/presets/{name}"
        ov = base + [f"algorithm.name={name}", f"trainer.output_dir={out_dir}", "trainer.progress=false"]
        start = time.perf_counter()
        info = train_flow(a.config, ov, f"bench-{name}")
        wall = time.perf_counter() - start
        final = evaluate_model.fn(info["final_model"], cfg.data.eval_path, load_checked(a.config, ov))
        rows.append(
            {
                "preset": name,
                "sft_acc": sft["acc"],
                "final_acc": final["acc"],
                "gain": final["acc"] - sft["acc"],
                "final_pass_at_k": final.get(f"pass_at_{cfg.trainer.eval_k}"),
                "train_s": round(wall, 1),
                "iterations": info["iterations"],
                "run_id": info["run_id"],
            }
        )
        print(f"{name}: acc {sft['acc']:.3f} -> {final['acc']:.3f} in {wall:.0f} s", flush=True)
    print(
        f"\n| preset | SFT acc | final acc | gain | pass@{cfg.trainer.eval_k} | train s |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['preset']} | {r['sft_acc']:.3f} | {r['final_acc']:.3f} | {r['gain']:+.3f} | "
            f"{r['final_pass_at_k']:.3f} | {r['train_s']:.0f} |"
        )
    write_json({"config": a.config, "overrides": base, "seed": cfg.trainer.seed, "results": rows}, a.out)


if __name__ == "__main__":
    main()
