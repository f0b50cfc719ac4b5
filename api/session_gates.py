"""Waiting for a busy session without holding a worker thread.

Store calls block: a session's locks are ``flock``\\ s taken in a worker thread, and a request that
waited for one there held that thread for up to the lock timeout (40 requests on one busy session
took every thread of the pool). A route whose store call may wait for a session's locks (append,
truncate, fork, delete, create, resume, verify, the file tools) runs it through
:meth:`SessionGates.call` instead:

- **bounded waiters**: at most ``max_waiters`` requests of one owner for one session are in flight
  at once; one more is refused at once with :class:`~kvstore.api.errors.SessionBusy` (429,
  ``Retry-After: 1``), before anything is read or done (an append enters :meth:`SessionGates.admitted`
  before it reads its body);
- **one writer at a time**: calls that change the session (``exclusive``) take turns on an asyncio
  lock (they would take turns on the session's write lock anyway); waiting there holds no thread;
- **no thread waits for a lock**: the store call runs in a worker thread under
  :func:`kvstore.locks.waits_capped` ``(0)``, so a lock held elsewhere (another process, a job, a
  download holding the read lock) raises ``JournalLocked`` at once; the request sleeps on the event
  loop (1 ms, doubling to 50 ms) and tries again until ``lock_timeout`` has passed since it arrived,
  then answers ``409 JournalLocked`` as before. A call that meets a busy lock has changed nothing
  (every store operation takes its locks before its first change), so trying again is safe.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

from starlette.concurrency import run_in_threadpool

from kvstore.api.errors import SessionBusy
from kvstore.errors import JournalLocked
from kvstore.locks import waits_capped

T = TypeVar("T")

_FIRST_PAUSE_S = 0.001
_LONGEST_PAUSE_S = 0.05


@dataclass
class _Gate:
    admitted: int = 0
    writer: asyncio.Lock = field(default_factory=asyncio.Lock)


def _try_once(fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
    with waits_capped(0):
        return fn(*args, **kwargs)


class SessionGates:
    """Admission and lock waiting for the requests on each (owner, session).

    Parameters
    ----------
    lock_timeout : seconds a request may wait, in all, for the session (then 409 JournalLocked)
    max_waiters : requests of one owner in flight for one session (one more: 429 SessionBusy)
    """

    def __init__(self, lock_timeout: float, max_waiters: int):
        self.lock_timeout = lock_timeout
        self.max_waiters = max_waiters
        self._gates: dict[tuple[str, str], _Gate] = {}
        # GET /metrics: calls that met a busy session and waited, and those that then gave up
        # (changed on the event loop only, so plain ints)
        self.lock_waits = 0
        self.lock_timeouts = 0

    def waiting(self, owner: str, session_id: str) -> int:
        """Requests of ``owner`` in flight for ``session_id`` (for tests and metrics)."""
        gate = self._gates.get((owner, session_id))
        return gate.admitted if gate is not None else 0

    @contextlib.asynccontextmanager
    async def admitted(self, owner: str, session_id: str) -> AsyncIterator["Admission"]:
        """Count a request of ``owner`` for ``session_id`` as in flight for the block, or refuse it.

        A route that reads a body enters this first, so that a refused request costs no more than
        its headers (an append's body may be ``--max-body`` bytes).

        Raises
        ------
        SessionBusy : ``max_waiters`` requests are already in flight for the session (429)
        """
        key = (owner, session_id)
        gate = self._gates.setdefault(key, _Gate())
        if gate.admitted >= self.max_waiters:
            raise SessionBusy(
                f"{gate.admitted} requests are already waiting for session {session_id!r}, the most this service "
                f"lets wait for one session (--session-waiters {self.max_waiters}); nothing was done, retry",
                retry_after=1,
            )
        gate.admitted += 1
        try:
            yield Admission(session_id, gate, self.lock_timeout, self)
        finally:
            gate.admitted -= 1
            if gate.admitted == 0 and self._gates.get(key) is gate:
                del self._gates[key]

    async def call(
        self,
        owner: str,
        session_id: str | None,
        fn: Callable[..., T],
        /,
        *args: Any,
        exclusive: bool = True,
        **kwargs: Any,
    ) -> T:
        """Run the blocking store call ``fn(*args, **kwargs)`` for ``owner``'s ``session_id``.

        ``exclusive``: the call changes the session (append, truncate, delete, ...); readers pass
        False and do not take turns. ``session_id`` None (an id the store will generate): no gate.

        Raises
        ------
        SessionBusy : ``max_waiters`` requests are already in flight for the session (429)
        JournalLocked : the session stayed busy for ``lock_timeout`` seconds (409)
        """
        if session_id is None:
            return await _retrying(fn, args, kwargs, asyncio.get_running_loop().time() + self.lock_timeout, self)
        async with self.admitted(owner, session_id) as admission:
            return await admission.call(fn, *args, exclusive=exclusive, **kwargs)


@dataclass
class Admission:
    """A request admitted for one session (:meth:`SessionGates.admitted`)."""

    session_id: str
    gate: _Gate
    lock_timeout: float
    counts: SessionGates | None = None  # where lock waits and timeouts are counted

    async def call(self, fn: Callable[..., T], /, *args: Any, exclusive: bool = True, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` as :meth:`SessionGates.call` does, within this admission.

        Raises
        ------
        JournalLocked : the session stayed busy for ``lock_timeout`` seconds from this call (409)
        """
        deadline = asyncio.get_running_loop().time() + self.lock_timeout
        if not exclusive:
            return await _retrying(fn, args, kwargs, deadline, self.counts)
        waiting = self.gate.writer.locked()
        if waiting and self.counts is not None:
            self.counts.lock_waits += 1
        try:
            # at least a moment, so that a free lock is taken even with lock_timeout 0
            await asyncio.wait_for(self.gate.writer.acquire(), timeout=max(_left(deadline), 0.001))
        except asyncio.TimeoutError:
            if waiting and self.counts is not None:
                self.counts.lock_timeouts += 1
            raise JournalLocked(f"session {self.session_id!r} is being changed by other requests; try again") from None
        try:
            return await _retrying(fn, args, kwargs, deadline, self.counts, waited=waiting)
        finally:
            self.gate.writer.release()


def _left(deadline: float) -> float:
    return max(0.0, deadline - asyncio.get_running_loop().time())


async def _retrying(
    fn: Callable[..., T],
    args: tuple,
    kwargs: dict,
    deadline: float,
    counts: SessionGates | None,
    *,
    waited: bool = False,
) -> T:
    """``waited``: the call already waited (for the session's writer turn) and was counted."""
    pause = _FIRST_PAUSE_S
    while True:
        try:
            return await run_in_threadpool(_try_once, fn, args, kwargs)
        except JournalLocked:
            if _left(deadline) < pause:
                if waited and counts is not None:
                    counts.lock_timeouts += 1
                raise
        if not waited and counts is not None:
            counts.lock_waits += 1  # counted as the wait begins, so a scrape sees a call still waiting
        waited = True
        await asyncio.sleep(pause)
        pause = min(pause * 2, _LONGEST_PAUSE_S)
