# Over 500 lines: every fsync and atomic rename of the project lives here on purpose (STYLE rule 5: durability in one place).
"""The durable ``.coli_kv`` journal: every fsync and every atomic rename of kvstore lives here.

Protocol (docs/FORMAT.md section 4), and what each step protects against:

- **create**: the header (nrec = 0) is written to a temporary file, fsynced, then linked into
  place (never clobbering) and the directory fsynced — a crash leaves no file or a valid empty one.
- **append**: records are written past the commit point, the data is fsynced, *then* h6 (nrec) is
  written and fsynced. A crash at any instant leaves the old nrec valid; bytes past it are ignored
  and the next append overwrites them.
- **truncate**: h6 is lowered (never above what is committed and physically complete), fsynced,
  and only then is the file shortened.
- **rewrite** (lazy v1 -> v2/v3 upgrade, migrate, repair): the new image goes to a temporary file in
  the same directory, is fsynced, renamed over the old one, and the directory is fsynced: a crash
  leaves either the old file or the new one, never less.
- After any failed write the handle forgets its cached count, so the next append re-reads the
  committed count and rewrites the tail rather than skipping it.

Writers take an advisory lock (``kvstore.locks.FileLock`` on a ``<file>.lock`` sidecar, which
survives the renames above), so two writers never interleave. The sidecar is named after the
journal's real path (:func:`real_path`: every symbolic link resolved), so a writer that names the
journal through a link and one that names it directly meet the same lock; a lock on the descriptor
or the inode would not do, as every rewrite renames a new inode over the journal. A journal named
through a link is written where the link leads: appends, rewrites (their temporary file and rename
in the real file's folder) and the lock all follow it, and the link stays a link. Readers take no
lock: the commit order guarantees they see a consistent prefix.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from kvstore.durable import AtomicFile, pwrite_all, read_whole, write_errors
from kvstore.errors import (
    BadScale,
    CodecMismatch,
    FormatError,
    GeometryMismatch,
    JournalClosed,
    JournalWriteError,
    PathRefused,
)
from kvstore.formats import coli_kv, fp8, nonfinite
from kvstore.formats.coli_kv import HEADER_BYTES, NREC_OFFSET, Geometry, Header, KVRecords, Tier
from kvstore.locks import DEFAULT_LOCK_TIMEOUT_S, FileLock
from kvstore.migrations import formats as format_migrations

MAX_RECORDS = 2**31 - 1  # h6 is an int32

if TYPE_CHECKING:
    from kvstore.sealed import Sealing


def open_regular(path: Path, flags: int, dir_fd: int | None = None, what: str = "a journal") -> int:
    """``os.open`` of a regular file that never follows a symbolic link at ``path``.

    A link, a folder, a FIFO or a device in its place is :class:`PathRefused` naming ``what`` the
    file should be (a FIFO is not waited on: the open does not block, and the file is checked before
    anything reads it). With ``dir_fd`` (an open descriptor of ``path``'s folder) the name is opened
    relative to it (``openat``). A missing file is ``FileNotFoundError``.
    """
    try:
        name = path.name if dir_fd is not None else path
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PathRefused(f"{path.name} is a symbolic link; {what} is opened only as a regular file") from None
        if exc.errno == errno.EISDIR:
            raise PathRefused(f"{path.name} is a folder; {what} is a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PathRefused(f"{path.name} is not a regular file; {what} is opened only as one")
    os.set_blocking(fd, True)
    return fd


def read_tokens(fd: int, rec_bytes: int, start: int, stop: int) -> np.ndarray:
    """Tokens (int32[stop - start]) of records ``[start, stop)`` of a journal, touching only their pages.

    The caller holds a lock that keeps the file from shrinking (a mapped page past the end of a
    file would fault).
    """
    if stop <= start:
        return np.empty(0, np.int32)
    first = HEADER_BYTES + start * rec_bytes
    aligned = first - first % mmap.ALLOCATIONGRANULARITY
    length = HEADER_BYTES + stop * rec_bytes - aligned
    mapped = mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=aligned)
    try:
        view = np.ndarray((stop - start,), dtype="<i4", buffer=mapped, offset=first - aligned, strides=(rec_bytes,))
        tokens = view.astype(np.int32)
        del view
    finally:
        mapped.close()
    return tokens


def real_path(path: str | os.PathLike) -> Path:
    """``path`` with every symbolic link resolved (of the file and of its folders): where the bytes
    of a journal named through a link live, and the one name every alias of it shares.

    A link that leads nowhere is resolved as far as it goes (a missing target is where a new file
    is created); a loop stays a link, which every open then refuses.
    """
    return Path(os.path.realpath(path))


def _writer_lock(target: Path, timeout: float, dir_fd: int | None = None) -> FileLock:
    """The journal's writer lock, held: ``flock`` on the ``<file>.lock`` sidecar (it survives renames).

    ``target`` is the journal's real path (:func:`real_path`), or its name in the folder ``dir_fd``.
    """
    return FileLock(
        target.with_name(target.name + ".lock"),
        timeout=timeout,
        busy_reason=f"{target.name} is being written by another writer; try again later",
        dir_fd=dir_fd,
    ).acquire()


@contextlib.contextmanager
def writer_lock(path: str | os.PathLike, timeout: float = DEFAULT_LOCK_TIMEOUT_S):
    """Hold the journal's writer lock (e.g. while a tool rewrites the file); ``path`` may name the
    journal through a symbolic link: the lock is the one of the file it leads to."""
    lock = _writer_lock(real_path(path), timeout)
    try:
        yield
    finally:
        lock.release()


class KVFile:
    """A durable, lockable ``.coli_kv`` journal.

    Open with :meth:`create` or :meth:`open`. ``tier`` is the *active* cache tier: a v1 file opened
    under a quantized tier is upgraded lazily (rows quantized in memory on :meth:`load`; the file is
    rewritten atomically on the first :meth:`append`). Any other tier difference is refused with
    :class:`CodecMismatch` — use ``kvstore.migrations`` for an explicit conversion (lossy unless the target
    is f32: ``migrations.formats.conversion`` says which).
    """

    def __init__(
        self,
        path: Path,
        fd: int,
        header: Header,
        committed: int,
        tier: Tier,
        lock: FileLock | None,
        dir_fd: int | None = None,
        target: Path | None = None,
    ):
        self.path = path  # as the caller named it (messages)
        # Where the bytes live: the real path (links resolved), or the name in the folder ``dir_fd``.
        # Rewrites replace this file, in its own folder; the lock sidecar sits beside it.
        self.target = target if target is not None else path
        self._dir_fd = dir_fd  # the folder's descriptor the file is (re)opened relative to, if given
        self._fd = fd
        self._header = header  # as stored on disk (its tier may differ from the active tier)
        self._committed: int | None = committed
        self.tier = tier
        self._lock = lock

    # ---------------------------------------------------------------- opening
    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        geometry: Geometry,
        tier: Tier,
        *,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
        dir_fd: int | None = None,
        sealing: "Sealing | None" = None,
    ) -> "KVFile":
        """Create a new, empty journal (refuses to overwrite an existing file); ``dir_fd`` as in :meth:`open`.

        With ``sealing`` the journal is encrypted at rest (:class:`kvstore.sealed.SealedKVFile`).

        Without ``dir_fd``, a ``path`` that is a symbolic link leading to no file creates the file it
        leads to (in that file's folder, under its lock); the link stays.
        """
        path = Path(path)
        target = path if dir_fd is not None else real_path(path)
        coli_kv.check_geometry(geometry, tier)
        lock = _writer_lock(target, lock_timeout, dir_fd)
        try:
            header = Header(geometry, tier, 0)
            if sealing is not None:
                from kvstore.sealed import SealedKVFile

                with write_errors(f"creating {path.name}", "no file was created"):
                    return SealedKVFile.create_sealed(path, target, header, tier, lock, dir_fd, sealing)
            with write_errors(f"creating {path.name}", "no file was created"):
                with AtomicFile(target, replace=False) as out:
                    out.write(header.to_bytes())
                # the file just linked there, never a link put in its place
                fd = open_regular(target, os.O_RDWR, dir_fd)
        except BaseException:
            lock.release()
            raise
        return cls(path, fd, header, 0, tier, lock, dir_fd, target)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        geometry: Geometry | None = None,
        tier: Tier | None = None,
        writable: bool = False,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
        follow_symlinks: bool = True,
        dir_fd: int | None = None,
        sealing: "Sealing | None" = None,
    ) -> "KVFile":
        """Open an existing journal.

        Parameters
        ----------
        geometry : the model fingerprint the caller expects (refused with GeometryMismatch if not)
        tier : the active cache tier (default: the file's own)
        writable : take the writer lock (waits up to ``lock_timeout`` seconds): the lock of the file
            ``path`` leads to, so writers naming one journal through different links exclude each other
        follow_symlinks : False refuses a ``path`` that is a symbolic link (:class:`PathRefused`):
            the session store's journals are regular files in its folder, never links out of it.
            True (without ``dir_fd``): a link is followed once, and the file it leads to is the one
            appended to and rewritten (:attr:`target`)
        dir_fd : an open descriptor of ``path``'s folder: the journal and its lock sidecar are opened
            relative to it (``openat``, never following a link), so a folder replaced by a link after
            the caller checked it cannot redirect them (the session store passes its ``journals/``)
        sealing : the keys of an encrypted store: the journal must be encrypted at rest (a
            plaintext one is refused, never mixed in) and opens as a :class:`kvstore.sealed.SealedKVFile`;
            without it an encrypted journal is refused (:class:`EncryptedJournal`)

        Raises
        ------
        PathRefused : ``path`` (with ``follow_symlinks=False``) or its lock sidecar is a symbolic link
        """
        path = Path(path)
        if dir_fd is not None:
            target = path  # opened by name in the folder the caller opened
        elif follow_symlinks:
            target = real_path(path)
        else:
            target = real_path(path.parent) / path.name  # the folder resolved, the name itself never followed
        lock = _writer_lock(target, lock_timeout, dir_fd) if writable else None
        try:
            flags = os.O_RDWR if writable else os.O_RDONLY
            fd = (
                open_regular(target, flags, dir_fd)
                if dir_fd is not None or not follow_symlinks
                else os.open(target, flags)
            )
            try:
                if sealing is not None:
                    from kvstore.sealed import SealedKVFile

                    return SealedKVFile.open_sealed(path, fd, target, geometry, tier, lock, dir_fd, sealing)
                header, committed = cls._read_commit(fd)
                if geometry is not None and header.geometry != geometry:
                    raise GeometryMismatch(
                        f"{path.name} is for another model: " + "; ".join(header.geometry.mismatches(geometry))
                    )
                active = tier or header.tier
                if header.tier != active and not (header.tier.version == 1 and active.version != 1):
                    raise CodecMismatch(
                        f"{path.name} is {header.tier.describe()} but the active tier is {active.describe()}; "
                        f"migrate it explicitly (kvstore migrate --tier {active.name}): "
                        + format_migrations.conversion(header.tier, active)
                    )
                return cls(path, fd, header, committed, active, lock, dir_fd, target)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    @staticmethod
    def _read_commit(fd: int) -> tuple[Header, int]:
        """The on-disk header and the committed count, clamped to complete records."""
        size = os.fstat(fd).st_size
        header = coli_kv.parse_header(os.pread(fd, HEADER_BYTES, 0))
        complete = (size - HEADER_BYTES) // header.rec_bytes
        return header, min(header.nrec, complete)

    # ---------------------------------------------------------------- state
    @property
    def geometry(self) -> Geometry:
        return self._header.geometry

    @property
    def stored_tier(self) -> Tier:
        return self._header.tier

    @property
    def upgrade_pending(self) -> bool:
        """A v1 file under a quantized tier, not yet rewritten."""
        return self._header.tier != self.tier

    @property
    def writable(self) -> bool:
        return self._lock is not None

    @property
    def n_records(self) -> int:
        """Records committed and physically complete."""
        return self._commit_point()

    @property
    def size_bytes(self) -> int:
        """The open file's size in bytes (``fstat``: never through the path, where a link may stand now)."""
        self._check_open()
        return os.fstat(self._fd).st_size

    def holds(self, n_records: int) -> bool:
        """Whether the file holds exactly ``n_records`` committed records of the active tier and no
        byte past them (else a store settles it against its index before writing)."""
        expected = HEADER_BYTES + n_records * coli_kv.record_bytes(self.geometry, self.tier)
        return self.n_records == n_records and self.size_bytes == expected

    def _check_open(self) -> None:
        if self._fd < 0:
            raise JournalClosed(f"{self.path.name} is closed")

    def _commit_point(self) -> int:
        self._check_open()
        if self._committed is None:  # after a failure: trust the disk, not memory
            self._header, self._committed = self._read_commit(self._fd)
        return self._committed

    # ---------------------------------------------------------------- reading
    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens (int32[stop - start]) of stored records ``[start, stop)``, touching only their
        pages (the caller keeps the file from shrinking: the writer lock, or a store's read lock)."""
        self._check_open()
        return read_tokens(self._fd, self._header.rec_bytes, start, stop)

    def load(self) -> KVRecords:
        """The committed records, in the active tier (one read + array operations)."""
        self._check_open()
        records = coli_kv.parse(read_whole(self._fd))
        if records.tier != self.tier:  # lazy upgrade: quantize in memory, the file stays as it is
            converted = format_migrations.convert(records, self.tier)
            header = Header(records.geometry, self.tier, records.n)
            records = KVRecords(header, converted, HEADER_BYTES + converted.nbytes)
        return records

    # ---------------------------------------------------------------- writing
    def _require_writer(self) -> None:
        self._check_open()
        if self._lock is None:
            raise JournalClosed(f"{self.path.name} was opened read-only")

    def encode(self, tokens, L, R, I=None) -> np.ndarray:
        """Encode rows as records of the active tier (``coli_kv.encode_records_counted``: a non-finite
        f32 value is stored as 0, so a journal never holds one)."""
        return coli_kv.encode_records_counted(self.geometry, self.tier, tokens, L, R, I)[0]

    def append(self, tokens, L, R, I=None) -> int:
        """Append rows (tokens int32[k], L f32[n_layers,k,kv_lora], R f32[n_layers,k,qk_rope],
        I f32[nic,k,index_hd]) durably; returns the new committed count."""
        return self.append_records(self.encode(tokens, L, R, I), validate=False)

    def append_records(self, records: np.ndarray | bytes | bytearray | memoryview, *, validate: bool = True) -> int:
        """Append already-encoded records of the active tier; returns the new committed count.

        Records are validated first (whole records, token ids in the vocabulary, no corrupt
        scale/radius or NaN code) so nothing invalid is ever committed; ``validate=False`` is for
        records this process just encoded itself.
        """
        self._require_writer()
        dtype = coli_kv.record_dtype(self.geometry, self.tier)
        if validate or not isinstance(records, np.ndarray) or records.dtype != dtype:
            records = self.validate_records(records, dtype)
        if records.shape[0] == 0:
            return self._commit_point()
        try:
            committed = self._commit_point()
            total = committed + records.shape[0]
            if total > MAX_RECORDS:
                raise FormatError(f"{total} records exceed the format's limit of {MAX_RECORDS}")
            if self.upgrade_pending:
                return self._rewrite(extra=records)
            self._write_tail(records, committed, total)
        except OSError as exc:
            self._committed = None
            raise JournalWriteError(
                f"append to {self.path.name} failed ({exc.strerror or exc}); committed records are intact"
            ) from exc
        except BaseException:
            self._committed = None
            raise
        self._committed = total
        self._header = self._header.with_nrec(total)
        return total

    def _write_tail(self, records: np.ndarray, committed: int, total: int) -> None:
        """Write ``records`` past the commit point ``committed``, fsync, then publish ``total``."""
        offset = HEADER_BYTES + committed * records.dtype.itemsize
        pwrite_all(self._fd, records.data.cast("B"), offset)
        os.fsync(self._fd)  # data first: the counter must never point at unwritten rows
        self._publish(total, committed)

    def _publish(self, count: int, previous: int) -> None:
        """Write h6 and fsync it. If that fails, put the previous count back (best effort): the
        caller reports a failure, so readers must not keep seeing the new count."""
        try:
            pwrite_all(self._fd, struct.pack("<i", count), NREC_OFFSET)
            os.fsync(self._fd)  # the commit point itself
        except OSError:
            try:
                pwrite_all(self._fd, struct.pack("<i", previous), NREC_OFFSET)
                os.fsync(self._fd)
            except OSError:
                pass  # the disk is failing; the next call re-reads whatever count it holds
            raise

    def validate_records(
        self, records: np.ndarray | bytes | bytearray | memoryview, dtype: np.dtype | None = None
    ) -> np.ndarray:
        """Check records of the active tier before they are committed; returns them as an array."""
        dtype = dtype or coli_kv.record_dtype(self.geometry, self.tier)
        if not isinstance(records, np.ndarray):
            raw = memoryview(records).cast("B")
            if len(raw) % dtype.itemsize:
                raise FormatError(
                    f"{len(raw)} bytes is not a whole number of {dtype.itemsize}-byte records for this session"
                )
            records = np.frombuffer(raw, dtype=dtype)
        elif records.dtype != dtype:
            raise FormatError("records were encoded for another geometry or tier")
        if records.shape[0] == 0:
            return records
        tokens = records["token"]
        if tokens.min() < 0 or tokens.max() >= self.geometry.vocab:
            raise FormatError(f"token ids must be in [0, {self.geometry.vocab})")
        g = self.geometry
        # a slice at a time: the checks' temporaries stay a slice's size whatever the upload's
        step = nonfinite.slice_rows(g.n_layers * (g.kv_lora + g.qk_rope) + g.nic * g.index_hd)
        for lo in range(0, records.shape[0], step):
            self._check_slice(records[lo : lo + step], lo)
        return records

    def _check_slice(self, records: np.ndarray, first_record: int) -> None:
        layers = records["layers"]
        if self.tier.holds_values:
            codec = self.tier.row_codec
            found = (codec.bad_codes(layers[field]) for field in ("Lc", "Rc"))
            if any(bad is not None and bad.any() for bad in found):
                raise FormatError("rows hold NaN or infinite values")
        else:
            # the one bound of every reader (Tier.corrupt_scales), naming the record and layer; a
            # FormatError as before (the API's error name for refused bytes), not its BadScale subclass
            try:
                coli_kv.check_scales(
                    records,
                    self.tier,
                    source="the rows to append",
                    first_record=first_record,
                    advice="no encoder writes it: nothing was written",
                )
            except BadScale as exc:
                raise FormatError(exc.reason) from None
            if self.tier.version == 2 and (fp8.nan_codes(layers["Lc"]).any() or fp8.nan_codes(layers["Rc"]).any()):
                raise FormatError("rows hold fp8 NaN codes (0x7F/0xFF), which no encoder writes")
        if self.geometry.nic and not np.isfinite(records["index"]).all():
            raise FormatError("indexer rows hold NaN or infinite values")

    def truncate(self, n: int) -> int:
        """Keep the first ``n`` records; never publishes more than are committed and complete.

        Returns the new committed count.
        """
        self._require_writer()
        if n < 0:
            raise FormatError(f"cannot truncate to {n} records")
        try:
            committed = self._commit_point()
            target = min(n, committed)
            if self.upgrade_pending:
                return self._rewrite(keep=target)
            if not self._cut(target, committed):
                return self._rewrite(keep=target)
        except OSError as exc:
            self._committed = None
            raise JournalWriteError(f"truncate of {self.path.name} failed ({exc.strerror or exc})") from exc
        except BaseException:
            self._committed = None
            raise
        self._committed = target
        self._header = self._header.with_nrec(target)
        return target

    def _cut(self, target: int, committed: int) -> bool:
        """Lower the commit point to ``target`` in place (False: it cannot be, rewrite instead)."""
        self._publish(target, committed)  # the lower commit point is durable before bytes disappear
        os.ftruncate(self._fd, HEADER_BYTES + target * self._header.rec_bytes)
        os.fsync(self._fd)
        return True

    def read_range(self, start: int, stop: int) -> bytes | memoryview:
        """The stored bytes of committed records ``[start, stop)`` (the caller keeps the file from
        shrinking)."""
        self._check_open()
        rec = self._header.rec_bytes
        return os.pread(self._fd, (stop - start) * rec, HEADER_BYTES + start * rec) if stop > start else b""

    def reseal(self) -> int:
        """Rewrite the journal under its owner's current data key (:class:`kvstore.sealed.SealedKVFile`);
        a plaintext journal has no key to rotate."""
        raise FormatError(f"{self.path.name} is not encrypted at rest: it has no data key to rotate")

    def size_after_truncate(self, n: int) -> int:
        """The file's size once :meth:`truncate` has kept ``n`` committed records."""
        return HEADER_BYTES + min(n, self.n_records) * coli_kv.record_bytes(self.geometry, self.tier)

    def growth(self, nbytes: int) -> int:
        """Bytes an append of ``nbytes`` of records adds to the file (what a store reserves)."""
        return nbytes

    def load_header(self) -> Header:
        """The stored header as a ``.coli_kv`` header (nrec: the committed records)."""
        return self._header.with_nrec(self._commit_point())

    def chunk_starts(self, start: int, stop: int, chunk_records: int) -> list[int]:
        """First records of chunks of ``chunk_records`` covering committed records ``[start, stop)``
        (any split reads as well here; a sealed journal ends them on its frames)."""
        return list(range(start, min(stop, self.n_records), max(1, chunk_records)))

    def iter_records(self, start: int, stop: int, chunk_records: int) -> Iterator[bytes | memoryview]:
        """Committed records ``[start, stop)`` in chunks of ``chunk_records`` (the caller keeps the
        file from shrinking)."""
        step = max(1, chunk_records)
        for lo in range(start, min(stop, self.n_records), step):
            yield self.read_range(lo, min(lo + step, stop, self.n_records))

    def read_into(self, out: memoryview, start: int, stop: int) -> int:
        """Committed records ``[start, stop)`` read straight into ``out``; returns the bytes read
        (fewer when the file ends early)."""
        self._check_open()
        rec = self._header.rec_bytes
        view, got = out[: max(0, stop - start) * rec], 0
        while got < len(view):
            n = os.preadv(self._fd, [view[got:]], HEADER_BYTES + start * rec + got)
            if n == 0:
                break
            got += n
        return got

    @property
    def committed_bytes(self) -> int:
        """Bytes of the header and the committed records: what a copy of the journal holds."""
        return HEADER_BYTES + self.n_records * self._header.rec_bytes

    def upgrade(self) -> None:
        """Perform a pending lazy upgrade now (an atomic rewrite in the active tier)."""
        self._require_writer()
        if self.upgrade_pending:
            try:
                self._rewrite()
            except OSError as exc:
                self._committed = None
                raise JournalWriteError(
                    f"rewrite of {self.path.name} failed ({exc.strerror or exc}); the old file is intact"
                ) from exc

    def _rewrite(self, extra: np.ndarray | None = None, keep: int | None = None) -> int:
        """Atomically replace the file with its committed records in the active tier (+ ``extra``).

        Returns the new commit point."""
        records = self.load()  # already converted to the active tier
        if keep is not None:
            records = records.slice(0, keep)
        total = records.n + (0 if extra is None else extra.shape[0])
        header = Header(self.geometry, self.tier, total)
        # The new image replaces the file the journal's name leads to, in that file's folder (a link
        # naming it stays a link).
        with AtomicFile(self.target, replace=True) as out:
            out.write(header.to_bytes())
            out.write(records.records)
            if extra is not None:
                out.write(extra)
        # Swap the handle to the new inode (the lock is on the sidecar, unaffected).
        new_fd = open_regular(self.target, os.O_RDWR, self._dir_fd)
        os.close(self._fd)
        self._fd = new_fd
        self._header = header
        self._committed = total
        return total

    def map_for_reads(self) -> None:
        """An encrypted journal's reads share one mapping while the file is open
        (:meth:`kvstore.sealed.SealedKVFile.map_for_reads`); a plaintext one's are ``preadv``s."""

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "KVFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._fd < 0 else f"{self._committed} records"
        return f"KVFile({str(self.path)!r}, {self.tier.describe()}, {state})"
