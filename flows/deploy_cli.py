"""`reinforge deploy`: pipelines.yaml -> Prefect deployments."""

from __future__ import annotations

import argparse
import sys

from components.errors import ReinforgeError
from flows.deploy import deploy, load_pipelines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="reinforge deploy",
        description="Turn pipelines.yaml into Prefect deployments. "
        "Default: register them and serve them from this process (needs a Prefect server: "
        "`prefect server start`, then `prefect deployment run 'rl-train/arith-grpo'`).",
    )
    p.add_argument("--file", default="pipelines.yaml", help="pipelines file")
    p.add_argument("--only", nargs="*", help="pipeline names to deploy (default: all)")
    p.add_argument("--apply", action="store_true", help="register the deployments and exit (no serving)")
    p.add_argument("--work-pool", help="deploy to this Prefect work pool instead of serving in-process")
    a = p.parse_args(argv)
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
