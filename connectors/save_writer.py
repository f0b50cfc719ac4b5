"""Saves off the serving step: a background writer with a bounded queue, for a connector's worker.

An engine's step hands over rows already on the host (a prompt's rows, a finished conversation's)
and returns at once; one thread encodes, writes and fsyncs them through
:meth:`~kvstore.connectors.prefix_cache.PrefixCache.save`, one save after another. The queue holds
at most ``capacity`` saves: a save that finds it full is skipped and counted (``save_skipped``),
never waited for, because a step must not stall behind the disk; a skipped save is a future miss.

A save may carry a request id to report: the id is handed back by :meth:`SaveWriter.finished` only
once its save is durable, failed, or was given up (skipped), so an engine that holds the request's
cache blocks until then (vLLM's ``get_finished``) frees them only when nothing reads them any more.
Counters: ``save_pending`` (saves queued or being written: a gauge), ``finished_done`` (reported
requests settled), plus those of :meth:`PrefixCache.save`.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.connectors.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

#: How much the writer thread's nice value is raised above the process's (Linux, capped at 19):
#: the engine's threads get contended cores first. On 2 shared cores (bench/vllm_steps.py, BENCHMARKS.md) 0 made every save and lengthened
#: the whole run 1.35x, 19 skipped half the saves (1.13x), 10 a third (1.19x); where the host has
#: cores to spare (a GPU server) the writer gets them whatever its nice value.
WRITER_NICE = 10


@dataclass(frozen=True)
class _Save:
    tokens: list[int] | np.ndarray
    rows: np.ndarray
    report: str | None  # the request id to report once the save is settled
    ready: Callable[[], object] | None  # waits until ``rows`` hold their values (a device copy's event)


class SaveWriter:
    """One background thread saving rows through ``cache``; at most ``capacity`` saves waiting.

    Parameters
    ----------
    cache : the prefix cache saves go through (its counters count them)
    capacity : saves that may wait for the thread (1 or more)
    """

    def __init__(self, cache: PrefixCache, capacity: int):
        if capacity < 1:
            raise ValueError(f"a save writer needs room for 1 save or more, got {capacity}")
        self.cache = cache
        self._queue: queue.Queue[_Save | None] = queue.Queue(maxsize=capacity)
        self._settled: set[str] = set()
        self._settled_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-save-writer", daemon=True)
        self._thread.start()

    def submit(
        self, tokens, rows: np.ndarray, report: str | None = None, ready: Callable[[], object] | None = None
    ) -> bool:
        """Queue a save of ``rows`` (f32 ``[n_layers, n, width]``, owned by the writer from now on);
        False when the queue is full or the writer closed: the save is skipped (``save_skipped``)
        and ``report``, if any, is settled at once (given up). ``ready``: called by the writer
        before it reads ``rows``, for rows a device is still copying in (it waits for the copy's
        event, so the step that queued the copy never does)."""
        save = _Save(tokens, rows, report, ready)
        if not self._closed:
            self.cache.count(save_pending=1)
            try:
                self._queue.put_nowait(save)
                return True
            except queue.Full:
                self.cache.count(save_pending=-1)
        self.cache.count(save_skipped=1)
        self._settle(report)
        return False

    def finished(self) -> set[str]:
        """The reported request ids settled since the last call (durable, failed or given up)."""
        with self._settled_lock:
            settled, self._settled = self._settled, set()
        return settled

    def flush(self) -> None:
        """Wait until every queued save is settled."""
        self._queue.join()

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued saves, then stop the thread (waits at most ``timeout`` seconds)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)  # after the queued saves: they are written first
        self._thread.join(timeout)

    def _settle(self, report: str | None) -> None:
        if report is None:
            return
        with self._settled_lock:
            self._settled.add(report)
        self.cache.count(finished_done=1)

    def _run(self) -> None:
        # a lower CPU priority than the engine's (a Linux thread's nice value is its own)
        if sys.platform.startswith("linux"):
            try:
                me = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + WRITER_NICE))
            except OSError:
                pass  # it runs at the process's priority
        while True:
            save = self._queue.get()
            try:
                if save is None:
                    return
                try:
                    if save.ready is not None:
                        save.ready()
                    self.cache.save(save.tokens, save.rows)
                except Exception as exc:  # a failed save is a future miss, never the engine's error
                    logger.warning("kvstore connector: a background save failed: %s", exc)
                    self.cache.count_save_error(str(exc))
                finally:
                    self.cache.count(save_pending=-1)
                    self._settle(save.report)
            finally:
                save = None  # let go of its rows (a staging buffer's loan) before it counts as done
                self._queue.task_done()


__all__ = ["SaveWriter"]
