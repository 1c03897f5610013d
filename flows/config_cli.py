"""`reinforge config`: `generate` writes the full reference config (every key, its default and its help);
`show` prints a config as it resolves, each value with its source (default, preset, file or override)."""

from __future__ import annotations

import sys
from pathlib import Path

from components.errors import ReinforgeError
from flows import parsers
from flows._args import report


def main(argv: list[str] | None = None) -> int:
    a = parsers.config().parse_args(argv)
    from components.reference import reference_config, resolved_config

    if a.action == "generate":
        text = reference_config()
        if a.out:
            Path(a.out).write_text(text)
            print(a.out)
        else:
            sys.stdout.write(text)
        return 0
    from components.config.loader import check_given

    try:
        rows = resolved_config(a.config, check_given(a.overrides))
    except ReinforgeError as exc:
        return report(exc, a.debug)
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table("key", "value", "source", title=f"{a.config or 'defaults'} {' '.join(a.overrides)}".strip())
    for key, value, source in rows:
        table.add_row(escape(key), escape(repr(value) if isinstance(value, str) else str(value)), source)
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
