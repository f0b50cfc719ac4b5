"""Inspect, repair and migrate ``.coli_kv`` files: what the CLI and the API's file endpoints run.

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
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from kvstore.errors import FileDamaged, FileUnreadable, InvalidRequest, KVStoreError, MigrationError
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header, KVRecords, Tier
from kvstore.journal import AtomicFile, read_whole, write_atomic, write_errors, writer_lock
from kvstore.migrations import formats as format_migrations

Progress = Callable[[int, int], None]

COLI_KV_FILE = "a .coli_kv file"
#: Records named one by one in a damage line before the rest are counted ("and 12 more").
SHOWN_RECORDS = 5


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


def check_output(path: str | os.PathLike, *, overwrite: bool, what: str) -> Path:
    """Refuse an output path that cannot take a new file, before any work is done.

    Raises
    ------
    InvalidRequest
        ``path`` is a folder, its folder does not exist, or it exists and ``overwrite`` is False
        (the reason says to pass ``--force``).
    """
    out = Path(path)
    if out.is_dir():
        raise InvalidRequest(f"{path}: is a folder; expected the path of {what} to write")
    folder = out.parent
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "does not exist"
        raise InvalidRequest(f"{path}: its folder {folder} {problem}; expected an existing folder to write {what} in")
    if not overwrite and (out.exists() or out.is_symlink()):
        raise InvalidRequest(f"{path}: exists; pass --force to replace it (nothing was written)")
    return out


# ---------------------------------------------------------------------------- damage
def _records_text(mask: np.ndarray, rec_bytes: int) -> str:
    """``records 0, 3, 9 and 12 more (first at byte 40)``: where a per-record mask is set."""
    where = np.flatnonzero(mask)
    shown = ", ".join(str(int(i)) for i in where[:SHOWN_RECORDS])
    more = f" and {where.size - SHOWN_RECORDS} more" if where.size > SHOWN_RECORDS else ""
    noun = "record" if where.size == 1 else "records"
    return f"{noun} {shown}{more} (first at byte {HEADER_BYTES + int(where[0]) * rec_bytes})"


def damage_lines(records: KVRecords) -> list[str]:
    """One line per kind of damage in ``records``, each saying what and where (empty: not damaged).

    The per-record scan runs only when the counters (:attr:`KVRecords.problems`) found row damage.
    """
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
    if found.bad_scales or found.bad_radii or found.nan_codes or found.nan_values:
        masks = records.damaged_records()
        kinds = (
            ("bad_scales", found.bad_scales, "rows with an fp8 scale out of range (read as zeros)"),
            ("bad_radii", found.bad_radii, "rows with a TQ radius out of range (read as zeros)"),
            ("nan_codes", found.nan_codes, "fp8 NaN codes 0x7F/0xFF (read as 0)"),
            ("nan_values", found.nan_values, "non-finite f32 values (NaN/inf)"),
        )
        for kind, count, text in kinds:
            if count and kind in masks and masks[kind].any():
                lines.append(f"{_records_text(masks[kind], rec)}: {text}: {count}")
    return lines


def leftover_notes(records: KVRecords) -> list[str]:
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


def records_dropped(records: KVRecords) -> int:
    """Committed records a reader of the damaged file does not get: those the header claims but the
    file does not hold whole (the partial record of a torn tail past nrec was never committed)."""
    return records.problems.overclaim


def check_damage(path: str | os.PathLike, records: KVRecords, *, allow: bool, doing: str) -> str | None:
    """Refuse a damaged file, or the warning to print when the caller allows it (None when not damaged).

    Parameters
    ----------
    path : the file as the user named it
    records : its parsed records
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
    ``.bak.2`` ... when older backups exist: a backup is never overwritten. Atomic and fsynced."""
    path = Path(path)
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
    path : a ``.coli_kv`` file (read once, never modified)

    Returns
    -------
    dict
        ``tier`` (its description, canonical name first), ``version``/``codec``/``bits``, the
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
    raw, records = load_source(path)
    h, found = records.header, records.problems
    damage = damage_lines(records)
    return {
        "path": str(path),
        "file_bytes": len(raw),
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
        "complete_records": records.complete_records,
        "records_safe": records.n,
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
        "notes": leftover_notes(records),
        "clean": not found.damaged,
    }


def _sanitized(records: KVRecords) -> tuple[np.ndarray, list[str]]:
    """A copy of the safe records with corrupt rows neutralized, and what was changed (each tier's
    codec decides what is corrupt: ``KVRecords.sanitized``)."""
    return records.sanitized()


def sanitized_records(records: KVRecords) -> np.ndarray:
    """A copy of the safe records with corrupt rows neutralized (what :func:`repair_file` writes)."""
    return _sanitized(records)[0]


def repaired(records: KVRecords) -> KVRecords:
    """``records`` as :func:`repair_file` would leave them (a sanitized copy): what a command that
    goes on with a damaged file (``--allow-damaged``) reads, so its output is never damaged."""
    fixed = sanitized_records(records)
    return KVRecords(records.header.with_nrec(records.n), fixed, HEADER_BYTES + fixed.nbytes)


def repair_file(
    path: str | os.PathLike, *, dry_run: bool = False, backup: bool = True, progress: Progress | None = None
) -> dict:
    """Clamp nrec to what is physically there, drop the torn tail, sanitize rows in place.

    Sanitizing stores what a reader already sees: rows with a bad fp8 scale or TQ radius become
    inert (zeros), fp8 NaN codes and non-finite f32 values become 0. The repaired file is clean.

    The original is kept as ``<name>.bak`` (``.bak.1`` ... when older backups exist) unless
    ``backup`` is False. The file is read and judged first, without the lock (a file that cannot be
    repaired leaves nothing behind, not even a lock sidecar); the repair itself runs under the
    journal's writer lock and the rewrite is atomic.

    Parameters
    ----------
    path : the ``.coli_kv`` file to repair
    dry_run : report the actions, change nothing (no lock is taken)
    backup : keep the original bytes as ``<name>.bak``
    progress : ``progress(records_written, records_total)`` as the repaired file is written

    Returns
    -------
    dict
        ``records`` kept, ``actions`` (one line each), ``changed``,
        ``dry_run`` and ``backup`` (its path, or None).

    Raises
    ------
    FileUnreadable, FormatError
        Not a readable ``.coli_kv`` file: nothing is written.
    """
    raw, records = load_source(path)  # refused here leaves no trace
    report = _repair_plan(path, raw, records, dry_run)
    if dry_run or not report["changed"]:
        return report
    with naming(path), writer_lock(path):
        raw, records = load_source(path)  # again, under the lock: what is rewritten is what was judged
        report = _repair_plan(path, raw, records, dry_run)
        if not report["changed"]:
            return report
        if backup:
            report["backup"] = str(keep_backup(path, raw))
        fixed, _ = _sanitized(records)
        write_atomic(path, records.header.with_nrec(records.n), _in_pieces(fixed, progress))
    return report


def _in_pieces(records: np.ndarray, progress: Progress | None) -> Iterator[np.ndarray]:
    """``records`` as views of about 4 MiB, calling ``progress(done, total)`` after each is written."""
    total = records.shape[0]
    step = total if progress is None else max(1, (4 << 20) // max(records.dtype.itemsize, 1))
    for start in range(0, total, max(step, 1)):
        yield records[start : start + step]
        if progress is not None:
            progress(min(start + step, total), total)


def _repair_plan(path: str | os.PathLike, raw: memoryview, records: KVRecords, dry_run: bool) -> dict:
    h = records.header
    actions = []
    if h.nrec != records.n:
        actions.append(f"clamped nrec from {h.nrec} to {records.n} (records physically complete)")
    tail = len(raw) - HEADER_BYTES - records.n * h.rec_bytes
    if tail > 0:
        actions.append(f"dropped {tail} bytes past the last committed record")
    actions += _sanitized(records)[1]
    return {
        "path": str(path),
        "records": records.n,
        "actions": actions,
        "changed": bool(actions),
        "dry_run": dry_run,
        "backup": None,
    }


def _cumulative(progress: Progress | None) -> Progress | None:
    """``convert_chunks`` reports each chunk's records; callers get ``(records_done, total)``."""
    if progress is None:
        return None
    done = 0

    def step(n: int, total: int) -> None:
        nonlocal done
        done += n
        progress(min(done, total), total)

    return step


