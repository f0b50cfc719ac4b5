"""Parked sessions: a journal as one zstd frame (``archive/<id>.coli_kv.zst``).

The frame holds the journal's exact bytes (header + committed records) with zstd's content size
and checksum, so unparking reproduces the journal byte for byte and a damaged archive is refused
instead of restored. Both directions write through ``kvstore.durable.AtomicFile``: a crash leaves
either no new file or a complete one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import zstandard

from kvstore.durable import AtomicFile
from kvstore.errors import IntegrityError
from kvstore.journal import open_regular

CHUNK_BYTES = 8 << 20
COMPRESSION_LEVEL = 3  # the cheap end: parking is I/O-bound, fp8/TQ codes compress little anyway

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def compress_journal(source_fd: int, length: int, destination: Path, *, progress: Progress | None = None) -> int:
    """Compress the first ``length`` bytes of ``source_fd`` into ``destination`` atomically.

    Returns the archive's size in bytes. ``destination`` must not exist (never clobbered).
    """
    compressor = zstandard.ZstdCompressor(level=COMPRESSION_LEVEL, write_checksum=True, write_content_size=True)
    stream = compressor.compressobj(size=length)
    done = 0
    with AtomicFile(destination, replace=False) as out:
        while done < length:
            chunk = os.pread(source_fd, min(CHUNK_BYTES, length - done), done)
            if not chunk:
                raise IntegrityError(f"the journal ended at byte {done} while parking {length} bytes")
            out.write(stream.compress(chunk))
            done += len(chunk)
            if progress is not None:
                progress(done, length)
        out.write(stream.flush())
        size = out.size
    return size


def _no_follow(path: str, flags: int) -> int:
    """``open``'s opener for archives: a symbolic link, folder or FIFO in an archive's place is
    refused (:class:`PathRefused`), never read or waited on."""
    return open_regular(Path(path), flags, what="an archive")


def stream_archive(path: Path, *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The decompressed bytes of an archive, in chunks; raises IntegrityError if it is damaged."""
    decompressor = zstandard.ZstdDecompressor()
    try:
        with (
            open(path, "rb", opener=_no_follow) as raw,
            decompressor.stream_reader(raw, read_size=chunk_bytes) as reader,
        ):
            while True:
                chunk = reader.read(chunk_bytes)
                if not chunk:
                    return
                yield chunk
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"archive {path.name} is damaged ({exc}); it cannot be restored") from None


def content_size(path: Path) -> int:
    """The journal size recorded in the archive's frame header."""
    with open(path, "rb", opener=_no_follow) as raw:
        head = raw.read(18)  # a zstd frame header is at most 18 bytes
    try:
        params = zstandard.get_frame_parameters(head)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"archive {path.name} has no valid zstd frame header ({exc})") from None
    if params.content_size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise IntegrityError(f"archive {path.name} does not record its size")
    return int(params.content_size)


def read_prefix(path: Path, nbytes: int) -> bytes:
    """The first ``nbytes`` decompressed bytes (fewer if the journal is shorter)."""
    parts, got = [], 0
    for chunk in stream_archive(path, chunk_bytes=min(CHUNK_BYTES, max(nbytes, 1 << 16))):
        parts.append(chunk[: nbytes - got])
        got += len(parts[-1])
        if got >= nbytes:
            break
    return b"".join(parts)


def restore_journal(archive: Path, destination: Path, *, progress: Progress | None = None) -> int:
    """Decompress ``archive`` into ``destination`` atomically (never clobbering); returns its size.

    The frame's checksum and recorded size are checked before the journal is published.
    """
    expected = content_size(archive)
    done = 0
    with AtomicFile(destination, replace=False) as out:
        for chunk in stream_archive(archive):
            out.write(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, expected)
        if done != expected:
            raise IntegrityError(f"archive {archive.name} decompressed to {done} bytes, its frame says {expected}")
    return done
