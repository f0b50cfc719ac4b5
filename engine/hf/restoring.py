"""Rebuild transformers caches from sessions — all of them, or nothing: :func:`restore`,
:func:`restore_batch`, :func:`restore_prefix`.

Every session is read, and its fingerprint checked, before a cache is built; the records are
decoded on the cache's device into fresh buffers (``kvstore.engine.restore``). Any failure raises
and returns nothing: the caller's own caches are never touched and the session is only read.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
import torch

from kvstore.engine import restore as device_restore
from kvstore.engine.fingerprint import refuse_mismatch
from kvstore.engine.hf.fingerprint import session_fingerprint, session_tier
from kvstore.engine.hf.layout import check_cache_layout, new_cache
from kvstore.engine.hf.results import BatchRestored, Restored
from kvstore.engine.hf.rows import build_from_body, placement, target
from kvstore.engine.hf.tokens import first_difference, token_array
from kvstore.errors import InvalidRequest
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import KVRecords
from kvstore.tiers import F32, Tier

if TYPE_CHECKING:
    from kvstore.store import ModelInfo, SessionInfo, SessionStore

__all__ = ["restore", "restore_batch", "restore_prefix"]

logger = logging.getLogger(__name__)


@dataclass
class _Read:
    """One session's served records, read (and the fingerprint checked) before anything is built."""

    records: KVRecords
    tokens: np.ndarray
    info: "SessionInfo"
    verified: bool
    damaged_from: int | None

    @property
    def n(self) -> int:
        return self.records.n


def _read_session(store, session_id, model, *, owner, upto, verify, tier: Tier | None, override, model_info_) -> _Read:
    if upto is not None and (not isinstance(upto, (int, np.integer)) or isinstance(upto, bool) or upto < 0):
        raise InvalidRequest(f"upto must be a non-negative number of tokens, got {upto!r}")
    info = store.get(session_id, owner=owner)
    expected = session_fingerprint(model, tier if tier is not None else info.tier, model_info_)
    refuse_mismatch(info, expected, override)
    # The reader re-checks under its lock (the session may have been migrated meanwhile).
    with store.reader(session_id, owner=owner, verify=verify, expect=expected, override=override) as reader:
        n = reader.n_records if upto is None else min(int(upto), reader.n_records)
        if n:
            records = next(reader.iter_batches(n, strict=True))  # a corrupt scale: SessionDamaged, not zeros
        else:
            geometry, stored_tier = reader.info.geometry, reader.info.tier
            records = KVRecords(
                coli_kv.Header(geometry, stored_tier, 0),
                np.empty(0, coli_kv.record_dtype(geometry, stored_tier)),
                coli_kv.HEADER_BYTES,
            )
        return _Read(records, records.tokens.copy(), reader.info, reader.verified, reader.damaged_from)


def restore(
    store: "SessionStore",
    session_id: str,
    model,
    device=None,
    dtype=None,
    *,
    owner: str,
    upto: int | None = None,
    verify: bool = False,
    tier: Tier | str | None = None,
    override: Iterable[str] = (),
    model_info: "ModelInfo | dict | None" = None,
) -> Restored:
    """Rebuild a session's cache for ``model`` — all of it, or nothing.

    Parameters
    ----------
    device, dtype : where the cache lives (default: the model's device and dtype)
    upto : serve at most this many records (a prefix); default: up to the session's watermark
    verify : re-hash the turns first; a damaged tail is not served (``damaged_from`` says where)
    tier : require the session to be stored in this tier (a Tier or a :mod:`kvstore.tiers` name;
        default: accept its own, reported in ``Restored.tier``)
    override : fingerprint fields not to compare (``model.<field>`` or ``tier``)
    model_info : the fingerprint's model part (default :func:`~kvstore.engine.hf.model_info` of ``model``)

    Returns
    -------
    Restored — unpacks as ``(tokens int32[n], DynamicCache)``; ``reused_tokens`` is ``n``. Continue
    with ``generate(restored.input_ids(turn), ...)``; with no new turn, ``restored.input_ids()``
    hands the last stored token back so the conversation is not run twice.

    Raises
    ------
    SessionNotFound, FingerprintMismatch (naming the fields), IntegrityError / SessionDamaged
    (journal missing or shorter than its index), CacheLayoutUnsupported, InvalidRequest, UnknownTier
    """
    tier = session_tier(tier)
    device, dtype = target(model, device, dtype)
    read = _read_session(
        store,
        session_id,
        model,
        owner=owner,
        upto=upto,
        verify=verify,
        tier=tier,
        override=override,
        model_info_=model_info,
    )
    geometry = check_cache_layout(model).geometry
    cache, _ = build_from_body(model, device_restore.MemoryBody(read.records), geometry, device, dtype)
    logger.info("hf restore %s: reused %d tokens (%s)", session_id, read.n, read.info.tier.describe())
    return Restored(read.tokens, cache, read.n, session_id, read.info, read.info.tier, read.verified, read.damaged_from)


