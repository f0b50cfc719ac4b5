"""Writing files so that a crash leaves the old image or the new one: what the journal
(:mod:`kvstore.journal`) and every rewrite of a file build on.

:class:`AtomicFile` writes a new image beside the file and renames it over it (data fsynced, then
the rename, then the folder fsynced); :func:`write_atomic` is one such rewrite from record chunks;
:class:`PreviousImage` keeps the file a rewrite replaces until another commit point agrees;
:func:`move_durably` sets a file aside under another name; :func:`write_errors` turns an
``OSError`` on the way into a typed ``JournalWriteError`` saying what was kept.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import time
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import numpy as np

from kvstore.errors import FormatError, JournalClosed, JournalWriteError, KVStoreError
from kvstore.formats.coli_kv import Header

FILE_MODE = 0o600  # conversations are private: owner-only files


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename/link/unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, payload: bytes | memoryview, offset: int) -> None:
    view = memoryview(payload).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[written:]
        offset += written


@contextlib.contextmanager
def write_errors(what: str, keeps: str):
    """Turn an OSError from a write path into a typed JournalWriteError saying what survived.

    ``FileExistsError`` passes through: refusing to clobber is an answer, not a failure; so do
    errors already typed (a ``PathRefused`` is an ``OSError`` too).
    """
    try:
        yield
    except (FileExistsError, KVStoreError):
        raise
    except OSError as exc:
        raise JournalWriteError(f"{what} failed ({exc.strerror or exc}); {keeps}") from exc


def read_whole(fd: int) -> memoryview:
    """The file's current bytes, read with as few syscalls as the kernel allows (<= 2 GiB each)."""
    size = os.fstat(fd).st_size
    buf = np.empty(size, dtype=np.uint8)  # not bytearray(size): that zero-fills first
    view = buf.data
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:]], got)
        if n == 0:  # the file shrank under us: what was read is a prefix, parse that
            break
        got += n
    return view[:got]


class AtomicFile:
    """Write a whole file image so that a crash leaves either the old file or the new one.

    Use as a context manager; the file is published only if the block exits cleanly.
    With ``replace=False`` an existing destination is never clobbered (``FileExistsError``).
    """

    def __init__(self, path: str | os.PathLike, *, replace: bool = True):
        self.path = Path(path)
        self.replace = replace
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
        self._fd: int | None = None
        self.size = 0

    def __enter__(self) -> "AtomicFile":
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        return self

    def write(self, payload: bytes | memoryview | np.ndarray) -> None:
        if self._fd is None:
            raise JournalClosed(f"{self.path.name}: write outside the AtomicFile's with-block")
        if isinstance(payload, np.ndarray):
            payload = np.ascontiguousarray(payload).data.cast("B")
        pwrite_all(self._fd, payload, self.size)
        self.size += len(memoryview(payload).cast("B"))

    @contextlib.contextmanager
    def stream(self, buffer_bytes: int = 1 << 20) -> Iterator[BinaryIO]:
        """A buffered, seekable file object on the image being written, for writers that need one
        (a zip archive, Arrow IPC, Parquet), positioned after what :meth:`write` wrote. Its bytes go
        through the same ``pwrite`` loop as :meth:`write`. It is flushed when the block ends
        cleanly, before the image is fsynced and published (:attr:`size` then counts its bytes); a
        block that raises drops what is still buffered (the image is discarded anyway)."""
        if self._fd is None:
            raise JournalClosed(f"{self.path.name}: write outside the AtomicFile's with-block")
        raw = _ImageWriter(self._fd, self.size)
        handle = io.BufferedWriter(raw, buffer_size=buffer_bytes)
        try:
            yield handle  # type: ignore[misc]  (a BufferedWriter is a binary file)
            handle.flush()
        except BaseException:
            raw.discarding = True  # closing must not write again (a full disk would fail twice)
            raise
        finally:
            handle.close()
        self.size = max(self.size, raw.end)

    def __exit__(self, exc_type, exc, tb) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if exc_type is None:
                os.fsync(fd)  # the new image is on disk before its name can point at it
        except BaseException:
            os.close(fd)
            self._discard()
            raise
        os.close(fd)
        if exc_type is not None:
            self._discard()
            return
        try:
            if self.replace:
                os.replace(self._tmp, self.path)
            else:
                os.link(self._tmp, self.path)  # fails if the destination exists: never clobber
                os.unlink(self._tmp)
            fsync_dir(self.path.parent)  # the rename itself survives a power loss
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


