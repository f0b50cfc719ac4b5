"""The service's expiry sweep: a thread deleting expired sessions (``Store.expire``) every
``Settings.expiry_sweep`` seconds (``kvstore serve --expiry-sweep``; 0: no sweep).

A pass calls ``Store.expire`` (one bounded batch, soonest expired first) again while a batch comes
back full, so a backlog is cleared in batches without one long scan or lock. Expiry is exact
without it: an expired session is refused (404, as a missing id) by every route from the moment its
time-to-live runs out; the sweep only frees its files (or objects). A failing pass (a shared store's
server down) is logged and retried at the next interval; the store counts what was deleted
(``kvstore_expired_sessions_total`` in ``GET /metrics``). Replicas of a shared store may all sweep:
a session another replica is deleting is skipped.
"""

from __future__ import annotations

import logging
import threading

from kvstore.errors import KVStoreError
from kvstore.store import Store
from kvstore.store.base import EXPIRE_BATCH

log = logging.getLogger("kvstore.api")

#: Batches one pass deletes at most (then it waits for the next interval): a pass stays bounded.
MAX_BATCHES_PER_PASS = 100


class ExpirySweeper:
    """Runs ``store.expire()`` every ``interval`` seconds in a daemon thread until :meth:`stop`."""

    def __init__(self, store: Store, interval: float):
        self.store = store
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-expiry", daemon=True)

    def start(self) -> "ExpirySweeper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def sweep(self) -> int:
        """One pass: batches until one comes back short (or :data:`MAX_BATCHES_PER_PASS`); how many
        sessions were deleted."""
        deleted = 0
        for _ in range(MAX_BATCHES_PER_PASS):
            batch = self.store.expire()
            deleted += len(batch)
            for expiry in batch:
                log.info(
                    "expired session %r of %r deleted (%d bytes)", expiry.session_id, expiry.owner, expiry.freed_bytes
                )
            if len(batch) < EXPIRE_BATCH or self._stop.is_set():
                break
        return deleted

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sweep()
            except KVStoreError as exc:
                log.warning("expiry sweep failed, retried in %.0f s: %s", self.interval, exc.reason)
            except Exception:  # the thread must outlive one bad pass; the next one tries again
                log.exception("expiry sweep failed")
