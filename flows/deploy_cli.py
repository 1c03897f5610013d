"""`reinforge deploy`: pipelines.yaml -> Prefect deployments."""

from __future__ import annotations

import sys

from components.errors import ReinforgeError
from flows import parsers
from flows.deploy import PREFECT_YAML, deploy, load_pipelines, prefect_yaml_text


def main(argv: list[str] | None = None) -> int:
    a = parsers.deploy().parse_args(argv)
    try:
        pipelines = [x for x in load_pipelines(a.file) if not a.only or x.name in a.only]
        if a.write_prefect_yaml:
            PREFECT_YAML.write_text(prefect_yaml_text(pipelines))
            print(PREFECT_YAML)
            return 0
        if a.source and not a.work_pool:
            raise ReinforgeError(
                "--source: a git repository is for a work pool's workers; add --work-pool NAME"
            )
        names = deploy(pipelines, "apply" if a.apply else "serve", a.work_pool, a.source, a.branch)
    except ReinforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
