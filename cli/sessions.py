"""``kvstore sessions ...`` and ``kvstore verify``: the session store on a data folder, no server.

Every command opens the store of ``--data`` (default ``./data``), does one thing and prints a line
or, with ``--json``, the whole report. Only ``create`` makes a store where the folder holds none;
every other command refuses such a folder (exit 2, naming it) and leaves it as it was. Session ids are per owner: ``--owner`` acts as that owner
(other owners' sessions, whatever their ids, are invisible); without it an id is looked up for any
owner and refused (exit 2, naming the owners) when several owners have it. ``create`` gives its new
session ``--owner`` (default ``default``). ``verify`` exits 1 when a turn does not match its hash; bad input raises a
``KVStoreError`` (exit 2).
"""

from __future__ import annotations

import argparse
import io
import json
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore import config
from kvstore.cli import options, progress, store_cmd
from kvstore.cli.output import emit, warn
from kvstore.errors import InvalidRequest
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry
from kvstore.units import parse_size

if TYPE_CHECKING:
    from kvstore.store import Store

GEOMETRY_WORDS = "n_layers,kv_lora,qk_rope,index_hd,nic,vocab"


# ---------------------------------------------------------------------------- helpers
def _store(args: argparse.Namespace, *, hard_limit_bytes: int | None = None, create: bool = False) -> Store:
    """The embedded store in ``--data``, or the shared one ``--index`` and ``--blobs`` name (also
    ``KVSTORE_INDEX_URL``, ``KVSTORE_BLOBS_URL``; no local folder, no cache): the same calls on
    either, from the one factory (``kvstore.store.open``).

    Only ``create`` makes a store where ``--data`` holds none: every other command works on sessions
    already stored, so a folder without a store (a typo in ``--data``) is refused, not made empty.
    """
    import kvstore.store

    index_url = store_cmd.optional_index_url(args)
    if index_url is not None:
        store_cmd.shared_modules()
        return kvstore.store.open(
            None,
            index_url=index_url,
            blobs_url=store_cmd.blobs_url(args),
            cache_bytes=0,
            hard_limit_bytes=hard_limit_bytes,
            kek=options.store_kek(args),  # else the index and KVSTORE_KEK_FILE / KVSTORE_KEK decide
        )
    if not create:
        return kvstore.store.open(
            options.existing_store(args.data),
            hard_limit_bytes=hard_limit_bytes,
            create=False,
            kek=options.store_kek(args),
        )
    return kvstore.store.open(
        options.data_folder(args.data), hard_limit_bytes=hard_limit_bytes, kek=options.store_kek(args)
    )


def _geometry(text: str) -> Geometry:
    words = text.split(",")
    if len(words) != 6 or not all(w.strip().isdigit() for w in words):
        raise InvalidRequest(f"--geometry is {GEOMETRY_WORDS} (six non-negative integers)")
    return Geometry(*(int(w) for w in words))


def _model(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": args.model_name,
        "revision": args.model_revision,
        "weights_hash": args.weights_hash,
        "tokenizer_hash": args.tokenizer_hash,
        "chat_template_hash": args.chat_template_hash,
        "attention_variant": args.attention_variant,
    }


def _summary(info) -> str:
    return (
        f"{info.id}  owner={info.owner}  model={info.model.name}@{info.model.revision}  {info.tier.describe()}  "
        f"records={info.n_records}  watermark={info.watermark}  {info.state}  {info.size_bytes} B"
        + (f"  tags={','.join(info.tags)}" if info.tags else "")
        + (f"  expires={_when(info.expires_at)}" if info.expires_at is not None else "")
        + (f"  problem: {info.problem}" if info.problem else "")
    )


def _write_output(path: Path, payload: bytes) -> None:
    from kvstore.durable import AtomicFile

    with AtomicFile(path, replace=True) as out:
        out.write(payload)


