"""The reward-curve image logged with every training run."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def reward_curve(history: list[dict], out: str | Path) -> Path:
    """Mean reward per iteration and held-out greedy accuracy where evaluated, as a PNG."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
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
    plt.close(fig)
    return out
