"""Reading a session's stored records where they are: its journal when active, its archive when parked.

Every read here is chunked or touches only the pages it needs: a session may hold gigabytes, and
hashing, forking or confirming a prefix must not load it whole. The caller holds the session's read
or write lock, which keeps the files from shrinking or being replaced meanwhile.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Iterator

import numpy as np

from kvstore.durable import pwrite_all
from kvstore.errors import IntegrityError
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.journal import read_tokens
from kvstore.sealed import SealedImage
from kvstore.store import archive
from kvstore.store.values import IndexRecord, public_id, record_bytes_of

if TYPE_CHECKING:
    from kvstore.store.context import StoreContext

COPY_CHUNK_BYTES = 8 << 20


def bytes_view(records: np.ndarray) -> memoryview:
    """The bytes of a record array (contiguous), as a flat byte view."""
    return np.ascontiguousarray(records).data.cast("B")


def record_chunks(
    ctx: StoreContext, record: IndexRecord, start: int, stop: int, chunk_bytes: int = COPY_CHUNK_BYTES
) -> Iterator[bytes | memoryview]:
    """The stored bytes of records ``[start, stop)`` in order, from the journal or the archive.

    Raises
    ------
    IntegrityError : the file ends before record ``stop``
    """
    rec_bytes = record_bytes_of(record)
    first, last = HEADER_BYTES + start * rec_bytes, HEADER_BYTES + stop * rec_bytes
    if ctx.keyring is not None:
        yield from _sealed_chunks(ctx, record, start, stop, max(1, chunk_bytes // rec_bytes))
        return
    if record["state"] == "active":
        fd = ctx.open_journal_fd(record["id"])
        try:
            offset = first
            while offset < last:
                chunk = os.pread(fd, min(chunk_bytes, last - offset), offset)
                if not chunk:
                    raise IntegrityError(f"the journal of {public_id(record['id'])!r} ends before record {stop}")
                yield chunk
                offset += len(chunk)
        finally:
            os.close(fd)
        return
    offset = 0
    for chunk in archive.stream_archive(ctx.archive_path(record["id"]), chunk_bytes=chunk_bytes):
        lo, hi = max(first - offset, 0), min(last - offset, len(chunk))
        if lo < hi:
            yield chunk[lo:hi]
        offset += len(chunk)
        if offset >= last:
            return
    raise IntegrityError(f"the archive of {public_id(record['id'])!r} ends before record {stop}")


def tokens_of(ctx: StoreContext, record: IndexRecord, n_records: int) -> np.ndarray | None:
    """The first ``n_records`` tokens (int32, fewer if the file holds fewer whole records) of a
    session, from its journal or, when parked, its archive; None for a session in another state."""
    rec_bytes = record_bytes_of(record)
    if ctx.keyring is not None and record["state"] in ("active", "parked"):
        with sealed_source(ctx, record) as source:
            upto = min(n_records, source.n_records)
            raw = source.read_range(0, upto)
        return np.ndarray((upto,), "<i4", raw, 0, (rec_bytes,)).astype(np.int32)
    if record["state"] == "active":
        fd = ctx.open_journal_fd(record["id"])
        try:
            complete = (os.fstat(fd).st_size - HEADER_BYTES) // rec_bytes
            return read_tokens(fd, rec_bytes, 0, min(n_records, complete))
        finally:
            os.close(fd)
    if record["state"] == "parked":
        head = archive.read_prefix(ctx.archive_path(record["id"]), HEADER_BYTES + n_records * rec_bytes)
        complete = (len(head) - HEADER_BYTES) // rec_bytes
        return np.ndarray((max(complete, 0),), "<i4", head, HEADER_BYTES, (rec_bytes,)).astype(np.int32)
    return None


@contextlib.contextmanager
def sealed_source(ctx: StoreContext, record: IndexRecord) -> Iterator[SealedImage]:
    """An encrypted store's session records where they are: its journal, or (parked) its archive
    decompressed into an anonymous in-memory file (the archive holds the sealed journal's bytes)."""
    sealing = ctx.sealing(record["id"])
    if sealing is None:
        raise IntegrityError("sealed_source is for a store encrypted at rest")
    if record["state"] == "active":
        fd = ctx.open_journal_fd(record["id"])
    else:
        fd = os.memfd_create(f"unsealed-{public_id(record['id'])}", os.MFD_CLOEXEC)
        try:
            offset = 0
            for chunk in archive.stream_archive(ctx.archive_path(record["id"])):
                pwrite_all(fd, chunk, offset)
                offset += len(chunk)
        except BaseException:
            os.close(fd)
            raise
    try:
        yield SealedImage(fd, sealing, f"{public_id(record['id'])} ({record['state']})")
    finally:
        os.close(fd)


def _sealed_chunks(
    ctx: StoreContext, record: IndexRecord, start: int, stop: int, per_chunk: int
) -> Iterator[bytes | memoryview]:
    with sealed_source(ctx, record) as source:
        if source.n_records < stop:
            raise IntegrityError(f"the files of {public_id(record['id'])!r} end before record {stop}")
        yield from source.iter_range(start, stop, per_chunk)  # chunks end on frames: a bad one names its turn


def pread_exact(fd: int, nbytes: int, offset: int) -> bytes:
    """``nbytes`` from ``offset`` (fewer only at the end of the file), in as many reads as it takes."""
    parts, got = [], 0
    while got < nbytes:
        chunk = os.pread(fd, nbytes - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class CountingChunks:
    """Record-sized views of byte chunks, so ``write_atomic`` can count the records it writes."""

    def __init__(self, chunks: Iterator[np.ndarray], rec_bytes: int):
        self._chunks = chunks
        self._rec_bytes = rec_bytes
        self._carry = np.empty(0, np.uint8)

    def __iter__(self) -> Iterator[np.ndarray]:
        rec_dtype = np.dtype((np.void, self._rec_bytes))
        for chunk in self._chunks:
            if self._carry.size:
                chunk = np.concatenate([self._carry, chunk])
            whole = chunk.size - chunk.size % self._rec_bytes
            if whole:
                yield chunk[:whole].view(rec_dtype)
            self._carry = chunk[whole:].copy()
        if self._carry.size:
            raise IntegrityError("the source ended inside a record")