def migrate_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    target: Tier,
    *,
    overwrite: bool = False,
    allow_damaged: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Convert ``src`` into a new file ``dst`` in ``target``; ``src`` is never modified.

    Parameters
    ----------
    src, dst : the file to read and the file to write (atomically)
    target : a file tier (``tiers.get("int4")``, ...)
    overwrite : replace an existing ``dst``
    allow_damaged : convert a damaged ``src`` instead of refusing it: its whole records, sanitized as
        ``repair`` would (the report's ``warning`` says what was dropped); ``dst`` is clean
    progress : ``progress(records_done, total)``, called after each converted chunk

    Returns
    -------
    dict
        ``from``/``to`` (tier descriptions), the migration ``steps``, ``lossy`` and ``conversion``
        (what the steps do to the values, in one line), ``records``, ``records_dropped``, the sizes
        before and after, ``seconds``, ``mb_per_s`` and ``warning`` (None unless ``src`` was damaged).

    Raises
    ------
    FileUnreadable, FormatError
        ``src`` is not a readable ``.coli_kv`` file (the reason names it and the field at fault).
    FileDamaged
        ``src`` is damaged and ``allow_damaged`` is False: nothing was written.
    MigrationError
        ``dst`` is ``src`` (or a link to it), or exists without ``overwrite``.
    InvalidRequest
        ``dst`` is a folder, or its folder does not exist.
    NoMigrationPath
        No step leads from the source's tier to ``target``.
    """
    src, dst = Path(src), Path(dst)
    started = time.perf_counter()
    _, records = load_source(src)
    if dst.exists() and (os.path.samefile(src, dst) or dst.resolve() == src.resolve()):
        raise MigrationError(f"{dst}: is the source file; a migration never overwrites its source")
    if dst.exists() and not dst.is_dir() and not overwrite:
        raise MigrationError(f"{dst}: exists; pass --force to replace it (nothing was written)")
    check_output(dst, overwrite=True, what="the migrated .coli_kv file")
    warning = check_damage(src, records, allow=allow_damaged, doing="migrate")
    steps = format_migrations.plan(records.tier, target)
    # Converted rows are sanitized by the conversion (dequantize, then the encoders zero non-finite
    # values as docs/FORMAT.md says: the bytes the reference encoders write). What a conversion copies
    # as stored — every record of a same-tier copy, the indexer rows of any — is sanitized as
    # repair would, so the destination is never damaged.
    copies_damage = not steps or (records.geometry.nic > 0 and not np.isfinite(records.records["index"]).all())
    source = repaired(records) if warning and copies_damage else records
    header = Header(records.geometry, target, records.n)
    write_atomic(dst, header, format_migrations.convert_chunks(source, target, _cumulative(progress)), replace=True)
    seconds = time.perf_counter() - started
    src_bytes = HEADER_BYTES + records.n * records.header.rec_bytes
    return {
        "source": str(src),
        "destination": str(dst),
        "from": records.tier.describe(),
        "to": target.describe(),
        "steps": [step.name for step in steps],
        "lossy": any(step.lossy for step in steps),
        "conversion": format_migrations.conversion(records.tier, target),
        "records": records.n,
        "records_dropped": records_dropped(records) if warning else 0,
        "source_bytes": src_bytes,
        "destination_bytes": dst.stat().st_size,
        "seconds": seconds,
        "mb_per_s": src_bytes / 1e6 / seconds if seconds > 0 else None,
        "warning": warning,
    }