def _read_tokens(args: argparse.Namespace) -> np.ndarray:
    """int64[n] token ids from ``--tokens`` or ``--tokens-file`` (.npy, .coli_kv or text)."""
    if args.tokens is not None:
        return np.array(options.parse_ids(args.tokens, "--tokens"), dtype=np.int64)
    from kvstore.filetools import load_source, naming, read_source

    path = Path(args.tokens_file)
    if path.suffix == ".coli_kv":
        return load_source(args.tokens_file)[1].tokens.astype(np.int64)
    read_source(args.tokens_file, ".npy, .coli_kv or text token ids", limit=0)  # missing, a folder: one line
    if path.suffix == ".npy":
        with naming(args.tokens_file):
            try:
                tokens = np.load(path, allow_pickle=False)
            except (ValueError, EOFError) as exc:
                raise InvalidRequest(f"not a .npy array of token ids ({exc}); expected a 1-D integer array") from None
    else:
        try:
            tokens = np.array(path.read_text().split(), dtype=np.int64)
        except ValueError:
            raise InvalidRequest(
                f"{path}: not whitespace-separated integers; expected token ids separated by spaces or newlines"
            ) from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise InvalidRequest(
            f"{path}: holds a {tokens.dtype} array of shape {tokens.shape}; expected a 1-D array of integer token ids"
        )
    return tokens


# ---------------------------------------------------------------------------- commands
LIST_PAGE = 1000  # sessions read (and printed) at a time by ``sessions list``


