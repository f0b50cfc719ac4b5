"""Recovery: make the index and the files agree again after a crash, a kill or an outside change.

Run on open (``reconcile``, safe while other processes use the store) and, for one session, before
each write (``match_journal``). The index is the commit record; what it settles:

- journal records past the indexed count were never acknowledged: rolled back (a torn tail cut);
- a journal shorter than the index (it lost its tail outside kvstore): the index is clamped to the
  last whole hashed turn the journal still has, and the session's ``problem`` says so;
- a journal rewritten in another tier by an interrupted migrate: the index adopts it (new
  fingerprint, re-hashed turns, prefix blocks);
- park/unpark interrupted: the index's state says which file is the truth, the other one goes; a
  missing file marks the session ``damaged`` with the reason;
- an interrupted delete is finished; space reservations of dead writers are released;
- files without an index entry: temporary files of dead writers are removed, empty unindexed
  journals (a creation that did not finish) removed, anything else moved to ``lost+found``;
- the usage counter is recounted from the records.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from kvstore.errors import FormatError, JournalLocked
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.journal import KVFile, fsync_dir, move_durably
from kvstore.locks import pid_alive
from kvstore.migrations import index as schema
from kvstore.store.context import StoreContext
from kvstore.store.integrity import TurnHasher, complete_end
from kvstore.store.removal import Removal
from kvstore.store.values import ID_PATTERN, Fingerprint, ModelInfo, geometry_of, tier_of, tier_record

# kvstore.journal.AtomicFile names its temporary files so: the pid tells whether the writer still runs.
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-\d+$")


class Recovery:
    """Reconcile the index of one store with its journals and archives."""

    def __init__(self, ctx: StoreContext, removal: Removal):
        self.ctx = ctx
        self._removal = removal

    # ------------------------------------------------------------------ one session, before a write
    def match_journal(self, record: dict, journal: KVFile) -> dict:
        """Reconcile one session whose journal count differs from the index (under its write lock)."""
        expected_size = HEADER_BYTES + record["n_records"] * coli_kv.record_bytes(journal.geometry, journal.tier)
        if journal.n_records == record["n_records"] and os.stat(journal.path).st_size == expected_size:
            return record
        record, _ = self.reconcile_journal(record, journal)
        return record

    def reconcile_journal(self, record: dict, journal: KVFile) -> tuple[dict, list[str]]:
        """Settle one active session's index against its open (writable) journal."""
        ctx = self.ctx
        sid = record["id"]
        actions: list[str] = []
        if journal.geometry != geometry_of(record):
            reason = "the journal is for another model: " + "; ".join(journal.geometry.mismatches(geometry_of(record)))
            with ctx.index.write() as txn:
                record = ctx.update(txn, sid, state="damaged", problem=reason)
            return record, [f"{sid}: {reason}; marked damaged"]
        if journal.stored_tier != tier_of(record):
            record = self._adopt_tier(record, journal)
            actions.append(
                f"{sid}: the journal was rewritten as {journal.stored_tier.describe()} (an interrupted migrate); index follows it"
            )
        rec_bytes = coli_kv.record_bytes(journal.geometry, journal.stored_tier)
        on_disk = journal.n_records
        indexed = record["n_records"]
        if on_disk < indexed:
            with ctx.index.read() as txn:
                turns = ctx.index.turns(txn, sid)
            keep = max((t.end for t in turns if t.end <= on_disk), default=0)
            why = f"the journal holds {on_disk} records, the index {indexed}: kept the {keep} covered by whole turns"
            record = self._removal.cut(
                record, journal, keep, complete=False, watermark=complete_end(turns, keep, record), problem=why
            )
            actions.append(f"{sid}: {why}")
        elif on_disk > indexed or os.stat(journal.path).st_size != HEADER_BYTES + indexed * rec_bytes:
            if on_disk > indexed:
                actions.append(f"{sid}: rolled back {on_disk - indexed} unacknowledged records")
            else:
                actions.append(f"{sid}: cut a torn tail")
            journal.truncate(indexed)
        size = os.stat(journal.path).st_size
        if size != record["size_bytes"]:
            with ctx.index.write() as txn:
                record = ctx.update(txn, sid, size_bytes=size)
        return record, actions

    def _adopt_tier(self, record: dict, journal: KVFile) -> dict:
        """Follow a journal rewritten in another tier: new fingerprint, re-hashed turns, prefixes."""
        ctx = self.ctx
        sid = record["id"]
        tier = journal.stored_tier
        records = coli_kv.load(journal.path)
        n = min(records.n, record["n_records"])
        with ctx.index.read() as txn:
            turns = [t for t in ctx.index.turns(txn, sid) if t.end <= n]
        hasher = TurnHasher(turns, coli_kv.record_bytes(journal.geometry, tier))
        for _ in hasher.wrap(iter([records.records[:n]])):
            pass
        key = Fingerprint(ModelInfo.from_dict(record["model"]), journal.geometry, tier).key()
        wm = min(record["watermark"], n)
        hashes = schema.chain_hashes(schema.chain_seed(record["owner"], key), records.tokens[:wm])
        with ctx.index.write() as txn:
            ctx.index.drop_turns_after(txn, sid, -1)
            for turn in hasher.turns():
                ctx.index.put_turn(txn, sid, turn)
            ctx.index.drop_prefix_blocks_from(txn, sid, 0)
            ctx.index.put_prefix_blocks(txn, sid, 0, hashes)
            return ctx.update(
                txn,
                sid,
                tier=tier_record(tier),
                fingerprint=key,
                prefix_blocks=len(hashes),
                problem=f"adopted a journal rewritten as {tier.describe()}",
            )

    # ------------------------------------------------------------------ the whole store, on open
    def reconcile(self) -> list[str]:
        """Repair the index from the journals; sessions another request holds are skipped (that
        request settles them). Returns one line per repair made."""
        ctx = self.ctx
        actions: list[str] = []
        with ctx.index.write() as txn:
            purged = ctx.index.purge_dead_reservations(txn)
        if purged:
            actions.append(f"released {purged} space reservations of writers that no longer run")
        with ctx.index.read() as txn:
            ids = [r["id"] for r in ctx.index.records(txn)]
        for sid in ids:
            try:
                with ctx.writing(sid, timeout=0):
                    actions.extend(self._reconcile_locked(sid))
            except JournalLocked:
                continue
        actions.extend(self._sweep_orphans())
        actions.extend(self._recount_usage())
        return actions

    def _reconcile_locked(self, sid: str) -> list[str]:
        ctx = self.ctx
        with ctx.index.read() as txn:
            record = ctx.index.get(txn, sid)
        if record is None:
            return []
        journal_path, archive_path = ctx.journal_path(sid), ctx.archive_path(sid)
        has_journal, has_archive = journal_path.exists(), archive_path.exists()
        state = record["state"]
        actions: list[str] = []
        if state == "deleting":  # a delete that crashed after hiding the session: finish it
            self._removal.remove_files(sid)
            with ctx.index.write() as txn:
                ctx.index.remove(txn, record)
            return [f"{sid}: finished an interrupted delete"]
        if state == "parked" and not has_archive and has_journal:
            with ctx.index.write() as txn:
                record = ctx.update(txn, sid, state="active", problem="the archive was missing; the journal was kept")
            state, actions = "active", [f"{sid}: archive missing, journal kept (session active again)"]
        if state == "active" and not has_journal and has_archive:
            with ctx.index.write() as txn:
                record = ctx.update(
                    txn,
                    sid,
                    state="parked",
                    size_bytes=os.stat(archive_path).st_size,
                    problem="the journal was missing; the archive was kept",
                )
            return [f"{sid}: journal missing, archive kept (session parked)"]
        if state == "parked":
            if has_journal:  # an unpark that crashed before its commit (or a park after it)
                journal_path.unlink()
                fsync_dir(ctx.journals)
                actions.append(f"{sid}: removed a journal left by an interrupted park/unpark")
            if not has_archive:
                return actions + [self._mark_damaged(sid, "the archive is missing")]
            return actions
        if state == "active":
            if has_archive:  # a park that crashed before its commit
                archive_path.unlink()
                fsync_dir(ctx.archives)
                actions.append(f"{sid}: removed an archive left by an interrupted park")
            if not has_journal:
                return actions + [self._mark_damaged(sid, "the journal is missing")]
            try:
                journal = KVFile.open(journal_path, writable=True, lock_timeout=0)
            except JournalLocked:
                return actions  # an outside tool is writing it; settle next time
            except (FormatError, OSError) as exc:
                return actions + [self._mark_damaged(sid, f"the journal cannot be read: {getattr(exc, 'reason', exc)}")]
            with journal:
                _, more = self.reconcile_journal(record, journal)
            actions.extend(more)
        return actions

    def _mark_damaged(self, sid: str, reason: str) -> str:
        with self.ctx.index.write() as txn:
            self.ctx.update(txn, sid, state="damaged", problem=reason)
        return f"{sid}: {reason}; marked damaged"

    def _sweep_orphans(self) -> list[str]:
        """Files without an index entry: temp files of dead writers, unacknowledged creations."""
        ctx = self.ctx
        actions: list[str] = []
        for folder, suffix in ((ctx.journals, ".coli_kv"), (ctx.archives, ".coli_kv.zst")):
            for entry in os.scandir(folder):
                temp = TEMP_NAME.match(entry.name)
                if temp is not None:
                    if not pid_alive(int(temp["pid"])):
                        os.unlink(entry.path)
                        actions.append(f"removed {folder.name}/{entry.name}, left by a writer that no longer runs")
                    continue
                if not entry.name.endswith(suffix):
                    continue
                sid = entry.name[: -len(suffix)]
                if not ID_PATTERN.fullmatch(sid) or entry.is_symlink():
                    continue
                try:
                    with ctx.writing(sid, timeout=0):
                        with ctx.index.read() as txn:
                            if ctx.index.get(txn, sid) is not None:
                                continue
                        actions.append(self._orphan(folder, entry.name, suffix))
                except JournalLocked:
                    continue
        return actions

    def _orphan(self, folder: Path, name: str, suffix: str) -> str:
        path = folder / name
        empty = False
        if suffix == ".coli_kv":
            try:
                empty = coli_kv.read_header(path)[0].nrec == 0
            except (FormatError, OSError):
                empty = False
        if empty:
            path.unlink()
            fsync_dir(folder)
            return f"removed {folder.name}/{name}: an empty journal never indexed (a creation that did not finish)"
        target = self.ctx.lost_found / f"{name}.{time.time_ns()}"
        move_durably(path, target)
        return f"moved {folder.name}/{name} to lost+found/{target.name}: it has no index entry"

    def _recount_usage(self) -> list[str]:
        index = self.ctx.index
        with index.write() as txn:
            records = [r for r in index.records(txn) if r["state"] != "deleting"]
            counted = sum(r["size_bytes"] for r in records)
            if counted != index.usage(txn):
                before = index.usage(txn)
                index.set_usage(txn, counted)
                return [f"disk usage recounted: {before} -> {counted} bytes"]
        return []
