"""``kvstore chat`` and ``kvstore verify``: conversations on stored sessions without a server.

``kvstore chat MODEL_DIR --session ID --prompt TEXT`` runs one turn of the conversation ``ID``
kept in the data folder's session store (created, with the model's fingerprint, when missing):
the session is restored into the engine's cache, only the new tokens are prefilled, the answer is
streamed to stdout, and the turn is appended. stderr ends with the split, e.g.
``[chat-1: 16 tokens (length); prefilled 7, reused 21 (journal); 44 records, v2 (fp8 e4m3)]``;
``--json`` prints the whole result as one JSON object instead.

``kvstore verify ID`` re-hashes a session's journal against the turn hashes kept in the index and
names the first bad turn (exit 1), the same check as ``kvstore sessions verify`` and
``GET /sessions/{id}/verify``.

``add_commands(subparsers)`` registers both (``kvstore.cli.COMMAND_MODULES``); ``main(argv)`` runs
them standalone (``python -m kvstore.engine.session_cli``). Nothing heavy is imported until a
command runs.
"""

from __future__ import annotations

import json
import sys

from kvstore.engine.cli import add_decode_options, decode_kwargs

DEFAULT_DATA = "./data"


def add_commands(sub) -> None:
    """Register ``chat`` and ``verify`` on the ``kvstore`` parser's subparsers."""
    p = sub.add_parser("chat", help="one turn of a stored conversation on a model folder (no server needed)")
    p.add_argument("model", help="model folder (config.json + safetensors, optionally a tokenizer)")
    p.add_argument("--session", required=True, help="session id (created with the model's fingerprint if missing)")
    p.add_argument("--data", default=DEFAULT_DATA, help="the store's data folder (default ./data)")
    p.add_argument("--owner", help="act as this owner (default: any owner; new sessions get 'default')")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--prompt", help="the new turn as text (the folder must carry a tokenizer); default: read stdin")
    given.add_argument("--ids", help="the new turn as token ids, comma or space separated")
    add_decode_options(p, dtypes=("float32", "bfloat16", "float16"))
    p.add_argument("--verify", action="store_true", help="re-hash the session's turns before restoring; a bad turn is a miss")
    p.add_argument("--override", action="append", default=[], metavar="FIELD",
                   help="a fingerprint field not to compare (model.weights_hash, model.name, tier, ...); repeatable")
    p.add_argument("--no-create", action="store_true", help="refuse a session that does not exist instead of creating it")
    p.add_argument("--hard-limit", help="refuse writes past this store size, e.g. 10G")
    p.add_argument("--budget", help="soft disk budget, e.g. 8G (least recently used sessions are parked, then deleted)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("verify", help="re-hash a session's journal; report the first bad turn (exit 1)")
    p.add_argument("id", help="session id")
    p.add_argument("--data", default=DEFAULT_DATA, help="the store's data folder (default ./data)")
    p.add_argument("--owner", help="act as this owner (default: any owner)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)


def _new_turn(args):
    from kvstore.engine.errors import GenerationError

    if args.ids is not None:
        try:
            return [int(part) for part in args.ids.replace(",", " ").split()]
        except ValueError:
            raise GenerationError(f"--ids must be integers separated by commas or spaces, got {args.ids!r}") from None
    if args.prompt is not None:
        return args.prompt
    text = sys.stdin.read()
    if not text:
        raise GenerationError("no prompt: give --prompt TEXT, --ids IDS, or the text on stdin")
    return text


def cmd_chat(args) -> int:
    from pathlib import Path

    from kvstore.units import parse_size
    from kvstore.engine.session import SessionEngine, TextDeltas
    from kvstore.errors import InvalidRequest
    from kvstore.sessions import SessionStore

    if not Path(args.model, "config.json").is_file():
        raise InvalidRequest(f"{args.model} is not a model folder (no config.json); create one with `kvstore new-model {args.model}`")
    prompt = _new_turn(args)
    with SessionStore(Path(args.data), hard_limit_bytes=parse_size(args.hard_limit), budget_bytes=parse_size(args.budget)) as store:
        chat = SessionEngine.from_folder(args.model, store, tier=args.tier, bits=args.bits, device=args.device, dtype=args.dtype)
        turn = chat.begin(
            args.session,
            prompt,
            owner=args.owner,
            create=not args.no_create,
            verify=args.verify,
            override=args.override,
            **decode_kwargs(args),
        )
        with turn:
            if turn.created and not args.json:
                print(f"[created session {args.session} for {chat.model.name} ({chat.tier.describe()})]", file=sys.stderr)
            pieces = TextDeltas(turn.tokenizer)
            for token in turn:
                if args.json:
                    continue
                sys.stdout.write(pieces.delta(turn.tokens) if turn.tokenizer is not None else f"{token} ")
                sys.stdout.flush()
        result = turn.result
        if not args.json and turn.tokenizer is not None:
            sys.stdout.write(pieces.rest(turn.tokens))
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    sys.stdout.write("\n")
    session = result.session
    notes = []
    if result.damaged_from is not None:
        notes.append(f"damage from record {result.damaged_from} was not served")
    if result.dropped_records:
        notes.append(f"dropped {result.dropped_records} unserved records")
    if result.upgraded:
        notes.append(f"upgraded {result.upgraded}")
    print(
        f"[{result.session_id}: {len(result.tokens)} tokens ({result.finish_reason}); prefilled {result.prefilled_tokens}, "
        f"reused {result.reused_tokens} ({result.source}); {session.n_records} records, {session.tier.describe()}"
        + ("; " + "; ".join(notes) if notes else "") + "]",
        file=sys.stderr,
    )
    return 0


def cmd_verify(args) -> int:
    from kvstore.cli_sessions import cmd_verify as verify_session

    return verify_session(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.engine.session_cli chat|verify ...``: the same as the ``kvstore`` command (one parser, one error policy)."""
    from kvstore.cli import main as kvstore_main

    return kvstore_main(argv)


if __name__ == "__main__":
    sys.exit(main())
