"""What one store counts for its operators: prefix lookups, restores, appends, lock waits, evictions.

Plain numbers under one thread lock and no exporter: the service reads a :class:`StatsSnapshot`
when ``GET /metrics`` is scraped and turns it into Prometheus metrics
(``kvstore.api.routers.metrics``), so the store never imports a metrics library. The counts belong
to the :class:`~kvstore.store.SessionStore` object (they start at 0 when it opens; a command line
tool and the service on one data folder each count their own). No session id or owner is kept.

What is counted, and where:

- **lookups** (``SessionStore.lookup`` answered): a hit found a session, a miss found none, and
  both move with the lookup under one lock, so ``hits + misses == lookups`` in every snapshot;
  a refused query (bad tokens) is not a lookup.
- **restores** (``kvstore.store.reader``): one :class:`~kvstore.store.SessionReader` whose records
  were read (whole, in batches or as a download); its bytes are the record bytes read, its seconds
  the time from the ``reader()`` call (an unpark and a verify included) plus the time spent
  reading, not the time a consumer took between chunks.
- **appends** (``SessionStore.append`` / ``append_records`` acknowledged): seconds per call, the
  journal fsyncs and the index commit included.
- **lock waits / timeouts** (``kvstore.store.context.SessionLock``): an acquisition that found the
  session busy and waited, and one of those that gave up (``JournalLocked``); a single try
  (timeout 0, e.g. eviction skipping a busy session) is neither.
- **evictions** (``kvstore.store.budget``): sessions parked or deleted to keep the soft budget,
  and the bytes that freed.
- **expiries** (``Store.expire``): sessions the expiry sweep deleted (their time-to-live ran out),
  and the bytes that freed.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

_KIB = 1 << 10
_MIB = 1 << 20
_GIB = 1 << 30

# Bucket upper bounds (an implicit +Inf bucket follows each). A restore is one conversation's rows:
# kilobytes for a short chat, gigabytes for 100k tokens of f32 rows.
RESTORE_BYTES_BUCKETS: tuple[float, ...] = (
    64 * _KIB,
    256 * _KIB,
    _MIB,
    4 * _MIB,
    16 * _MIB,
    64 * _MIB,
    256 * _MIB,
    _GIB,
    4 * _GIB,
)
RESTORE_SECONDS_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# An append is two fsyncs and an index commit: sub-millisecond on NVMe, tens of ms on slow disks.
APPEND_SECONDS_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
EVICTION_ACTIONS = ("parked", "deleted")


@dataclass(frozen=True)
class Distribution:
    """Observations in buckets: ``counts[i]`` fell in ``(bounds[i-1], bounds[i]]``; the last entry
    of ``counts`` (one more than ``bounds``) holds those above the last bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float  # the sum of the observed values
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` per bucket, ending with ``(inf, count)``."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out


class _Buckets:
    """A mutable :class:`Distribution` (the caller holds the stats lock)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def frozen(self) -> Distribution:
        return Distribution(self.bounds, tuple(self.counts), self.total, self.count)


@dataclass(frozen=True)
class StatsSnapshot:
    """The store's counts at one moment (see the module docstring for what each counts)."""

    lookups: int
    lookup_hits: int
    lookup_misses: int
    restore_bytes: Distribution
    restore_seconds: Distribution
    append_seconds: Distribution
    lock_waits: int
    lock_timeouts: int
    evictions: dict[str, int]  # action ("parked", "deleted") -> sessions
    evicted_bytes: int
    expired: int = 0  # sessions the expiry sweep deleted
    expired_bytes: int = 0


class StoreStats:
    """The counters of one store (thread-safe; every method is a few additions under a lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._lookups = self._hits = self._misses = 0
        self._lock_waits = self._lock_timeouts = 0
        self._evictions: dict[str, int] = dict.fromkeys(EVICTION_ACTIONS, 0)
        self._evicted_bytes = 0
        self._expired = self._expired_bytes = 0
        self._restore_bytes = _Buckets(RESTORE_BYTES_BUCKETS)
        self._restore_seconds = _Buckets(RESTORE_SECONDS_BUCKETS)
        self._append_seconds = _Buckets(APPEND_SECONDS_BUCKETS)

    def lookup(self, hit: bool) -> None:
        with self._lock:
            self._lookups += 1
            if hit:
                self._hits += 1
            else:
                self._misses += 1

    def restored(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._restore_bytes.observe(nbytes)
            self._restore_seconds.observe(seconds)

    def appended(self, seconds: float) -> None:
        with self._lock:
            self._append_seconds.observe(seconds)

    def lock_waited(self) -> None:
        with self._lock:
            self._lock_waits += 1

    def lock_timed_out(self) -> None:
        with self._lock:
            self._lock_timeouts += 1

    def evicted(self, action: str, freed_bytes: int) -> None:
        with self._lock:
            self._evictions[action] = self._evictions.get(action, 0) + 1
            self._evicted_bytes += max(0, freed_bytes)

    def expired(self, freed_bytes: int) -> None:
        with self._lock:
            self._expired += 1
            self._expired_bytes += max(0, freed_bytes)

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(
                lookups=self._lookups,
                lookup_hits=self._hits,
                lookup_misses=self._misses,
                restore_bytes=self._restore_bytes.frozen(),
                restore_seconds=self._restore_seconds.frozen(),
                append_seconds=self._append_seconds.frozen(),
                lock_waits=self._lock_waits,
                lock_timeouts=self._lock_timeouts,
                evictions=dict(self._evictions),
                evicted_bytes=self._evicted_bytes,
                expired=self._expired,
                expired_bytes=self._expired_bytes,
            )
