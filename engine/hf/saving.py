"""Append the rows of a transformers cache that a session does not hold yet: :func:`save`, :func:`save_batch`.

Before anything is computed or written, the session's fingerprint is compared with the model's
and its stored tokens are checked to be a prefix of the conversation given (a cache of another
conversation, or a shorter one, is refused with ``ConversationMismatch``).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import torch

from kvstore.engine.errors import ConversationMismatch
from kvstore.engine.fingerprint import refuse_mismatch
from kvstore.engine.hf.fingerprint import session_fingerprint, session_tier
from kvstore.engine.hf.layout import cache_kwargs, cache_layers, cache_length, check_cache_layout
from kvstore.engine.hf.rows import cache_rows
from kvstore.engine.hf.tokens import first_difference, token_array
from kvstore.errors import InvalidRequest, SessionExists, SessionNotFound
from kvstore.formats import coli_kv
from kvstore.tiers import F32, Tier

if TYPE_CHECKING:
    from kvstore.store import ModelInfo, SessionInfo, SessionStore

__all__ = ["Saved", "save", "save_batch"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Saved:
    """What :func:`save` did.

    Attributes
    ----------
    info : the session after the append
    appended : records written by this call (0 when the session already held every row)
    computed : tokens whose rows ``save`` computed itself (given tokens past the cache's rows)
    """

    info: "SessionInfo"
    appended: int
    computed: int

    @property
    def n_records(self) -> int:
        return self.info.n_records


def _session_for_save(
    store, session_id, *, owner, model, tier: Tier | None, model_info_, tags, override
) -> "SessionInfo":
    """The session to append to: created with the expected fingerprint (``tier``, default f32), or
    checked against it (``tier`` None: the session's own)."""
    try:
        info = store.get(session_id, owner=owner)
    except SessionNotFound:
        expected = session_fingerprint(model, tier if tier is not None else F32, model_info_)
        try:
            return store.create(
                owner, expected.geometry, expected.tier, expected.model, session_id=session_id, tags=tags
            )
        except SessionExists as exists:  # created meanwhile by another writer: check it like any other
            try:
                info = store.get(session_id, owner=owner)
            except SessionNotFound:
                # not created meanwhile: the id is taken by something the index does not list (a
                # journal left without an index entry); its reason says what to do, not "no session"
                raise exists from None
    expected = session_fingerprint(model, tier if tier is not None else info.tier, model_info_)
    refuse_mismatch(info, expected, override)
    return info


def _stored_tokens(store, info: "SessionInfo", owner: str | None) -> np.ndarray:
    """The session's first ``info.n_records`` tokens: the token column only, read under its read lock."""
    n = info.n_records
    if n == 0:
        return np.empty(0, np.int32)
    with store.reader(info.id, owner=owner):  # nothing shrinks or replaces the journal meanwhile
        path = store.journal_path(info.id, owner=info.owner)
        body = np.memmap(path, dtype=np.uint8, mode="r", offset=coli_kv.HEADER_BYTES, shape=(n * info.record_bytes,))
        try:
            return np.ndarray((n,), "<i4", body, 0, (info.record_bytes,)).astype(np.int32)
        finally:
            del body


def _check_continuation(stored: np.ndarray, tokens: np.ndarray, rows: int, session_id: str) -> None:
    """Refuse a conversation the session's stored tokens do not begin, or a cache shorter than them."""
    n = stored.shape[0]
    if n > rows:
        raise ConversationMismatch(
            f"session {session_id!r} holds {n} records but the cache only {rows} rows: it is not this "
            f"conversation's cache (save it under another session id, or delete the session to start over)"
        )
    at = first_difference(stored, tokens[:n])
    if at is not None:
        raise ConversationMismatch(
            f"session {session_id!r} holds another conversation: token {at} is {int(stored[at])} there, "
            f"{int(tokens[at])} here; save it under another session id"
        )


def _extend(
    model,
    cache,
    tail: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Run ``tail`` [batch, k] through the model once so that the cache holds its rows too."""
    kwargs: dict[str, Any] = {"use_cache": True, **cache_kwargs(model, cache)}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1  # the logits are not wanted, only the rows
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
        kwargs["position_ids"] = positions
    with torch.no_grad():
        model(input_ids=tail.to(model.device), **kwargs)


def save(
    store: "SessionStore",
    session_id: str,
    model,
    cache,
    tokens,
    *,
    owner: str,
    tier: Tier | str | None = None,
    complete_turn: bool = True,
    extend: bool = True,
    model_info: "ModelInfo | dict | None" = None,
    override: Iterable[str] = (),
    tags: Iterable[str] = (),
) -> Saved:
    """Append the rows of a transformers cache that the session does not hold yet.

    Call it after every turn: only the rows past the session's record count are encoded and
    appended (the stored tokens are checked to be a prefix of ``tokens`` first).

    Parameters
    ----------
    store : the session store
    session_id : created (with this model's fingerprint and ``tier``) when missing
    model : the transformers model the cache belongs to
    cache : its ``DynamicCache``, batch 1: rows ``[1, 1, T, kv_lora]`` / ``[1, 1, T, qk_rope]``
    tokens : int[S] — the conversation so far, ``S >= T`` (e.g. ``generate``'s output row)
    tier : a file tier of :mod:`kvstore.tiers` (``f32``, the default for a new session, ``fp8``,
        ``int4``, ``polar2`` .. ``polar6``), as a Tier or its name; for an existing session, None
        means its own tier and anything else must equal it
    complete_turn : the rows end a turn (the session's watermark moves: resumes serve them)
    extend : tokens past the cache's rows (the last generated token has none yet) are run through
        the model once, in place on ``cache``, so every token is stored; False stores ``T`` only
    model_info : the fingerprint's model part (default :func:`~kvstore.engine.hf.model_info` of ``model``)
    override : fingerprint fields not to compare (``model.<field>`` or ``tier``)

    Returns
    -------
    Saved

    Raises
    ------
    FingerprintMismatch, ConversationMismatch, CacheLayoutUnsupported, InvalidRequest, UnknownTier,
    BudgetExceeded
    """
    tier = session_tier(tier)
    geometry = check_cache_layout(model).geometry
    tokens = token_array(tokens, geometry.vocab)
    layers = cache_layers(cache, geometry.n_layers)
    rows = cache_length(cache)
    if rows and layers[0].keys.shape[0] != 1:
        raise InvalidRequest(f"the cache holds a batch of {layers[0].keys.shape[0]} sequences: use save_batch")
    if tokens.shape[0] < rows:
        raise ConversationMismatch(f"the cache holds {rows} rows but only {tokens.shape[0]} tokens were given")
    info = _session_for_save(
        store, session_id, owner=owner, model=model, tier=tier, model_info_=model_info, tags=tags, override=override
    )
    total = tokens.shape[0] if extend else rows
    _check_continuation(_stored_tokens(store, info, owner), tokens, total, session_id)
    computed = 0
    if total > rows:
        _extend(model, cache, torch.from_numpy(tokens[rows:])[None])
        computed = total - rows
    start = info.n_records
    L, R = cache_rows(model, cache, start, total)
    result = store.append(
        session_id, tokens[start:total].astype(np.int32), L, R, complete_turn=complete_turn, owner=owner
    )
    logger.info(
        "hf save %s: appended %d records (%d held before, %d computed)", session_id, result.appended, start, computed
    )
    return Saved(result.info, result.appended, computed)


def save_batch(
    store: "SessionStore",
    session_ids: Sequence[str],
    model,
    cache,
    sequences,
    attention_mask,
    *,
    owner: str,
    tier: Tier | str | None = None,
    complete_turn: bool = True,
    extend: bool = True,
    model_info: "ModelInfo | dict | None" = None,
    override: Iterable[str] = (),
    tags: Iterable[str] = (),
) -> list[Saved]:
    """:func:`save` for a batched, padded cache: row ``b`` goes to ``session_ids[b]``.

    Parameters
    ----------
    sequences : int[B, S] — the padded token ids (e.g. ``generate``'s output)
    attention_mask : int/bool[B, S'] with ``S' <= S`` — 1 for real tokens; columns past ``S'`` (the
        generated ones) count as real
    (the rest as in :func:`save`)

    Returns
    -------
    list of Saved, one per session

    Every session is checked (fingerprint, stored tokens) before anything is computed or written;
    each session's append is then its own commit.
    """
    tier = session_tier(tier)
    geometry = check_cache_layout(model).geometry
    sequences = torch.as_tensor(sequences).to("cpu", torch.int64)
    mask = torch.as_tensor(attention_mask).to("cpu", torch.int64)
    if (
        sequences.ndim != 2
        or mask.ndim != 2
        or mask.shape[0] != sequences.shape[0]
        or mask.shape[1] > sequences.shape[1]
    ):
        raise InvalidRequest(
            f"sequences [B, S] and attention_mask [B, S' <= S] expected, got {list(sequences.shape)} and {list(mask.shape)}"
        )
    batch, width = sequences.shape
    if len(session_ids) != batch:
        raise InvalidRequest(f"{len(session_ids)} session ids for a batch of {batch}")
    mask = torch.cat([mask, torch.ones((batch, width - mask.shape[1]), dtype=torch.int64)], dim=1)
    layers = cache_layers(cache, geometry.n_layers)
    rows = cache_length(cache)
    if rows and layers[0].keys.shape[0] != batch:
        raise InvalidRequest(f"the cache holds {layers[0].keys.shape[0]} sequences, {batch} were given")
    if width < rows:
        raise ConversationMismatch(f"the cache holds {rows} rows but the sequences only {width} columns")
    total = width if extend else rows
    real = mask[:, :total].bool()
    per_session = [token_array(sequences[b, :total][real[b]], geometry.vocab, f"sequence {b}") for b in range(batch)]
    infos = []
    for b, session_id in enumerate(session_ids):
        info = _session_for_save(
            store, session_id, owner=owner, model=model, tier=tier, model_info_=model_info, tags=tags, override=override
        )
        _check_continuation(_stored_tokens(store, info, owner), per_session[b], per_session[b].shape[0], session_id)
        infos.append(info)
    computed = 0
    if total > rows:
        positions = (mask[:, :total].cumsum(-1) - 1).clamp_min(0)
        _extend(
            model,
            cache,
            sequences[:, rows:total],
            mask[:, :total].to(model.device),
            positions[:, rows:total].to(model.device),
        )
        computed = total - rows
    saved = []
    for b, (session_id, info) in enumerate(zip(session_ids, infos)):
        start = info.n_records
        L, R = cache_rows(model, cache, start, None, batch_index=b, slots=real[b].to(layers[0].keys.device))
        result = store.append(
            session_id, per_session[b][start:].astype(np.int32), L, R, complete_turn=complete_turn, owner=owner
        )
        saved.append(Saved(result.info, result.appended, int(real[b, rows:].sum()) if computed else 0))
    return saved
