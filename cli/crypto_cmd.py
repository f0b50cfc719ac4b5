"""``kvstore crypto ...``: the keys of a store encrypted at rest (docs/SECURITY.md), apart from the
API keys (``kvstore keys``). No command prints a key.

- ``init-kek PATH`` writes a new random key-encryption key (KEK) to a new file (0600).
- ``status`` lists the owners with data keys, their versions and the files sealed under each, and
  the owners shredded.
- ``shred OWNER`` destroys every data key of the owner, durably: each of its journals, archives and
  every copy of them is unreadable from then on, without touching them. A running server notices
  within half a second (it watches the keyring) and drops the owner's rows it holds in memory.
- ``rotate-kek --new-kek-file PATH`` wraps every data key anew under another KEK; no data is
  rewritten. Give the server the new KEK file afterwards (a running one keeps the keys it holds).
- ``rotate-key OWNER`` makes a new data-key version (new files are sealed under it at once) and
  rewrites the owner's sessions under it, one at a time under each session's lock, while the store
  keeps serving; versions no file uses any longer are destroyed.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvstore.cli import options, store_cmd
from kvstore.cli.output import emit


def _store(args: argparse.Namespace) -> Any:  # an encrypted SessionStore or SharedSessionStore: the same crypto members
    import kvstore.store
    from kvstore.crypto import provider_from_settings

    kek = options.store_kek(args) or provider_from_settings()
    index_url = store_cmd.optional_index_url(args)
    if index_url is not None:  # a shared store: its data keys are in the index, shared by every replica
        store_cmd.shared_modules()
        return kvstore.store.open(
            None, index_url=index_url, blobs_url=store_cmd.blobs_url(args), cache_bytes=0, kek=kek
        )
    return kvstore.store.open(options.existing_store(args.data), kek=kek, create=False)


def _keyring(store):
    """The store's keyring (the store opened with a KEK always has one)."""
    from kvstore.errors import KeyUnavailable

    if store.keyring is None:
        raise KeyUnavailable(
            f"the store in {getattr(store, 'data_dir', None) or 'the shared index'} is not encrypted at rest"
        )
    return store.keyring


def cmd_init_kek(args: argparse.Namespace) -> int:
    from kvstore.crypto.kek import write_kek_file

    kek = write_kek_file(args.path)
    emit(
        args,
        {"path": args.path, "kek_id": kek.key_id},
        f"wrote a new key-encryption key to {args.path} (id {kek.key_id})",
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _store(args) as store:
        keyring = _keyring(store)
        owners = {}
        for owner in keyring.owners():
            owners[owner] = {
                "versions": keyring.versions(owner),
                "current": keyring.current(owner, create=False).version,
                "files_by_version": {str(v): n for v, n in sorted(store.key_versions_in_use(owner).items())},
            }
        payload = {"kek_id": keyring.provider.key_id, "owners": owners, "shredded": keyring.shredded()}
    lines = [f"KEK {payload['kek_id']}"]
    for owner, entry in owners.items():
        lines.append(
            f"{owner}: current v{entry['current']}, versions {entry['versions']}, files {entry['files_by_version']}"
        )
    lines += [f"{owner}: shredded" for owner in payload["shredded"]]
    emit(args, payload, "\n".join(lines))
    return 0


def cmd_shred(args: argparse.Namespace) -> int:
    from kvstore.store.values import validate_owner

    validate_owner(args.owner)
    with _store(args) as store:
        destroyed = store.shred_owner(args.owner)
    emit(
        args,
        {"owner": args.owner, "versions_destroyed": destroyed},
        f"shredded owner {args.owner!r}: {destroyed} data-key version(s) destroyed; its rows are unreadable "
        "everywhere (delete its sessions to free their space)",
    )
    return 0


def cmd_rotate_kek(args: argparse.Namespace) -> int:
    from kvstore.crypto import LocalKEK

    new = LocalKEK.from_file(args.new_kek_file)
    with _store(args) as store:
        count = _keyring(store).rewrap(new)
    emit(
        args,
        {"rewrapped": count, "kek_id": new.key_id},
        f"re-wrapped {count} data key(s) under the KEK of {args.new_kek_file} (id {new.key_id}); no data was "
        "rewritten: open the store with the new KEK from now on",
    )
    return 0


def cmd_rotate_key(args: argparse.Namespace) -> int:
    with _store(args) as store:
        report = store.rotate_data_key(args.owner)
    text = (
        f"owner {args.owner!r}: data key v{report['version']}; resealed {len(report['resealed'])} session(s); "
        f"retired versions {report['retired'] or 'none'}"
    )
    if report["skipped"]:
        text += "\nskipped (kept their version): " + "; ".join(report["skipped"])
    emit(args, report, text)
    return 1 if report["skipped"] else 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``crypto ...`` on the ``kvstore`` parser's subparsers."""
    crypto = sub.add_parser(
        "crypto", help="the keys of a store encrypted at rest: make a KEK, shred an owner, rotate keys"
    )
    commands = crypto.add_subparsers(dest="crypto_command", required=True, metavar="COMMAND")

    p = commands.add_parser("init-kek", help="write a new random key-encryption key to a new file (0600)")
    p.add_argument("path", metavar="PATH", help="the file to create (never overwritten)")
    options.add_json(p)
    p.set_defaults(func=cmd_init_kek)

    p = commands.add_parser("status", help="owners, their data-key versions and the files under each (no key)")
    options.add_data(p)
    store_cmd.add_shared(p)  # or a shared store's --index and --blobs
    options.add_json(p)
    p.set_defaults(func=cmd_status)

    p = commands.add_parser("shred", help="destroy an owner's data keys: its rows become unreadable everywhere")
    p.add_argument("owner", metavar="OWNER", help="the owner whose keys are destroyed (for good)")
    options.add_data(p)
    store_cmd.add_shared(p)  # or a shared store's --index and --blobs
    options.add_json(p)
    p.set_defaults(func=cmd_shred)

    p = commands.add_parser("rotate-kek", help="re-wrap every data key under a new KEK (no data rewritten)")
    p.add_argument("--new-kek-file", metavar="PATH", required=True, help="the new KEK's file (`crypto init-kek`)")
    options.add_data(p)
    store_cmd.add_shared(p)  # or a shared store's --index and --blobs
    options.add_json(p)
    p.set_defaults(func=cmd_rotate_kek)

    p = commands.add_parser(
        "rotate-key", help="a new data-key version for an owner; its sessions rewritten under it, one at a time"
    )
    p.add_argument("owner", metavar="OWNER", help="the owner whose data key is rotated")
    options.add_data(p)
    store_cmd.add_shared(p)  # or a shared store's --index and --blobs
    options.add_json(p)
    p.set_defaults(func=cmd_rotate_key)
