"""The ``kvstore`` command line.

File tools: ``inspect``, ``export``, ``migrate``, ``repair``; the service and session commands
(``serve``, ``sessions ...``) and the engine commands are registered by their own modules.
Bad input exits with code 2 and a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable

from kvstore.errors import KVStoreError
from kvstore import tiers

# Modules that add subcommands through `add_commands(subparsers)`; imported lazily so a file
# tool does not pay for the web stack or torch.
COMMAND_MODULES = ("kvstore.cli_sessions", "kvstore.engine.cli", "kvstore.engine.session_cli", "kvstore.engine.hf_cli")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors: exit 2 with one line, like every bad input
        self.print_usage(sys.stderr)
        raise SystemExit(_fail(message))


def _fail(reason: str) -> int:
    print(f"kvstore: error: {reason}", file=sys.stderr)
    return 2


def _progress(description: str) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """A tqdm bar on stderr (silent when stderr is not a terminal)."""
    from tqdm import tqdm

    bar = tqdm(desc=description, unit="rec", disable=None, file=sys.stderr, leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done)

    return update, bar.close


def _print(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=False))
        return
    width = max(len(k) for k in report)
    for key, value in report.items():
        if isinstance(value, list):
            value = "; ".join(map(str, value)) if value else "-"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, float):
            value = f"{value:.3f}"
        print(f"{key:<{width}}  {value}")


def cmd_inspect(args) -> int:
    from kvstore.filetools import inspect_file

    _print(inspect_file(args.path), args.json)
    return 0


def cmd_export(args) -> int:
    from kvstore.export import export
    from kvstore.formats import coli_kv

    records = coli_kv.load(args.path)
    out = export(records, args.out)
    if not args.quiet:
        print(f"exported {records.n} records ({records.tier.describe()}) to {out}")
    return 0


def cmd_migrate(args) -> int:
    from kvstore.filetools import migrate_file
    from kvstore.formats.coli_kv import Tier

    target = tiers.parse(args.to, codec=args.codec, bits=args.bits)
    update, close = _progress("migrate")
    try:
        report = migrate_file(args.src, args.dst, target, overwrite=args.force, progress=update)
    finally:
        close()
    if report["lossy"] and not args.json:
        print(f"note: {report['from']} -> {report['to']} is lossy (values are re-quantized)", file=sys.stderr)
    _print(report, args.json)
    return 0


def cmd_repair(args) -> int:
    from kvstore.filetools import repair_file

    report = repair_file(args.path, dry_run=args.dry_run, backup=not args.no_backup)
    if args.json:
        _print(report, True)
    elif not report["actions"]:
        print(f"{args.path}: clean, nothing to repair ({report['records']} records)")
    else:
        verb = "would" if args.dry_run else "did"
        for action in report["actions"]:
            print(f"{verb}: {action}")
        if report["backup"]:
            print(f"backup: {report['backup']}")
    return 0


FILE_COMMANDS = ("inspect", "export", "migrate", "repair")


def build_parser(extra_commands: bool = True) -> argparse.ArgumentParser:
    parser = _Parser(prog="kvstore", description="Resumable LLM conversations over .coli_kv latent caches.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("inspect", help="show a .coli_kv file's header, counts and damage")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("export", help="export rows to .npz, .arrow or .parquet")
    p.add_argument("path")
    p.add_argument("out", help="OUT.npz | OUT.arrow | OUT.parquet")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("migrate", help="convert a file to another version (never overwrites SRC)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=["v1", "v2", "v3"])
    p.add_argument("--codec", choices=["polar", "int4"], help="v3 codec (default int4)")
    p.add_argument("--bits", type=int, help="v3 bits: 4 for int4, 2..6 for polar (default 4)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("repair", help="clamp nrec, drop a torn tail, sanitize rows (keeps PATH.bak)")
    p.add_argument("path")
    p.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    p.add_argument("--no-backup", action="store_true", help="do not keep PATH.bak")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_repair)

    for name in COMMAND_MODULES if extra_commands else ():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module exists but a dependency of it is missing
                raise
            continue
        module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # A file tool needs neither the web stack nor torch: skip importing them.
    parser = build_parser(extra_commands=not (argv and argv[0] in FILE_COMMANDS))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        return int(args.func(args) or 0)
    except KVStoreError as exc:
        return _fail(exc.reason)
    except (FileNotFoundError, IsADirectoryError, PermissionError, NotADirectoryError) as exc:
        return _fail(f"{exc.strerror}: {exc.filename}")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
