"""`reinforge deploy`: pipelines.yaml -> Prefect deployments."""

from __future__ import annotations

import sys

from components.errors import ReinforgeError
from flows import parsers
from flows.deploy import deploy, load_pipelines


def main(argv: list[str] | None = None) -> int:
    a = parsers.deploy().parse_args(argv)
    try:
        pipelines = [x for x in load_pipelines(a.file) if not a.only or x.name in a.only]
        names = deploy(pipelines, "apply" if a.apply else "serve", a.work_pool)
    except ReinforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
