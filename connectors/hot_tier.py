"""A hot tier in host memory in front of the store: an LRU of recently loaded or saved rows.

A connector's loads go through :meth:`~kvstore.connectors.prefix_cache.PrefixCache.load`; with a hot
tier, the rows (f32, or a bf16 tier's bit patterns as stored: u16, half the bytes) of a session that a load checked (its XXH3-128 tag, or the store's turn
hashes) or a save wrote are kept here, up to ``budget`` bytes, and the next load of that session
copies them out at memory speed instead of reading, checking and decoding the journal (as LMCache's
local CPU backend does in front of its disk backend).

- **Keys**: (owner, fingerprint key, session id). A session id is already derived from the
  fingerprint and the prompt (or page key), but the key states both, so one tier shared by caches
  of several models, tiers or owners never hands one of them another's rows.
- **Budget**: entries' bytes never exceed ``budget``; adding one evicts the least recently used
  first; an entry larger than the whole budget is not kept.
- **Entries are immutable**: a stored array is read-only and never written again; a replacement is
  a new array. A reader copies an entry out with no lock held and can never see half of one (an
  eviction drops the tier's reference, not the reader's).
- **Memory**: pinned (page-locked) host memory when torch is already imported and sees CUDA, so a
  device copy from it can be asynchronous; plain numpy memory otherwise. The tier never imports
  torch itself: a numpy-only process stays one.

The tier trusts what it holds: it is the bytes this process checked or wrote. A session deleted or
quarantined by this process is dropped (:meth:`HotTier.drop`); one deleted by another process stays
until evicted, which serves the same rows its id names (the id is a hash of the fingerprint and the
tokens), never another prompt's.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

#: What an entry may hold: f32 rows, or a bf16 tier's bit patterns.
_ENTRY_TYPES = (np.dtype(np.float32), np.dtype(np.uint16))

HotKey = tuple[str, str, str]  # (owner, fingerprint key, session id)


def _pinned_allocator() -> Any:
    """``torch`` when it is already imported and sees CUDA (entries go to pinned memory), else None."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:  # a broken CUDA set-up: plain memory works everywhere
        return None


class HotTier:
    """A byte-budgeted LRU of f32 rows ``[n_layers, n, width]`` by :data:`HotKey`, shared by threads.

    Parameters
    ----------
    budget : the most bytes the entries may hold together (0: the tier keeps nothing)
    pinned : put entries in pinned host memory (None: when torch is imported and sees CUDA)
    """

    def __init__(self, budget: int, *, pinned: bool | None = None):
        if budget < 0:
            raise ValueError(f"a hot tier's budget is 0 bytes or more, got {budget}")
        self.budget = int(budget)
        self._torch = _pinned_allocator() if pinned is None or pinned else None
        if pinned and self._torch is None:
            raise ValueError("pinned host memory needs torch with CUDA")
        self._entries: OrderedDict[HotKey, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0  # what the entries hold now
        self.evictions = 0

    @property
    def pinned(self) -> bool:
        return self._torch is not None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: HotKey) -> bool:
        return key in self._entries

    def get(self, key: HotKey) -> np.ndarray | None:
        """The entry of ``key`` (read-only; now the most recently used), None when absent."""
        with self._lock:
            rows = self._entries.get(key)
            if rows is not None:
                self._entries.move_to_end(key)
            return rows

    def put(self, key: HotKey, rows: np.ndarray, *, owned: bool = False) -> int:
        """Keep a copy of ``rows`` under ``key`` (replacing an older entry); returns how many
        entries were evicted to make room. Rows larger than the budget are not kept (and any older
        entry of ``key`` is dropped: it no longer holds what the store holds). ``owned``: the caller
        hands ``rows`` over (a fresh array nobody else holds) and it is kept as it is, made
        read-only, unless the tier pins its entries (a copy of a page was a third of a save) or the
        rows are not in row order (a view of a value tier's records: a hit places rows in order
        about twice as fast), which are copied.
        ``rows`` are f32 or u16 (bf16 bit patterns); an entry keeps their type."""
        if rows.dtype not in _ENTRY_TYPES:
            raise TypeError(f"the hot tier keeps f32 or u16 (bf16) rows, not {rows.dtype}")
        size = int(rows.nbytes)
        if size > self.budget:
            self.drop(key)
            return 0
        if owned and self._torch is None and rows.flags.c_contiguous:
            entry = rows
            entry.flags.writeable = False
        else:
            entry = self._copy(rows)  # outside the lock: a copy of megabytes must not stall readers
        evicted = 0
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            while self.nbytes + size > self.budget:
                _, oldest = self._entries.popitem(last=False)
                self.nbytes -= oldest.nbytes
                evicted += 1
            self._entries[key] = entry
            self.nbytes += size
            self.evictions += evicted
        return evicted

    def drop(self, key: HotKey) -> bool:
        """Forget ``key`` (its session was deleted, quarantined or replaced); whether it was held."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            return old is not None

    def drop_owner(self, owner: str) -> int:
        """Forget every entry of ``owner`` (its data keys were destroyed: ``kvstore crypto shred``);
        returns how many were held."""
        with self._lock:
            gone = [key for key in self._entries if key[0] == owner]
            for key in gone:
                self.nbytes -= self._entries.pop(key).nbytes
            return len(gone)

    def _copy(self, rows: np.ndarray) -> np.ndarray:
        if self._torch is not None:
            dtype = self._torch.float32 if rows.dtype == np.float32 else self._torch.int16
            pinned = self._torch.empty(rows.shape, dtype=dtype, pin_memory=True)
            entry = pinned.numpy().view(rows.dtype)  # a view that keeps the pinned tensor alive
            np.copyto(entry, rows)
        else:
            entry = np.array(rows, copy=True, order="C")  # in row order whatever the strides handed in
        entry.flags.writeable = False
        return entry


__all__ = ["HotKey", "HotTier"]
