"""The series DVC plots read: every logged step once, each column where its metric was logged."""

from __future__ import annotations

import json

from components.tracking.plots import DVC_PLOTS, write_dvc_plots


def test_dvc_plot_files_hold_each_series_by_step(tmp_path):
    series = {
        "critic/score/mean": {1: 0.1, 2: 0.3, 3: 0.5},
        "actor/ppo_kl": {1: 0.0, 2: 0.01, 3: 0.02},
        "val/acc": {2: 0.4},
    }
    written = write_dvc_plots(series, tmp_path / "plots")
    assert sorted(p.name for p in written) == sorted(DVC_PLOTS)
    train = json.loads((tmp_path / "plots" / "train.json").read_text())
    assert train == [
        {"step": 1, "reward": 0.1, "ppo_kl": 0.0},
        {"step": 2, "reward": 0.3, "ppo_kl": 0.01},
        {"step": 3, "reward": 0.5, "ppo_kl": 0.02},
    ]
    assert json.loads((tmp_path / "plots" / "val.json").read_text()) == [{"step": 2, "acc": 0.4}]
    assert json.loads((tmp_path / "plots" / "kl.json").read_text()) == []  # no KL to a reference logged
    assert not list((tmp_path / "plots").glob(".*.tmp"))