def cmd_list(args: argparse.Namespace) -> int:
    """Every matching session, a page of the store's list at a time (cursor to cursor), each page
    printed before the next is read: what the command holds is one page, whatever the store holds.
    The output is the same as printing the whole list at once (``--json``: one indented array)."""
    as_json = getattr(args, "json", False)
    shown = 0
    with _store(args) as store:
        after = None
        while True:
            page = store.list(
                owner=args.owner, model_name=args.model, tags=args.tag or (), state=args.state,
                limit=LIST_PAGE, after=after,
            )  # fmt: skip
            if not page:
                break
            if as_json:
                items = (textwrap.indent(json.dumps(info.to_dict(), indent=2), "  ") for info in page)
                print(("[\n" if shown == 0 else ",\n") + ",\n".join(items), end="")
            else:
                print("\n".join(_summary(info) for info in page))
            shown += len(page)
            after = page[-1].cursor
    if as_json:
        print("\n]" if shown else "[]")
    elif shown == 0:
        print("(no sessions)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _store(args) as store:
        info = store.get(args.id, owner=args.owner)
        turns = store.inspect(args.id, owner=args.owner)["turns"] if args.turns else None
    payload = info.to_dict() | ({"turns": turns} if turns is not None else {})
    emit(args, payload, _summary(info) + (f"  turns={turns}" if turns is not None else ""))
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    if args.like is not None:
        from kvstore.filetools import source_header

        header = source_header(args.like)
        geometry, tier = header.geometry, header.tier
    elif args.geometry is not None:
        geometry, tier = _geometry(args.geometry), args.tier
    else:
        raise InvalidRequest(f"give --geometry {GEOMETRY_WORDS} or --like FILE.coli_kv")
    with _store(args, hard_limit_bytes=parse_size(args.hard_limit), create=True) as store:
        info = store.create(
            args.owner, geometry, tier, _model(args), session_id=args.id, tags=args.tag or (), ttl_s=_ttl(args.ttl)
        )
    emit(args, info.to_dict(), info.id)
    return 0


# ---------------------------------------------------------------------------- expiry
def _ttl(text: str | None) -> float | None:
    from kvstore.store.values import parse_ttl

    return parse_ttl(text) if text is not None else None


def _when(seconds: float | None) -> str:
    import datetime

    if seconds is None:
        return "never"
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cmd_ttl(args: argparse.Namespace) -> int:
    """``sessions ttl ID TTL``: set (``none``: drop) a session's own time-to-live, counted from now."""
    from kvstore.store.values import parse_ttl

    ttl_s = parse_ttl(args.ttl, "TTL")
    with _store(args) as store:
        info = store.set_ttl(args.id, ttl_s, owner=args.owner)
    emit(
        args,
        info.to_dict(),
        f"{info.id}: ttl {info.ttl_s if info.ttl_s is not None else 'none'}, expires {_when(info.expires_at)}",
    )
    return 0


def cmd_owner_ttl(args: argparse.Namespace) -> int:
    """``sessions owner-ttl OWNER [TTL]``: show, or set (``none``: drop), an owner's default time-to-live."""
    from kvstore.store.values import parse_ttl, validate_owner

    owner = validate_owner(args.owner_name)
    with _store(args) as store:
        if args.ttl is None:
            ttl_s, moved = store.owner_ttl(owner), None
        else:
            ttl_s = parse_ttl(args.ttl, "TTL")
            moved = store.set_owner_ttl(owner, ttl_s)
    shown = f"{ttl_s:g} s" if ttl_s is not None else "none"
    text = f"owner {owner!r}: ttl {shown}" + (
        f" (applies to {moved} sessions without their own)" if moved is not None else ""
    )
    emit(args, {"owner": owner, "ttl_s": ttl_s, **({"sessions": moved} if moved is not None else {})}, text)
    return 0


def cmd_expire(args: argparse.Namespace) -> int:
    """``sessions expire``: delete the expired sessions now (what ``kvstore serve`` sweeps every
    ``--expiry-sweep`` seconds), a batch of ``--limit`` at a time."""
    swept = []
    with _store(args) as store:
        while True:
            batch = store.expire(limit=args.limit)
            swept.extend(batch)
            if len(batch) < args.limit:
                break
    text = "\n".join(f"expired {e.session_id} (owner {e.owner}, {e.freed_bytes} B)" for e in swept)
    emit(args, [e.to_dict() for e in swept], text or "no expired sessions")
    return 0


def cmd_append(args: argparse.Namespace) -> int:
    from kvstore.filetools import check_damage, load_source, read_source, sanitized_records

    source = Path(args.file)
    read_source(args.file, "a .coli_kv, .npz or raw records file", limit=0)  # missing, a folder: one line
    with _store(args, hard_limit_bytes=parse_size(args.hard_limit)) as store:
        info = store.get(args.id, owner=args.owner)
        complete = not args.partial
        if source.suffix == ".coli_kv":
            _, records = load_source(args.file, expect=info.geometry, tier=info.tier)
            warning = check_damage(args.file, records, allow=args.allow_damaged, doing="append")
            if warning:
                warn(warning)
            rows = sanitized_records(records) if warning else records.records
            result = store.append_records(args.id, rows, complete_turn=complete, owner=args.owner)
        elif source.suffix == ".npz":
            with np.load(source, allow_pickle=False) as arrays:
                missing = {"tokens", "L", "R"} - set(arrays.files)
                if missing:
                    raise InvalidRequest(
                        f"{source} lacks arrays {sorted(missing)} (needs tokens, L, R and I when nic > 0)"
                    )
                index = arrays["I"] if "I" in arrays.files else None
                result = store.append(
                    args.id, arrays["tokens"], arrays["L"], arrays["R"], index, complete_turn=complete, owner=args.owner
                )
        else:
            result = store.append_records(args.id, source.read_bytes(), complete_turn=complete, owner=args.owner)
    payload = {"session": result.info.to_dict(), "appended": result.appended, "turn": result.turn}
    emit(
        args,
        payload,
        f"appended {result.appended} records: {result.info.n_records} in {args.id}, watermark {result.info.watermark}",
    )
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    from kvstore.filetools import check_output

    out = check_output(args.out, overwrite=True, what="the resumed rows")
    with _store(args) as store:
        resumed = store.resume(args.id, owner=args.owner, verify=args.verify)
    records = resumed.records
    if out.suffix == ".coli_kv":
        payload = coli_kv.Header(records.geometry, records.tier, records.n).to_bytes() + records.record_bytes()
    elif out.suffix == ".npz":
        L, R, index = records.dequantize()
        buffer = io.BytesIO()
        if index is None:
            np.savez(buffer, tokens=records.tokens, L=L, R=R)
        else:
            np.savez(buffer, tokens=records.tokens, L=L, R=R, I=index)
        payload = buffer.getvalue()
    else:
        payload = records.record_bytes()
    _write_output(out, payload)
    report = {
        "session_id": args.id,
        "reused_tokens": resumed.reused_tokens,
        "verified": resumed.verified,
        "damaged_from": resumed.damaged_from,
        "out": str(out),
    }
    text = f"reused_tokens={resumed.reused_tokens} -> {out}"
    if resumed.damaged_from is not None:
        text += f" (damage from record {resumed.damaged_from} was not served)"
    emit(args, report, text)
    return 0


def cmd_truncate(args: argparse.Namespace) -> int:
    with _store(args) as store:
        info = store.truncate(args.id, args.n_records, owner=args.owner)
    emit(args, info.to_dict(), _summary(info))
    return 0


def cmd_fork(args: argparse.Namespace) -> int:
    with _store(args, hard_limit_bytes=parse_size(args.hard_limit)) as store:
        info = store.fork(args.id, at=args.at, new_id=args.new_id, owner=args.owner, tags=args.tag)
    emit(args, info.to_dict(), info.id)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    with _store(args) as store:
        store.delete(args.id, owner=args.owner)
    emit(args, {"deleted": args.id}, f"deleted {args.id}")
    return 0


def cmd_park(args: argparse.Namespace) -> int:
    with _store(args) as store, progress.bar("park", enabled=not args.json) as update:
        info = store.park(args.id, owner=args.owner, progress=update)
    emit(args, info.to_dict(), _summary(info))
    return 0


def cmd_unpark(args: argparse.Namespace) -> int:
    with _store(args) as store, progress.bar("unpark", enabled=not args.json) as update:
        info = store.unpark(args.id, owner=args.owner, progress=update)
    emit(args, info.to_dict(), _summary(info))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every turn of a session: exit 0 when all match, 1 naming the first that does not.

    ``--repair`` first reconciles the data folder (``kvstore.store.recovery``: stale lock files and
    temporary files removed, interrupted calls settled, damaged sessions whose files are sound again
    given back their state) and prints each thing it did; the id is then optional.
    """
    if args.id is None and not args.repair:
        raise InvalidRequest("give the id of the session to verify, or --repair to reconcile the whole data folder")
    with _store(args) as store:
        # opening reconciled already; a second pass settles what a busy session made it skip
        repaired = [*store.reconcile_actions, *store.reconcile()] if args.repair else []
        report = None
        if args.id is not None:
            with progress.bar("verify", enabled=not args.json) as update:
                report = store.verify(args.id, owner=args.owner, progress=update)
    lines = [f"repaired: {line}" for line in repaired] or (["nothing to repair"] if args.repair else [])
    if report is None:
        emit(args, {"repaired": repaired}, "\n".join(lines))
        return 0
    bad = report.first_bad  # None exactly when the report is ok
    if bad is None:
        lines.append(f"{args.id}: ok ({report.turns_checked} turns, {report.n_records} records)")
    else:
        lines.append(
            f"{args.id}: turn {bad['turn']} (records {bad['start']}..{bad['end']}) does not match its hash; "
            f"{report.good_records} records before it are good"
        )
    emit(args, report.to_dict() | ({"repaired": repaired} if args.repair else {}), "\n".join(lines))
    return 0 if report.ok else 1


def cmd_inspect(args: argparse.Namespace) -> int:
    with _store(args) as store:
        report = store.inspect(args.id, owner=args.owner)
    session = report["session"]
    head = f"{session['id']}: {session['tier']['description']}, {report.get('loadable_records')} loadable records, file {report.get('file')}"
    emit(args, report, "\n".join([head, *(report.get("problems") or ["no problems"])]))
    return 0


def cmd_repair(args: argparse.Namespace) -> int:
    with _store(args) as store, progress.bar("repair", enabled=not args.json) as update:
        report = store.repair(args.id, owner=args.owner, dry_run=args.dry_run, progress=update)
    text = "\n".join(report.actions) or "nothing to repair"
    emit(args, report.to_dict(), text + (" (dry run)" if args.dry_run and report.actions else ""))
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.tier is None:
        raise InvalidRequest(f"give the target with --tier NAME ({options.listing(args.tier_option.choices())})")
    with _store(args) as store:
        per_record = store.get(args.id, owner=args.owner).record_bytes if progress.wanted(not args.json) else 1
        with progress.bar("migrate", enabled=not args.json, bytes_per_unit=per_record) as update:
            info = store.migrate(args.id, args.tier, owner=args.owner, progress=update)
    emit(args, info.to_dict(), _summary(info))
    return 0


def cmd_lookup(args: argparse.Namespace) -> int:
    from kvstore.store import Fingerprint, ModelInfo

    tokens = _read_tokens(args)
    with _store(args) as store:
        if args.like_session is not None:
            like = store.get(args.like_session, owner=args.owner)  # ids are per owner: --owner's session
            fingerprint, owner = like.fingerprint, like.owner
        else:
            if args.geometry is None or args.model_name is None or args.model_revision is None:
                raise InvalidRequest(
                    "give --like-session ID, or --model-name, --model-revision and --geometry (+ --tier)"
                )
            fingerprint = Fingerprint(ModelInfo.from_dict(_model(args)), _geometry(args.geometry), args.tier)
            owner = options.creating_owner(args.owner)
        found = store.lookup(owner, fingerprint, tokens)
    if found is None:
        emit(args, {"match": None}, "no session shares a prefix of at least one block")
    else:
        emit(
            args,
            {"match": found.to_dict()},
            f"{found.session_id}: {found.matched_tokens} tokens in common ({found.state})",
        )
    return 0


# ---------------------------------------------------------------------------- parsers
def _on_data(parser: argparse.ArgumentParser, *, session: bool = True, owner: options.OwnerRole = "existing") -> None:
    """The options every sessions command takes: ``--data`` (or ``--index`` and ``--blobs``),
    ``--owner``, ``--json`` (and the id)."""
    options.add_data(parser)
    store_cmd.add_shared(parser)
    options.add_owner(parser, owner)
    options.add_json(parser)
    if session:
        parser.add_argument("id", help="session id")


def _model_flags(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--model-name", required=required, help="the model's name (fingerprint: model.name)")
    parser.add_argument(
        "--model-revision", required=required, help="the model's revision (fingerprint: model.revision)"
    )
    for name in ("--weights-hash", "--tokenizer-hash", "--chat-template-hash", "--attention-variant"):
        field = name.removeprefix("--").replace("-", "_")
        parser.add_argument(name, help=f"fingerprint field model.{field} (default: not recorded)")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``sessions ...`` on the ``kvstore`` parser's subparsers."""
    sessions = sub.add_parser(
        "sessions", help="manage sessions directly on a data folder or a shared store (--index, --blobs; no server)"
    )
    commands = sessions.add_subparsers(dest="sessions_command", required=True, metavar="COMMAND")

    p = commands.add_parser("list", help="list sessions")
    _on_data(p, session=False)
    p.add_argument("--model", help="model name")
    p.add_argument("--tag", action="append", help="sessions holding this tag (repeatable)")
    p.add_argument("--state", choices=["active", "parked", "damaged"], help="sessions in this state only")
    p.set_defaults(func=cmd_list)

    p = commands.add_parser("show", help="one session")
    _on_data(p)
    p.add_argument("--turns", action="store_true", help="also count the hashed turns")
    p.set_defaults(func=cmd_show)

    p = commands.add_parser("create", help="create an empty session")
    _on_data(p, session=False, owner="create")
    p.add_argument("--id", help="session id (generated if absent)")
    _model_flags(p, required=True)
    p.add_argument("--geometry", help=GEOMETRY_WORDS)
    p.add_argument("--like", help="take geometry and tier from this .coli_kv file")
    options.add_tier(p, files_only=True, default=config.SESSION_TIER.value, what="record format (ignored with --like)")
    p.add_argument("--tag", action="append", help="a tag for the session (repeatable)")
    p.add_argument("--hard-limit", help="refuse the write past this store size")
    p.add_argument(
        "--ttl",
        help="its own time-to-live, counted from its last use: seconds or 90s, 30m, 12h, 30d, 2w (default: its owner's)",
    )
    p.set_defaults(func=cmd_create)

    p = commands.add_parser("ttl", help="set a session's own time-to-live, counted from now (none: drop it)")
    _on_data(p)
    p.add_argument("ttl", metavar="TTL", help="seconds or 90s, 30m, 12h, 30d, 2w; none: its owner's applies")
    p.set_defaults(func=cmd_ttl)

    p = commands.add_parser("owner-ttl", help="show or set an owner's default time-to-live (operators)")
    p.add_argument("owner_name", metavar="OWNER", help="the owner (as its API keys name it)")
    p.add_argument(
        "ttl", metavar="TTL", nargs="?", help="seconds or 90s, 30m, 12h, 30d, 2w; none: drop it; absent: show"
    )
    options.add_data(p)
    store_cmd.add_shared(p)
    options.add_json(p)
    p.set_defaults(func=cmd_owner_ttl)

    p = commands.add_parser(
        "expire", help="delete the expired sessions now (kvstore serve sweeps every --expiry-sweep)"
    )
    options.add_data(p)
    store_cmd.add_shared(p)
    options.add_json(p)
    p.add_argument("--limit", type=int, default=100, help="sessions deleted per batch (default 100)")
    p.set_defaults(func=cmd_expire)

    p = commands.add_parser(
        "append", help="append rows from a .coli_kv file, an .npz (tokens, L, R, I) or raw record bytes"
    )
    _on_data(p)
    p.add_argument("file", help="FILE.coli_kv, FILE.npz or raw record bytes of the session's tier")
    p.add_argument("--partial", action="store_true", help="the rows do not end a turn (resume will not serve them yet)")
    p.add_argument(
        "--allow-damaged",
        action="store_true",
        help="append a damaged .coli_kv file anyway: its whole records, rows made inert as repair would",
    )
    p.add_argument("--hard-limit", help="refuse the write past this store size")
    p.set_defaults(func=cmd_append)

    p = commands.add_parser("resume", help="write the rows to restore: OUT.coli_kv, OUT.npz (dequantized) or raw bytes")
    _on_data(p)
    p.add_argument("out", help="OUT.coli_kv, OUT.npz or any other name for raw record bytes")
    p.add_argument("--verify", action="store_true", help="re-hash the turns; damage is not served")
    p.set_defaults(func=cmd_resume)

    p = commands.add_parser("truncate", help="keep the first N records")
    _on_data(p)
    p.add_argument("n_records", type=int, help="records to keep")
    p.set_defaults(func=cmd_truncate)

    p = commands.add_parser("fork", help="a new session sharing a prefix")
    _on_data(p)
    p.add_argument("--at", type=int, help="records to copy (default: the watermark)")
    p.add_argument("--new-id", help="id of the new session (generated if absent)")
    p.add_argument("--tag", action="append", help="a tag for the new session (repeatable)")
    p.add_argument("--hard-limit", help="refuse the write past this store size")
    p.set_defaults(func=cmd_fork)

    for name, func, text in (
        ("delete", cmd_delete, "delete a session and its files"),
        ("park", cmd_park, "compress a session into the archive"),
        ("unpark", cmd_unpark, "restore a parked session"),
        ("inspect", cmd_inspect, "the session file's header and problems"),
    ):
        p = commands.add_parser(name, help=text)
        _on_data(p)
        p.set_defaults(func=func)

    _verify_options(commands.add_parser("verify", help="re-hash every turn (exit 1 if bad); --repair the folder"))

    p = commands.add_parser("repair", help="drop torn, unacknowledged or damaged tails")
    _on_data(p)
    p.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    p.set_defaults(func=cmd_repair)

    p = commands.add_parser("migrate", help="convert a session to another tier (lossy unless f32)")
    _on_data(p)
    options.add_tier(p, files_only=True, default=None, what="the tier to convert to")
    p.set_defaults(func=cmd_migrate)

    p = commands.add_parser("lookup", help="the session sharing the longest token prefix")
    options.add_data(p)
    store_cmd.add_shared(p)
    options.add_owner(
        p,
        text="search this owner's sessions; with --like-session, that owner's session of the id (default: the "
        "--like-session's owner, else 'default')",
    )
    options.add_json(p)
    p.add_argument("--like-session", help="use this session's model fingerprint (and owner)")
    _model_flags(p, required=False)
    p.add_argument("--geometry", help=GEOMETRY_WORDS)
    options.add_tier(p, files_only=True, default=config.SESSION_TIER.value, what="the record format sessions must have")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", help="token ids, comma or space separated")
    source.add_argument("--tokens-file", help=".npy, .coli_kv or whitespace-separated integers")
    p.set_defaults(func=cmd_lookup)


def add_verify(sub: argparse._SubParsersAction) -> None:
    """Register ``verify ID``: ``sessions verify`` at the top level, where the engine commands are."""
    _verify_options(sub.add_parser("verify", help="re-hash a session's journal; report the first bad turn (exit 1)"))


def _verify_options(p: argparse.ArgumentParser) -> None:
    """``verify [ID] [--repair]``, the same under ``sessions`` and at the top level."""
    _on_data(p, session=False)
    p.add_argument("id", nargs="?", help="session id (optional with --repair)")
    p.add_argument(
        "--repair",
        action="store_true",
        help="first reconcile the data folder and print what was done: lock files of sessions that no longer "
        "exist, symbolic links where lock files belong and temporary files no writer holds removed; damaged "
        "sessions whose files are sound again (present, same model, every turn re-hashing) restored",
    )
    p.set_defaults(func=cmd_verify)
