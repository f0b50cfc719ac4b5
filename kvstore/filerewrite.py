"""Rewrite ``.coli_kv`` files a user names: ``repair`` (clamp the count, drop a torn tail,
sanitize rows in place) and ``migrate`` (into another tier). The reading, judging and damage rules
are :mod:`kvstore.filetools`'s; the writes go through ``kvstore.journal`` (atomic, under the file's
writer lock, a ``.bak`` first for a damaged file), so a crash at any instant leaves the old file or
the new one. Each returns a plain dict report and raises a typed ``KVStoreError``.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from kvstore.durable import write_atomic
from kvstore.errors import MigrationError
from kvstore.filetools import (
    Progress,
    _leads_to,
    _sanitized,
    check_damage,
    check_output,
    keep_backup,
    load_source,
    naming,
    real_target,
    records_dropped,
    repaired,
)
from kvstore.formats.coli_kv import HEADER_BYTES, Header, KVRecords, Tier
from kvstore.journal import writer_lock
from kvstore.migrations import formats as format_migrations

__all__ = ["migrate_file", "repair_file"]


def repair_file(
    path: str | os.PathLike, *, dry_run: bool = False, backup: bool = True, progress: Progress | None = None
) -> dict:
    """Clamp nrec to what is physically there, drop the torn tail, sanitize rows in place.

    Sanitizing stores what a reader already sees: rows with a bad fp8 scale or TQ radius become
    inert (zeros), fp8 NaN codes and non-finite f32 values become 0. The repaired file is clean.

    The original is kept as ``<name>.bak`` (``.bak.1`` ... when older backups exist) unless
    ``backup`` is False. The file is read and judged first, without the lock (a file that cannot be
    repaired leaves nothing behind, not even a lock sidecar); the repair itself runs under the
    journal's writer lock and the rewrite is atomic. A ``path`` that is a symbolic link repairs the
    file it leads to, in that file's folder (its backup and lock beside it); the link stays.

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
        ``dry_run``, ``backup`` (its path, or None) and ``file`` (the file repaired: ``path`` with
        its links followed).

    Raises
    ------
    FileUnreadable, FormatError
        Not a readable ``.coli_kv`` file: nothing is written.
    """
    target = real_target(path)
    raw, records = load_source(target)  # refused here leaves no trace
    report = _repair_plan(path, target, raw, records, dry_run)
    if dry_run or not report["changed"]:
        return report
    with naming(path), writer_lock(target):
        raw, records = load_source(target)  # again, under the lock: what is rewritten is what was judged
        report = _repair_plan(path, target, raw, records, dry_run)
        if not report["changed"]:
            return report
        if backup:
            report["backup"] = str(keep_backup(target, raw))
        fixed, _ = _sanitized(records)
        write_atomic(target, records.header.with_nrec(records.n), _in_pieces(fixed, progress))
    return report


def _in_pieces(records: np.ndarray, progress: Progress | None) -> Iterator[np.ndarray]:
    """``records`` as views of about 4 MiB, calling ``progress(done, total)`` after each is written."""
    total = records.shape[0]
    step = total if progress is None else max(1, (4 << 20) // max(records.dtype.itemsize, 1))
    for start in range(0, total, max(step, 1)):
        yield records[start : start + step]
        if progress is not None:
            progress(min(start + step, total), total)


def _repair_plan(path: str | os.PathLike, target: Path, raw: memoryview, records: KVRecords, dry_run: bool) -> dict:
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
        "file": str(target),
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
    src, dst : the file to read and the file to write (atomically); a ``dst`` that is a symbolic
        link writes the file it leads to (created, or replaced with ``overwrite``, in its folder)
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
    JournalLocked
        ``dst`` exists and a writer kept its journal lock for the lock timeout: a file is replaced
        under its writer lock, so a journal being appended to is never replaced under its writer.
    """
    src, dst = Path(src), Path(dst)
    started = time.perf_counter()
    _, records = load_source(src)
    out = real_target(dst)
    via = _leads_to(dst, out)
    if out.exists() and (os.path.samefile(src, out) or out == real_target(src)):
        raise MigrationError(f"{dst}{via}: is the source file; a migration never overwrites its source")
    if out.exists() and not out.is_dir() and not overwrite:
        raise MigrationError(f"{dst}{via}: exists; pass --force to replace it (nothing was written)")
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
    chunks = format_migrations.convert_chunks(source, target, _cumulative(progress))
    # A file replaced (--force) may be a journal a writer is appending to: replace it under its lock.
    with writer_lock(out) if out.exists() else contextlib.nullcontext():
        write_atomic(out, header, chunks, replace=True)
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
        "destination_bytes": out.stat().st_size,
        "seconds": seconds,
        "mb_per_s": src_bytes / 1e6 / seconds if seconds > 0 else None,
        "warning": warning,
    }
