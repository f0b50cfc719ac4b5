"""Disk budget: the hard limit (reservations) and the soft budget (LRU eviction).

``hard_limit_bytes`` refuses a write with :class:`BudgetExceeded` before anything is written.
Writers reserve their bytes in the index's write transaction (LMDB's writer lock spans threads and
processes), so concurrent writers cannot overshoot the limit together; the reservation is released
in the transaction that commits the write, or when the write fails. A writer killed in between
leaves a reservation with its pid: it is released once that pid no longer runs.

``budget_bytes`` is a soft target kept by LRU eviction after a write: park the least recently used
active sessions, then delete the least recently used parked ones. Both count journal and archive
bytes.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterable, Iterator

from kvstore.errors import (
    BudgetExceeded,
    IndexFull,
    IndexIOError,
    IntegrityError,
    JournalLocked,
    JournalWriteError,
    SessionNotFound,
)
from kvstore.locks import FileLock
from kvstore.store.context import StoreContext
from kvstore.store.results import Eviction
from kvstore.store.values import Progress

if TYPE_CHECKING:
    from kvstore.store.parking import Parking
    from kvstore.store.removal import Removal


class Reservation:
    """Bytes reserved against the hard limit; released in the commit transaction or on failure."""

    def __init__(self, token: bytes | None, nbytes: int):
        self.token = token
        self.nbytes = nbytes
        self.settled = token is None


class Reservations:
    """The hard limit of one store: reserve bytes before writing them, settle them on commit."""

    def __init__(self, ctx: StoreContext):
        self.ctx = ctx

    def usage(self) -> dict[str, int | None]:
        """Bytes the store holds (journals + archives), bytes reserved by writers, and the limits."""
        index = self.ctx.index
        with index.read() as txn:
            used = index.usage(txn)
            reserved = sum(nbytes for _, _, nbytes in index.reservations(txn))
        return {
            "used_bytes": used,
            "reserved_bytes": reserved,
            "budget_bytes": self.ctx.budget_bytes,
            "hard_limit_bytes": self.ctx.hard_limit_bytes,
        }

    @contextmanager
    def reserve(self, nbytes: int) -> Iterator[Reservation]:
        """Reserve ``nbytes`` under the hard limit before writing them (BudgetExceeded if they do not fit)."""
        if self.ctx.hard_limit_bytes is None or nbytes <= 0:
            yield Reservation(None, nbytes)
            return
        index = self.ctx.index
        with index.write() as txn:
            token = self._reserve_in(txn, nbytes, self.ctx.hard_limit_bytes)
        reservation = Reservation(token, nbytes)
        try:
            yield reservation
        finally:
            if not reservation.settled:
                with index.write() as txn:
                    index.release(txn, token)

    def _reserve_in(self, txn, nbytes: int, limit: int) -> bytes:
        index = self.ctx.index

        def total() -> int:
            return index.usage(txn) + sum(n for _, _, n in index.reservations(txn))

        committed = total()
        if committed + nbytes > limit and index.purge_dead_reservations(txn):
            committed = total()  # a writer killed mid-write no longer holds its bytes
        if committed + nbytes > limit:
            raise BudgetExceeded(
                f"writing {nbytes} bytes would take the store to {committed + nbytes} bytes, over its hard "
                f"limit of {limit}; nothing was written. Delete or park sessions, or raise the limit"
            )
        return index.reserve(txn, nbytes)

    def settle(self, txn, reservation: Reservation) -> None:
        """Release ``reservation`` inside the transaction that commits its bytes."""
        if not reservation.settled and reservation.token is not None:
            self.ctx.index.release(txn, reservation.token)
            reservation.settled = True


class Evictor:
    """The soft budget of one store: LRU eviction (one evicting thread per process, one process per store)."""

    def __init__(self, ctx: StoreContext, parking: Parking, removal: Removal):
        self.ctx = ctx
        self._parking = parking
        self._removal = removal
        self._evicting = threading.Lock()

    def after_write(self, keep: str) -> list[Eviction]:
        """Evict if a write took the store over its budget (never the session just written).

        The write has committed when this runs: an eviction the disk or the index has no room for
        now is left to the next write, never reported as the committed write's failure (a client
        told so would send its rows again).
        """
        if self.ctx.budget_bytes is None:
            return []
        with self.ctx.index.read() as txn:
            over = self.ctx.index.usage(txn) > self.ctx.budget_bytes
        try:
            return self.enforce(keep=(keep,)) if over else []
        except (IndexFull, IndexIOError, JournalWriteError):
            return []

    def enforce(self, *, keep: Iterable[str] = (), progress: Progress | None = None) -> list[Eviction]:
        """Evict until the store fits its budget; returns what was evicted, in order."""
        if self.ctx.budget_bytes is None:
            return []
        if not self._evicting.acquire(blocking=False):
            return []  # another thread of this process is evicting
        try:
            with FileLock(self.ctx.locks / "evict.lock", timeout=0, dir_fd=self.ctx.dir_fd(self.ctx.locks)):
                return self._evict(set(keep), progress, self.ctx.budget_bytes)
        except JournalLocked:
            return []  # another process is evicting
        finally:
            self._evicting.release()

    def _evict(self, keep: set[str], progress: Progress | None, budget: int) -> list[Eviction]:
        ctx = self.ctx
        evictions: list[Eviction] = []
        tried = {"parked": set(keep), "deleted": set(keep)}  # a session parked here may be deleted later
        while True:
            with ctx.index.read() as txn:
                used = ctx.index.usage(txn)
                if used <= budget:
                    return evictions
                order = [(sid, ctx.index.get(txn, sid)) for sid in ctx.index.least_recently_used(txn)]
            action, victim = "parked", None
            for action, state in (("parked", "active"), ("deleted", "parked")):
                victim = next(
                    ((sid, r) for sid, r in order if sid not in tried[action] and r and r["state"] == state), None
                )
                if victim is not None:
                    break
            if victim is None:
                return evictions
            sid, record = victim
            tried[action].add(sid)
            before = record["size_bytes"]
            try:
                with ctx.writing(sid, timeout=0):
                    if action == "parked":
                        after = self._parking.park_locked(sid, None, progress, read_timeout=0)["size_bytes"]
                    else:
                        self._removal.delete_locked(sid, None, read_timeout=0)
                        after = 0
            except (JournalLocked, SessionNotFound, IntegrityError):
                continue  # in use, gone, or damaged: try the next one
            evictions.append(Eviction(sid, action, before - after))
            ctx.stats.evicted(action, before - after)