def restore_batch(
    store: "SessionStore",
    session_ids: Sequence[str],
    model,
    device=None,
    dtype=None,
    *,
    owner: str,
    upto: int | Sequence[int | None] | None = None,
    verify: bool = False,
    tier: Tier | str | None = None,
    override: Iterable[str] = (),
    model_info: "ModelInfo | dict | None" = None,
) -> BatchRestored:
    """Restore several sessions into one left-padded batched cache (all of them, or nothing).

    Every session is read and checked before the cache is built; one failure (not found,
    fingerprint, damaged journal) raises and nothing is returned. ``upto`` is one cap for all or
    one per session. See :class:`~kvstore.engine.hf.BatchRestored` for the layout and
    :meth:`~kvstore.engine.hf.BatchRestored.inputs` for the next inputs.

    Returns
    -------
    BatchRestored — cache rows ``[B, 1, N, w]``, ``N`` the longest session's record count
    """
    if not session_ids:
        raise InvalidRequest("restore_batch needs at least one session id")
    tier = session_tier(tier)
    caps = list(upto) if isinstance(upto, (list, tuple)) else [upto] * len(session_ids)
    if len(caps) != len(session_ids):
        raise InvalidRequest(f"{len(caps)} upto values for {len(session_ids)} sessions")
    device, dtype = target(model, device, dtype)
    geometry = check_cache_layout(model).geometry
    reads = [
        _read_session(
            store,
            sid,
            model,
            owner=owner,
            upto=cap,
            verify=verify,
            tier=tier,
            override=override,
            model_info_=model_info,
        )
        for sid, cap in zip(session_ids, caps)
    ]
    lengths = [read.n for read in reads]
    batch, width = len(reads), max(lengths)
    mask = torch.zeros((batch, width), dtype=torch.int64)
    for b, n in enumerate(lengths):
        mask[b, width - n :] = 1
    cache = new_cache(model)
    if width:
        # Every session's records go straight into its left-padded slot of one buffer per row kind
        # (zeros elsewhere), decoded on the device; each layer is then handed to the cache.
        keys = torch.zeros((geometry.n_layers, batch, 1, width, geometry.kv_lora), device=device, dtype=dtype)
        values = torch.zeros((geometry.n_layers, batch, 1, width, geometry.qk_rope), device=device, dtype=dtype)
        for b, read in enumerate(reads):
            if read.n:
                slot = {"lc": keys[:, b, 0, width - read.n :], "rc": values[:, b, 0, width - read.n :]}
                body = device_restore.MemoryBody(read.records)
                device_restore.fill(body, slot, placement(geometry, read.records.tier), device)
        for layer in range(geometry.n_layers):
            cache.update(keys[layer], values[layer], layer)
    logger.info("hf restore_batch %s: reused %s tokens", list(session_ids), lengths)
    return BatchRestored(
        tokens=[read.tokens for read in reads],
        cache=cache,
        attention_mask=mask,
        reused_tokens=lengths,
        session_ids=list(session_ids),
        infos=[read.info for read in reads],
        tiers=[read.info.tier for read in reads],
        damaged_from=[read.damaged_from for read in reads],
    )


def restore_prefix(
    store: "SessionStore",
    model,
    prompt,
    device=None,
    dtype=None,
    *,
    owner: str,
    tier: Tier | str | None = None,
    verify: bool = False,
    override: Iterable[str] = (),
    model_info: "ModelInfo | dict | None" = None,
) -> Restored:
    """Restore the owner's stored conversation sharing the longest prefix with ``prompt``.

    The store's prefix lookup finds the session (same fingerprint, stored in ``tier``, default
    ``f32``; at least one 64-token block in common); its rows for the common prefix are restored,
    capped at ``len(prompt) - 1`` so the prompt's last token still runs and gives the next token's
    logits. When nothing matches, the cache is empty and ``reused_tokens`` is 0.

    Returns
    -------
    Restored — ``tokens`` is ``prompt[:reused_tokens]``; pass ``prompt`` itself to ``generate``.
    """
    tier = session_tier(tier)
    geometry = check_cache_layout(model).geometry
    prompt = token_array(prompt, geometry.vocab, "prompt")
    expected = session_fingerprint(model, tier if tier is not None else F32, model_info)
    limit = prompt.shape[0] - 1
    hit = store.lookup(owner, expected, prompt) if limit > 0 else None
    if hit is None or min(hit.matched_tokens, limit) <= 0:
        logger.info("hf restore_prefix: no stored prefix (reused 0 tokens)")
        return Restored(np.empty(0, np.int32), new_cache(model), 0, tier=expected.tier)
    upto = min(hit.matched_tokens, limit)
    again = functools.partial(
        restore,
        store,
        hit.session_id,
        model,
        device,
        dtype,
        owner=owner,
        verify=verify,
        tier=expected.tier,
        override=override,
        model_info=expected.model,
    )
    restored = again(upto=upto)
    common = first_difference(restored.tokens, prompt)
    if common is not None:  # the session changed between the lookup and the read: serve what still matches
        restored = again(upto=common)
    return restored
