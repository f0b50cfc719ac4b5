"""``kvstore keys create|list|revoke``: the API keys of a data folder (``<data>/keys.json``), no server
needed. A running server re-reads the file on its next request: a new key works at once, and a
revoked one is refused from the next request on (401, as an unknown key is).

With ``--index postgresql://...`` (or ``KVSTORE_INDEX_URL``) the keys are those of a shared store,
in its PostgreSQL index (``kvstore.keys.IndexKeys``), the same for every replica; ``--data`` is then
not used.

``create`` prints the key once (only a salted digest is stored); ``list`` never prints a key, a
digest or a salt: id, owner, state, created, expires, revoked and the key's last 4 characters.

``--expires`` and every time in ``keys.json`` lie in 1970-01-01 .. 9999-12-31T23:59:59Z; an entry of
``keys.json`` that cannot be used (a time out of that range, ...) is skipped: each command warns
about it on stderr (position, id and owner, why) and works with the other keys, and a change keeps
the entry as written.
"""

from __future__ import annotations

import argparse

from kvstore.cli import options, store_cmd
from kvstore.cli.output import emit, warn


def _keys(args: argparse.Namespace):
    """The key store the command acts on: the shared index when one is named, else ``<data>/keys.json``."""
    from kvstore.keys import IndexKeys, KeyFile

    url = store_cmd.optional_index_url(args)
    if url is not None:
        store_cmd.shared_modules()
        return IndexKeys(url)
    return KeyFile(options.data_folder(args.data))


def _warn_skipped(keys) -> None:
    """Warn (stderr) about each ``keys.json`` entry the command left aside (a shared index has none)."""
    from kvstore.keys import KeyFile

    if isinstance(keys, KeyFile):
        for skipped in keys.document().skipped:
            warn(skipped.describe(str(keys.path)))


def _where(args: argparse.Namespace) -> str:
    """How to name the same key store again on the command line (a password is not repeated)."""
    if args.index:
        from kvstore.store.shared.index import redacted_url

        return f"--index {redacted_url(args.index)}"
    return "" if store_cmd.optional_index_url(args) else f"--data {args.data}"


def cmd_create(args: argparse.Namespace) -> int:
    from kvstore.keys import check_owner, format_time, parse_expires

    owner = check_owner(args.owner)
    expires = parse_expires(args.expires) if args.expires is not None else None
    keys = _keys(args)
    record, key = keys.create(owner, expires=expires)
    _warn_skipped(keys)
    until = f", expires {format_time(record.expires)}" if record.expires is not None else ""
    text = (
        f"Created API key {record.id} for owner {owner!r}{until} in {keys.path} (shown once, keep it):\n"
        f"  {key}\n"
        f"Revoke it with: kvstore keys revoke {record.id} {_where(args)}".rstrip()
    )
    emit(args, {**record.public(), "key": key}, text)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from kvstore.keys import KeyFile, check_owner, utc_now

    owner = check_owner(args.owner) if args.owner is not None else None
    keys = _keys(args)
    now = utc_now()
    records = keys.document().records if isinstance(keys, KeyFile) else keys.records()
    _warn_skipped(keys)
    shown = [record.public(now) for record in records if owner is None or record.owner == owner]
    emit(args, shown, _table(shown) if shown else f"no API keys in {keys.path}" + (f" for {owner!r}" if owner else ""))
    return 0


def _table(rows: list[dict]) -> str:
    columns = ["id", "owner", "state", "created", "expires", "revoked", "hint"]
    cells = [[column.upper() for column in columns]]
    for row in rows:
        hint = row["hint"]
        cells.append([*("-" if row[c] is None else str(row[c]) for c in columns[:-1]), f"...{hint}" if hint else "-"])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells)


def cmd_revoke(args: argparse.Namespace) -> int:
    from kvstore.keys import format_time

    keys = _keys(args)
    record, changed = keys.revoke(args.id)
    _warn_skipped(keys)
    if changed:
        text = f"Revoked API key {record.id} of owner {record.owner!r}: the service refuses it from its next request"
    else:
        text = f"API key {record.id} of owner {record.owner!r} was already revoked at {format_time(record.revoked)}"
    emit(args, record.public(), text)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``keys ...`` on the ``kvstore`` parser's subparsers."""
    keys = sub.add_parser(
        "keys", help="create, list and revoke the service's API keys (in <data>/keys.json, or a shared --index)"
    )
    commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")

    p = commands.add_parser("create", help="make a key for an owner and print it once")
    p.add_argument("--owner", metavar="NAME", required=True, help="the owner the key acts for (its sessions)")
    p.add_argument(
        "--expires",
        metavar="WHEN",
        help="when the key stops working: a span (12h, 30d, 2w) or an ISO date or time (2026-01-31 is its "
        "00:00 UTC; 2026-01-31T12:00:00Z); default never",
    )
    options.add_data(p)
    store_cmd.add_shared(p, blobs=False)
    options.add_json(p, "print the new key and its record as JSON")
    p.set_defaults(func=cmd_create)

    p = commands.add_parser("list", help="list the keys: id, owner, state, dates, last 4 characters (never a key)")
    p.add_argument("--owner", metavar="NAME", help="only this owner's keys (default: every owner's)")
    options.add_data(p)
    store_cmd.add_shared(p, blobs=False)
    options.add_json(p, "print the records as a JSON list")
    p.set_defaults(func=cmd_list)

    p = commands.add_parser("revoke", help="refuse a key from the service's next request on")
    p.add_argument("id", metavar="ID", help="the key's id, as `kvstore keys list` shows it (k_ and 12 hex digits)")
    options.add_data(p)
    store_cmd.add_shared(p, blobs=False)
    options.add_json(p, "print the revoked key's record as JSON")
    p.set_defaults(func=cmd_revoke)
