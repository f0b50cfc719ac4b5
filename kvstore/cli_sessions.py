"""``kvstore serve`` and ``kvstore sessions ...``: the service, and the store without a server.

``add_commands(subparsers)`` registers both on the main CLI's subparsers; every command's
``func(args)`` returns an exit code (0 ok, 1 a check that found a problem) and raises
``KVStoreError`` on bad input (the main CLI prints the reason and exits 2). ``main(argv)`` runs
the same commands standalone (``python -m kvstore.cli_sessions``).
"""

from __future__ import annotations

import argparse
import io
import json
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import InvalidRequest
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Tier
from kvstore import tiers

DEFAULT_DATA = "./data"
DEFAULT_OWNER = "default"


# ---------------------------------------------------------------------------- helpers
def _store(args, **limits):
    from kvstore.sessions import SessionStore

    return SessionStore(Path(args.data), **limits)


def _print(args, payload: Any, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2, sort_keys=True))
    else:
        print(text)


def _size(text: str | None) -> int | None:
    from kvstore.units import parse_size

    return parse_size(text)


def _geometry(text: str) -> Geometry:
    words = text.split(",")
    if len(words) != 6 or not all(w.strip().isdigit() for w in words):
        raise InvalidRequest("--geometry is n_layers,kv_lora,qk_rope,index_hd,nic,vocab (six non-negative integers)")
    return Geometry(*(int(w) for w in words))


def _tier(args) -> Tier:
    return tiers.parse(args.tier, codec=args.codec, bits=args.bits)


def _model(args) -> dict[str, Any]:
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
        + (f"  problem: {info.problem}" if info.problem else "")
    )


def _write_output(path: Path, payload: bytes) -> None:
    from kvstore.journal import AtomicFile

    with AtomicFile(path, replace=True) as out:
        out.write(payload)


def _read_tokens(args) -> np.ndarray:
    if args.tokens is not None:
        try:
            return np.array([int(t) for t in args.tokens.split(",") if t.strip()], dtype=np.int64)
        except ValueError:
            raise InvalidRequest("--tokens is a comma-separated list of integers") from None
    path = Path(args.tokens_file)
    if not path.is_file():
        raise InvalidRequest(f"{path} is not a file")
    if path.suffix == ".npy":
        tokens = np.load(path, allow_pickle=False)
    elif path.suffix == ".coli_kv":
        tokens = coli_kv.load(path).tokens
    else:
        try:
            tokens = np.array(path.read_text().split(), dtype=np.int64)
        except ValueError:
            raise InvalidRequest(f"{path} does not hold whitespace-separated integers") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise InvalidRequest(f"{path} must hold a 1-D array of integer token ids")
    return tokens


def _progress(label: str):
    def report(done: int, total: int) -> None:
        print(f"\r{label}: {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    return report


# ---------------------------------------------------------------------------- serve
def _log_to_stderr(level: str) -> None:
    """kvstore's own log lines (reconcile actions, the engine, each generate turn's reuse) on stderr."""
    import logging

    logger = logging.getLogger("kvstore")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)


