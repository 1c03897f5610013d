"""eval.json's figures from the evaluation's val/ metrics, by hand: one source keeps the flat layout the
default pipeline's metrics have; several get each one's figures, and each one's gain."""

from __future__ import annotations

import pytest

from tasks.evaluate import eval_figures, flat, gains


def test_one_source_keeps_the_flat_figures():
    m = {"val/acc": 0.5, "val/arith/acc": 0.5, "val/arith/acc_mean_at_4": 0.25, "val/arith/pass_at_4": 0.75}
    assert eval_figures(m, 4, 200) == {"acc": 0.5, "n": 200, "acc_mean_at_4": 0.25, "pass_at_4": 0.75}


def test_several_sources_each_have_their_figures_and_gain():
    def figures(a: float, b: float) -> dict:
        m = {"val/acc": (a + b) / 2, "val/tool_call_rate": 0.0}
        for source, acc in (("rg_spell", a), ("rg_sum", b)):
            m |= {
                f"val/{source}/acc": acc,
                f"val/{source}/acc_mean_at_4": acc,
                f"val/{source}/pass_at_4": acc,
            }
        return eval_figures(m, 4, 10)

    sft, final = figures(0.5, 0.25), figures(0.75, 0.5)
    assert final["by_source"]["rg_sum"] == {"acc": 0.5, "acc_mean_at_4": 0.5, "pass_at_4": 0.5}
    assert gains(sft, final) == {"acc": 0.25, "rg_spell/acc": 0.25, "rg_sum/acc": 0.25}
    assert flat(final)["rg_spell/pass_at_4"] == 0.75 and flat(final)["acc"] == pytest.approx(0.625)
