"""``kvstore config``: every environment variable kvstore reads and every default its parts share
(:mod:`kvstore.config`), each with its type, default, doc and the value it has in this shell (a
secret shows as ``(set)``, never its text). Exit 2 when a variable is set to a value kvstore cannot
use, naming it."""

from __future__ import annotations

import argparse

from kvstore import config
from kvstore.cli import options
from kvstore.cli.output import emit


def cmd_config(args: argparse.Namespace) -> int:
    rows = config.report()
    for entry in config.VARIABLES:
        entry.get()  # a value that does not parse: SettingError, one line, exit 2
    lines = []
    for group in dict.fromkeys(row["group"] for row in rows):
        lines.append(f"{group}:")
        for row in rows:
            if row["group"] != group:
                continue
            now = "" if row["value"] is None else f" = {row['value']}"
            default = "" if row["default"] is None else f" (default {row['default']})"
            lines.append(f"  {row['name']}{now}{default}\n      {row['doc']}")
    emit(args, rows, "\n".join(lines))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``config`` on the ``kvstore`` parser's subparsers."""
    p = sub.add_parser("config", help="the environment variables and shared defaults kvstore reads, with their values")
    options.add_json(p, "print them as a JSON list (name, group, type, default, value, doc)")
    p.set_defaults(func=cmd_config)
