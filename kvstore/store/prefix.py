"""Prefix lookup: which of an owner's sessions shares the longest token prefix with a query.

The index keeps, per session, the chain hashes of its token blocks (``PREFIX_BLOCK_TOKENS`` tokens
each, up to the watermark), seeded with the owner and the fingerprint (see
``kvstore.migrations.index``): a lookup hashes the query the same way and finds the candidates in a
few key probes, then confirms them against their stored tokens (journal or archive) and extends the
match past the last whole block. Appends add the blocks their new watermark completes
(:func:`block_tokens` gathers their tokens, ``Index.extend_prefix`` hashes and stores them in the
append's transaction); cuts and migrations drop or recompute them.
"""

from __future__ import annotations

import numpy as np

from kvstore.errors import IntegrityError, JournalLocked, SessionNotFound
from kvstore.journal import KVFile
from kvstore.migrations import index as schema
from kvstore.store.context import StoreContext
from kvstore.store.index import visible
from kvstore.store.records import tokens_of
from kvstore.store.results import LookupResult, common_prefix, query_tokens
from kvstore.store.values import Fingerprint, IndexRecord

CONFIRM_WAIT_S = 1.0  # the longest a lookup waits for one candidate's read lock


def block_tokens(
    journal: KVFile, fresh: np.ndarray | None, have_blocks: int, old_count: int, new_wm: int
) -> np.ndarray | None:
    """The tokens (int32) of the whole blocks a watermark of ``new_wm`` completes past the
    ``have_blocks`` a session stores: those of its journal's first ``old_count`` records, then of
    the records ``fresh`` appended after them. None when it completes no new block."""
    block = schema.PREFIX_BLOCK_TOKENS
    want = new_wm // block
    if want <= have_blocks:
        return None
    start, stop = have_blocks * block, want * block
    parts = [journal.read_tokens(start, min(stop, old_count))]
    if stop > old_count and fresh is not None:
        parts.append(np.asarray(fresh["token"][: stop - old_count], dtype=np.int32))
    return np.concatenate(parts)


class Prefixes:
    """Prefix lookup over the sessions of one store."""

    def __init__(self, ctx: StoreContext):
        self.ctx = ctx

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
            best: tuple[int, float, IndexRecord] | None = None
            for record in records:
                if not visible(record, owner) or record["state"] not in ("active", "parked"):
                    continue
                matched = self._confirm(record, tokens)
                if matched >= depth * block and (best is None or (matched, record["last_used"]) > best[:2]):
                    best = (matched, record["last_used"], record)
            if best is not None:
                matched, _, record = best
                return LookupResult(record["id"], matched, record["state"], record["n_records"], record["watermark"])
            depth -= 1  # every candidate's tokens disagreed (its index entry went stale): look shallower
        return None

    def _confirm(self, record: IndexRecord, tokens: np.ndarray) -> int:
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
