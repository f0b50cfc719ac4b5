"""Read, judge and inspect ``.coli_kv`` files: what the CLI and the API's file endpoints run (the
rewrites, ``repair`` and ``migrate``, are :mod:`kvstore.filerewrite`).

Each function returns a plain dict report (JSON-ready) and raises a typed ``KVStoreError`` on bad
input. Rewrites go through ``kvstore.journal`` (atomic, under the writer lock), so a crash at any
instant leaves the old file or the new one.

Files named by a user are read through :func:`read_source` / :func:`load_source`: every refusal
names the path, the field at fault and what was expected there (:func:`naming` puts the path in
front of the formats layer's reasons, which know no paths). A file is *damaged* when
``KVRecords.problems.damaged`` (committed records missing or invalid, a partial record at the end;
whole records past the commit point are a crash leftover, not damage): :func:`check_damage`
refuses it (:class:`FileDamaged`, exit 1) unless the caller allows it, and a damaged file is never
rewritten without a ``.bak`` first (:func:`keep_backup`).

A file is judged a chunk at a time (:class:`Scan`, :class:`SourceFile`): ``inspect`` and ``export``
hold one chunk (:data:`CHUNK_BYTES`) of a file whatever its size, and a session store inspects a
journal or an archive stream the same way (:func:`scan_stream`).

Symbolic links, one rule for every tool: a path that is a symbolic link is followed. What is read
is the file it leads to; what is rewritten (``repair``, a journal's lazy upgrade) and what is
written (``migrate``'s and ``export``'s output, a ``.bak``, a new journal) is the file it leads to,
created or replaced atomically in that file's own folder, under that file's writer lock; the link
itself stays as it was. A link that leads to no file yet names the file to create. A loop of links
is refused (exit 2), naming the path (:func:`real_target`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from kvstore.durable import AtomicFile, read_whole, write_errors
from kvstore.errors import (
    CodecMismatch,
    FileDamaged,
    FileUnreadable,
    GeometryMismatch,
    InvalidRequest,
    KVStoreError,
)
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header, KVRecords, Problems, Tier
from kvstore.journal import real_path

Progress = Callable[[int, int], None]

COLI_KV_FILE = "a .coli_kv file"
#: Records named one by one in a damage line before the rest are counted ("and 12 more").
SHOWN_RECORDS = 5
#: Bytes of a file a streaming reader holds at once (whole records; one record when a record is
#: larger). The rows of a chunk are judged in :data:`_SLICES` slices, so what judging allocates
#: besides the chunk stays under a tenth of it.
CHUNK_BYTES = 8 << 20
_SLICES = 16
#: The row damage a loader neutralizes, each a ``Problems`` counter and a ``damaged_records`` kind.
_ROW_DAMAGE = ("bad_scales", "bad_radii", "nan_codes", "nan_values")


# ---------------------------------------------------------------------------- reading what a user names
@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Put ``path`` (as the user wrote it) in front of the reason of a ``KVStoreError`` raised inside.

    The formats layer knows no paths and the journal names files by their base name; a reason that
    already starts with the path is left alone, one that starts with its base name gets the path
    instead.
    """
    try:
        yield
    except KVStoreError as exc:
        shown, name = str(path), Path(path).name
        if not exc.reason.startswith(shown):
            rest = exc.reason[len(name) :] if exc.reason.startswith(name + " ") else f": {exc.reason}"
            exc.reason = shown + rest
            exc.args = (exc.reason,)
        raise


def _unreadable(path: str | os.PathLike, exc: OSError, what: str) -> FileUnreadable:
    problem = {
        errno.ENOENT: "no such file",
        errno.EISDIR: "is a folder",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOTDIR: "a part of the path before it is not a folder",
        errno.ELOOP: "too many levels of symbolic links",
        errno.ENAMETOOLONG: "the name is too long",
    }.get(exc.errno or 0, exc.strerror or type(exc).__name__)
    return FileUnreadable(f"{path}: {problem}; expected {what}")


