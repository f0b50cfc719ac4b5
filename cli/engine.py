"""The bundled engine's commands: ``kvstore new-model``, ``kvstore generate`` and ``kvstore chat``.

``new-model DIR --preset tiny`` writes a random-weight model folder (with a byte-level tokenizer)
that both the engine and ``transformers`` load. ``generate MODEL ...`` runs a prompt; with
``--journal FILE.coli_kv`` the conversation lives in a durable journal: an existing file is resumed
(no re-prefill of what it holds) and the turn's rows are appended after it; a damaged journal is
refused (exit 1, the damage named) unless ``--allow-damaged``, which keeps ``FILE.coli_kv.bak``
first. ``chat MODEL --session ID`` runs one turn of a conversation kept in the data folder's
session store (created, with the model's fingerprint, when missing; a turn refused before it starts
— an empty prompt — creates nothing): only the new tokens are prefilled, the answer is streamed to
stdout and stderr ends with the split, e.g. ``[chat-1: 16 tokens (length); prefilled 7, reused 21
(journal); 44 records, fp8 (v2, e4m3 codes + f32 scale)]``; ``--json`` prints the whole result as
one JSON object instead.

``--tier`` takes every tier (the engine caches bf16 and q8 too; their journals hold f32 rows). A
journal whose rows are of another tier than the cache's journal tier is refused before it is opened,
with the ``--tier`` that continues it (an f32 journal is the exception: a quantized cache
upgrades it on its first append).

torch is imported when a command runs, never when the parser is built; without the ``engine``
extra each command exits 2 with ``pip install 'kvstore[engine]'`` before it does anything.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstore.cli import options
from kvstore.cli.output import emit, end_stream, json_line, warn
from kvstore.engine.config import PRESETS
from kvstore.errors import InvalidRequest
from kvstore.tiers import Tier
from kvstore.units import parse_size


# ---------------------------------------------------------------------------- shared options
def add_decode_options(p: argparse.ArgumentParser, dtypes: tuple[str, ...]) -> None:
    """The engine and sampling options of the commands that generate (``generate``, ``chat``):
    cache tier, device, weights dtype (one of ``dtypes``), token budget, sampling, stops."""
    options.add_tier(p, files_only=False, default="f32", what="latent-cache tier")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, mps)")
    p.add_argument("--dtype", choices=dtypes, help="weights dtype (default float32)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    p.add_argument("--seed", type=int, help="sampling seed (default: random, reported)")
    p.add_argument(
        "--stop", type=int, nargs="*", help="stop token ids (default: the model's eos; give none to disable)"
    )


def decode_kwargs(args: argparse.Namespace) -> dict:
    """The sampling keywords of :func:`add_decode_options`'s options, as ``stream`` / ``begin`` take them."""
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_tokens=args.stop,
    )


# ---------------------------------------------------------------------------- new-model
def cmd_new_model(args: argparse.Namespace) -> int:
    options.require_engine("new-model")
    from kvstore.engine.weights import write_random_model

    options.folder_to_write(args.path, "a new (or existing) folder to write the model into")
    folder = write_random_model(
        args.path, args.preset, seed=args.seed, dtype=args.dtype, tokenizer=not args.no_tokenizer
    )
    cfg = PRESETS[args.preset]
    report = {
        "path": str(folder),
        "preset": args.preset,
        "n_layers": cfg.n_layers,
        "kv_lora": cfg.kv_lora_rank,
        "qk_rope": cfg.qk_rope_head_dim,
        "vocab": cfg.vocab_size,
        "tokenizer": not args.no_tokenizer,
    }
    text = (
        f"wrote {args.preset} model to {folder}: {cfg.n_layers} layers, kv_lora {cfg.kv_lora_rank}, "
        f"qk_rope {cfg.qk_rope_head_dim}, vocab {cfg.vocab_size}"
    )
    emit(args, report, text)
    return 0


