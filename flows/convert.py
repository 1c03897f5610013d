"""`reinforge convert`: Hugging Face directory <-> sharded model (components/models/convert.py)."""

from __future__ import annotations

import argparse
import sys

from components.errors import ReinforgeError
from flows._args import report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="reinforge convert",
        description="Split a Hugging Face model into the shards of a worker mesh (--to sharded), or merge a "
        "sharded model or sharded checkpoint back into a Hugging Face directory (--to hf); a round trip is "
        "bit-identical.",
    )
    p.add_argument("--to", choices=["sharded", "hf"], required=True, help="the format to write")
    p.add_argument(
        "--source",
        required=True,
        help="--to sharded: a Hugging Face model directory; --to hf: a sharded model directory, or a "
        "checkpoint (iter_NNNNNN) written with trainer.checkpoint_format=sharded",
    )
    p.add_argument("--out", required=True, help="the directory to write (new, or empty)")
    p.add_argument("--tensor-parallel", type=int, default=1, help="--to sharded: TP workers per replica")
    p.add_argument("--data-parallel", type=int, default=1, help="--to sharded: FSDP replicas")
    a = p.parse_args(argv)
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
