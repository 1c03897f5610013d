"""The reward-curve image logged with every training run, and the per-iteration series DVC plots (dvc.yaml's
`plots:`; `dvc plots show`, `dvc plots diff` between experiments)."""

from __future__ import annotations

import json
from pathlib import Path


def reward_curve(history: list[dict], out: str | Path) -> Path:
    """Mean reward per iteration and held-out greedy accuracy where evaluated, as a PNG."""
    # a Figure of its own, not pyplot's: no GUI backend, no global state, and matplotlib is imported only at
    # the end of a run (~0.25 s less of every training process's start-up)
    from matplotlib.figure import Figure

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = [h["step"] for h in history]
    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    ax.plot(steps, [h.get("critic/score/mean", float("nan")) for h in history], label="train reward (mean)")
    evals = [(h["step"], h["val/acc"]) for h in history if "val/acc" in h]
    if evals:
        ax.plot(*zip(*evals), marker="o", label="held-out greedy acc")
    ax.set_xlabel("iteration")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    return out


# file under <trainer.output_dir>/plots -> {column: metric}; each file's rows are {step, column: value}, a row
# for each iteration that logged any of its metrics (val.json: the evaluated iterations; kl.json: the KL of the
# policy to the reference, which only a run with a KL penalty computes, so it is empty for default GRPO)
DVC_PLOTS = {
    "train.json": {
        "reward": "critic/score/mean",
        "response_length": "response_length/mean",
        "ppo_kl": "actor/ppo_kl",
        "entropy": "actor/entropy",
    },
    "val.json": {"acc": "val/acc"},
    "kl.json": {"kl": "actor/kl_loss"},
}


def plot_metrics() -> list[str]:
    return sorted({m for columns in DVC_PLOTS.values() for m in columns.values()})


def write_dvc_plots(series: dict[str, dict[int, float]], out_dir: str | Path) -> list[Path]:
    """The metrics' whole series (metric -> {step: value}, as MLflow holds them: a resumed run's too) as
    DVC_PLOTS' files in `out_dir`. Returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, columns in DVC_PLOTS.items():
        steps = sorted({s for metric in columns.values() for s in series.get(metric, {})})
        rows = [
            {"step": s} | {col: series[m][s] for col, m in columns.items() if s in series.get(m, {})}
            for s in steps
        ]
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        tmp.replace(out_dir / name)
        written.append(out_dir / name)
    return written