def cmd_serve(args) -> int:
    import uvicorn

    from kvstore.api.keys import KEYS_FILE, ensure_keys_file
    from kvstore.api.main import create_app
    from kvstore.api.settings import DEFAULT_MAX_BODY_BYTES, Settings

    engine_flags = [flag for flag, value in (("--tier", args.tier), ("--bits", args.bits), ("--device", args.device), ("--dtype", args.dtype)) if value is not None]
    if args.model is None and engine_flags:
        raise InvalidRequest(f"{', '.join(engine_flags)} only apply to the engine: give its model folder with --model DIR")
    if args.model is not None and not Path(args.model, "config.json").is_file():
        raise InvalidRequest(f"{args.model} is not a model folder (no config.json); create one with `kvstore new-model {args.model}`")
    settings = Settings(
        data_dir=Path(args.data),
        budget_bytes=_size(args.budget),
        hard_limit_bytes=_size(args.hard_limit),
        max_body_bytes=_size(args.max_body) or DEFAULT_MAX_BODY_BYTES,
        model_dir=Path(args.model) if args.model is not None else None,
        tier=args.tier or "f32",
        bits=args.bits,
        device=args.device or "cpu",
        dtype=args.dtype,
    )
    _log_to_stderr(args.log_level)
    created = ensure_keys_file(settings.data_dir)
    if created is not None:
        print(f"Created {settings.data_dir / KEYS_FILE} with an API key for owner 'default' (shown once, keep it):")
        print(f"  {created}", flush=True)
    app = create_app(settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    if args.fd is not None:  # a socket bound by the caller (tests, socket activation)
        server.run(sockets=[socket.socket(fileno=args.fd)])
    else:
        server.run()
    return 0


# ---------------------------------------------------------------------------- sessions
def cmd_list(args) -> int:
    with _store(args) as store:
        infos = store.list(owner=args.owner, model_name=args.model, tags=args.tag or (), state=args.state)
    _print(args, [i.to_dict() for i in infos], "\n".join(_summary(i) for i in infos) or "(no sessions)")
    return 0


def cmd_show(args) -> int:
    with _store(args) as store:
        info = store.get(args.id, owner=args.owner)
        turns = store.inspect(args.id, owner=args.owner)["turns"] if args.turns else None
    payload = info.to_dict() | ({"turns": turns} if turns is not None else {})
    _print(args, payload, _summary(info) + (f"  turns={turns}" if turns is not None else ""))
    return 0


def cmd_create(args) -> int:
    if args.like is not None:
        header, _ = coli_kv.read_header(args.like)
        geometry, tier = header.geometry, header.tier
    elif args.geometry is not None:
        geometry, tier = _geometry(args.geometry), _tier(args)
    else:
        raise InvalidRequest("give --geometry n_layers,kv_lora,qk_rope,index_hd,nic,vocab or --like FILE.coli_kv")
    with _store(args, hard_limit_bytes=_size(args.hard_limit)) as store:
        info = store.create(args.owner, geometry, tier, _model(args), session_id=args.id, tags=args.tag or ())
    _print(args, info.to_dict(), info.id)
    return 0


def cmd_append(args) -> int:
    source = Path(args.file)
    if not source.is_file():
        raise InvalidRequest(f"{source} is not a file")
    with _store(args, hard_limit_bytes=_size(args.hard_limit)) as store:
        info = store.get(args.id, owner=args.owner)
        complete = not args.partial
        if source.suffix == ".coli_kv":
            records = coli_kv.load(source, expect=info.geometry, tier=info.tier)
            result = store.append_records(args.id, records.records, complete_turn=complete, owner=args.owner)
        elif source.suffix == ".npz":
            with np.load(source, allow_pickle=False) as arrays:
                missing = {"tokens", "L", "R"} - set(arrays.files)
                if missing:
                    raise InvalidRequest(f"{source} lacks arrays {sorted(missing)} (needs tokens, L, R and I when nic > 0)")
                index = arrays["I"] if "I" in arrays.files else None
                result = store.append(args.id, arrays["tokens"], arrays["L"], arrays["R"], index, complete_turn=complete, owner=args.owner)
        else:
            result = store.append_records(args.id, source.read_bytes(), complete_turn=complete, owner=args.owner)
    payload = {"session": result.info.to_dict(), "appended": result.appended, "turn": result.turn}
    _print(args, payload, f"appended {result.appended} records: {result.info.n_records} in {args.id}, watermark {result.info.watermark}")
    return 0


def cmd_resume(args) -> int:
    out = Path(args.out)
    with _store(args) as store:
        resumed = store.resume(args.id, owner=args.owner, verify=args.verify)
    records = resumed.records
    if out.suffix == ".coli_kv":
        payload = coli_kv.Header(records.geometry, records.tier, records.n).to_bytes() + records.record_bytes()
    elif out.suffix == ".npz":
        L, R, I = records.dequantize()
        buffer = io.BytesIO()
        arrays = {"tokens": records.tokens, "L": L, "R": R} | ({"I": I} if I is not None else {})
        np.savez(buffer, **arrays)
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
    _print(args, report, text)
    return 0


def cmd_truncate(args) -> int:
    with _store(args) as store:
        info = store.truncate(args.id, args.n_records, owner=args.owner)
    _print(args, info.to_dict(), _summary(info))
    return 0


def cmd_fork(args) -> int:
    with _store(args, hard_limit_bytes=_size(args.hard_limit)) as store:
        info = store.fork(args.id, at=args.at, new_id=args.new_id, owner=args.owner, tags=args.tag)
    _print(args, info.to_dict(), info.id)
    return 0


def cmd_delete(args) -> int:
    with _store(args) as store:
        store.delete(args.id, owner=args.owner)
    _print(args, {"deleted": args.id}, f"deleted {args.id}")
    return 0


def cmd_park(args) -> int:
    with _store(args) as store:
        info = store.park(args.id, owner=args.owner, progress=None if args.json else _progress("park"))
    _print(args, info.to_dict(), _summary(info))
    return 0


def cmd_unpark(args) -> int:
    with _store(args) as store:
        info = store.unpark(args.id, owner=args.owner, progress=None if args.json else _progress("unpark"))
    _print(args, info.to_dict(), _summary(info))
    return 0


def cmd_verify(args) -> int:
    with _store(args) as store:
        report = store.verify(args.id, owner=args.owner)
    if report.ok:
        text = f"{args.id}: ok ({report.turns_checked} turns, {report.n_records} records)"
    else:
        bad = report.first_bad
        text = f"{args.id}: turn {bad['turn']} (records {bad['start']}..{bad['end']}) does not match its hash; {report.good_records} records before it are good"
    _print(args, report.to_dict(), text)
    return 0 if report.ok else 1


def cmd_lookup(args) -> int:
    from kvstore.sessions import Fingerprint, ModelInfo

    tokens = _read_tokens(args)
    with _store(args) as store:
        if args.like_session is not None:
            like = store.get(args.like_session)
            fingerprint, owner = like.fingerprint, args.owner or like.owner
        else:
            if args.geometry is None or args.model_name is None or args.model_revision is None:
                raise InvalidRequest("give --like-session ID, or --model-name, --model-revision and --geometry (+ --tier)")
            fingerprint = Fingerprint(ModelInfo.from_dict(_model(args)), _geometry(args.geometry), _tier(args))
            owner = args.owner or DEFAULT_OWNER
        found = store.lookup(owner, fingerprint, tokens)
    if found is None:
        _print(args, {"match": None}, "no session shares a prefix of at least one block")
    else:
        _print(args, {"match": found.to_dict()}, f"{found.session_id}: {found.matched_tokens} tokens in common ({found.state})")
    return 0


def cmd_inspect(args) -> int:
    with _store(args) as store:
        report = store.inspect(args.id, owner=args.owner)
    problems = report.get("problems") or ["no problems"]
    _print(args, report, f"{_summary_from(report)}\n" + "\n".join(problems))
    return 0


def _summary_from(report: dict) -> str:
    session = report["session"]
    return f"{session['id']}: {session['tier']['description']}, {report.get('loadable_records')} loadable records, file {report.get('file')}"


def cmd_repair(args) -> int:
    with _store(args) as store:
        report = store.repair(args.id, owner=args.owner, dry_run=args.dry_run)
    text = "\n".join(report.actions) or "nothing to repair"
    _print(args, report.to_dict(), text + (" (dry run)" if args.dry_run and report.actions else ""))
    return 0


def cmd_migrate(args) -> int:
    if args.tier is None:
        raise InvalidRequest("give the target with --tier v1|v2|v3 (and --codec/--bits for v3)")
    with _store(args) as store:
        info = store.migrate(args.id, _tier(args), owner=args.owner, progress=None if args.json else _progress("migrate"))
    _print(args, info.to_dict(), _summary(info))
    return 0


# ---------------------------------------------------------------------------- parsers
def _common(parser: argparse.ArgumentParser, *, session: bool = True, json_flag: bool = True, owner_default=None) -> None:
    parser.add_argument("--data", default=DEFAULT_DATA, help="the store's data folder (default ./data)")
    parser.add_argument(
        "--owner",
        default=owner_default,
        help="act as this owner (sessions of other owners are invisible); default: any owner",
    )
    if session:
        parser.add_argument("id", help="session id")
    if json_flag:
        parser.add_argument("--json", action="store_true", help="machine-readable output")


def _model_flags(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--model-name", required=required)
    parser.add_argument("--model-revision", required=required)
    for name in ("--weights-hash", "--tokenizer-hash", "--chat-template-hash", "--attention-variant"):
        parser.add_argument(name)


def _tier_flags(parser: argparse.ArgumentParser, default: str | None = "v2") -> None:
    parser.add_argument("--tier", default=default, choices=["v1", "v2", "v3"], help="record format (default v2, fp8)")
    parser.add_argument("--codec", choices=["polar", "int4"], help="v3 codec")
    parser.add_argument("--bits", type=int, help="v3 bits")


def add_commands(subparsers) -> None:
    """Register ``serve`` and ``sessions`` on the main parser's subparsers."""
    serve = subparsers.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data", default=DEFAULT_DATA, help="data folder (default ./data)")
    serve.add_argument("--budget", help="soft disk budget, e.g. 50G (LRU sessions are parked, then deleted)")
    serve.add_argument("--hard-limit", help="hard disk limit, e.g. 60G (writes past it are refused)")
    serve.add_argument("--max-body", help="largest request body (default 256M)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--model", help="model folder to generate with (POST /sessions/{id}/generate); without it that endpoint answers 503")
    serve.add_argument("--tier", choices=["f32", "bf16", "fp8", "tq-int4", "tq-polar", "int8"], help="the engine's cache tier (default f32)")
    serve.add_argument("--bits", type=int, help="PolarQuant bits for --tier tq-polar (2..6, default 4)")
    serve.add_argument("--device", help="torch device of the engine: cpu (default), cuda, cuda:1, mps")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="the engine's weights dtype (default float32)")
    serve.add_argument("--fd", type=int, help=argparse.SUPPRESS)  # an already bound socket
    serve.set_defaults(func=cmd_serve)

    sessions = subparsers.add_parser("sessions", help="manage sessions directly on a data folder (no server)")
    commands = sessions.add_subparsers(dest="sessions_command", required=True, metavar="COMMAND")

    p = commands.add_parser("list", help="list sessions")
    _common(p, session=False)
    p.add_argument("--model", help="model name")
    p.add_argument("--tag", action="append", help="sessions holding this tag (repeatable)")
    p.add_argument("--state", choices=["active", "parked", "damaged"])
    p.set_defaults(func=cmd_list)

    p = commands.add_parser("show", help="one session")
    _common(p)
    p.add_argument("--turns", action="store_true", help="also count the hashed turns")
    p.set_defaults(func=cmd_show)

    p = commands.add_parser("create", help="create an empty session")
    _common(p, session=False, owner_default=DEFAULT_OWNER)
    p.add_argument("--id", help="session id (generated if absent)")
    _model_flags(p, required=True)
    p.add_argument("--geometry", help="n_layers,kv_lora,qk_rope,index_hd,nic,vocab")
    p.add_argument("--like", help="take geometry and tier from this .coli_kv file")
    _tier_flags(p)
    p.add_argument("--tag", action="append")
    p.add_argument("--hard-limit", help="refuse the write past this store size")
    p.set_defaults(func=cmd_create)

    p = commands.add_parser("append", help="append rows from a .coli_kv file, an .npz (tokens, L, R, I) or raw record bytes")
    _common(p)
    p.add_argument("file")
    p.add_argument("--partial", action="store_true", help="the rows do not end a turn (resume will not serve them yet)")
    p.add_argument("--hard-limit", help="refuse the write past this store size")
    p.set_defaults(func=cmd_append)

    p = commands.add_parser("resume", help="write the rows to restore: OUT.coli_kv, OUT.npz (dequantized) or raw bytes")
    _common(p)
    p.add_argument("out")
    p.add_argument("--verify", action="store_true", help="re-hash the turns; damage is not served")
    p.set_defaults(func=cmd_resume)

    p = commands.add_parser("truncate", help="keep the first N records")
    _common(p)
    p.add_argument("n_records", type=int)
    p.set_defaults(func=cmd_truncate)

    p = commands.add_parser("fork", help="a new session sharing a prefix")
    _common(p)
    p.add_argument("--at", type=int, help="records to copy (default: the watermark)")
    p.add_argument("--new-id")
    p.add_argument("--tag", action="append")
    p.add_argument("--hard-limit", help="refuse the write past this store size")
    p.set_defaults(func=cmd_fork)

    for name, func, text in (
        ("delete", cmd_delete, "delete a session and its files"),
        ("park", cmd_park, "compress a session into the archive"),
        ("unpark", cmd_unpark, "restore a parked session"),
        ("verify", cmd_verify, "re-hash every turn (exit 1 if one is bad)"),
        ("inspect", cmd_inspect, "the session file's header and problems"),
    ):
        p = commands.add_parser(name, help=text)
        _common(p)
        p.set_defaults(func=func)

    p = commands.add_parser("repair", help="drop torn, unacknowledged or damaged tails")
    _common(p)
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=cmd_repair)

    p = commands.add_parser("migrate", help="convert a session to another tier (lossy unless v1)")
    _common(p)
    _tier_flags(p, default=None)
    p.set_defaults(func=cmd_migrate)

    p = commands.add_parser("lookup", help="the session sharing the longest token prefix")
    _common(p, session=False)
    p.add_argument("--like-session", help="use this session's model fingerprint (and owner)")
    _model_flags(p, required=False)
    p.add_argument("--geometry")
    _tier_flags(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", help="comma-separated token ids")
    source.add_argument("--tokens-file", help=".npy, .coli_kv or whitespace-separated integers")
    p.set_defaults(func=cmd_lookup)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.cli_sessions serve|sessions ...``: the same as the ``kvstore`` command (one parser, one error policy)."""
    from kvstore.cli import main as kvstore_main

    return kvstore_main(argv)


if __name__ == "__main__":
    sys.exit(main())
