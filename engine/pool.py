"""Resident sessions: the latent rows of many conversations kept on the device between their turns.

A session whose rows are resident starts its next turn with no restore (``source == "live"``). The
pool holds each resident session's :class:`~kvstore.engine.cache.LatentCache` under its storage
key (``<id>~<owner>``), with the state the rows were taken at (so a session another writer changed
is not served stale), within a budget of device bytes. When a session must come in and the budget
is spent, the least recently used sessions *not in a turn* leave first: to the pinned host tier when
it has room (``source == "host"`` on their next turn: one device copy back, no read of the
journal), else they are simply dropped. Eviction writes nothing: the journal already holds every
row, so a dropped session restores from it (``journal``, or ``shared`` on a replica's store).

Sessions in a turn are pinned (:meth:`ResidentPool.acquire`): never evicted, never entered twice.
A turn that must wait for its session's previous turn waits here, in arrival order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.engine.cache import LatentCache

__all__ = ["Resident", "ResidentPool"]


@dataclass
class Resident:
    """One resident session: its rows, the store state they match, where they are.

    Attributes
    ----------
    key : the session's storage key (``<id>~<owner>``)
    cache : its rows (on the engine's device, or on the host for ``where == "host"``)
    state : the store state the rows were taken at (``SessionEngine`` compares it with the index)
    served : the first ``served`` stored records are the cache's rows
    where : ``"device"`` or ``"host"``
    """

    key: str
    cache: LatentCache
    state: tuple
    served: int
    where: str = "device"
    last_used: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes


class ResidentPool:
    """The sessions resident on the device (and on the host), least recently used leaving first.

    Parameters
    ----------
    device_bytes : budget of the rows kept on the device (sessions in a turn may pass it: they
        cannot leave)
    host_bytes : budget of the host tier (0: evicted sessions are dropped)
    """

    def __init__(self, device_bytes: int, host_bytes: int = 0):
        if device_bytes < 0 or host_bytes < 0:
            raise ValueError("the pool's budgets are byte counts >= 0")
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self._entries: dict[str, Resident] = {}
        self._busy: dict[str, int] = {}  # key -> turns holding or waiting for it
        self._held: set[str] = set()
        self._lock = threading.Condition()
        self.evictions = {"host": 0, "dropped": 0}

    # ------------------------------------------------------------------ turns pin their session
    def acquire(self, key: str, timeout: float | None = None) -> bool:
        """Hold ``key`` for one turn, waiting (in arrival order) while another turn holds it;
        False when ``timeout`` passed first."""
        with self._lock:
            self._busy[key] = self._busy.get(key, 0) + 1
            deadline = None if timeout is None else time.monotonic() + timeout
            while key in self._held:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._release_waiter(key)
                    return False
                self._lock.wait(left)
            self._held.add(key)
            return True

    def release(self, key: str) -> None:
        """End the turn holding ``key``; the next one waiting for it goes on."""
        with self._lock:
            self._held.discard(key)
            self._release_waiter(key)
            self._lock.notify_all()

    def _release_waiter(self, key: str) -> None:
        left = self._busy.get(key, 1) - 1
        if left:
            self._busy[key] = left
        else:
            self._busy.pop(key, None)

    # ------------------------------------------------------------------ what is resident
    def get(self, key: str) -> Resident | None:
        with self._lock:
            return self._entries.get(key)

    def put(self, resident: Resident) -> None:
        """Make ``resident`` the session's rows (on the device), evicting others to fit the budget."""
        with self._lock:
            old = self._entries.pop(resident.key, None)
            del old
            resident.where, resident.last_used = "device", time.monotonic()
            self._entries[resident.key] = resident
            self._fit()

    def drop(self, key: str) -> None:
        """Forget a session's rows (its store state changed, or it was deleted)."""
        with self._lock:
            self._entries.pop(key, None)

    def touch(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.last_used = time.monotonic()

    def most_recent(self) -> Resident | None:
        """The session used last (on the device), or None."""
        with self._lock:
            on_device = [r for r in self._entries.values() if r.where == "device"]
            return max(on_device, key=lambda r: r.last_used, default=None)

    def resident(self) -> list[Resident]:
        with self._lock:
            return list(self._entries.values())

    def usage(self) -> dict[str, Any]:
        """Sessions and bytes on the device and on the host, with the budgets and evictions so far."""
        with self._lock:
            device = [r for r in self._entries.values() if r.where == "device"]
            host = [r for r in self._entries.values() if r.where == "host"]
            return {
                "device_sessions": len(device),
                "device_bytes": sum(r.nbytes for r in device),
                "device_budget": self.device_bytes,
                "host_sessions": len(host),
                "host_bytes": sum(r.nbytes for r in host),
                "host_budget": self.host_bytes,
                "evicted_to_host": self.evictions["host"],
                "evicted": self.evictions["dropped"],
            }

    # ------------------------------------------------------------------ eviction
    def _fit(self) -> None:
        """Move least recently used idle sessions off the device until it fits its budget; the
        host tier keeps what fits its own budget (oldest dropped first)."""
        device = sorted((r for r in self._entries.values() if r.where == "device"), key=lambda r: r.last_used)
        used = sum(r.nbytes for r in device)
        for entry in device:
            if used <= self.device_bytes:
                break
            if entry.key in self._busy:  # in a turn, or a turn waits for it
                continue
            used -= entry.nbytes
            if self.host_bytes and entry.nbytes <= self.host_bytes:
                entry.cache = _to_host(entry.cache)
                entry.where = "host"
                self.evictions["host"] += 1
            else:
                del self._entries[entry.key]
                self.evictions["dropped"] += 1
        host = sorted((r for r in self._entries.values() if r.where == "host"), key=lambda r: r.last_used)
        held = sum(r.nbytes for r in host)
        for entry in host:
            if held <= self.host_bytes:
                break
            if entry.key in self._busy:
                continue
            held -= entry.nbytes
            del self._entries[entry.key]
            self.evictions["dropped"] += 1


def _to_host(cache: LatentCache) -> LatentCache:
    """A copy of ``cache``'s committed rows in host memory (pinned when the rows come from CUDA, so
    the way back is one asynchronous copy)."""
    host = LatentCache(cache.tier, cache.geometry, "cpu", capacity=max(cache.length, 1), prefer_backend="torch")
    host.copy_rows(cache, 0, 0, cache.length)
    if cache.device.type == "cuda":
        host.pin()
    host.commit(0, cache.tokens)
    return host


def to_device(host: LatentCache, device: torch.device, headroom: int) -> LatentCache:
    """A device copy of a host-tier cache, with ``headroom`` rows of room after its rows."""
    cache = LatentCache(host.tier, host.geometry, device, capacity=host.length + max(1, headroom))
    cache.copy_rows(host, 0, 0, host.length)
    cache.commit(0, host.tokens)
    return cache