class _ImageWriter(io.RawIOBase):
    """The image an :class:`AtomicFile` writes, as a seekable raw file (:meth:`AtomicFile.stream`):
    every write is one ``pwrite`` loop at the current position."""

    def __init__(self, fd: int, position: int):
        self._fd = fd
        self._position = position
        self.end = position  # the largest offset written
        self.discarding = False

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, payload) -> int:  # type: ignore[override]
        view = memoryview(payload).cast("B")
        if not self.discarding:
            pwrite_all(self._fd, view, self._position)
        self._position += len(view)
        self.end = max(self.end, self._position)
        return len(view)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.end}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, "negative seek position")
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position


def write_atomic(path: str | os.PathLike, header: Header, chunks: Iterable[np.ndarray], *, replace: bool = True) -> int:
    """Write ``header`` + record chunks as a new file image, atomically; returns bytes written.

    The header's nrec must equal the records written (checked) — a rewrite publishes nothing partial.
    """
    written = 0
    with write_errors(f"writing {Path(path).name}", "the previous file (if any) is intact"):
        with AtomicFile(path, replace=replace) as out:
            out.write(header.to_bytes())
            for chunk in chunks:
                out.write(chunk)
                written += chunk.shape[0]
            if written != header.nrec:
                raise FormatError(f"rewrite produced {written} records, header says {header.nrec}")
    return written


class PreviousImage:
    """The file ``path`` names now, kept under a temporary hard link while a rewrite replaces it.

    For a rewrite whose own commit point is elsewhere (the session store's index): if that commit
    fails after the rename, :meth:`restore` puts the previous file back (an atomic rename, the
    folder fsynced), so the file and its index entry agree again. Once that commit is made,
    :meth:`discard` drops the link; leaving the block drops it too, quietly (an error there must not
    hide the one that ended the block). The link is named like an :class:`AtomicFile` temporary
    (``.<name>.tmp-<pid>-<ns>``): one that could not be removed, or that a killed process left, is
    removed by the store's reconcile as a leftover temporary file of that journal.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._link = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
        self._kept = False

    def __enter__(self) -> "PreviousImage":
        with write_errors(f"keeping the previous {self.path.name}", "nothing was changed"):
            os.link(self.path, self._link, follow_symlinks=False)
        self._kept = True
        return self

    def restore(self) -> None:
        """Put the previous file back under its name (durable when it returns)."""
        if not self._kept:
            return
        with write_errors(f"putting the previous {self.path.name} back", f"{self.path.name} holds the rewritten image"):
            os.replace(self._link, self.path)
            self._kept = False
            fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Drop the kept link (the rewrite is committed). One try: on an ``OSError`` the link stays
        (the caller reports it; the store's reconcile removes it)."""
        if self._kept:
            self._kept = False
            try:
                os.unlink(self._link)
            except FileNotFoundError:
                pass

    @property
    def link_name(self) -> str:
        return self._link.name

    def __exit__(self, *exc) -> None:
        if self._kept:
            try:
                self.discard()
            except OSError:
                pass  # a leftover temporary file, not a failure of the block (see the class docstring)


def move_durably(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Rename ``source`` to ``destination`` (never clobbering) and make it survive a power loss.

    Used by the session store to set aside files it cannot account for (``lost+found``): the
    link, the unlink and both directories are fsynced, so a crash leaves the file under one of
    its two names, never none.
    """
    source, destination = Path(source), Path(destination)
    os.link(source, destination, follow_symlinks=False)  # fails if the destination exists; a link moves as itself
    fsync_dir(destination.parent)
    os.unlink(source)
    fsync_dir(source.parent)
