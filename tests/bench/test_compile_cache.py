"""bench/compile_cache.py: how many calls a compiled run needs to catch up with an eager one."""

from __future__ import annotations

from bench.compile_cache import payback


def test_a_compile_pays_back_after_its_extra_over_what_each_call_saves():
    # 10 s first call against an eager 0.2 s: 9.8 s extra, repaid at 0.05 s a call
    assert payback(first=10.0, later=0.15, eager=0.2) == "196"


def test_a_compile_whose_calls_are_no_faster_never_pays_back():
    assert payback(first=6.0, later=0.06, eager=0.05) == "never"
    assert payback(first=6.0, later=0.05, eager=0.05) == "never"