# ---------------------------------------------------------------------------- generate
def journal_tier_refusal(journal: str, stored: Tier, cache: Tier) -> str | None:
    """Why a journal holding ``stored`` records cannot take the rows of a ``cache`` tier (None: it can).

    A cache journals ``cache.file_tier`` records (f32 for q8). An f32 journal takes any other
    tier's cache (its rows are converted in memory; the first append rewrites it); any other
    difference would need a conversion the user asks for.
    """
    rows = cache.file_tier
    if stored == rows or (stored.version == 1 and rows.version != 1):
        return None
    journals = (
        f"--tier {rows.name} journals {rows.name} rows"
        if rows == cache
        else f"a {cache.name} cache journals {rows.name} rows"
    )
    return (
        f"{journal} holds {stored.describe()} rows and {journals}: continue it with --tier {stored.name}, or "
        f"convert it first (kvstore migrate {journal} OUT.coli_kv --tier {rows.name}, then --journal OUT.coli_kv)"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    options.require_engine("generate")
    from kvstore.engine.generate import Engine
    from kvstore.engine.session import TextDeltas
    from kvstore.filetools import check_damage, check_output, keep_backup, load_source, naming, read_source
    from kvstore.journal import KVFile

    options.require_model_folder(args.model)
    engine = Engine.from_folder(args.model, device=args.device, dtype=args.dtype, tier=args.tier)
    resuming = bool(args.journal) and Path(args.journal).exists()
    if args.prompt is not None:
        if engine.tokenizer is None:
            raise InvalidRequest(f"{args.model} has no tokenizer: pass --ids instead of --prompt")
        # a continued conversation already starts with the tokenizer's special prefix
        turn = engine.tokenizer(args.prompt, add_special_tokens=not resuming)["input_ids"]
    else:
        turn = options.parse_ids(args.ids)
    if not turn and not resuming:  # refused before anything is created: no journal, no trace
        raise InvalidRequest("nothing to generate from: the prompt is empty and there is no journal to continue")
    geometry = engine.config.coli_geometry()
    journal_tier = args.tier.file_tier  # q8 caches journal f32 rows
    journal = None
    history: list[int] = []
    if args.journal:
        path = Path(args.journal)
        if resuming:
            # Judged before the writer lock (a refusal leaves no sidecar): a damaged journal is
            # refused (exit 1) unless --allow-damaged; then, under the lock, the journal as it is
            # is kept as a .bak before this turn writes to it.
            _, stored = load_source(args.journal, expect=geometry)  # another model's journal: refused here
            refusal = journal_tier_refusal(args.journal, stored.tier, args.tier)
            if refusal is not None:
                raise InvalidRequest(refusal)
            warning = check_damage(args.journal, stored, allow=args.allow_damaged, doing="generate")
            del stored
            with naming(args.journal):
                journal = KVFile.open(path, geometry=geometry, tier=journal_tier, writable=True)
            try:
                if warning:
                    backup = keep_backup(path, read_source(args.journal))
                    warn(f"{warning}; the journal as it was is kept in {backup}")
                records = journal.load()
                engine.cache.restore_records(records, expect=geometry)
            except BaseException:
                journal.close()
                raise
            history = records.tokens.tolist()
        else:
            check_output(args.journal, overwrite=True, what="the journal")
            with naming(args.journal):
                journal = KVFile.create(path, geometry, journal_tier)
    try:
        stream = engine.stream(history + list(turn), **decode_kwargs(args))
        pieces = TextDeltas(engine.tokenizer)
        for token in stream:
            if args.json:
                continue
            sys.stdout.write(pieces.delta(stream.tokens) if engine.tokenizer is not None else f"{token} ")
            sys.stdout.flush()
        result = stream.final()
        if not args.json and engine.tokenizer is not None:
            sys.stdout.write(pieces.rest(stream.tokens))
        appended = 0
        if journal is not None:
            # the last generated token gets its row too: the journal holds the whole conversation
            if result.tokens:
                engine.extend([result.tokens[-1]])
            before = journal.n_records
            rows = engine.export_rows(before)
            journal.append_records(rows.record_array(geometry))
            appended = journal.n_records - before
    finally:
        if journal is not None:
            journal.close()
    if args.json:
        json_line(
            {
                "tokens": result.tokens,
                "text": result.text,
                "finish_reason": result.finish_reason,
                "prefilled_tokens": result.prefilled_tokens,
                "reused_tokens": result.reused_tokens,
                "seed": result.seed,
                "journal_records_appended": appended,
            }
        )
        return 0
    end_stream()
    print(
        f"[{len(result.tokens)} tokens, {result.finish_reason}; prefilled {result.prefilled_tokens}, "
        f"reused {result.reused_tokens}; tier {args.tier.name}]",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------------------- chat
def _new_turn(args: argparse.Namespace) -> list[int] | str:
    if args.ids is not None:
        return options.parse_ids(args.ids)
    if args.prompt is not None:
        return args.prompt
    text = sys.stdin.read()
    if not text:
        raise InvalidRequest("no prompt: give --prompt TEXT, --ids IDS, or the text on stdin")
    return text


def cmd_chat(args: argparse.Namespace) -> int:
    options.require_engine("chat")
    import kvstore.store
    from kvstore.engine.session import SessionEngine, TextDeltas

    options.require_model_folder(args.model)
    prompt = _new_turn(args)
    with kvstore.store.open(
        options.data_folder(args.data),
        hard_limit_bytes=parse_size(args.hard_limit),
        budget_bytes=parse_size(args.budget),
        kek=options.store_kek(args),
    ) as store:
        chat = SessionEngine.from_folder(args.model, store, tier=args.tier, device=args.device, dtype=args.dtype)
        try:
            turn = chat.begin(
                args.session,
                prompt,
                owner=args.owner,
                create=not args.no_create,
                verify=args.verify,
                override=args.override,
                **decode_kwargs(args),
            )
        except BaseException:
            chat.close()
            raise
        with turn:
            if turn.created and not args.json:
                print(
                    f"[created session {args.session} for {chat.model.name} ({chat.tier.describe()})]", file=sys.stderr
                )
            pieces = TextDeltas(turn.tokenizer)
            for token in turn:
                if args.json:
                    continue
                sys.stdout.write(pieces.delta(turn.tokens) if turn.tokenizer is not None else f"{token} ")
                sys.stdout.flush()
        chat.close()  # the scheduler's thread: this command runs one turn
        result = turn.final()
        if not args.json and turn.tokenizer is not None:
            sys.stdout.write(pieces.rest(turn.tokens))
    if args.json:
        json_line(result.to_dict())
        return 0
    end_stream()
    session = result.session
    notes = []
    if result.damaged_from is not None:
        notes.append(f"damage from record {result.damaged_from} was not served")
    if result.dropped_records:
        notes.append(f"dropped {result.dropped_records} unserved records")
    if result.upgraded:
        notes.append(f"upgraded {result.upgraded}")
    stored = f"{session.n_records} records, {session.tier.describe()}" if session is not None else "nothing stored"
    print(
        f"[{result.session_id}: {len(result.tokens)} tokens ({result.finish_reason}); prefilled {result.prefilled_tokens}, "
        f"reused {result.reused_tokens} ({result.source}); {stored}" + ("; " + "; ".join(notes) if notes else "") + "]",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------------------- parsers
def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``new-model``, ``generate`` and ``chat`` on the ``kvstore`` parser's subparsers."""
    p = sub.add_parser("new-model", help="write a random-weight DeepSeek-V3-architecture model folder")
    p.add_argument("path", help="folder to create")
    p.add_argument("--preset", choices=tuple(PRESETS), default="tiny", help="geometry (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="weights dtype (default float32)"
    )
    p.add_argument("--no-tokenizer", action="store_true", help="do not write the byte-level tokenizer")
    options.add_json(p)
    p.set_defaults(func=cmd_new_model)

    p = sub.add_parser("generate", help="generate from a model folder, optionally resuming a .coli_kv journal")
    p.add_argument("model", help="model folder (config.json + safetensors)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="text (the folder must carry a tokenizer)")
    given.add_argument("--ids", help="token ids, comma or space separated")
    p.add_argument("--journal", help=".coli_kv file holding the conversation so far (created if missing)")
    p.add_argument(
        "--allow-damaged",
        action="store_true",
        help="continue a damaged journal anyway (its whole records; the journal as it was is kept as JOURNAL.bak)",
    )
    add_decode_options(p, dtypes=("float32", "bfloat16"))
    options.add_json(p, "print one JSON object instead of streaming")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="one turn of a stored conversation on a model folder (no server needed)")
    p.add_argument("model", help="model folder (config.json + safetensors, optionally a tokenizer)")
    p.add_argument("--session", required=True, help="session id (created with the model's fingerprint if missing)")
    options.add_data(p)
    options.add_owner(p, "either")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--prompt", help="the new turn as text (the folder must carry a tokenizer); default: read stdin")
    given.add_argument("--ids", help="the new turn as token ids, comma or space separated")
    add_decode_options(p, dtypes=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--verify", action="store_true", help="re-hash the session's turns before restoring; a bad turn is a miss"
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD",
        help="a fingerprint field not to compare (model.weights_hash, model.name, tier, ...); repeatable",
    )
    p.add_argument(
        "--no-create", action="store_true", help="refuse a session that does not exist instead of creating it"
    )
    p.add_argument("--hard-limit", help="refuse writes past this store size, e.g. 10G")
    p.add_argument("--budget", help="soft disk budget, e.g. 8G (least recently used sessions are parked, then deleted)")
    options.add_json(p, "print one JSON object instead of streaming")
    p.set_defaults(func=cmd_chat)
