"""``kvstore hf-chat``: continue a stored conversation with a Hugging Face ``transformers`` model.

The session is restored into a ``DynamicCache`` (no re-prefill of what it holds), the new turn is
run and answered greedily, and the turn's rows are appended to the session. Turns come from
``--prompt``/``--ids`` (one turn) or from standard input, one per line. Text needs a tokenizer in
the folder; token ids always work. Each turn reports how many tokens were reused from the store and
how many were prefilled. An empty ``--prompt ""`` / ``--ids ""`` continues the stored conversation
with no new turn (its last token is re-run, never the whole conversation); blank stdin lines are
skipped.

``--owner`` means what it means for ``kvstore chat``. Session ids are per owner (docs/API.md,
"Session ids are per owner"): with ``--owner NAME`` the session is that owner's ``--session``,
created for it on the first turn when it has none, whatever other owners hold under the same id;
without it the id is looked up for any owner, refused (exit 2, naming the owners) when several
owners have it, and created for ``default`` when nobody has it. Every turn of one run is stored
on the session the run found or created.

A tiny random model folder to try it on: ``kvstore new-model models/tiny`` (see docs/HF.md).
torch and transformers are imported when the command runs, never when the parser is built; without
the ``engine`` extra the command exits 2 with ``pip install 'kvstore[engine]'``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any, Protocol, cast

from kvstore.cli import options
from kvstore.cli.output import json_line
from kvstore.errors import InvalidRequest


class CausalLM(Protocol):
    """What this command calls on a ``transformers`` causal language model."""

    device: Any

    def generate(self, inputs: Any, **kwargs: Any) -> Any: ...


def _turns(args: argparse.Namespace, tokenizer) -> Iterator[tuple[list[int] | None, str | None]]:
    """(ids or None, text or None) per turn: the one given on the command line, or stdin lines."""
    if args.prompt is not None:
        yield None, args.prompt
        return
    if args.ids is not None:
        yield options.parse_ids(args.ids), None
        return
    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        yield (None, line) if tokenizer is not None else (options.parse_ids(line, "stdin"), None)


def _load(args: argparse.Namespace) -> tuple[CausalLM, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from kvstore.engine.tokenizer import load_tokenizer

    folder = options.require_model_folder(args.model)
    hf_logging.disable_progress_bar()  # stdout/stderr carry the conversation and its report
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(args.device).eval()
    # transformers annotates generate's self with a protocol its own model classes do not satisfy
    # for a type checker; the loaded model has generate (it is a GenerationMixin)
    return cast(CausalLM, model), load_tokenizer(folder)


def cmd_hf_chat(args: argparse.Namespace) -> int:
    options.require_engine("hf-chat")
    import numpy as np
    import torch

    import kvstore.store
    from kvstore.engine import hf
    from kvstore.errors import SessionNotFound
    from kvstore.store import validate_session_id

    validate_session_id(args.session)
    if args.max_new_tokens < 1:
        raise InvalidRequest("--max-new-tokens must be at least 1")
    model, tokenizer = _load(args)
    vocab = hf.check_cache_layout(model).geometry.vocab  # refuse an unsupported model before touching the store
    owner = args.owner
    with kvstore.store.open(options.data_folder(args.data), kek=options.store_kek(args)) as store:
        try:
            restored = hf.restore(
                store, args.session, model, owner=owner, verify=args.verify, tier=args.tier, override=args.override
            )
            history, cache = restored.tokens.astype(np.int64), restored.cache
            if restored.info is not None:  # found for any owner: its turns go to that owner's session only
                owner = restored.info.owner
            if restored.damaged_from is not None:
                print(
                    f"note: records from {restored.damaged_from} on failed verification and were not used",
                    file=sys.stderr,
                )
        except SessionNotFound:
            history, cache = np.empty(0, np.int64), hf.new_cache(model)
            owner = options.creating_owner(owner)  # the first save creates the session
        for ids, text in _turns(args, tokenizer):
            if text is not None:
                if tokenizer is None:
                    raise InvalidRequest(f"{args.model} has no tokenizer: pass --ids (or token ids on stdin)")
                # a continued conversation already starts with the tokenizer's special prefix
                ids = tokenizer(text, add_special_tokens=history.size == 0)["input_ids"]
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise InvalidRequest(f"token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
            # An empty turn continues the stored conversation: the cache hands its last token back
            # as the input rather than letting generate run the whole conversation again (issue 21).
            context = hf.next_input_ids(cache, history, ids, device=model.device)
            reused = hf.cache_length(cache)
            prefilled = hf.prefill_length(cache, context)
            with torch.no_grad():
                out = model.generate(
                    context, max_new_tokens=args.max_new_tokens, do_sample=False, **hf.cache_kwargs(model, cache)
                )
            saved = hf.save(
                store, args.session, model, cache, out[0], owner=owner, tier=args.tier, override=args.override
            )
            new = out[0, context.shape[1] :].tolist()
            answer = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else None
            report = {
                "session": args.session,
                "tokens": new,
                "text": answer,
                "reused_tokens": reused,
                "prefilled_tokens": prefilled,
                "records": saved.n_records,
                "tier": saved.info.tier.describe(),
            }
            if args.json:
                json_line(report)
            else:
                print(answer if answer is not None else " ".join(map(str, new)), flush=True)
                print(
                    f"[reused {reused}, prefilled {prefilled}, generated {len(new)}; session {args.session}: "
                    f"{saved.n_records} records, {report['tier']}]",
                    file=sys.stderr,
                )
            history = out[0].cpu().numpy().astype(np.int64)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``hf-chat`` on the ``kvstore`` parser's subparsers."""
    p = sub.add_parser("hf-chat", help="continue a stored conversation with a transformers model")
    p.add_argument("model", help="model folder (config.json + safetensors, as save_pretrained writes)")
    p.add_argument("--session", required=True, help="session id (created on the first turn)")
    options.add_data(p)
    options.add_owner(p, "either")
    options.add_tier(
        p,
        files_only=True,
        default=None,
        shown_default="f32",
        what="record format of a new session (an existing session must already be in it)",
    )
    given = p.add_mutually_exclusive_group()
    given.add_argument("--prompt", help="one turn of text (the folder must carry a tokenizer)")
    given.add_argument("--ids", help="one turn of token ids, comma or space separated")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per turn (default 32)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, mps)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="weights dtype (default float32)"
    )
    p.add_argument("--verify", action="store_true", help="re-hash the stored turns before resuming")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD",
        help="fingerprint field not to compare (e.g. model.weights_hash for the same weights re-saved)",
    )
    options.add_json(p, "one JSON object per turn on stdout")
    p.set_defaults(func=cmd_hf_chat)
