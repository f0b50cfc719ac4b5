"""Reading a session of the shared store, and checking rows before they are appended.

:class:`SharedReader` serves a resume from one committed snapshot with the attributes of the
embedded :class:`~kvstore.store.SessionReader`; :func:`validated` makes the checks every journal
append makes on the embedded store, so both backends refuse the same rows.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Iterator

import numpy as np

from kvstore.errors import BadScale, FormatError, InvalidRequest, SessionDamaged
from kvstore.formats import coli_kv, fp8, nonfinite
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header, KVRecords
from kvstore.store.base import Reader
from kvstore.store.shared.index import ReadPlan
from kvstore.store.values import SessionInfo
from kvstore.tiers import Tier

if TYPE_CHECKING:
    from kvstore.store.shared.sessions import SharedSessionStore

READ_CHUNK_BYTES = 4 << 20


class SharedReader(Reader):
    """A session's served records from one committed snapshot (the attributes of
    :class:`~kvstore.store.SessionReader`): segments are immutable and only added after the served
    range, so the bytes read later are those of the snapshot."""

    def __init__(
        self,
        store: SharedSessionStore,
        info: SessionInfo,
        plan: ReadPlan,
        served: int,
        verified: bool,
        damaged_from: int | None,
        opened_s: float,
    ):
        self._store = store
        self._plan = plan
        self._info = info
        self.n_records = served
        self.record_bytes = plan.rec_bytes
        self.verified = verified
        self.damaged_from = damaged_from
        self._busy_s = opened_s
        self._read_bytes: int | None = None
        self._counting = threading.Lock()

    @property
    def info(self) -> SessionInfo:
        """The session as the snapshot this reader serves found it."""
        return self._info

    def close(self) -> None:
        if self._read_bytes is not None:
            self._store.stats.restored(self._read_bytes, self._busy_s)
            self._read_bytes = None

    def _read(self, start: int, stop: int) -> bytearray:
        started = time.perf_counter()
        body = self._store.shared.read_planned(self.info.key, self._plan, start, stop)
        self._count(len(body), time.perf_counter() - started)
        return body

    def _count(self, nbytes: int, seconds: float) -> None:
        with self._counting:  # read_into runs on several threads at once
            self._busy_s += seconds
            self._read_bytes = (self._read_bytes or 0) + nbytes

    def _stream(self, per: int) -> Iterator[memoryview]:
        """Every served record in chunks of ``per`` records, the next ones fetched ahead (a download
        waits on the object store only when the client reads faster than it serves)."""
        self._read_bytes = self._read_bytes or 0
        chunks = self._store.shared.stream_planned(self.info.key, self._plan, 0, self.n_records, per)
        try:
            while True:
                started = time.perf_counter()
                body = next(chunks, None)
                if body is None:
                    return
                self._count(len(body), time.perf_counter() - started)
                yield body
        finally:
            chunks.close()

    def iter_bytes(self, chunk_bytes: int | None = None) -> Iterator[bytes | memoryview]:
        """The served records' raw bytes in chunks of whole records (``chunk_bytes`` None: 4 MiB)."""
        per = max(1, (READ_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // self.record_bytes)
        # memoryviews the server sends without another copy (a chunk across two segments is joined):
        # whole chunks, so the first one a server reads before its 200 holds as many bytes as asked
        yield from _exactly(self._stream(per), per * self.record_bytes)

    def read_into(self, out: np.ndarray, start: int, count: int) -> int:
        """Served records ``[start, start + count)`` into ``out`` (u8, at least ``count`` records
        long), from this reader's snapshot: a device restore's ring filled chunk by chunk. Returns
        ``count``."""
        if not 0 <= start <= start + count <= self.n_records:
            raise InvalidRequest(f"records [{start}, {start + count}) are not within the {self.n_records} served")
        body = self._read(start, start + count)
        out.data.cast("B")[: len(body)] = body
        return count

    def load(self, *, strict: bool = False) -> KVRecords:
        body = self._read(0, self.n_records)
        records = np.frombuffer(body, dtype=coli_kv.record_dtype(self.info.geometry, self.info.tier))
        if strict:
            self.check_scales(records, 0)
        return KVRecords(Header(self.info.geometry, self.info.tier, self.n_records), records, HEADER_BYTES + len(body))

    def check_scales(self, records: np.ndarray, first_record: int) -> None:
        """A scale no encoder writes in served records is damage (``SessionDamaged``), never a row of zeros."""
        try:
            coli_kv.check_scales(
                records,
                self.info.tier,
                source=f"session {self.info.id!r} (shared store)",
                first_record=first_record,
                advice="the session is damaged: a resume with verify serves the turns before it",
            )
        except BadScale as exc:
            raise SessionDamaged(exc.reason) from None

    def iter_batches(self, batch_records: int, *, strict: bool = False) -> Iterator[KVRecords]:
        dtype = coli_kv.record_dtype(self.info.geometry, self.info.tier)
        start = 0
        per = max(1, batch_records)
        for body in _exactly(self._stream(per), per * dtype.itemsize):
            records = np.frombuffer(body, dtype=dtype)
            if strict:
                self.check_scales(records, start)
            yield KVRecords(Header(self.info.geometry, self.info.tier, len(records)), records, HEADER_BYTES + len(body))
            start += len(records)


def _exactly(views: Iterator[memoryview], size: int) -> Iterator[memoryview]:
    """``views`` (whole records, cut at segment ends) as chunks of exactly ``size`` bytes, the last
    one shorter: a chunk inside one view is that view's slice, one across views a joined copy."""
    held: list[memoryview] = []
    held_bytes = 0
    for view in views:
        at = 0
        while at < len(view):
            if not held and len(view) - at >= size:
                yield view[at : at + size]
                at += size
                continue
            take = min(size - held_bytes, len(view) - at)
            held.append(view[at : at + take])
            held_bytes, at = held_bytes + take, at + take
            if held_bytes == size:
                yield memoryview(b"".join(held))
                held, held_bytes = [], 0
    if held:
        yield memoryview(b"".join(held))


def validated(geometry: Geometry, tier: Tier, records) -> tuple[np.ndarray, nonfinite.Sanitized]:
    """Raw records as an array, non-finite f32 values set to 0 and counted, then the checks every
    journal append makes (``KVFile.validate_records``): whole records, tokens in the vocabulary, no
    corrupt scale or NaN code. A :class:`FormatError` names the first problem; nothing is written."""
    dtype = coli_kv.record_dtype(geometry, tier)
    if isinstance(records, np.ndarray):
        if records.dtype != dtype:
            raise FormatError("records were encoded for another geometry or tier")
        rows = records
    else:
        raw = memoryview(records).cast("B")
        if len(raw) % dtype.itemsize:
            raise FormatError(
                f"{len(raw)} bytes is not a whole number of {dtype.itemsize}-byte records for this session"
            )
        rows = np.frombuffer(raw, dtype=dtype)
    if rows.shape[0] == 0:
        return rows, nonfinite.Sanitized()
    rows, found = nonfinite.sanitize_records(rows, tier)
    tokens = rows["token"]
    if tokens.min() < 0 or tokens.max() >= geometry.vocab:
        raise FormatError(f"token ids must be in [0, {geometry.vocab})")
    layers = rows["layers"]
    if tier.row_codec.scaled:
        try:
            coli_kv.check_scales(
                rows, tier, source="the rows to append", advice="no encoder writes it: nothing was written"
            )
        except BadScale as exc:
            raise FormatError(exc.reason) from None
        if tier.version == 2 and (fp8.nan_codes(layers["Lc"]).any() or fp8.nan_codes(layers["Rc"]).any()):
            raise FormatError("rows hold fp8 NaN codes (0x7F/0xFF), which no encoder writes")
    return rows, found
