"""Resuming a session: an open, consistent view of its records up to the watermark.

A :class:`SessionReader` holds the session's read lock (nothing shrinks or replaces the journal
while it is open; appends may continue) and one file descriptor of the journal; it serves the
records whole (:meth:`SessionReader.load`), as raw chunks (a download) or in batches (a device
restore). :class:`Resumed` is a whole load with what the caller needs to restore it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from kvstore.errors import BadScale, FingerprintMismatch, IntegrityError, InvalidRequest, SessionDamaged
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Header, KVRecords
from kvstore.locks import FileLock
from kvstore.store.context import StoreContext
from kvstore.store.integrity import Integrity
from kvstore.store.records import COPY_CHUNK_BYTES, pread_exact
from kvstore.store.values import MODEL_FIELDS, Fingerprint, SessionInfo, geometry_of, public_id, tier_of


@dataclass(frozen=True)
class Resumed:
    """A resumed session: the records to restore, trimmed to the watermark (or before damage)."""

    info: SessionInfo
    records: KVRecords
    reused_tokens: int
    verified: bool
    damaged_from: int | None  # first record of the first bad turn, when verify found one

    @property
    def tokens(self) -> np.ndarray:
        return self.records.tokens

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(L f32[n_layers,n,kv_lora], R f32[n_layers,n,qk_rope], I f32[nic,n,index_hd] | None)``."""
        return self.records.dequantize()


def check_fingerprint(record: dict, expect: Fingerprint, override: Iterable[str]) -> None:
    """Raise :class:`FingerprintMismatch` naming each field of ``expect`` the session differs in
    (``override``: fields not to compare, ``model.*`` or ``tier`` only)."""
    skip = set(override)
    unknown = skip - {f"model.{n}" for n in MODEL_FIELDS} - {"tier"}
    if unknown:
        raise InvalidRequest(f"cannot override {sorted(unknown)}: only model.* fields and tier can be overridden")
    found = SessionInfo.from_record(record).fingerprint.mismatches(expect)
    blocking = [m for m in found if m.split(":")[0] not in skip]
    if blocking:
        raise FingerprintMismatch(
            f"session {public_id(record['id'])!r} was written by another model or cache tier: "
            + "; ".join(blocking)
            + " (pass an override only if you know the caches are interchangeable)"
        )


class ServedRows:
    """What every session reader (either backend) derives from its ``info``, ``n_records`` and
    ``record_bytes``: the reused tokens, the body's size and a ``.coli_kv`` header for it."""

    info: SessionInfo
    n_records: int
    record_bytes: int

    @property
    def reused_tokens(self) -> int:
        return self.n_records

    @property
    def body_bytes(self) -> int:
        return self.n_records * self.record_bytes

    def header_bytes(self) -> bytes:
        """A ``.coli_kv`` header for the served records (nrec = ``n_records``)."""
        return Header(self.info.geometry, self.info.tier, self.n_records).to_bytes()


