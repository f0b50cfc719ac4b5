"""Reading committed segments: from this replica's cache or the object store, many GETs at once.

Every byte served has been checked against the digest its segment's commit recorded (the shared
backend's ``hashes_every_read``): a segment that is not in the cache is fetched **whole** — ranged
GETs of ``part_bytes`` in parallel, since one S3 stream is far below a NIC (~100 MB/s); the object
store's ``get_bytes``, ``KVSTORE_BLOBS_GET_SIZE``: 0 fetches each object in one GET, for a server that
reads a whole object to answer any range (moto does: three 8 MiB parts of an 18 MB object cost it
three whole reads; BENCHMARKS.md, "Restore through a replica") — into a reused buffer, hashed,
fetched once more if it does not match (a torn read), then refused (:class:`SessionDamaged`).
Concurrent readers of one object share that one fetch (single flight).

- :meth:`SegmentFetcher.read`: records ``[start, end)`` into one buffer, every segment at once;
- :meth:`SegmentFetcher.stream`: the same range as chunks in order — views of the cache's mapped
  copies or of the fetched objects, never copied — with up to ``read_ahead_bytes`` of the next
  segments read while the caller sends one: a resume's download hides the object store's latency
  behind the client's reading, in bounded memory (the read-ahead, or one segment if larger);
- :meth:`SegmentFetcher.whole`: one segment's bytes.

With a cache, a checked object is handed to the **keeper**, one thread at the lowest CPU priority
that writes the copy (no second hash: it was checked) once no read is in progress (write-behind):
a lowest priority alone did not keep the copies off a busy machine's cores — the page cache's new
pages and their writeback are the kernel's work, at its own priority, and cost a replica on two
cores half its cold download rate. Objects waiting for it are held in memory up to
:data:`KEEP_BACKLOG_BYTES` (past half of it the keeper writes beside the reads; past all of it one
is not kept this time: a later read keeps it). A compressed object (a parked session's) is fetched
whole, decompressed and checked every time.
"""

from __future__ import annotations

import bisect
import logging
import os
import queue
import sys
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Generator, Iterator, NamedTuple

import numpy as np
import zstandard

from kvstore.errors import KeyShredded, SealBroken, SessionDamaged
from kvstore.store.shared.blobs import BlobStore
from kvstore.store.shared.cache import SegmentCache
from kvstore.store.shared.index import ReadPlan, Segment
from kvstore.store.shared.keys import SegmentSealer
from kvstore.store.values import public_id

log = logging.getLogger("kvstore.store")

FETCH_THREADS = 16  # segments in flight at once (and, apart, the parts of each)
READ_AHEAD_BYTES = 64 << 20  # a stream's blocks fetched ahead of the one being consumed
KEEP_BACKLOG_BYTES = 512 << 20  # checked objects waiting for the keeper to write them, at most
IDLE_BUFFER_BYTES = 128 << 20  # whole-object buffers kept for the next fetches, at most


class Piece(NamedTuple):
    """Bytes ``[offset, offset + nbytes)`` of ``segment``, at ``at`` in the caller's buffer."""

    segment: Segment
    offset: int
    nbytes: int
    at: int


def pieces(plan: ReadPlan, start: int, end: int) -> list[Piece]:
    """The pieces of records ``[start, end)`` of ``plan``: one per segment it overlaps, in order."""
    out = []
    for segment in plan.segments:
        lo, hi = max(start, segment.first_record), min(end, segment.end)
        if lo < hi:
            offset = (lo - segment.first_record) * plan.rec_bytes
            out.append(Piece(segment, offset, (hi - lo) * plan.rec_bytes, (lo - start) * plan.rec_bytes))
    return out


