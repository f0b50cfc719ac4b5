"""Events produced by a worker thread, read by the event loop: what the streamed turns send.

A turn's tokens come from the engine's scheduler to a worker thread (the turn's reader, which also
appends the turn at its end); :class:`EventPipe` hands them to the response's async generator with
one wake-up of the loop for the events that arrive together (every streamed turn's token of one
scheduler step) and no thread per read, and gives the generator every event that arrived meanwhile
at once, so a slow client gets one write for several tokens rather than a backlog.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, AsyncIterator, Callable

__all__ = ["EventPipe", "loop_poster"]

#: What the producer puts last: the stream is over.
END = None


class _Deliveries:
    """The items producer threads hand to one event loop, delivered together: the first item put
    since the loop's last delivery schedules one (one wake-up of the loop, one callback), the
    others join it. Many streamed turns get their tokens at the same scheduler step: the loop wakes
    once for all of them, not once for each."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], object], Any]] = []

    def post(self, callback: Callable[[Any], object], item: Any) -> None:
        with self._lock:
            self._pending.append((callback, item))
            first = len(self._pending) == 1
        if first:
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            arrived, self._pending = self._pending, []
        for callback, item in arrived:
            callback(item)


# one per event loop, by its id; a loop may not take weak references (uvloop's), so an entry holds
# its loop and is dropped once the loop is closed (an id is reused only after its loop is gone)
_deliveries: dict[int, _Deliveries] = {}
_deliveries_lock = threading.Lock()


def _deliveries_of(loop: asyncio.AbstractEventLoop) -> _Deliveries:
    with _deliveries_lock:
        found = _deliveries.get(id(loop))
        if found is None or found._loop is not loop:
            for key in [key for key, entry in _deliveries.items() if entry._loop.is_closed()]:
                del _deliveries[key]
            found = _deliveries[id(loop)] = _Deliveries(loop)
        return found


def loop_poster(loop: asyncio.AbstractEventLoop) -> Callable[[Callable[[Any], object], Any], None]:
    """``post(callback, item)``, callable from any thread: runs ``callback(item)`` on ``loop`` with
    whatever else was posted to it before the loop got to it (one wake-up); RuntimeError once the
    loop is closed. Found once per producer, not per item."""
    return _deliveries_of(loop).post


class EventPipe:
    """A queue from one producer thread to one async consumer. Make it in the event loop."""

    def __init__(self):
        self._post = loop_poster(asyncio.get_running_loop())
        self._items: deque[Any] = deque()  # touched on the loop only
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        """From any thread: queue ``item`` (``END`` when there is nothing more)."""
        self._post(self._arrived, item)

    def close(self) -> None:
        self.put(END)

    def _arrived(self, item: Any) -> None:  # on the loop
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def batches(self) -> AsyncIterator[list[Any]]:
        """Every item queued since the last batch (at least one), until ``END``."""
        while True:
            if not self._items:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            batch = list(self._items)
            self._items.clear()
            if END in batch:
                items = batch[: batch.index(END)]
                if items:
                    yield items
                return
            yield batch