class SessionReader(ServedRows):
    """An open, consistent view of a session's records ``[0, n_records)`` for resuming.

    Holds the session's read lock (nothing shrinks or replaces the journal meanwhile) and a file
    descriptor of the journal. Close it (or use ``with``) to release both.

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
        record: dict,
        lock: FileLock,
        verify: bool,
        *,
        started: float | None = None,
    ):
        self._lock = lock
        self._fd = -1
        self._stats = ctx.stats
        self._counting = threading.Lock()
        # a restore (kvstore.store.stats): bytes read, and seconds spent opening and reading only
        self._read_bytes: int | None = None  # None until a read starts
        self._busy_s = time.perf_counter() - (started if started is not None else time.perf_counter())
        opened = time.perf_counter()
        sid = record["id"]
        try:
            self._fd = ctx.open_journal_fd(sid)
            header = coli_kv.parse_header(os.pread(self._fd, HEADER_BYTES, 0))
            if header.geometry != geometry_of(record) or header.tier != tier_of(record):
                raise IntegrityError(
                    f"the journal of {public_id(sid)!r} no longer matches its index entry; reopen the store to reconcile it"
                )
            self.info = SessionInfo.from_record(record)
            self.record_bytes = header.rec_bytes
            served = record["watermark"]
            self.verified = bool(verify)
            self.damaged_from: int | None = None
            if verify:
                with ctx.index.read() as txn:
                    turns = ctx.index.turns(txn, sid)
                _, bad = integrity.check_turns(record, turns, served)
                covered = max((t.end for t in turns if t.end <= served), default=0)
                limit = turns[bad].start if bad is not None else covered
                if limit < served:
                    self.damaged_from = limit
                    served = max((t.end for t in turns if t.end <= limit and t.complete), default=0)
            self.n_records = served
            ctx.touch(sid)
            self._busy_s += time.perf_counter() - opened
        except FileNotFoundError:
            self.close()
            raise SessionDamaged(f"the journal of session {public_id(sid)!r} is missing") from None
        except BaseException:
            self.close()
            raise

    def iter_bytes(self, chunk_bytes: int = COPY_CHUNK_BYTES) -> Iterator[bytes]:
        """The served records' raw bytes, in chunks (a whole number of records each, when it fits)."""
        chunk_bytes = max(self.record_bytes, chunk_bytes - chunk_bytes % self.record_bytes)
        offset, end = HEADER_BYTES, HEADER_BYTES + self.body_bytes
        self._count_read(0, 0.0)
        while offset < end:
            started = time.perf_counter()
            chunk = os.pread(self._fd, min(chunk_bytes, end - offset), offset)
            if not chunk:
                raise IntegrityError(f"the journal of {self.info.id!r} ended at byte {offset} of {end}")
            self._count_read(len(chunk), time.perf_counter() - started)
            yield chunk
            offset += len(chunk)

    def load(self, *, strict: bool = False) -> KVRecords:
        """All served records with one read (KVRecords, ``n = n_records``); ``strict``: see
        :meth:`check_scales`."""
        started = time.perf_counter()
        body = bytearray(self.body_bytes)
        view = memoryview(body)
        got = 0
        while got < len(body):
            n = os.preadv(self._fd, [view[got:]], HEADER_BYTES + got)
            if n == 0:
                raise IntegrityError(f"the journal of {self.info.id!r} ended at record {got // self.record_bytes}")
            got += n
        dtype = coli_kv.record_dtype(self.info.geometry, self.info.tier)
        records = np.frombuffer(body, dtype=dtype, count=self.n_records)
        if strict:
            self.check_scales(records, 0)
        self._count_read(len(body), time.perf_counter() - started)
        return KVRecords(Header(self.info.geometry, self.info.tier, self.n_records), records, HEADER_BYTES + len(body))

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
        view = memoryview(out).cast("B")[: count * self.record_bytes]
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

    def iter_batches(self, batch_records: int, *, strict: bool = False) -> Iterator[KVRecords]:
        """Served records as KVRecords batches of at most ``batch_records``; ``strict``: see
        :meth:`check_scales`."""
        dtype = coli_kv.record_dtype(self.info.geometry, self.info.tier)
        self._count_read(0, 0.0)
        for start in range(0, self.n_records, batch_records):
            started = time.perf_counter()
            stop = min(start + batch_records, self.n_records)
            raw = pread_exact(self._fd, (stop - start) * self.record_bytes, HEADER_BYTES + start * self.record_bytes)
            if len(raw) != (stop - start) * self.record_bytes:
                raise IntegrityError(
                    f"the journal of {self.info.id!r} ended inside record {start + len(raw) // self.record_bytes}"
                )
            records = np.frombuffer(raw, dtype=dtype)
            if strict:
                self.check_scales(records, start)
            self._count_read(len(raw), time.perf_counter() - started)
            yield KVRecords(Header(self.info.geometry, self.info.tier, stop - start), records, HEADER_BYTES + len(raw))

    def check_scales(self, records: np.ndarray, first_record: int) -> None:
        """Refuse served records holding a scale/radius no encoder writes (``Tier.corrupt_scales``).

        The store validated every row it acknowledged, so such a row is damage on disk. The byte
        streams serve records as stored (a client's loader makes such rows inert, FORMAT.md section
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
        self._lock.release()

    def __enter__(self) -> "SessionReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
