"""``kvstore inspect | export | migrate | repair``: one ``.coli_kv`` file, no store, no server.

The work is done by :mod:`kvstore.filetools` and :mod:`kvstore.export`; this module parses the
arguments and prints the reports. Nothing beyond numpy (and pyarrow for Arrow/Parquet exports) is
imported.
"""

from __future__ import annotations

import argparse
import sys

from kvstore.cli import options
from kvstore.cli.output import emit, progress, table
from kvstore.errors import InvalidRequest


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvstore.filetools import inspect_file

    report = inspect_file(args.path)
    emit(args, report, table(report))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from kvstore.export import export
    from kvstore.formats import coli_kv

    records = coli_kv.load(args.path)
    out = export(records, args.out)
    report = {"source": args.path, "out": str(out), "records": records.n, "tier": records.tier.name}
    if not args.quiet:
        emit(args, report, f"exported {records.n} records ({records.tier.describe()}) to {out}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from kvstore.filetools import migrate_file

    if args.tier is None:
        raise InvalidRequest(f"give the target with --tier NAME ({options.listing(args.tier_option.choices())})")
    with progress("migrate", enabled=not args.json) as update:
        report = migrate_file(args.src, args.dst, args.tier, overwrite=args.force, progress=update)
    if report["lossy"] and not args.json:
        print(f"note: {report['from']} -> {report['to']} is lossy (values are re-quantized)", file=sys.stderr)
    emit(args, report, table(report))
    return 0


def cmd_repair(args: argparse.Namespace) -> int:
    from kvstore.filetools import repair_file

    report = repair_file(args.path, dry_run=args.dry_run, backup=not args.no_backup)
    if args.json or not report["actions"]:
        emit(args, report, f"{args.path}: clean, nothing to repair ({report['records']} records)")
        return 0
    verb = "would" if args.dry_run else "did"
    lines = [f"{verb}: {action}" for action in report["actions"]]
    if report["backup"]:
        lines.append(f"backup: {report['backup']}")
    print("\n".join(lines))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register the file tools on the ``kvstore`` parser's subparsers."""
    p = sub.add_parser("inspect", help="show a .coli_kv file's header, counts and damage")
    p.add_argument("path")
    options.add_json(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("export", help="export rows to .npz, .arrow or .parquet")
    p.add_argument("path")
    p.add_argument("out", help="OUT.npz | OUT.arrow | OUT.parquet")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    options.add_json(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("migrate", help="convert a file to another tier (never overwrites SRC)")
    p.add_argument("src")
    p.add_argument("dst")
    options.add_tier(p, files_only=True, default=None, what="the tier to convert to", aliases=("--to",))
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    options.add_json(p)
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("repair", help="clamp nrec, drop a torn tail, sanitize rows (keeps PATH.bak)")
    p.add_argument("path")
    p.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    p.add_argument("--no-backup", action="store_true", help="do not keep PATH.bak")
    options.add_json(p)
    p.set_defaults(func=cmd_repair)
