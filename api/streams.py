"""Events produced by a worker thread, read by the event loop: what the streamed turns send.

A turn's tokens come from the engine's scheduler to a worker thread (the turn's reader, which also
appends the turn at its end); :class:`EventPipe` hands them to the response's async generator with
one wake-up of the loop per event and no thread per read, and gives the generator every event that
arrived meanwhile at once, so a slow client gets one write for several tokens rather than a backlog.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

__all__ = ["EventPipe"]

#: What the producer puts last: the stream is over.
END = None


class EventPipe:
    """A queue from one producer thread to one async consumer. Make it in the event loop."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        """From any thread: queue ``item`` (``END`` when there is nothing more)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def close(self) -> None:
        self.put(END)

    async def batches(self) -> AsyncIterator[list[Any]]:
        """Every item queued since the last batch (at least one), until ``END``."""
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            if END in batch:
                items = batch[: batch.index(END)]
                if items:
                    yield items
                return
            yield batch