class _Buffers:
    """Buffers for whole objects fetched from the object store, reused once nothing refers to them.

    A buffer made fresh for every object costs a page fault per 4 KiB the fetch writes — on CI's
    virtual machine ~1.4 ms a MiB, a replica's cold download its largest cost after the copies
    themselves. :meth:`take` hands out a view of a kept slab (or a new one); the slab comes back
    when the last memoryview or array made from that view is gone (a finalizer on the view:
    whatever holds the bytes — a download's chunk, the keeper's backlog, a fetch in flight — keeps
    them), and up to ``idle_bytes`` of slabs are kept for the next fetches. An encrypted store's
    objects are fetched as ciphertext: no idle slab holds an owner's plaintext for a shred to miss.
    """

    MIN_BYTES = 1 << 20  # smaller objects: a fresh buffer (the allocator reuses its own memory)

    def __init__(self, idle_bytes: int):
        self.idle_bytes = idle_bytes
        self._idle: list[np.ndarray] = []  # by size
        self._idle_total = 0
        self._lock = threading.Lock()
        # slabs given back while the lock was held (a finalizer runs wherever the last reference
        # goes, a collection inside take() included): sorted in by the next take
        self._returned: deque[np.ndarray] = deque()
        self.made = 0  # slabs allocated so far (the rest of the takes reused one)

    def take(self, nbytes: int) -> memoryview:
        """A writable ``nbytes``-byte buffer (its contents are not zeroed)."""
        if nbytes < self.MIN_BYTES:
            return memoryview(bytearray(nbytes))
        slab = None
        with self._lock:
            while self._returned:
                self._keep(self._returned.popleft())
            at = bisect.bisect_left(self._idle, nbytes, key=len)
            if at < len(self._idle) and len(self._idle[at]) <= 2 * nbytes:  # not a far larger one
                slab = self._idle.pop(at)
                self._idle_total -= len(slab)
        if slab is None:
            slab = np.empty(-(-nbytes // self.MIN_BYTES) * self.MIN_BYTES, dtype=np.uint8)
            self.made += 1
        view = slab[:nbytes]
        weakref.finalize(view, self._give_back, slab)
        return view.data  # a memoryview whose exporter is the view: it keeps the view (and the slab) held

    def _give_back(self, slab: np.ndarray) -> None:
        if not self._lock.acquire(blocking=False):
            self._returned.append(slab)
            return
        try:
            self._keep(slab)
        finally:
            self._lock.release()

    def _keep(self, slab: np.ndarray) -> None:
        """Keep ``slab`` for a later take if the idle ones leave room (the lock held)."""
        if self._idle_total + len(slab) <= self.idle_bytes:
            bisect.insort(self._idle, slab, key=len)
            self._idle_total += len(slab)


class _Keeper:
    """Writes checked objects into the cache, one at a time, on a thread of its own at the lowest
    CPU priority (on Linux a thread's nice value is its own), while no read is in progress — or
    beside them once half the backlog waits, or for a flush or a close."""

    def __init__(self, cache: SegmentCache, backlog_bytes: int):
        self.cache = cache
        self.backlog_bytes = backlog_bytes
        self._queue: queue.SimpleQueue[tuple[Segment, memoryview] | threading.Event | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the last read ends
        self._waiting: dict[str, memoryview] = {}  # object name -> its checked bytes, until written
        self._waiting_bytes = 0
        self._readers = 0  # reads in progress: copies wait for them
        self._urgent = 0  # flushes and a close waiting: copies are written whatever reads run
        self._thread: threading.Thread | None = None

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Around a read: copies are not written meanwhile (unless the backlog is half full)."""
        with self._lock:
            self._readers += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers -= 1
                if self._readers == 0:
                    self._idle.notify_all()

    def _wait_for_idle(self) -> None:
        with self._lock:
            while self._readers and not self._urgent and 2 * self._waiting_bytes <= self.backlog_bytes:
                self._idle.wait()

    def waiting(self, segment: Segment) -> memoryview | None:
        """The checked bytes of ``segment`` if they wait to be written (a reader copies them)."""
        with self._lock:
            return self._waiting.get(segment.object)

    def offer(self, segment: Segment, checked: memoryview) -> bool:
        """Queue a copy of ``segment`` (``checked``: its bytes, matched against its digest); False
        when the backlog is full."""
        with self._lock:
            if segment.object in self._waiting:
                return True
            if self._waiting_bytes + segment.nbytes > self.backlog_bytes:
                return False
            self._waiting[segment.object] = checked
            self._waiting_bytes += segment.nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-cache-keeper", daemon=True)
                self._thread.start()
        self._queue.put((segment, checked))
        return True

    def flush(self) -> None:
        """Return once every copy queued before the call is written (or refused)."""
        with self._lock:
            if self._thread is None:
                return
        written = threading.Event()
        with self._lock:
            self._urgent += 1
            self._idle.notify_all()
        self._queue.put(written)
        written.wait()

    def close(self) -> None:
        """Write what is queued, then stop."""
        with self._lock:
            thread = self._thread
            self._urgent += 1
            self._idle.notify_all()
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        if sys.platform.startswith("linux"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass  # it runs at the process's priority
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                with self._lock:
                    self._urgent -= 1
                item.set()  # a flush: everything queued before it is written
                continue
            segment, checked = item
            self._wait_for_idle()
            try:
                self.cache.put(segment, checked)
            except Exception:  # a copy is an optimisation: one failure never stops the keeper
                log.exception("segment cache: keeping %s failed", segment.object)
            finally:
                with self._lock:
                    del self._waiting[segment.object]
                    self._waiting_bytes -= segment.nbytes


class SegmentFetcher:
    """The segment reads of one :class:`~kvstore.store.shared.store.SharedStore` (its threads, its
    cache, its fetches in flight). ``pool`` also runs the store's other object moves."""

    def __init__(
        self,
        blobs: BlobStore,
        cache: SegmentCache | None,
        *,
        part_bytes: int | None = None,
        read_ahead_bytes: int = READ_AHEAD_BYTES,
    ):
        self.blobs = blobs
        self.cache = cache
        # bytes per ranged GET (None: the object store's ``get_bytes``; 0: one GET per object)
        self.part_bytes = max(0, blobs.get_bytes if part_bytes is None else part_bytes)
        self.read_ahead_bytes = max(1, read_ahead_bytes)
        self.pool = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="kvstore-s3")
        # the parts of whole-object fetches: their own threads, so a segment waiting for its parts
        # never holds the threads that fetch them
        self._parts = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="kvstore-s3-part")
        self._fetching: dict[str, Future] = {}  # object name -> its whole, checked bytes
        self._fetching_lock = threading.Lock()
        self._keeper = _Keeper(cache, KEEP_BACKLOG_BYTES) if cache is not None else None
        self._buffers = _Buffers(IDLE_BUFFER_BYTES)
        self.sealer: SegmentSealer | None = None  # an encrypted store's (SharedStore.encrypt)
        # set while the store's encryption is not known yet (PostgreSQL down at open): it decides
        # before a sealed object is opened (and clears itself)
        self.pending: Callable[[], None] | None = None

    def flush(self) -> None:
        """Return once the copies of the objects fetched so far are written to the cache."""
        if self._keeper is not None:
            self._keeper.flush()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self._parts.shutdown(wait=True)
        if self._keeper is not None:
            self._keeper.close()

    # ------------------------------------------------------------------ ranges
    def read(self, key: str, plan: ReadPlan, start: int, end: int) -> bytearray:
        """Bytes of records ``[start, end)`` of ``plan`` (``0 <= start <= end <= plan.n_records``)."""
        out = bytearray((end - start) * plan.rec_bytes)
        with self._reading():
            self._wait(key, self._submit(key, plan, start, end, memoryview(out)), len(out))
        return out

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """Around a read: the keeper writes no copy meanwhile."""
        if self._keeper is None:
            yield
        else:
            with self._keeper.reading():
                yield

    def stream(
        self, key: str, plan: ReadPlan, start: int, end: int, chunk_records: int, read_ahead_bytes: int | None = None
    ) -> Generator[memoryview, None, None]:
        """Records ``[start, end)`` as chunks of at most ``chunk_records`` records, in order: views of
        each segment's checked bytes — the cache's mapped copy, or the fetched object — never copied
        here. The next segments, up to ``read_ahead_bytes`` of them (None: the fetcher's; 0: one at
        a time), are read while the caller holds a chunk; closing the iterator early cancels what
        has not started."""
        ahead = self.read_ahead_bytes if read_ahead_bytes is None else read_ahead_bytes
        step = max(1, chunk_records) * plan.rec_bytes
        todo = deque(pieces(plan, start, end))
        covered, expected = sum(piece.nbytes for piece in todo), (end - start) * plan.rec_bytes
        if covered != expected:
            raise SessionDamaged(
                f"session {public_id(key)!r}: the committed segments cover {covered} of {expected} bytes"
            )
        pending: deque[tuple[Piece, Future]] = deque()
        in_flight = 0

        def submit_next() -> None:
            nonlocal in_flight
            while todo and (not pending or in_flight + todo[0].nbytes <= ahead):
                piece = todo.popleft()
                pending.append((piece, self.pool.submit(self._view, key, piece)))
                in_flight += piece.nbytes

        with self._reading():
            try:
                submit_next()
                while pending:
                    piece, job = pending.popleft()
                    view = job.result()  # re-raises a failed read
                    in_flight -= piece.nbytes
                    submit_next()
                    for at in range(0, piece.nbytes, step):
                        yield view[at : at + step]
            finally:
                for _, job in pending:
                    job.cancel()

    def _view(self, key: str, piece: Piece) -> memoryview:
        """``piece``'s checked bytes without a copy: a slice of the cache's mapped copy, of an object
        waiting for the keeper, or of the object fetched whole now."""
        segment, lo, hi = piece.segment, piece.offset, piece.offset + piece.nbytes
        if segment.key_version is not None or self.sealer is not None:
            return self._opened(key, segment)[lo:hi]
        if segment.codec != "raw":
            return memoryview(self._unpacked(key, segment))[lo:hi]
        whole = self.cache.view(segment) if self.cache is not None else None
        if whole is None and self._keeper is not None:
            whole = self._keeper.waiting(segment)
        if whole is None:
            whole = self._checked(key, segment)
        return whole[lo:hi]

    def _submit(self, key: str, plan: ReadPlan, start: int, end: int, out: memoryview) -> list[Future]:
        return [
            self.pool.submit(self.fetch, key, piece.segment, piece.offset, out[piece.at : piece.at + piece.nbytes])
            for piece in pieces(plan, start, end)
        ]

    @staticmethod
    def _wait(key: str, jobs: list[Future], expected: int) -> None:
        covered = sum(len(job.result()) for job in jobs)  # result() re-raises a failed fetch
        if covered != expected:
            raise SessionDamaged(
                f"session {public_id(key)!r}: the committed segments cover {covered} of {expected} bytes"
            )

    def first_damaged(
        self, key: str, plan: ReadPlan, end: int, progress: Callable[[int, int], None] | None = None
    ) -> int | None:
        """Re-hash every segment of ``plan`` that starts before ``end`` (several in parallel); the
        first record of the first one whose bytes do not match their digest, or None.
        ``progress(bytes_hashed, bytes_total)`` as they finish. A window of segments is in flight
        at a time, each buffer dropped once hashed: memory stays a few segments."""
        chosen = [segment for segment in plan.segments if segment.first_record < end]
        total, done, bad = sum(segment.nbytes for segment in chosen), 0, None
        for at in range(0, len(chosen), FETCH_THREADS):
            window = chosen[at : at + FETCH_THREADS]
            for segment, job in zip(window, [self.pool.submit(self._sound, key, segment) for segment in window]):
                if not job.result() and bad is None:
                    bad = segment.first_record  # segments are in order: the first bad one found is the first
                done += segment.nbytes
                if progress is not None:
                    progress(done, total)
        return bad

    def _sound(self, key: str, segment: Segment) -> bool:
        try:
            self.whole(key, segment)
        except (SessionDamaged, SealBroken):
            return False
        return True

    # ------------------------------------------------------------------ one segment
    def whole(self, key: str, segment: Segment) -> memoryview:
        """Every record byte of ``segment`` (decompressed if it is a parked one's), re-hashed now
        even from the cache (:class:`SessionDamaged` if they do not match the digest)."""
        return self.fetch(key, segment, 0, memoryview(bytearray(segment.nbytes)), verify=True)

    def fetch(self, key: str, segment: Segment, offset: int, into: memoryview, *, verify: bool = False) -> memoryview:
        """Bytes ``[offset, offset + len(into))`` of ``segment`` into ``into``, checked: from the
        cache when it holds a sound copy (``verify``: re-hashed now, else as the cache checks), or
        from the whole object fetched and matched against its digest (then kept in the cache)."""
        if segment.key_version is not None or self.sealer is not None:
            if segment.codec == "raw" and offset == 0 and len(into) == segment.nbytes:
                self._opened(key, segment, verify=verify, into=into)  # decrypted in place: no copy
            else:
                into[:] = self._opened(key, segment, verify=verify)[offset : offset + len(into)]
            return into
        if segment.codec != "raw":
            into[:] = self._unpacked(key, segment)[offset : offset + len(into)]
            return into
        if self.cache is not None and self.cache.read(segment, offset, into, verify=verify):
            return into
        checked = self._keeper.waiting(segment) if self._keeper is not None else None
        if checked is None:
            checked = self._checked(key, segment)
        into[:] = checked[offset : offset + len(into)]
        return into

    def _checked(self, key: str, segment: Segment) -> memoryview:
        """The whole object of ``segment``, matched against its digest; one fetch at a time per
        object (a concurrent caller waits for the one in flight and shares its bytes)."""
        with self._fetching_lock:
            running = self._fetching.get(segment.object)
            mine = running is None
            if running is None:
                running = self._fetching[segment.object] = Future()
        if not mine:
            return running.result()
        try:
            checked = self._remote_whole(key, segment, self._buffers.take(segment.nbytes))
        except BaseException as exc:
            running.set_exception(exc)
            with self._fetching_lock:
                del self._fetching[segment.object]
            raise
        if self.cache is not None and self.cache.fits(segment) and self._keeper is not None:
            # queued before this fetch is forgotten: a reader in between finds one or the other
            self._keeper.offer(segment, checked)  # not kept when the backlog is full: a later read keeps it
        running.set_result(checked)
        with self._fetching_lock:
            del self._fetching[segment.object]
        return checked

    def _remote(self, key: str, segment: Segment, offset: int, into: memoryview) -> None:
        body = self.blobs.get(segment.object, offset, offset + len(into))
        if len(body) != len(into):  # the object ends before the range: damage, not a network fault
            raise SessionDamaged(
                f"session {public_id(key)!r}: object {segment.object} is shorter than its commit recorded "
                f"(records {segment.first_record}..); it is not served"
            )
        into[:] = body

    def _fetch_parts(self, key: str, segment: Segment, into: memoryview) -> None:
        """``segment``'s object (``len(into)`` bytes) into ``into``: ranged GETs of ``part_bytes``
        in parallel (0: one GET), each into its own slice."""
        step = self.part_bytes or max(1, len(into))
        jobs = [
            self._parts.submit(self._remote, key, segment, lo, into[lo : min(lo + step, len(into))])
            for lo in range(0, len(into), step)
        ]
        for job in jobs:
            job.result()

    def _remote_whole(self, key: str, segment: Segment, into: memoryview) -> memoryview:
        """The whole object into ``into`` (ranged GETs of ``part_bytes`` in parallel), checked
        against its digest; fetched once more if it does not match (a torn read), then refused."""
        for _ in range(2):
            self._fetch_parts(key, segment, into)
            if segment.holds(into):
                return into
        raise SessionDamaged(
            f"session {public_id(key)!r}: object {segment.object} does not hold the bytes its commit recorded "
            f"(records {segment.first_record}..); it is not served"
        )

    # ------------------------------------------------------------------ sealed objects (encrypted at rest)
    def _opened(
        self, key: str, segment: Segment, *, verify: bool = False, into: memoryview | None = None
    ) -> memoryview:
        """The records of a sealed segment: its object (the cache's ciphertext copy, or fetched whole
        in parallel ranged GETs) opened under the owner's data key — the AEAD tag refuses any
        changed byte (:class:`SealBroken`) — decompressed if parked, then matched against the
        records' digest when fetched from the object store or with ``verify`` (``verify``,
        ``whole``). A copy in the cache is authenticated by its tag at every read, which is what
        the plaintext cache's digest check of a copy stands for (the tag is stronger: any changed
        byte of the copy fails it). The cache is given the ciphertext only: no plaintext reaches
        the replica's disk. One more GET if the fetched object fails (a torn read). ``into``
        (exactly the records' size; raw segments): decrypted there, not into a buffer of its own."""
        if self.sealer is None and self.pending is not None:
            self.pending()
        if self.sealer is None:
            raise SealBroken(
                f"session {public_id(key)!r}: object {segment.object} is sealed and this store was opened without "
                "its key-encryption key; nothing was decrypted"
            )
        copy = self.cache.sealed(segment) if self.cache is not None else None
        if copy is None and self._keeper is not None:
            copy = self._keeper.waiting(segment)
        if copy is not None:
            try:
                return self._plain(key, segment, copy, check=verify, into=into)
            except KeyShredded:
                raise
            except (SealBroken, SessionDamaged):
                if self.cache is not None:
                    self.cache.drop(segment)  # a damaged copy: fetched again below
        failure: Exception | None = None
        for _ in range(2):
            body = self._buffers.take(segment.object_bytes)
            self._fetch_parts(key, segment, body)
            try:
                plain = self._plain(key, segment, body, into=into)
            except KeyShredded:
                raise
            except (SealBroken, SessionDamaged) as exc:
                failure = exc
                continue
            if self.cache is not None and self.cache.fits(segment) and self._keeper is not None:
                self._keeper.offer(segment, body)  # the ciphertext, as fetched
            return plain
        assert failure is not None
        raise failure

    def _plain(
        self,
        key: str,
        segment: Segment,
        sealed: bytes | memoryview,
        *,
        check: bool = True,
        into: memoryview | None = None,
    ) -> memoryview:
        if self.sealer is None:  # _opened checked it; for the type checker
            raise SealBroken(f"object {segment.object} is sealed: no key-encryption key")
        raw: bytes | memoryview = self.sealer.open(key, segment, sealed, into if segment.codec == "raw" else None)
        if segment.codec != "raw":
            try:
                raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=segment.nbytes)
            except zstandard.ZstdError:
                raw = b""
        if len(raw) != segment.nbytes or (check and not segment.holds(raw)):
            raise SessionDamaged(
                f"session {public_id(key)!r}: object {segment.object} opened but does not hold the records its commit "
                f"recorded (records {segment.first_record}..); it is not served"
            )
        return memoryview(raw)

    def _unpacked(self, key: str, segment: Segment) -> bytes:
        for _ in range(2):  # one more GET if the bytes do not decompress to the recorded digest
            body = self.blobs.get(segment.object, 0, segment.object_bytes)
            try:
                raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=segment.nbytes)
            except zstandard.ZstdError:
                continue
            if len(raw) == segment.nbytes and segment.holds(raw):
                return raw
        raise SessionDamaged(
            f"session {public_id(key)!r}: the compressed object {segment.object} does not hold the bytes its commit "
            f"recorded (records {segment.first_record}..); it is not served"
        )
