"""Prefix lookup: which of an owner's sessions shares the longest token prefix with a query.

The index keeps, per session, the chain hashes of its token blocks (``PREFIX_BLOCK_TOKENS`` tokens
each, up to the watermark), seeded with the owner and the fingerprint (see
``kvstore.migrations.index``): a lookup hashes the query the same way and finds the candidates in a
few key probes, then confirms them against their stored tokens (journal or archive) and extends the
match past the last whole block. Appends add the blocks their new watermark completes; cuts and
migrations drop or recompute them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import IntegrityError, InvalidRequest, JournalLocked, SessionNotFound
from kvstore.formats import coli_kv
from kvstore.journal import KVFile
from kvstore.migrations import index as schema
from kvstore.store.context import StoreContext
from kvstore.store.records import read_tokens, tokens_of
from kvstore.store.values import Fingerprint, validate_owner

CONFIRM_WAIT_S = 1.0  # the longest a lookup waits for one candidate's read lock


@dataclass(frozen=True)
class LookupResult:
    """The owner's session sharing the longest token prefix with a query."""

    session_id: str
    matched_tokens: int  # common prefix, at most the session's watermark
    state: str
    n_records: int
    watermark: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two 1-D token arrays."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class Prefixes:
    """The prefix blocks of the sessions of one store: extend them on append, look them up."""

    def __init__(self, ctx: StoreContext):
        self.ctx = ctx

    def new_blocks(
        self, record: dict, journal: KVFile, fresh: np.ndarray | None, new_wm: int
    ) -> tuple[list[bytes], int]:
        """Chain hashes of the blocks that ``new_wm`` completes (tokens of journal records before
        ``record['n_records']``, then of the records ``fresh``), and the first new block's number."""
        block = schema.PREFIX_BLOCK_TOKENS
        have = record["prefix_blocks"]
        want = new_wm // block
        if want <= have:
            return [], have
        start, stop = have * block, want * block
        old_count = record["n_records"]
        rec_bytes = coli_kv.record_bytes(journal.geometry, journal.tier)
        fd = self.ctx.open_journal_fd(record["id"])
        try:
            parts = [read_tokens(fd, rec_bytes, start, min(stop, old_count))]
        finally:
            os.close(fd)
        if stop > old_count and fresh is not None:
            parts.append(np.asarray(fresh["token"][: stop - old_count], dtype=np.int32))
        tokens = np.concatenate(parts)
        with self.ctx.index.read() as txn:
            previous = self.ctx.index.last_chain_hash(txn, record["id"], have)
        if previous is None:
            previous = schema.chain_seed(record["owner"], record["fingerprint"])
        return schema.chain_hashes(previous, tokens), have

    def lookup(self, owner: str, fingerprint: Fingerprint, tokens) -> LookupResult | None:
        """The owner's session (same fingerprint) sharing the longest prefix with ``tokens`` (int[n])."""
        ctx = self.ctx
        tokens = query_tokens(owner, fingerprint, tokens)
        if tokens is None:
            return None
        hashes = schema.chain_hashes(schema.chain_seed(owner, fingerprint.key()), tokens)
        block = schema.PREFIX_BLOCK_TOKENS
        with ctx.index.read() as txn:
            depth = ctx.index.longest_chain(txn, hashes)
        while depth > 0:
            with ctx.index.read() as txn:
                ids = ctx.index.sessions_with_chain(txn, hashes[depth - 1])
                records = [ctx.index.get(txn, sid) for sid in ids]
            best: tuple[int, float, dict] | None = None
            for record in records:
                if not ctx.visible(record, owner) or record["state"] not in ("active", "parked"):
                    continue
                matched = self._confirm(record, tokens)
                if matched >= depth * block and (best is None or (matched, record["last_used"]) > best[:2]):
                    best = (matched, record["last_used"], record)
            if best is not None:
                matched, _, record = best
                return LookupResult(record["id"], matched, record["state"], record["n_records"], record["watermark"])
            depth -= 1  # every candidate's tokens disagreed (its index entry went stale): look shallower
        return None

    def _confirm(self, record: dict, tokens: np.ndarray) -> int:
        """Length of the common prefix of ``tokens`` and the session's tokens up to its watermark."""
        ctx = self.ctx
        upto = min(record["watermark"], tokens.shape[0])
        try:
            # a candidate busy being cut or parked is skipped after a short wait (never past the
            # store's lock timeout, the one setting): a lookup must not queue behind one session
            with ctx.reading(record["id"], timeout=min(CONFIRM_WAIT_S, ctx.lock_timeout)):
                current = ctx.record(record["id"])
                upto = min(upto, current["watermark"])
                stored = tokens_of(ctx, current, upto)
        except (JournalLocked, SessionNotFound, IntegrityError, OSError):
            return 0
        if stored is None:
            return 0
        return common_prefix(stored, tokens[:upto])


def query_tokens(owner: str, fingerprint: Fingerprint, tokens) -> np.ndarray | None:
    """A lookup's tokens as int32, checked as every backend checks them (None: an empty query,
    which matches nothing). ``InvalidRequest`` for a bad owner, shape or token id."""
    validate_owner(owner)
    tokens = np.asarray(tokens)
    if tokens.size == 0:
        return None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise InvalidRequest("tokens must be a 1-D list of integers")
    if tokens.min() < 0 or tokens.max() >= fingerprint.geometry.vocab:
        raise InvalidRequest(f"token ids must be in [0, {fingerprint.geometry.vocab})")
    return tokens.astype(np.int32)
