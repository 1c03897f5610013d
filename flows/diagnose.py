"""`reinforge diagnose [--device] [--config FILE] [--json]`: one report of what this machine (and the clusters
the environment names) can run, each line a check with ok / warn / fail and the fix. Exit 0 when nothing
fails, 1 otherwise. The checks themselves are in components/diagnose.py."""

from __future__ import annotations

import json
import sys

from flows import parsers


def main(argv: list[str] | None = None) -> int:
    a = parsers.diagnose().parse_args(argv)
    from components.diagnose import run_checks

    checks = run_checks(device=a.device, config=a.config, overrides=a.overrides)
    if a.json:
        print(json.dumps([c.__dict__ for c in checks], indent=1))
    else:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        colours = {"ok": "green", "warn": "yellow", "fail": "red"}
        table = Table("check", "status", "found", "fix", title="reinforge diagnose")
        for c in checks:
            table.add_row(c.name, f"[{colours[c.status]}]{c.status}[/]", escape(c.found), escape(c.fix))
        Console(width=200).print(table)
    return 1 if any(c.status == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
