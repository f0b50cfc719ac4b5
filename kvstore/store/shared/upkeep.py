"""Park, unpark, repair, migrate and the soft budget of the shared store's sessions (docs/SCALE.md).

The embedded store's operations with its answers, over segment objects (``kvstore.store.shared.recode``):

- **park** compresses a session's segments (state ``parked``); **unpark** stores them plain again
  (state ``active``). Resume, append and truncate unpark first, as on the embedded store; verify,
  inspect, fork and prefix lookup read a parked session as it is.
- **repair** re-hashes every segment and drops the records from the first one whose bytes differ
  from its digest (a fenced truncate that records the problem); ``dry_run`` only reports.
- **migrate** re-encodes every record in another tier; a damaged session is refused (repair it first).
- **the soft budget** (``budget_bytes``): after a write, the least recently used active sessions
  of every replica are parked, then the least recently used parked ones deleted, until the store
  fits (the embedded evictor's order).

Each write runs under the session's lease, as appends do; eviction skips a session whose lease
another replica holds instead of waiting for it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

from kvstore.errors import (
    BudgetExceeded,
    IntegrityError,
    LeaseHeld,
    SessionDamaged,
    SessionNotFound,
    StaleLease,
    Unavailable,
)
from kvstore.formats import coli_kv
from kvstore.store.results import Eviction, RepairReport
from kvstore.store.shared import recode
from kvstore.store.shared.reports import verify_session
from kvstore.store.shared.store import Lease
from kvstore.store.values import Progress, public_id
from kvstore.tiers import Tier

if TYPE_CHECKING:
    from kvstore.store.shared.sessions import SharedSessionStore

T = TypeVar("T")
log = logging.getLogger("kvstore.store")

_LRU_WINDOW = 1000  # sessions considered per pass of the evictor


class Upkeep:
    """The maintenance operations of one :class:`SharedSessionStore`."""

    def __init__(self, store: SharedSessionStore):
        self.store = store

    # ------------------------------------------------------------------ park / unpark
    def park(self, key: str, progress: Progress | None) -> None:
        self.store._under_lease(key, lambda lease: self.park_leased(lease, progress))

    def park_leased(self, lease: Lease, progress: Progress | None = None) -> None:
        if self.store.index.session(lease.key)["state"] != "parked":
            recode.park(self.store.shared, lease, progress=progress)

    def unpark(self, key: str, progress: Progress | None) -> None:
        self.store._under_lease(key, lambda lease: self.unpark_leased(lease, progress))

    def unpark_leased(self, lease: Lease, progress: Progress | None = None) -> None:
        """Store a parked session plain again (nothing when it is active); under ``lease``."""
        if self.store.index.session(lease.key)["state"] == "parked":
            recode.unpark(self.store.shared, lease, hard_limit=self.store.hard_limit_bytes, progress=progress)

    def unpark_for_reading(self, key: str) -> None:
        """Before a resume of a session its row showed parked: unpark it (it is in use again), if its
        lease is free now. A resume never fails for it: with the lease held by another writer, past
        the hard limit or with a server failing, the compressed objects are served as they are and
        the session stays parked."""
        try:
            self._leased_now(key, self.unpark_leased)
        except (BudgetExceeded, LeaseHeld, StaleLease, Unavailable) as exc:
            log.info("session %r is served parked: %s", public_id(key), exc.reason)
            return
        self.after_write(key)

    # ------------------------------------------------------------------ repair / migrate
    def repair(self, key: str, dry_run: bool, progress: Progress | None) -> RepairReport:
        """Drop the records from the first segment whose bytes differ from its digest on."""

        def body(lease: Lease | None) -> RepairReport:
            report = verify_session(self.store.shared, key, progress)
            actions: list[str] = []
            keep, bad = report.good_records, report.first_bad
            if bad is not None:
                why = f"turn {bad['turn']} (records {bad['start']}..{bad['end']}) does not match its hash"
                actions.append(f"drop records {keep}..{report.n_records}: {why}")
                if lease is not None:
                    self.store.shared.truncate(lease, keep, record_patch={"problem": f"repaired: {why}"})
            return RepairReport(public_id(key), dry_run, actions, keep, report.n_records - keep, bad)

        return body(None) if dry_run else self.store._under_lease(key, body)

    def migrate(self, key: str, tier: Tier, progress: Progress | None) -> None:
        """Re-encode the session in ``tier`` (nothing when it is in it already)."""

        def body(lease: Lease) -> None:
            row = self.store.index.session(key)
            if coli_kv.parse_header(row["header"]).tier != tier:
                recode.migrate(
                    self.store.shared, lease, row, tier, hard_limit=self.store.hard_limit_bytes, progress=progress
                )

        self.store._under_lease(key, body)
        self.after_write(key)

    # ------------------------------------------------------------------ the soft budget
    def enforce_budget(self, keep: Iterable[str]) -> list[Eviction]:
        """Park the least recently used active sessions, then delete the least recently used parked
        ones, until the store fits ``budget_bytes``; what was evicted, in order. Sessions in ``keep``
        (ids, every owner's), sessions whose lease another writer holds and sessions found damaged
        are skipped."""
        store = self.store
        budget = store.budget_bytes
        if budget is None:
            return []
        kept = [key for session_id in keep for key in store.index.keys_of_id(session_id)]
        evicted: list[Eviction] = []
        tried = set(kept)
        while self._used() > budget:
            victim = next((k for k in store.index.least_recently_used(_LRU_WINDOW) if k not in tried), None)
            if victim is None:
                break
            tried.add(victim)
            try:
                before = int(store.index.session(victim)["size_bytes"])
                self._leased_now(victim, self.park_leased)
                freed = before - int(store.index.session(victim)["size_bytes"])
            except (LeaseHeld, SessionNotFound, SessionDamaged, IntegrityError):
                continue  # being written, gone, or damaged: the next one
            store.stats.evicted("parked", freed)
            evicted.append(Eviction(public_id(victim), "parked", freed))
        for key, freed, objects in store.index.evict(budget, kept, states=("parked",)):
            for name in objects:
                store.shared.blobs.delete(name)
            store.stats.evicted("deleted", freed)
            evicted.append(Eviction(public_id(key), "deleted", freed))
        return evicted

    def after_write(self, key: str) -> None:
        """Keep the store within its budget after a write that grew it (the session written is kept).
        The write itself is done: a server down now only postpones the eviction to the next write."""
        if self.store.budget_bytes is None:
            return
        try:
            self.enforce_budget([public_id(key)])
        except Unavailable as exc:
            log.warning("eviction postponed: %s", exc.reason)

    def _used(self) -> int:
        return sum(nbytes for _, _, nbytes in self.store.index.usage())

    def _leased_now(self, key: str, body: Callable[[Lease], Any]) -> None:
        """``body(lease)`` under the session's lease if nobody holds it now (``LeaseHeld`` otherwise)."""
        shared = self.store.shared
        lease = shared.acquire(key, self.store.holder)
        try:
            body(lease)
        finally:
            try:
                shared.release(lease)
            except Unavailable:
                pass  # it runs out by itself
