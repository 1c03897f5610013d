"""How long the config parser takes on a small file whose nested YAML aliases stand for billions of values
(a "billion laughs"), against the default config: `python -m bench.config_parse`. The parser walks each node
once and refuses past a bound, so both answer in milliseconds (issue 37: 81 s at 9 levels before)."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from components.errors import ConfigError
from components.validate import load_checked


def laughs(levels: int, width: int = 9) -> str:
    lines = ['l0: &l0 ["lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def seconds(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    load_checked("configs/arith_grpo.yaml")  # imports out of the timing
    print(f"configs/arith_grpo.yaml: {seconds(lambda: load_checked('configs/arith_grpo.yaml')) * 1e3:.1f} ms")
    with tempfile.TemporaryDirectory() as tmp:
        for levels in (9, 30):
            path = Path(tmp) / f"laughs{levels}.yaml"
            path.write_text(laughs(levels))

            def refused(p=path) -> None:
                try:
                    load_checked(p)
                except ConfigError:
                    return
                raise SystemExit(f"{p} was not refused")

            size = path.stat().st_size
            print(
                f"{levels}-level alias file ({size} bytes, 9^{levels} values): refused in "
                f"{seconds(refused) * 1e3:.1f} ms (median of 5)"
            )


if __name__ == "__main__":
    main()
