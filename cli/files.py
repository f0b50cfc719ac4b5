"""``kvstore inspect | export | migrate | repair``: one ``.coli_kv`` file, no store, no server.

The work is done by :mod:`kvstore.filetools` and :mod:`kvstore.export`; this module parses the
arguments and prints the reports. Nothing beyond numpy (and pyarrow for Arrow/Parquet exports) is
imported.

``inspect`` exits 0 when the file is clean, 1 when it is damaged (each damage and where it is are
printed), 2 when it cannot be read as a ``.coli_kv`` file. ``export`` and ``migrate`` refuse a
damaged file (exit 1, the damage named) unless ``--allow-damaged``, which goes on with the whole
records and says on stderr how many committed records were dropped; neither ever writes its
source, and ``export`` refuses an existing output unless ``--force``.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvstore.cli import options, progress
from kvstore.cli.output import emit, table, warn
from kvstore.errors import InvalidRequest, KVStoreError

EXIT_DAMAGED = 1  # kvstore.cli.EXIT_DAMAGED (not imported: that package imports this module)
_LISTS = ("problems", "damage", "notes", "damaged", "clean")


def _inspect_text(report: dict) -> str:
    # codec and bits name a v3 file's TurboQuant codec; a v1 or v2 file has neither (None in --json)
    shown = {key: value for key, value in report.items() if key not in _LISTS}
    for key in ("codec", "bits"):
        if shown.get(key) is None:
            shown.pop(key, None)
    lines = [table(shown)]
    lines += [f"note: {note}" for note in report["notes"]]
    if report["damaged"]:
        lines += [f"damaged: {damage}" for damage in report["damage"]]
        lines.append(
            f"{report['path']}: damaged; `kvstore repair {report['path']}` fixes what can be fixed (keeps a .bak)"
        )
    else:
        lines.append(f"{report['path']}: clean")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvstore.filetools import inspect_file

    report = inspect_file(args.path)
    emit(args, report, _inspect_text(report))
    return EXIT_DAMAGED if report["damaged"] else 0


def cmd_export(args: argparse.Namespace) -> int:
    from kvstore.export import SUFFIXES, export
    from kvstore.filetools import SourceFile, check_damage, check_output, records_dropped

    if args.out.lower().endswith(SUFFIXES):  # the output is checked before the source is read
        check_output(args.out, overwrite=args.force, what="the export")
    # read a chunk at a time, judged first, then exported a batch at a time: whatever the file's size
    with SourceFile(args.path) as source:
        scan = source.scan()
        warning = check_damage(args.path, scan, allow=args.allow_damaged, doing="export")
        with progress.bar("export", enabled=not args.json and not args.quiet) as update:
            out = export(source, args.out, overwrite=args.force, repair=warning is not None, progress=update)
    report = {"source": args.path, "out": args.out, "records": scan.n, "tier": scan.tier.name}
    where = args.out
    if os.path.islink(args.out):  # a link is followed: the file written is where it leads
        report["written"] = str(out)
        where = f"{args.out} (written to {out})"
    if warning:
        warn(warning)
        report["records_dropped"] = records_dropped(scan)
    if not args.quiet:
        emit(args, report, f"exported {scan.n} records ({scan.tier.describe()}) to {where}")
    return 0


def _record_bytes(path: str) -> int:
    """Bytes per record of ``path`` for a progress bar (1 when no bar is drawn, or when the header
    cannot be read: the command itself then reports why, as it does without a bar)."""
    if not progress.wanted():
        return 1
    from kvstore.filetools import source_header

    try:
        return source_header(path).rec_bytes
    except (KVStoreError, OSError):
        return 1


def cmd_migrate(args: argparse.Namespace) -> int:
    from kvstore.filerewrite import migrate_file

    if args.tier is None:
        raise InvalidRequest(f"give the target with --tier NAME ({options.listing(args.tier_option.choices())})")
    with progress.bar("migrate", enabled=not args.json, bytes_per_unit=_record_bytes(args.src)) as update:
        report = migrate_file(
            args.src, args.dst, args.tier, overwrite=args.force, allow_damaged=args.allow_damaged, progress=update
        )
    if report["warning"]:
        warn(report["warning"])
    if report["steps"] and not args.json:
        print(f"note: {report['conversion']}", file=sys.stderr)
    emit(args, report, table({key: value for key, value in report.items() if key != "warning"}))
    return 0


def cmd_repair(args: argparse.Namespace) -> int:
    from kvstore.filerewrite import repair_file

    with progress.bar("repair", enabled=not args.json, bytes_per_unit=_record_bytes(args.path)) as update:
        report = repair_file(args.path, dry_run=args.dry_run, backup=not args.no_backup, progress=update)
    if args.json or not report["actions"]:
        emit(args, report, f"{args.path}: clean, nothing to repair ({report['records']} records)")
        return 0
    verb = "would" if args.dry_run else "did"
    lines = [f"{verb}: {action}" for action in report["actions"]]
    if os.path.islink(args.path):  # a link is followed: say which file was (or would be) repaired
        lines.append(f"file: {report['file']} (where {args.path} leads)")
    if report["backup"]:
        lines.append(f"backup: {report['backup']}")
    print("\n".join(lines))
    return 0


def _allow_damaged(parser: argparse.ArgumentParser, doing: str) -> None:
    parser.add_argument(
        "--allow-damaged",
        action="store_true",
        help=f"{doing} a damaged file anyway: its whole records, with a warning saying how many were dropped",
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register the file tools on the ``kvstore`` parser's subparsers."""
    p = sub.add_parser("inspect", help="show a .coli_kv file's header, counts and damage (exit 1: damaged)")
    p.add_argument("path", help="the .coli_kv file")
    options.add_json(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("export", help="export rows to .npz, .arrow or .parquet")
    p.add_argument("path", help="the .coli_kv file to read")
    p.add_argument("out", help="OUT.npz | OUT.arrow | OUT.parquet")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    _allow_damaged(p, "export")
    options.add_json(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("migrate", help="convert a file to another tier (never overwrites SRC)")
    p.add_argument("src", help="the .coli_kv file to convert (left as it is)")
    p.add_argument("dst", help="the file to write")
    options.add_tier(p, files_only=True, default=None, what="the tier to convert to", aliases=("--to",))
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    _allow_damaged(p, "migrate")
    options.add_json(p)
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("repair", help="clamp nrec, drop a torn tail, sanitize rows (keeps PATH.bak)")
    p.add_argument("path", help="the .coli_kv file to repair in place")
    p.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    p.add_argument("--no-backup", action="store_true", help="do not keep PATH.bak")
    options.add_json(p)
    p.set_defaults(func=cmd_repair)
