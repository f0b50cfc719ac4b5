"""``kvstore store push | pull``: copy sessions between an embedded store (``--data``) and a shared one
(``--index postgresql://...`` + ``--blobs s3://BUCKET/PREFIX``).

The shared store is named as ``kvstore serve`` names it: ``--index`` / ``KVSTORE_INDEX_URL``,
``--blobs`` / ``KVSTORE_BLOBS_URL``, and the S3 endpoint and credentials from ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_REGION``. The work is
:mod:`kvstore.store.shared.transfer`: a session's turns become segments and back, byte for byte; a
session the target already holds is left alone (or extended, or its metadata updated), so running a
copy twice changes nothing.

Exit codes: 0 every session copied or already there; 1 a session was refused because its bytes do
not match their hashes (``kvstore verify`` names the turn); 2 a session was refused for another
reason (the target holds a different session under its id, another writer holds its lease), or
bad arguments; a server that is down stops the copy with exit 2 and ``retry``: running it again
resumes it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstore import config
from kvstore.cli import options, progress
from kvstore.cli.output import emit
from kvstore.errors import ConfigError, InvalidRequest

EXIT_DAMAGED = 1  # kvstore.cli.EXIT_DAMAGED (not imported: that package imports this module)
EXIT_REFUSED = 2
INDEX_ENV = config.INDEX_URL.name
BLOBS_ENV = config.BLOBS_URL.name


def optional_index_url(args: argparse.Namespace) -> str | None:
    """``--index`` or ``KVSTORE_INDEX_URL``; None when neither is set."""
    url = getattr(args, "index", None) or config.INDEX_URL.get()
    if url is not None and not url.startswith(("postgresql://", "postgres://")) and "=" not in url:
        raise InvalidRequest(f"--index {url!r} is not a PostgreSQL URL (postgresql://USER@HOST:PORT/DB)")
    return url


def index_url(args: argparse.Namespace) -> str:
    """``--index`` or ``KVSTORE_INDEX_URL``, refused with one line when neither is set."""
    url = optional_index_url(args)
    if url is None:
        raise InvalidRequest(f"name the shared index with --index postgresql://USER@HOST:PORT/DB (or {INDEX_ENV})")
    return url


def optional_blobs_url(args: argparse.Namespace) -> str | None:
    """``--blobs`` or ``KVSTORE_BLOBS_URL``; None when neither is set."""
    return getattr(args, "blobs", None) or config.BLOBS_URL.get()


def blobs_url(args: argparse.Namespace) -> str:
    url = optional_blobs_url(args)
    if url is None:
        raise InvalidRequest(f"name the object store with --blobs s3://BUCKET/PREFIX (or {BLOBS_ENV})")
    return url


def shared_modules() -> None:
    """Refuse with one line when the ``shared`` extra (psycopg, boto3) is not installed."""
    try:
        import boto3  # noqa: F401
        import psycopg  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"the shared store needs {exc.name}: pip install 'kvstore[shared]' (psycopg and boto3)"
        ) from None


def add_shared(parser: argparse.ArgumentParser, *, blobs: bool = True) -> None:
    """``--index URL`` (and ``--blobs URL``): the shared store, defaults from the environment."""
    parser.add_argument(
        "--index",
        metavar="URL",
        help=f"the shared index, postgresql://USER@HOST:PORT/DB (default: ${INDEX_ENV})",
    )
    if blobs:
        parser.add_argument(
            "--blobs",
            metavar="URL",
            help=f"the object store, s3://BUCKET/PREFIX (default: ${BLOBS_ENV}; endpoint and credentials from "
            "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION)",
        )


def _describe(copied: dict[str, Any]) -> str:
    who = f"{copied['id']} ({copied['owner']})"
    if copied["action"] == "refused":
        return f"refused    {who}: {copied['reason']}"
    if copied["copied_records"]:
        size = copied["copied_bytes"]
        shown = f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size} bytes"
        return (
            f"{copied['action']:<10} {who}: {copied['copied_records']} records ({shown}), {copied['n_records']} in all"
        )
    return f"{copied['action']:<10} {who}: {copied['n_records']} records"


def _run(args: argparse.Namespace, direction: str) -> int:
    index, blobs = index_url(args), blobs_url(args)
    owner = args.owner
    if owner is not None:
        from kvstore.store.values import validate_owner

        validate_owner(owner)
    data = options.data_folder(args.data)
    if direction == "push" and not (Path(data) / "index").is_dir():
        raise InvalidRequest(f"--data {args.data}: no session store there (no index/ folder); nothing to push")
    shared_modules()
    import kvstore.store
    from kvstore.store.shared import BlobStore, SharedIndex, SharedStore
    from kvstore.store.shared.index import redacted_url
    from kvstore.store.shared.transfer import pull, push

    blob_store = BlobStore(blobs)  # checks the URL before anything connects
    # the embedded side through the one factory; the shared side is the protocol's own SharedStore
    # (segments turn by turn, kvstore.store.shared.transfer), not the session interface
    from kvstore.store.shared.keys import encrypted

    # sealed objects when the index says the store is encrypted: --kek-file's KEK, else the settings'
    shared_store = encrypted(SharedStore(SharedIndex(index), blob_store), options.store_kek(args))
    with shared_store as shared, kvstore.store.open(data) as local:
        with progress.bar(direction, enabled=not args.json) as update:
            copy = push if direction == "push" else pull
            report = copy(local, shared, owner=owner, progress=update)
    payload = {"data": str(data), "index": redacted_url(index), "blobs": blobs, **report.to_dict()}
    counts = report.counts()
    lines = [_describe(copied) for copied in payload["sessions"]]
    summary = ", ".join(f"{n} {action}" for action, n in counts.items() if n) or "no sessions"
    where = f"{args.data} -> {blobs}" if direction == "push" else f"{blobs} -> {args.data}"
    lines.append(f"{direction} {where}: {summary}")
    emit(args, payload, "\n".join(lines))
    if any(copied.damaged for copied in report.sessions):
        return EXIT_DAMAGED
    return EXIT_REFUSED if counts["refused"] else 0


def cmd_push(args: argparse.Namespace) -> int:
    return _run(args, "push")


def cmd_pull(args: argparse.Namespace) -> int:
    return _run(args, "pull")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``store push | pull`` on the ``kvstore`` parser's subparsers."""
    store = sub.add_parser("store", help="copy sessions between a local store and a shared one (PostgreSQL + S3)")
    commands = store.add_subparsers(dest="store_command", required=True, metavar="COMMAND")
    for name, doing, func in (
        ("push", "copy every session of --data into the shared store (again: only what changed)", cmd_push),
        ("pull", "copy every session of the shared store into --data (again: only what changed)", cmd_pull),
    ):
        p = commands.add_parser(name, help=doing)
        options.add_data(p)
        add_shared(p)
        p.add_argument("--owner", metavar="NAME", help="only this owner's sessions (default: every owner's)")
        options.add_json(p, "print the report as JSON: counts and one entry per session")
        p.set_defaults(func=func)
