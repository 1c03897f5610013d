"""Imports with the collector paused: it is back on after, and what the block made is frozen."""

from __future__ import annotations

import gc

from components.gc_pause import collector_paused, import_paused


def test_the_block_runs_without_the_collector_and_its_objects_are_frozen():
    before = gc.get_freeze_count()
    kept = []
    try:
        with collector_paused():
            assert not gc.isenabled()
            kept.extend([{"i": i}] for i in range(1000))
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + 1000
    finally:
        gc.unfreeze()  # back to what the rest of the tests expect


def test_a_collector_that_was_off_stays_off_and_imports_still_happen():
    gc.disable()
    try:
        import_paused("json", "components.gc_pause")
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
