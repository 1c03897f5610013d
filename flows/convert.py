"""`reinforge convert`: Hugging Face directory <-> sharded model (components/models/convert.py)."""

from __future__ import annotations

import sys

from components.errors import ReinforgeError
from flows import parsers
from flows._args import report


def main(argv: list[str] | None = None) -> int:
    a = parsers.convert().parse_args(argv)
    from components.models import convert

    try:
        if a.to == "hf":
            out = convert.to_hf(a.source, a.out)
        else:
            out = convert.to_sharded(a.source, a.out, a.tensor_parallel, a.data_parallel)
    except ReinforgeError as exc:
        return report(exc)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