def _open_source(path: str | os.PathLike, what: str) -> int:
    """A read-only descriptor of the regular file at ``path`` (links followed), opened without
    blocking (a FIFO or a device is refused, not waited on); :class:`FileUnreadable` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _unreadable(path, exc, what) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise FileUnreadable(f"{path}: is a folder; expected {what}")
        if not stat.S_ISREG(mode):
            raise FileUnreadable(f"{path}: is not a regular file (a device, FIFO or socket); expected {what}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_source(path: str | os.PathLike, what: str = COLI_KV_FILE, *, limit: int | None = None) -> memoryview:
    """The bytes of a file the user named (at most ``limit`` of them), or one line saying why not.

    Opened without blocking (a FIFO or a device is refused, not waited on) and checked to be a
    regular file before anything is read.

    Raises
    ------
    FileUnreadable
        Missing, a folder, not a regular file, not readable, or a read error: the reason names
        ``path``, what is wrong and ``what`` was expected.
    """
    fd = _open_source(path, what)
    try:
        if limit is not None:
            return memoryview(os.pread(fd, limit, 0))
        return read_whole(fd)
    except OSError as exc:
        if isinstance(exc, KVStoreError):
            raise
        raise FileUnreadable(f"{path}: reading failed ({exc.strerror or exc}); expected {what}") from None
    finally:
        os.close(fd)


def load_source(
    path: str | os.PathLike, *, expect: Geometry | None = None, tier: Tier | None = None
) -> tuple[memoryview, KVRecords]:
    """Read and parse a ``.coli_kv`` file the user named (one read); every error names ``path``.

    See :func:`kvstore.formats.coli_kv.parse` for ``expect`` and ``tier``.
    """
    raw = read_source(path)
    with naming(path):
        return raw, coli_kv.parse(raw, expect=expect, tier=tier)


def source_header(path: str | os.PathLike) -> Header:
    """Only the header of a ``.coli_kv`` file the user named (40 bytes read); errors name ``path``."""
    raw = read_source(path, limit=HEADER_BYTES)
    with naming(path):
        return coli_kv.parse_header(raw)


def real_target(path: str | os.PathLike) -> Path:
    """The file a tool reads, rewrites or writes for ``path``: where ``path`` leads when it is a
    symbolic link (the module docstring has the rule), else ``path`` itself, as given.

    Raises
    ------
    InvalidRequest
        ``path`` is a loop of links (it leads nowhere a file can be).
    """
    if not os.path.islink(path):
        return Path(path)
    real = real_path(path)
    if real.is_symlink():  # realpath stops where links loop
        raise InvalidRequest(f"{path}: too many levels of symbolic links (a loop); expected a file or a link to one")
    return real


def _leads_to(path: str | os.PathLike, real: Path) -> str:
    """`` (a link to REAL)`` when ``path`` is a symbolic link, for messages that name ``path``."""
    return f" (a link to {real})" if os.path.islink(path) else ""


def check_output(path: str | os.PathLike, *, overwrite: bool, what: str) -> Path:
    """Refuse an output path that cannot take a new file, before any work is done; returns the file
    to write (:func:`real_target`: where a link at ``path`` leads).

    Raises
    ------
    InvalidRequest
        ``path`` is a folder (or leads to one), its folder does not exist, it exists (or leads to a
        file that exists) and ``overwrite`` is False (the reason says to pass ``--force``), or it
        is a loop of links.
    """
    out = real_target(path)
    via = _leads_to(path, out)
    if out.is_dir():
        raise InvalidRequest(f"{path}{via}: is a folder; expected the path of {what} to write")
    folder = out.parent
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "does not exist"
        raise InvalidRequest(
            f"{path}{via}: its folder {folder} {problem}; expected an existing folder to write {what} in"
        )
    if not overwrite and out.exists():
        raise InvalidRequest(f"{path}{via}: exists; pass --force to replace it (nothing was written)")
    return out


# ---------------------------------------------------------------------------- judging a file a chunk at a time
def _fill(readinto: Callable[[memoryview], int], view: memoryview) -> int:
    """Fill ``view`` from a stream (``readinto`` returns 0 at its end); returns the bytes read."""
    got = 0
    while got < len(view):
        n = readinto(view[got:])
        if not n:
            break
        got += n
    return got


def chunks_reader(chunks: Iterable[bytes | bytearray | memoryview]) -> Callable[[memoryview], int]:
    """A ``readinto`` (see :func:`scan_stream`) over an iterator of byte chunks, holding none of
    them past the call that finishes it."""
    pending = iter(chunks)
    current, at = memoryview(b""), 0

    def readinto(view: memoryview) -> int:
        nonlocal current, at
        while at == len(current):
            chunk = next(pending, None)
            if chunk is None:
                return 0
            current, at = memoryview(chunk).cast("B"), 0
        n = min(len(view), len(current) - at)
        view[:n] = current[at : at + n]
        at += n
        return n

    return readinto


@dataclass
class Scan:
    """What a loader of a ``.coli_kv`` image finds in it, counted a chunk at a time.

    The same answers as the loaded records (``KVRecords.problems``, ``damaged_records()``) give,
    without holding more than a chunk of the file: :func:`scan_records` judges records in memory,
    :func:`scan_stream` a stream (a file, an archive being decompressed).

    Attributes
    ----------
    header : the file's header (``header.nrec`` as stored)
    file_size : bytes in the image
    problems : the counters of :class:`~kvstore.formats.records.Problems`
    damaged : row damage kind (``bad_scales``, ``bad_radii``, ``nan_codes``, ``nan_values``) ->
        (records holding it, the first :data:`SHOWN_RECORDS` of them)
    """

    header: Header
    file_size: int = HEADER_BYTES
    problems: Problems = field(default_factory=Problems)
    damaged: dict[str, tuple[int, list[int]]] = field(default_factory=dict)

    @property
    def complete_records(self) -> int:
        """Whole records in the image, committed or not."""
        return max(0, self.file_size - HEADER_BYTES) // self.header.rec_bytes

    @property
    def n(self) -> int:
        """Records safe to resume: ``min(nrec, complete records)``."""
        return min(self.header.nrec, self.complete_records)

    @property
    def tier(self) -> Tier:
        return self.header.tier

    @property
    def geometry(self) -> Geometry:
        return self.header.geometry

    def add(self, records: np.ndarray, first: int) -> None:
        """Count the row damage of committed records ``first ..`` (a structured array of the
        header's record dtype), a slice at a time."""
        rec_bytes = self.header.rec_bytes
        step = max(1, CHUNK_BYTES // _SLICES // rec_bytes)
        for start in range(0, records.shape[0], step):
            part = records[start : start + step]
            piece = KVRecords(self.header.with_nrec(part.shape[0]), part, HEADER_BYTES + part.nbytes)
            found = piece.problems
            hits = [kind for kind in _ROW_DAMAGE if getattr(found, kind)]
            if not hits:
                continue
            for kind in hits:
                setattr(self.problems, kind, getattr(self.problems, kind) + getattr(found, kind))
            for kind, mask in piece.damaged_records().items():
                where = np.flatnonzero(mask)
                if not where.size:
                    continue
                count, shown = self.damaged.get(kind, (0, []))
                shown += [first + start + int(i) for i in where[: SHOWN_RECORDS - len(shown)]]
                self.damaged[kind] = (count + int(where.size), shown)

    def finish(self) -> "Scan":
        """Set the counters that depend on the whole image: records missing, past nrec, torn bytes."""
        h, complete = self.header, self.complete_records
        self.problems.overclaim = max(0, h.nrec - complete)
        self.problems.uncommitted = max(0, complete - h.nrec)
        self.problems.torn_tail_bytes = max(0, self.file_size - HEADER_BYTES - complete * h.rec_bytes)
        return self


def scan_records(records: KVRecords) -> Scan:
    """:class:`Scan` of loaded records (what :func:`damage_lines` and :func:`check_damage` read)."""
    scan = Scan(records.header, records.file_size)
    scan.add(records.records, 0)
    return scan.finish()


def scan_stream(
    readinto: Callable[[memoryview], int], *, size: int | None = None, chunk_bytes: int | None = None
) -> Scan:
    """Judge a ``.coli_kv`` image read from a stream, holding at most ``chunk_bytes`` of it (whole
    records; one record when a record is larger) and what judging a slice of it allocates.

    Parameters
    ----------
    readinto : fills the view it is given from the stream's current position; returns the bytes
        read, 0 at the end (``RawIOBase.readinto``)
    size : the image's size when known: nothing larger than it is allocated (a header's widths
        cannot make a short file allocate a large record)
    chunk_bytes : bytes read at a time (default :data:`CHUNK_BYTES`)

    Raises
    ------
    FormatError
        The header is short or invalid (``kvstore.formats`` names the field).
    """
    head = bytearray(HEADER_BYTES)
    got = _fill(readinto, memoryview(head))
    header = coli_kv.parse_header(memoryview(head)[:got])
    rec_bytes = header.rec_bytes
    dtype = coli_kv.record_dtype(header.geometry, header.tier)
    length = max(1, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // rec_bytes) * rec_bytes
    if size is not None:
        length = min(length, max(0, size - HEADER_BYTES))
    buffer = np.empty(length, dtype=np.uint8)
    view = buffer.data.cast("B")
    scan = Scan(header)
    read, held, index = got, 0, 0  # bytes so far; bytes of a partial record at the buffer's front; records
    while True:
        n = _fill(readinto, view[held:])
        read += n
        total = held + n
        whole = total // rec_bytes
        committed = max(0, min(whole, header.nrec - index))
        if committed:
            scan.add(np.frombuffer(buffer, dtype=dtype, count=committed), index)
        index += whole
        held = total - whole * rec_bytes
        if held and whole:
            buffer[:held] = buffer[whole * rec_bytes : total]
        if n == 0 or total < length:  # the stream ended
            break
    scan.file_size = read
    return scan.finish()


class SourceFile:
    """A ``.coli_kv`` file the user named, open for reading a chunk at a time: ``inspect`` and
    ``export`` hold a chunk (:data:`CHUNK_BYTES`) of it, whatever its size.

    The header is read and checked on opening; the size is the file's when it was opened (records
    a writer appends meanwhile are not read). Close it (or use ``with``).

    Parameters
    ----------
    path : the file (a link is followed)
    expect, tier : refuse a file for another model or of another tier, as ``coli_kv.parse`` does

    Raises
    ------
    FileUnreadable, FormatError, GeometryMismatch, CodecMismatch
        As :func:`load_source`, every reason naming ``path``.
    """

    def __init__(self, path: str | os.PathLike, *, expect: Geometry | None = None, tier: Tier | None = None):
        self.path = path
        self._fd = _open_source(path, COLI_KV_FILE)
        try:
            self.file_size = os.fstat(self._fd).st_size
            with naming(path):
                self.header = coli_kv.parse_header(self._pread(min(HEADER_BYTES, self.file_size), 0))
                if expect is not None and self.header.geometry != expect:
                    raise GeometryMismatch(
                        "file is for another model: " + "; ".join(self.header.geometry.mismatches(expect))
                    )
                if tier is not None and self.header.tier != tier:
                    raise CodecMismatch(f"file is {self.header.tier.describe()}, the active tier is {tier.describe()}")
        except BaseException:
            self.close()
            raise
        self._dtype = coli_kv.record_dtype(self.header.geometry, self.header.tier)

    @property
    def geometry(self) -> Geometry:
        return self.header.geometry

    @property
    def tier(self) -> Tier:
        return self.header.tier

    @property
    def n(self) -> int:
        """Records safe to resume: ``min(nrec, complete records)``."""
        return min(self.header.nrec, max(0, self.file_size - HEADER_BYTES) // self.header.rec_bytes)

    def _pread(self, length: int, offset: int) -> memoryview:
        """Up to ``length`` bytes from ``offset`` (fewer at the end of the file), in a new buffer."""
        buffer = np.empty(length, dtype=np.uint8)  # not bytearray: that zero-fills first
        return self._pread_into(buffer.data.cast("B"), offset)

    def _pread_into(self, view: memoryview, offset: int) -> memoryview:
        """Fill ``view`` from ``offset`` (less at the end of the file); returns what was filled."""
        got = 0
        try:
            while got < len(view):
                n = os.preadv(self._fd, [view[got:]], offset + got)
                if n == 0:
                    break
                got += n
        except OSError as exc:
            raise FileUnreadable(
                f"{self.path}: reading failed ({exc.strerror or exc}); expected {COLI_KV_FILE}"
            ) from None
        return view[:got]

    def scan(self) -> Scan:
        """Judge the whole file (:func:`scan_stream`), holding one chunk of it."""
        offset = 0

        def readinto(view: memoryview) -> int:
            nonlocal offset
            got = len(self._pread_into(view[: max(0, self.file_size - offset)], offset))
            offset += got
            return got

        with naming(self.path):
            return scan_stream(readinto, size=self.file_size)

    def chunks(self, max_bytes: int = CHUNK_BYTES, *, repair: bool = False) -> Iterator[KVRecords]:
        """The safe records ``[0, n)`` in order, as KVRecords of at most ``max_bytes`` (one record
        when a record is larger); ``repair``: each sanitized as :func:`repaired` does."""
        rec_bytes = self.header.rec_bytes
        step = max(1, max_bytes // rec_bytes)
        for start in range(0, self.n, step):
            count = min(step, self.n - start)
            raw = self._pread(count * rec_bytes, HEADER_BYTES + start * rec_bytes)
            if len(raw) < count * rec_bytes:
                raise FileUnreadable(
                    f"{self.path}: the file shrank while it was read (record {start + len(raw) // rec_bytes})"
                )
            records = np.frombuffer(raw, dtype=self._dtype)
            piece = KVRecords(self.header.with_nrec(count), records, HEADER_BYTES + len(raw))
            yield repaired(piece) if repair else piece

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SourceFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------- damage
def _scan_of(records: KVRecords | Scan) -> Scan:
    return records if isinstance(records, Scan) else scan_records(records)


def _records_text(count: int, shown: list[int], rec_bytes: int) -> str:
    """``records 0, 3, 9 and 12 more (first at byte 40)``: ``count`` records, the first of them ``shown``."""
    listed = ", ".join(str(i) for i in shown)
    more = f" and {count - len(shown)} more" if count > len(shown) else ""
    noun = "record" if count == 1 else "records"
    return f"{noun} {listed}{more} (first at byte {HEADER_BYTES + shown[0] * rec_bytes})"


def damage_lines(records: KVRecords | Scan) -> list[str]:
    """One line per kind of damage in ``records`` (loaded, or a :class:`Scan` of them), each saying
    what and where (empty: not damaged)."""
    h, found = records.header, records.problems
    rec = h.rec_bytes
    complete = records.complete_records
    lines = []
    if found.overclaim:
        lines.append(
            f"records {complete}..{h.nrec - 1}: the header claims nrec {h.nrec} but the file holds "
            f"{complete} whole records ({found.overclaim} committed records are missing: the file was cut short)"
        )
    if found.torn_tail_bytes:
        start = HEADER_BYTES + complete * rec
        lines.append(
            f"bytes {start}..{start + found.torn_tail_bytes - 1}: {found.torn_tail_bytes} bytes of a partial "
            f"{rec}-byte record after the last whole one (torn tail: a write cut mid-record, or a file cut short)"
        )
    if any(getattr(found, kind) for kind in _ROW_DAMAGE):
        where = _scan_of(records).damaged
        kinds = (
            ("bad_scales", "rows with an fp8 scale out of range (read as zeros)"),
            ("bad_radii", "rows with a TQ radius out of range (read as zeros)"),
            ("nan_codes", "fp8 NaN codes 0x7F/0xFF (read as 0)"),
            ("nan_values", "non-finite values (NaN/inf)"),
        )
        for kind, text in kinds:
            count = getattr(found, kind)
            if count and kind in where:
                lines.append(f"{_records_text(*where[kind], rec)}: {text}: {count}")
    return lines


def leftover_notes(records: KVRecords | Scan) -> list[str]:
    """What is not damage but is more than the committed records: whole records past nrec."""
    h, found = records.header, records.problems
    if not found.uncommitted:
        return []
    start = HEADER_BYTES + h.nrec * h.rec_bytes
    return [
        f"records {h.nrec}..{h.nrec + found.uncommitted - 1} (bytes {start}..{start + found.uncommitted * h.rec_bytes - 1}): "
        f"{found.uncommitted} whole records past the commit point (nrec {h.nrec}) are not loaded — a crash leftover "
        f"(an append killed before its commit, or a truncate before it cut them); the next append or "
        f"`kvstore repair` removes them"
    ]


def records_dropped(records: KVRecords | Scan) -> int:
    """Committed records a reader of the damaged file does not get: those the header claims but the
    file does not hold whole (the partial record of a torn tail past nrec was never committed)."""
    return records.problems.overclaim


def check_damage(path: str | os.PathLike, records: KVRecords | Scan, *, allow: bool, doing: str) -> str | None:
    """Refuse a damaged file, or the warning to print when the caller allows it (None when not damaged).

    Parameters
    ----------
    path : the file as the user named it
    records : its parsed records, or a :class:`Scan` of them
    allow : ``--allow-damaged`` was given
    doing : what was about to happen (``"export"``, ``"migrate"``, ...), for the refusal

    Raises
    ------
    FileDamaged
        ``records`` are damaged and ``allow`` is False; the reason names each damage and where.
    """
    if not records.problems.damaged:
        return None
    lines = damage_lines(records)
    if not allow:
        raise FileDamaged(
            f"{path}: damaged, {doing} refused: {'; '.join(lines)}. Run `kvstore repair {path}` (keeps a .bak), "
            f"or pass --allow-damaged to go on with the {records.n} whole records"
        )
    return (
        f"{path} is damaged ({'; '.join(lines)}); --allow-damaged: {doing} goes on with {records.n} records, "
        f"{records_dropped(records)} committed records dropped"
    )


def keep_backup(path: str | os.PathLike, raw: bytes | memoryview) -> Path:
    """Write ``raw`` (the file's bytes as read) next to ``path`` as ``<name>.bak`` — or ``.bak.1``,
    ``.bak.2`` ... when older backups exist: a backup is never overwritten. Atomic and fsynced.
    A ``path`` that is a symbolic link gets its backup beside the file it leads to."""
    path = real_target(path)
    for attempt in range(1000):
        backup = path.with_name(path.name + ".bak" + (f".{attempt}" if attempt else ""))
        if backup.exists() or backup.is_symlink():
            continue
        try:
            with write_errors(f"writing {backup.name}", f"{path.name} is unchanged"):
                with AtomicFile(backup, replace=False) as out:
                    out.write(raw)
        except FileExistsError:  # another writer took this name meanwhile: the next one
            continue
        return backup
    raise InvalidRequest(f"{path}: 1000 backups ({path.name}.bak ...) exist already; remove old ones")


def inspect_file(path: str | os.PathLike) -> dict:
    """Everything a user needs to judge a file: header, counts, damage found and where.

    Parameters
    ----------
    path : a ``.coli_kv`` file (read once, a chunk at a time, never modified)

    Returns
    -------
    dict
        ``tier`` (its description, canonical name first), ``version``/``codec``/``bits`` (codec and
        bits None for v1 and v2 files, which have neither), the
        geometry, ``nrec`` (the header's count) against ``complete_records`` and ``records_safe``,
        the damage counters (torn tail bytes, bad scales/radii, NaN codes/values), ``problems``
        (every finding, one line each), ``damaged`` with ``damage`` (what and where, one line per
        kind), ``notes`` (whole records past the commit point: a crash leftover, not damage) and
        ``clean`` (not damaged). ``kvstore inspect`` exits 0 clean, 1 damaged.

    Raises
    ------
    FileUnreadable
        Missing, a folder, not readable.
    FormatError
        Not a ``.coli_kv`` file (short, bad magic, a header field out of range): the reason names
        the path and the field.
    """
    with SourceFile(path) as source:
        scan = source.scan()  # one chunk of the file at a time, whatever its size
    h, found = scan.header, scan.problems
    damage = damage_lines(scan)
    return {
        "path": str(path),
        "file_bytes": scan.file_size,
        "magic": h.magic.rstrip(b"\0").decode(),
        "version": h.version,
        "tier": h.tier.describe(),
        "tag": h.tag,
        "codec": h.tier.codec_name,
        "bits": h.bits,
        "geometry": {
            "n_layers": h.n_layers,
            "kv_lora": h.kv_lora,
            "qk_rope": h.qk_rope,
            "index_hd": h.index_hd,
            "nic": h.nic,
            "vocab": h.vocab,
        },
        "record_bytes": h.rec_bytes,
        "nrec": h.nrec,
        "complete_records": scan.complete_records,
        "records_safe": scan.n,
        "overclaim": found.overclaim,
        "uncommitted_records": found.uncommitted,
        "torn_tail_bytes": found.torn_tail_bytes,
        "bad_scales": found.bad_scales,
        "bad_radii": found.bad_radii,
        "nan_codes": found.nan_codes,
        "nan_values": found.nan_values,
        "problems": found.messages(),
        "damaged": found.damaged,
        "damage": damage,
        "notes": leftover_notes(scan),
        "clean": not found.damaged,
    }


def _sanitized(records: KVRecords) -> tuple[np.ndarray, list[str]]:
    """A copy of the safe records with corrupt rows neutralized, and what was changed (each tier's
    codec decides what is corrupt: ``KVRecords.sanitized``)."""
    return records.sanitized()


def sanitized_records(records: KVRecords) -> np.ndarray:
    """A copy of the safe records with corrupt rows neutralized (what ``filerewrite.repair_file`` writes)."""
    return _sanitized(records)[0]


def repaired(records: KVRecords) -> KVRecords:
    """``records`` as ``filerewrite.repair_file`` would leave them (a sanitized copy): what a command that
    goes on with a damaged file (``--allow-damaged``) reads, so its output is never damaged."""
    fixed = sanitized_records(records)
    return KVRecords(records.header.with_nrec(records.n), fixed, HEADER_BYTES + fixed.nbytes)
