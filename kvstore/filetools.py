"""Inspect, repair and migrate ``.coli_kv`` files: what the CLI and the API's file endpoints run.

Each function returns a plain dict report (JSON-ready) and raises a typed ``KVStoreError`` on bad
input. Rewrites go through ``kvstore.journal`` (atomic, under the writer lock), so a crash at any
instant leaves the old file or the new one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore.errors import MigrationError
from kvstore.formats import coli_kv, fp8, tq
from kvstore.formats.coli_kv import HEADER_BYTES, Header, KVRecords, Tier
from kvstore.journal import AtomicFile, read_whole, write_atomic, write_errors, writer_lock
from kvstore.migrations import formats as format_migrations

Progress = Callable[[int, int], None]


def _load_raw(path: Path) -> tuple[memoryview, KVRecords]:
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = read_whole(fd)
    finally:
        os.close(fd)
    return raw, coli_kv.parse(raw)


def inspect_file(path: str | os.PathLike) -> dict:
    """Everything a user needs to judge a file: header, counts, damage found.

    Parameters
    ----------
    path : a ``.coli_kv`` file (read once, never modified)

    Returns
    -------
    dict
        ``tier`` (its description, canonical name first), ``version``/``codec``/``bits``, the
        geometry, ``nrec`` (the header's count) against ``complete_records`` and ``records_safe``,
        the damage counters (torn tail bytes, bad scales/radii, NaN codes/values), ``problems``
        (one line each) and ``clean``.

    Raises
    ------
    FormatError
        Not a ``.coli_kv`` file (short, bad magic, inconsistent header).
    """
    path = Path(path)
    raw, records = _load_raw(path)
    h, found = records.header, records.problems
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
        "clean": not found.messages(),
    }


def _sanitized(records: KVRecords) -> tuple[np.ndarray, list[str]]:
    """A copy of the safe records with corrupt rows neutralized, and what was changed."""
    fixed = records.records.copy()
    layers = fixed["layers"]
    actions = []
    if records.tier.version == 2:
        for which in ("L", "R"):
            bad = fp8.bad_scales(layers[which + "s"])
            codes = layers[which + "c"]
            nan = fp8.nan_codes(codes)
            if bad.any():
                codes[bad] = 0
                layers[which + "s"][bad] = 1.0
                actions.append(f"made {int(bad.sum())} {which}c rows with a bad scale inert")
            if nan.any():
                codes[nan] = 0
                actions.append(f"zeroed {int(nan.sum())} NaN codes in {which}c rows")
    elif records.tier.version == 3:
        for which in ("L", "R"):
            bad = tq.sanitize_radii(layers[which + "s"])[1]
            if bad.any():
                layers[which + "c"][bad] = 0
                layers[which + "s"][bad] = 0.0
                actions.append(f"made {int(bad.sum())} {which}c rows with a bad radius inert")
    return fixed, actions


def repair_file(path: str | os.PathLike, *, dry_run: bool = False, backup: bool = True) -> dict:
    """Clamp nrec to what is physically there, drop the torn tail, sanitize rows in place.

    The original is kept as ``<name>.bak`` unless ``backup`` is False. Runs under the journal's
    writer lock; the rewrite is atomic.

    Parameters
    ----------
    path : the ``.coli_kv`` file to repair
    dry_run : report the actions, change nothing
    backup : keep the original bytes as ``<name>.bak``

    Returns
    -------
    dict
        ``records`` kept, ``actions`` (one line each; "left ..." lines change nothing), ``changed``,
        ``dry_run`` and ``backup`` (its path, or None).

    Raises
    ------
    FormatError
        Not a ``.coli_kv`` file: nothing is written.
    """
    path = Path(path)
    with writer_lock(path):
        raw, records = _load_raw(path)
        h, found = records.header, records.problems
        actions = []
        if h.nrec != records.n:
            actions.append(f"clamped nrec from {h.nrec} to {records.n} (records physically complete)")
        tail = len(raw) - HEADER_BYTES - records.n * h.rec_bytes
        if tail > 0:
            actions.append(f"dropped {tail} bytes past the last committed record")
        fixed, sanitize_actions = _sanitized(records)
        actions += sanitize_actions
        if found.nan_values:
            actions.append(f"left {found.nan_values} non-finite f32 values in place (v1 rows are stored as written)")
        changes = [a for a in actions if not a.startswith("left ")]
        report = {
            "path": str(path),
            "records": records.n,
            "actions": actions,
            "changed": bool(changes),
            "dry_run": dry_run,
            "backup": None,
        }
        if dry_run or not changes:
            return report
        if backup:
            backup_path = path.with_name(path.name + ".bak")
            with write_errors(f"writing {backup_path.name}", f"{path.name} is unchanged"):
                with AtomicFile(backup_path) as out:
                    out.write(raw)
            report["backup"] = str(backup_path)
        write_atomic(path, h.with_nrec(records.n), [fixed])
    return report


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
    progress: Progress | None = None,
) -> dict:
    """Convert ``src`` into a new file ``dst`` in ``target``; ``src`` is never modified.

    Parameters
    ----------
    src, dst : the file to read and the file to write (atomically)
    target : a file tier (``tiers.get("int4")``, ...)
    overwrite : replace an existing ``dst``
    progress : ``progress(records_done, total)``, called after each converted chunk

    Returns
    -------
    dict
        ``from``/``to`` (tier descriptions), the migration ``steps``, ``lossy``, ``records``, the
        sizes before and after, ``seconds`` and ``mb_per_s``.

    Raises
    ------
    MigrationError
        ``dst`` is ``src`` (or a link to it), or exists without ``overwrite``.
    NoMigrationPath
        No step leads from the source's tier to ``target``.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise MigrationError(f"{src} is not a file")
    if dst.exists() and (os.path.samefile(src, dst) or dst.resolve() == src.resolve()):
        raise MigrationError(f"{dst} is the source file: a migration never overwrites its source")
    if dst.exists() and not overwrite:
        raise MigrationError(f"{dst} exists; pass --force to replace it")
    started = time.perf_counter()
    records = coli_kv.load(src)
    steps = format_migrations.plan(records.tier, target)
    header = Header(records.geometry, target, records.n)
    write_atomic(dst, header, format_migrations.convert_chunks(records, target, _cumulative(progress)), replace=True)
    seconds = time.perf_counter() - started
    src_bytes = HEADER_BYTES + records.n * records.header.rec_bytes
    return {
        "source": str(src),
        "destination": str(dst),
        "from": records.tier.describe(),
        "to": target.describe(),
        "steps": [step.name for step in steps],
        "lossy": any(step.lossy for step in steps),
        "records": records.n,
        "source_bytes": src_bytes,
        "destination_bytes": dst.stat().st_size,
        "seconds": seconds,
        "mb_per_s": src_bytes / 1e6 / seconds if seconds > 0 else None,
    }
