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
