"""Resuming a session: an open, consistent view of its records up to the watermark.

A :class:`SessionReader` holds the session's read lock (nothing shrinks or replaces the journal
while it is open; appends may continue) and one file descriptor of the journal; it serves the
records whole (:meth:`SessionReader.load`), as raw chunks (a download) or in batches (a device
restore). Opening one is the resume path, in one line: the session resolved once by the facade (a
``SessionHandle``), its fingerprint and state checked (a parked session unparked first), its read
lock, the record read again, the journal opened and its header checked against it, the use
recorded in the index.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable, Iterator

import numpy as np

from kvstore.errors import BadScale, IntegrityError, InvalidRequest, JournalLocked, SessionDamaged
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header, KVRecords
from kvstore.journal import KVFile
from kvstore.store.base import Reader
from kvstore.store.context import SessionHandle, SessionLock, StoreContext
from kvstore.store.index import refuse_damaged
from kvstore.store.integrity import Integrity
from kvstore.store.records import COPY_CHUNK_BYTES, pread_exact
from kvstore.store.results import check_fingerprint, checked_override
from kvstore.store.values import Fingerprint, IndexRecord, SessionInfo, stored_tier


class SessionReader(Reader):
    """An open, consistent view of a session's records ``[0, n_records)`` for resuming.

    Holds the session's read lock (nothing shrinks or replaces the journal meanwhile) and a file
    descriptor of the journal. Close it (or use ``with``) to release both.

    Parameters
    ----------
    ctx, integrity : the store's context and turn hashes
    session : the session, resolved (``StoreContext.session``)
    verify : re-hash the turns first; a mismatch is a miss: only the records before the first bad
        turn (down to a complete turn) are served
    expect, override : the fingerprint the caller will restore under, and the fields not to compare
    unpark : unparks the session (the store's ``unpark``, write lock and eviction included)
    started : ``time.perf_counter()`` when the caller began (a restore's seconds count from there)

    Attributes
    ----------
    info : SessionInfo at open
    n_records : records served (the watermark, or less after a failed verify) = reused tokens
    record_bytes : bytes per record
    verified : whether the turns were re-hashed
    damaged_from : first record of the first bad turn, when verify found one
    """

    def __init__(
        self,
        ctx: StoreContext,
        integrity: Integrity,
        session: SessionHandle,
        *,
        verify: bool = False,
        expect: Fingerprint | None = None,
        override: Iterable[str] = (),
        unpark: Callable[[], object],
        started: float | None = None,
    ):
        self._fd = -1
        self._sealed: KVFile | None = None  # an encrypted store's journal: reads decrypt its frames
        self._lock: SessionLock | None = None
        self._stats = ctx.stats
        self._counting = threading.Lock()
        # a restore (kvstore.store.stats): bytes read, and seconds spent opening and reading only
        self._read_bytes: int | None = None  # None until a read starts
        self._info: SessionInfo | None = None
        key = session.key
        record = session.record
        checked_override(override)  # a misspelt override is refused, a fingerprint given or not
        for attempt in range(3):  # a parked session is unparked, then read; eviction may race us once
            if attempt:
                record = ctx.index.current(key, session.owner)
            if expect is not None:
                check_fingerprint(record, expect, override)
            if record["state"] == "parked":
                unpark()
                continue
            refuse_damaged(record)
            lock = session.reading.acquire()
            try:
                record = ctx.index.current(key, session.owner)
            except BaseException:
                lock.release()
                raise
            if record["state"] == "active":
                self._lock = lock
                break
            lock.release()
        else:
            raise JournalLocked(f"session {session.id!r} keeps being parked while it is resumed; try again")
        self._record: IndexRecord = record
        self._busy_s = time.perf_counter() - (started if started is not None else time.perf_counter())
        opened = time.perf_counter()
        try:
            if ctx.keyring is not None:
                self._sealed = ctx.open_journal_file(
                    session.journal, Geometry(*record["geometry"]), stored_tier(record["tier"]), writable=False
                )
                self._sealed.map_for_reads()  # the read lock held above keeps it from shrinking
                header = self._sealed.load_header()
            else:
                self._fd = ctx.open_journal_reader(session.journal)
                header = coli_kv.parse_header(os.pread(self._fd, HEADER_BYTES, 0))
            self._geometry, self._tier = Geometry(*record["geometry"]), stored_tier(record["tier"])
            if header.geometry != self._geometry or header.tier != self._tier:
                raise IntegrityError(
                    f"the journal of {session.id!r} no longer matches its index entry; reopen the store to reconcile it"
                )
            self.record_bytes = header.rec_bytes
            served = record["watermark"]
            self.verified = bool(verify)
            self.damaged_from: int | None = None
            if verify:
                with ctx.index.read() as txn:
                    turns = ctx.index.turns(txn, key)
                _, bad = integrity.check_turns(record, turns, served)
                covered = max((t.end for t in turns if t.end <= served), default=0)
                limit = turns[bad].start if bad is not None else covered
                if limit < served:
                    self.damaged_from = limit
                    served = max((t.end for t in turns if t.end <= limit and t.complete), default=0)
            self.n_records = served
            ctx.index.touch(key)
            self._busy_s += time.perf_counter() - opened
        except FileNotFoundError:
            self.close()
            raise SessionDamaged(f"the journal of session {session.id!r} is missing") from None
        except BaseException:
            self.close()
            raise

    @property
    def info(self) -> SessionInfo:
        """The session as its record was when the reader opened."""
        if self._info is None:
            self._info = SessionInfo.from_record(self._record)
        return self._info

    def iter_bytes(self, chunk_bytes: int | None = None) -> Iterator[bytes | memoryview]:
        """The served records' raw bytes, in chunks (a whole number of records each, when it fits;
        ``chunk_bytes`` None: 8 MiB)."""
        chunk_bytes = COPY_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        chunk_bytes = max(self.record_bytes, chunk_bytes - chunk_bytes % self.record_bytes)
        offset, end = HEADER_BYTES, HEADER_BYTES + self.body_bytes
        self._count_read(0, 0.0)
        if self._sealed is not None:  # each chunk decrypted straight into its own buffer
            yield from self._sealed_chunks(chunk_bytes // self.record_bytes)
            return
        while offset < end:
            started = time.perf_counter()
            chunk = self._pread(min(chunk_bytes, end - offset), offset)
            if not chunk:
                raise IntegrityError(f"the journal of {self.info.id!r} ended at byte {offset} of {end}")
            self._count_read(len(chunk), time.perf_counter() - started)
            yield chunk
            offset += len(chunk)

    def load(self, *, strict: bool = False) -> KVRecords:
        """All served records with one read (KVRecords, ``n = n_records``); ``strict``: see
        :meth:`check_scales`."""
        started = time.perf_counter()
        if self._sealed is not None:
            body = self._sealed.read_range(0, self.n_records)
            if len(body) != self.body_bytes:
                raise IntegrityError(
                    f"the journal of {self.info.id!r} ended at record {len(body) // self.record_bytes}"
                )
            dtype = coli_kv.record_dtype(self._geometry, self._tier)
            records = np.frombuffer(body, dtype=dtype, count=self.n_records)
            if strict:
                self.check_scales(records, 0)
            self._count_read(len(body), time.perf_counter() - started)
            return KVRecords(Header(self._geometry, self._tier, self.n_records), records, HEADER_BYTES + len(body))
        # uninitialized: a bytearray is zero-filled first, a whole pass over memory the read
        # overwrites (a quarter of a 74 MB load's time here)
        body = np.empty(self.body_bytes, dtype=np.uint8)
        view = body.data
        got = 0
        while got < len(body):
            n = os.preadv(self._fd, [view[got:]], HEADER_BYTES + got)
            if n == 0:
                raise IntegrityError(f"the journal of {self.info.id!r} ended at record {got // self.record_bytes}")
            got += n
        dtype = coli_kv.record_dtype(self._geometry, self._tier)
        records = np.frombuffer(body, dtype=dtype, count=self.n_records)
        if strict:
            self.check_scales(records, 0)
        self._count_read(len(body), time.perf_counter() - started)
        return KVRecords(Header(self._geometry, self._tier, self.n_records), records, HEADER_BYTES + len(body))

    def read_into(self, out: np.ndarray, start: int, count: int) -> int:
        """Read served records ``[start, start + count)`` into ``out`` (u8, at least ``count``
        records long) with no copy in between: a device restore's pinned ring is filled straight
        from the journal, by several threads at once. Returns ``count``.

        Raises
        ------
        IntegrityError : the journal ended inside the range (it cannot shrink while the reader is open)
        """
        if not 0 <= start <= start + count <= self.n_records:
            raise InvalidRequest(f"records [{start}, {start + count}) are not within the {self.n_records} served")
        started = time.perf_counter()
        view = out.data.cast("B")[: count * self.record_bytes]
        if self._sealed is not None:  # only the frames covering the range, decrypted straight into out
            got = self._sealed.read_into(view, start, start + count)
            if got != len(view):
                raise IntegrityError(f"the journal of {self.info.id!r} ended inside records [{start}, {start + count})")
            self._count_read(got, time.perf_counter() - started)
            return count
        got = 0
        while got < len(view):  # one preadv returns at most 2 GiB
            n = os.preadv(self._fd, [view[got:]], HEADER_BYTES + start * self.record_bytes + got)
            if n == 0:
                raise IntegrityError(
                    f"the journal of {self.info.id!r} ended at record {start + got // self.record_bytes}"
                )
            got += n
        self._count_read(got, time.perf_counter() - started)
        return count

    @property
    def decrypts(self) -> bool:
        """Reads decrypt (the store is encrypted at rest): CPU-bound, not bound by the page cache."""
        return self._sealed is not None

    def chunk_starts(self, chunk_records: int) -> list[int] | None:
        """First records of chunks of at most ``chunk_records`` that a restore's ring reads best:
        on an encrypted store, chunks that end on the journal's frames (none decrypted twice);
        None: any split is as good."""
        if self._sealed is None:
            return None
        return self._sealed.chunk_starts(0, self.n_records, chunk_records)

    def iter_batches(self, batch_records: int, *, strict: bool = False) -> Iterator[KVRecords]:
        """Served records as KVRecords batches of at most ``batch_records``; ``strict``: see
        :meth:`check_scales`."""
        dtype = coli_kv.record_dtype(self._geometry, self._tier)
        self._count_read(0, 0.0)
        for start in range(0, self.n_records, batch_records):
            started = time.perf_counter()
            stop = min(start + batch_records, self.n_records)
            raw = self._pread((stop - start) * self.record_bytes, HEADER_BYTES + start * self.record_bytes)
            if len(raw) != (stop - start) * self.record_bytes:
                raise IntegrityError(
                    f"the journal of {self.info.id!r} ended inside record {start + len(raw) // self.record_bytes}"
                )
            records = np.frombuffer(raw, dtype=dtype)
            if strict:
                self.check_scales(records, start)
            self._count_read(len(raw), time.perf_counter() - started)
            yield KVRecords(Header(self._geometry, self._tier, stop - start), records, HEADER_BYTES + len(raw))

    def _sealed_chunks(self, chunk_records: int) -> Iterator[memoryview]:
        """The first ``chunk_records`` records (a server reads that chunk before its answer starts:
        a small session is checked whole before a 200), then chunks of at most ``chunk_records``
        ending on the journal's frames where they can (:meth:`chunk_starts`: a chunk ending inside
        a frame would make the next one decrypt that frame again, its tag covering all of it; only
        the frame the first chunk cuts is), each decrypted straight into its own buffer
        in the caller's thread (the API's is a worker thread already; the read and AES-GCM release
        the GIL). Cheaper than decrypting each frame once and cutting chunks from them (whose joins
        copy more than they save: the server's CPU time per download 0.068 s here against 0.090 s
        for 376 MB); decrypting ahead on more threads took the cores the event loop's socket
        writes and the client needed on a 2-core box (bench/encryption.py)."""
        sealed = self._sealed
        if sealed is None:
            return
        step = max(1, chunk_records)
        first = min(step, self.n_records)
        starts = [0, *sealed.chunk_starts(first, self.n_records, step)] if self.n_records else []
        for start, stop in zip(starts, [*starts[1:], self.n_records]):
            began = time.perf_counter()
            out = np.empty((stop - start) * self.record_bytes, dtype=np.uint8).data
            got = sealed.read_into(out, start, stop)
            if got != len(out):
                raise IntegrityError(f"the journal of {self.info.id!r} ended inside records [{start}, {stop})")
            self._count_read(len(out), time.perf_counter() - began)
            yield out

    def _pread(self, nbytes: int, offset: int) -> bytes | memoryview:
        """``nbytes`` of the journal's plaintext image from ``offset`` (header + records; whole
        records past the header), decrypted from an encrypted store's frames."""
        if self._sealed is None:
            return pread_exact(self._fd, nbytes, offset)
        first = (offset - HEADER_BYTES) // self.record_bytes
        skip = offset - HEADER_BYTES - first * self.record_bytes
        last = -(-(offset - HEADER_BYTES + nbytes) // self.record_bytes)
        return self._sealed.read_range(first, last)[skip : skip + nbytes]

    def check_scales(self, records: np.ndarray, first_record: int) -> None:
        """Refuse served records holding a scale/radius no encoder writes (``Tier.corrupt_scales``).

        The store validated every row it acknowledged, so such a row is damage on disk. The byte
        streams serve records as stored (a client's loader makes such rows inert, docs/FORMAT.md section
        4); a restore into a cache reads with ``strict`` and gets :class:`SessionDamaged` naming the
        session, its journal and the record instead of a row of zeros.
        """
        info = self.info
        try:
            coli_kv.check_scales(
                records,
                info.tier,
                source=f"session {info.id!r} (journals/{info.key}.coli_kv)",
                first_record=first_record,
                advice="the session is damaged: `kvstore verify` names the turn, a resume with verify serves "
                "the turns before it, `kvstore sessions repair` drops it",
            )
        except BadScale as exc:
            raise SessionDamaged(exc.reason) from None

    def _count_read(self, nbytes: int, seconds: float) -> None:
        with self._counting:  # read_into runs on several threads at once
            self._read_bytes = (self._read_bytes or 0) + nbytes
            self._busy_s += seconds

    def close(self) -> None:
        if self._read_bytes is not None:  # records were read: one restore, counted once
            nbytes, self._read_bytes = self._read_bytes, None
            self._stats.restored(nbytes, self._busy_s)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._sealed is not None:
            self._sealed.close()
            self._sealed = None
        if self._lock is not None:
            self._lock.release()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
