"""bench/trl_compare.py: a run rewrites the report's tables and keeps the notes written by hand below them."""

from __future__ import annotations

from bench.trl_compare import NOTES_MARK, with_kept_notes


def test_a_rerun_replaces_the_tables_and_keeps_the_hand_written_notes(tmp_path):
    doc = tmp_path / "benchmarks.md"
    assert with_kept_notes("# run 1\n| w1 | 1.25 |\n", doc) == "# run 1\n| w1 | 1.25 |\n"  # no report yet
    doc.write_text(f"# run 1\n| w1 | 1.25 |\n\n{NOTES_MARK}\n## Where the time goes\nreading run 1\n")
    new = with_kept_notes("# run 2\n| w1 | 1.11 |\n", doc)
    assert new == f"# run 2\n| w1 | 1.11 |\n\n{NOTES_MARK}\n## Where the time goes\nreading run 1\n"
    doc.write_text("# run 1, no notes\n")
    assert with_kept_notes("# run 2\n", doc) == "# run 2\n"


def test_the_whole_process_table_takes_medians_over_the_pairs_and_their_ratios():
    from bench.trl_compare import whole_process_table

    def run(wall, cpu, rss, pss):
        return {"process": {"wall_s": wall, "cpu_s": cpu}, "peak_rss_gib": rss, "peak_pss_gib": pss}

    pairs = [
        {"trl": run(10.0, 12.0, 0.5, 0.4), "ours": run(30.0, 30.0, 2.0, 1.5)},
        {"trl": run(11.0, 14.0, 0.6, 0.4), "ours": run(22.0, 35.0, 2.1, 1.6)},
        {"trl": run(12.0, 16.0, 0.7, 0.5), "ours": run(20.0, 40.0, 2.4, 1.7)},
    ]
    result = {"workload": "w1", "beta": 0.0, "mode": "config", "steps": 20, "pairs": pairs}
    row = whole_process_table([result])[-1]
    assert row == (
        "| w1 | 0 | config | 20 | 11.0 / 22.0 | **2.00** | 14.0 / 35.0 | 2.50 | 0.60 / 2.10 | 3.50 | 0.40 / 1.60 |"
    )


def test_our_runs_ends_split_the_teardown_into_the_final_work_and_the_rest():
    from bench.trl_compare import ends_table

    def ours(first, down, final):
        return {"process": {"first_rollout_s": first, "teardown_s": down, "finalize_s": final}}

    pairs = [
        {"trl": {}, "ours": ours(10.0, 3.0, 1.0)},
        {"trl": {}, "ours": ours(12.0, 2.5, 1.0)},
        {"trl": {}, "ours": ours(11.0, 4.0, 1.2)},
    ]
    result = {"workload": "w1", "beta": 0.0, "mode": "config", "steps": 20, "pairs": pairs}
    # medians of each column, and of each pair's rest (2.0, 1.5, 2.8), not the difference of two medians
    assert ends_table([result])[-1] == "| w1 | 0 | config | 11.00 | 3.00 | 1.00 | 2.00 |"


def test_our_peak_memory_is_split_by_role_with_medians_over_the_pairs():
    from bench.trl_compare import memory_split_table

    def ours(total, driver, workers):
        split = {"driver": driver, "ray workers": workers, "ray services": 0.5, "prefect server": 0.2}
        return {"peak_rss_gib": total, "peak_rss_by_role_gib": split}

    pairs = [
        {"trl": {"peak_rss_gib": 0.6}, "ours": ours(2.2, 0.6, 0.9)},
        {"trl": {"peak_rss_gib": 0.7}, "ours": ours(2.4, 0.7, 1.0)},
        {"trl": {"peak_rss_gib": 0.5}, "ours": ours(2.3, 0.5, 1.1)},
    ]
    result = {"workload": "w1", "beta": 0.0, "mode": "config", "steps": 20, "pairs": pairs}
    # the columns in bench.startup's role order; a role no process had ("other") is 0
    assert (
        memory_split_table([result])[-1]
        == "| w1 | 0 | config | 0.60 | 2.30 | 0.60 | 0.20 | 0.50 | 1.00 | 0.00 |"
    )
