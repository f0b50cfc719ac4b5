"""Engine commands of the ``kvstore`` CLI: ``new-model`` and ``generate``.

``kvstore new-model DIR --preset tiny`` writes a random-weight model folder (with a byte-level
tokenizer) that both this engine and ``transformers`` load. ``kvstore generate MODEL ...`` runs a
prompt; with ``--journal FILE.coli_kv`` the conversation lives in a durable journal: an existing
file is resumed (no re-prefill of what it holds) and the turn's rows are appended after it.

This module imports nothing heavy at import time: every ``kvstore`` command builds the parser.
"""

from __future__ import annotations

import json
import sys

TIER_CHOICES = ("f32", "bf16", "fp8", "tq-int4", "tq-polar", "int8")
PRESET_CHOICES = ("tiny", "tiny-yarn", "tiny-512", "v2-lite")


def add_commands(sub) -> None:
    """Register the engine's subcommands on the ``kvstore`` parser's subparsers."""
    p = sub.add_parser("new-model", help="write a random-weight DeepSeek-V3-architecture model folder")
    p.add_argument("path", help="folder to create")
    p.add_argument("--preset", choices=PRESET_CHOICES, default="tiny", help="geometry (default: tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-tokenizer", action="store_true", help="do not write the byte-level tokenizer")
    p.set_defaults(func=cmd_new_model)

    p = sub.add_parser("generate", help="generate from a model folder, optionally resuming a .coli_kv journal")
    p.add_argument("model", help="model folder (config.json + safetensors)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="text (the folder must carry a tokenizer)")
    given.add_argument("--ids", help="token ids, comma or space separated")
    p.add_argument("--journal", help=".coli_kv file holding the conversation so far (created if missing)")
    add_decode_options(p, dtypes=("float32", "bfloat16"))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(func=cmd_generate)


def add_decode_options(p, dtypes: tuple[str, ...]) -> None:
    """The engine and sampling options of the commands that generate (``generate``, ``chat``):
    cache tier and bits, device, weights dtype (one of ``dtypes``), token budget, sampling, stops."""
    p.add_argument("--tier", choices=TIER_CHOICES, default="f32", help="latent-cache tier (default: f32)")
    p.add_argument("--bits", type=int, help="PolarQuant bits for --tier tq-polar (2..6, default 4)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, mps)")
    p.add_argument("--dtype", choices=dtypes, help="weights dtype (default float32)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", type=int, nargs="*", help="stop token ids (default: the model's eos; give none to disable)")


def decode_kwargs(args) -> dict:
    """The sampling keywords of :func:`add_decode_options`'s options, as ``stream`` / ``begin`` take them."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop_tokens=args.stop)


def cmd_new_model(args) -> int:
    from kvstore.engine.config import preset
    from kvstore.engine.weights import write_random_model

    folder = write_random_model(args.path, args.preset, seed=args.seed, dtype=args.dtype, tokenizer=not args.no_tokenizer)
    cfg = preset(args.preset)
    print(
        f"wrote {args.preset} model to {folder}: {cfg.n_layers} layers, kv_lora {cfg.kv_lora_rank}, "
        f"qk_rope {cfg.qk_rope_head_dim}, vocab {cfg.vocab_size}"
    )
    return 0


def _parse_ids(text: str) -> list[int]:
    from kvstore.engine.errors import GenerationError

    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise GenerationError(f"--ids must be integers separated by commas or spaces, got {text!r}") from None


def cmd_generate(args) -> int:
    from pathlib import Path

    from kvstore.engine.errors import GenerationError
    from kvstore.engine.generate import Engine
    from kvstore.journal import KVFile

    engine = Engine.from_folder(args.model, device=args.device, dtype=args.dtype, tier=args.tier, bits=args.bits)
    resuming = bool(args.journal) and Path(args.journal).exists()
    if args.prompt is not None:
        if engine.tokenizer is None:
            raise GenerationError(f"{args.model} has no tokenizer: pass --ids instead of --prompt")
        # a continued conversation already starts with the tokenizer's special prefix
        turn = engine.tokenizer(args.prompt, add_special_tokens=not resuming)["input_ids"]
    else:
        turn = _parse_ids(args.ids)
    geometry = engine.config.coli_geometry()
    journal = None
    history: list[int] = []
    if args.journal:
        path = Path(args.journal)
        if resuming:
            journal = KVFile.open(path, geometry=geometry, tier=engine.cache.journal_tier(), writable=True)
            records = journal.load()
            engine.cache.restore_records(records, expect=geometry)
            history = records.tokens.tolist()
        else:
            journal = KVFile.create(path, geometry, engine.cache.journal_tier())
    try:
        stream = engine.stream(history + list(turn), **decode_kwargs(args))
        shown = ""
        for token in stream:
            if args.json:
                continue
            if engine.tokenizer is None:
                sys.stdout.write(f"{token} ")
            else:  # decode the whole tail so multi-byte characters come out whole
                text = engine.tokenizer.decode(stream.tokens, skip_special_tokens=True)
                sys.stdout.write(text[len(shown) :])
                shown = text
            sys.stdout.flush()
        result = stream.result
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
        report = {
            "tokens": result.tokens,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "prefilled_tokens": result.prefilled_tokens,
            "reused_tokens": result.reused_tokens,
            "seed": result.seed,
            "journal_records_appended": appended,
        }
        print(json.dumps(report))
    else:
        sys.stdout.write("\n")
        print(
            f"[{len(result.tokens)} tokens, {result.finish_reason}; prefilled {result.prefilled_tokens}, "
            f"reused {result.reused_tokens}; tier {args.tier}]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.engine.cli new-model|generate ...``: the same as the ``kvstore`` command (one parser, one error policy)."""
    from kvstore.cli import main as kvstore_main

    return kvstore_main(argv)


if __name__ == "__main__":
    sys.exit(main())
