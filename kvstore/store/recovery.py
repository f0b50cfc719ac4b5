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
- files without an index entry: temporary files of dead writers are removed (and a running
  process's temporary file of a journal nobody holds: the previous journal a migrate kept and could
  not remove), empty unindexed journals (a creation that did not finish) removed, anything else
  moved to ``lost+found``;
- stale sidecars (``sweep_sidecars``) are never damage: a symbolic link where a lock file belongs
  is removed (the link only; nothing is opened through it), and so are the lock files of sessions
  that no longer exist, their journals' included (each unlinked while held, so a waiter locks a
  fresh file);
- a session marked ``damaged`` is looked at again (``recheck_damaged``): when the file its state
  needs is there again, regular, for the same model, and every hashed turn re-hashes, it is
  ``active`` (or ``parked``) again — damage is never "forever" for a cause that went away;
- the usage counter is recounted from the records.

``kvstore verify --repair`` runs the same reconcile on demand and prints what it did.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from kvstore.durable import fsync_dir, move_durably
from kvstore.errors import FormatError, IntegrityError, JournalLocked, PathRefused
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Header
from kvstore.journal import KVFile, open_regular
from kvstore.locks import FileLock, pid_alive
from kvstore.migrations import index as schema
from kvstore.sealed import read_any_header
from kvstore.store.context import StoreContext
from kvstore.store.integrity import Integrity, TurnHasher, complete_end
from kvstore.store.removal import Removal, unlink_quietly
from kvstore.store.values import KEY_PATTERN, Fingerprint, IndexRecord, ModelInfo, geometry_of, tier_of, tier_record

# kvstore.durable.AtomicFile names its temporary files so: the pid tells whether the writer still runs.
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-\d+$")
JOURNAL_LOCK_SUFFIX = ".coli_kv.lock"  # kvstore.journal's writer lock beside each journal
SESSION_LOCK_SUFFIXES = (".write", ".read")  # StoreContext.writing / reading, in locks/


class Recovery:
    """Reconcile the index of one store with its journals and archives."""

    def __init__(self, ctx: StoreContext, removal: Removal):
        self.ctx = ctx
        self._removal = removal
        self._integrity = Integrity(ctx)  # stateless over the context: re-hashes a file that came back
        self._headers: dict[tuple, tuple[bytes, int]] = {}  # a model and tier -> its header, record bytes

    # ------------------------------------------------------------------ one session, before a write
    def match_journal(self, record: IndexRecord, journal: KVFile) -> IndexRecord:
        """Reconcile one session whose journal count differs from the index (under its write lock)."""
        if journal.holds(record["n_records"]):
            return record
        record, _ = self.reconcile_journal(record, journal)
        return record

    def reconcile_journal(self, record: IndexRecord, journal: KVFile) -> tuple[IndexRecord, list[str]]:
        """Settle one active session's index against its open (writable) journal."""
        ctx = self.ctx
        sid = record["id"]
        actions: list[str] = []
        if journal.geometry != geometry_of(record):
            reason = "the journal is for another model: " + "; ".join(journal.geometry.mismatches(geometry_of(record)))
            with ctx.index.write() as txn:
                record = ctx.index.update(txn, sid, state="damaged", problem=reason)
            return record, [f"{sid}: {reason}; marked damaged"]
        if journal.stored_tier != tier_of(record):
            record = self._adopt_tier(record, journal)
            actions.append(
                f"{sid}: the journal was rewritten as {journal.stored_tier.describe()} (an interrupted migrate); index follows it"
            )
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
        elif on_disk > indexed or not journal.holds(indexed):  # holds: sizes a sealed journal's frames too
            if on_disk > indexed:
                actions.append(f"{sid}: rolled back {on_disk - indexed} unacknowledged records")
            else:
                actions.append(f"{sid}: cut a torn tail")
            journal.truncate(indexed)
        size = journal.size_bytes
        if size != record["size_bytes"]:
            with ctx.index.write() as txn:
                record = ctx.index.update(txn, sid, size_bytes=size)
        return record, actions

    def _adopt_tier(self, record: IndexRecord, journal: KVFile) -> IndexRecord:
        """Follow a journal rewritten in another tier: new fingerprint, re-hashed turns, prefixes."""
        ctx = self.ctx
        sid = record["id"]
        tier = journal.stored_tier
        records = journal.load()  # the journal as stored (opened in its own tier), sealed or not
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
            return ctx.index.update(
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
        request settles them). Returns one line per repair made.

        Its cost is one read of the index and one listing of each folder, plus a header read per
        active journal: a session whose files agree with its record (the one file its state names,
        a regular file, its header's model and tier, its count and size) is left as it is without
        taking its locks. Only a session that disagrees — a torn or unacknowledged tail, a missing
        or extra file, an interrupted park, delete or migrate, a damaged or hostile file — is
        settled under its write lock, as before (``_reconcile_locked``); likewise only lock files
        and journals the index does not name are looked at under their locks.
        """
        ctx = self.ctx
        actions: list[str] = []
        with ctx.index.write() as txn:  # one scan, and the counters checked against it, atomically
            purged = ctx.index.purge_dead_reservations(txn)
            records = ctx.index.records(txn)
            recounted = self._recount(txn, records)
        if purged:
            actions.append(f"released {purged} space reservations of writers that no longer run")
        known = {r["id"] for r in records}
        journals, archives = _listing(ctx.dir_fd(ctx.journals)), _listing(ctx.dir_fd(ctx.archives))
        actions.extend(self.sweep_sidecars(known=known, journals=journals))
        for record in records:
            sid = record["id"]
            if self._agrees(record, journals, archives):
                continue
            try:
                with ctx.writing(sid, timeout=0):
                    actions.extend(self._reconcile_locked(sid))
            except JournalLocked:
                continue
            except PathRefused as exc:  # one session's hostile file never keeps the store from opening
                actions.append(f"{sid}: left alone: {exc.reason}")
        actions.extend(self._sweep_orphans(known))
        actions.extend(recounted)
        return actions

    def _agrees(self, record: IndexRecord, journals: dict[str, int], archives: dict[str, int]) -> bool:
        """Whether a session's files agree with its record, looked at without its locks: an active
        session has its journal alone (a regular file), whose header names the record's model and
        tier and whose committed count and size are the record's; a parked one has its archive alone.
        ``journals`` / ``archives``: each folder's entries (:func:`_listing`). Anything else
        (a damaged or deleting session included) is for ``_reconcile_locked`` to settle."""
        sid = record["id"]
        journal, archived = f"{sid}.coli_kv", f"{sid}.coli_kv.zst"
        if record["state"] == "parked":
            return archives.get(archived, -1) >= 0 and journal not in journals
        if record["state"] != "active" or journals.get(journal, -1) < 0 or archived in archives:
            return False
        expected, rec_bytes = self._header_of(record)
        try:
            fd = open_regular(self.ctx.journals / journal, os.O_RDONLY, self.ctx.dir_fd(self.ctx.journals))
        except (OSError, PathRefused):
            return False
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, HEADER_BYTES, 0)
        except OSError:
            return False
        finally:
            os.close(fd)
        # the header of the record's model and tier, byte for byte, but for its count (h6)
        if len(head) != HEADER_BYTES or head[:32] != expected[:32] or head[36:] != expected[36:]:
            return False
        n_records = record["n_records"]
        nrec = int.from_bytes(head[32:36], "little", signed=True)
        held = min(nrec, (size - HEADER_BYTES) // rec_bytes)  # KVFile.holds, from the header
        return held == n_records and size == HEADER_BYTES + n_records * rec_bytes == record["size_bytes"]

    def _header_of(self, record: IndexRecord) -> tuple[bytes, int]:
        """The header bytes (count 0) and record bytes of a record's model and tier (a few distinct ones)."""
        stored = record["tier"]
        form = (*record["geometry"], stored["version"], stored.get("codec"), stored.get("bits"))
        found = self._headers.get(form)
        if found is None:
            header = Header(geometry_of(record), tier_of(record), 0)
            found = self._headers[form] = (header.to_bytes(), header.rec_bytes)
        return found

    def _reconcile_locked(self, sid: str) -> list[str]:
        ctx = self.ctx
        with ctx.index.read() as txn:
            record = ctx.index.get(txn, sid)
        if record is None:
            return []
        state = record["state"]
        try:
            journal_path, archive_path = ctx.journal_path(sid), ctx.archive_path(sid)
        except PathRefused as exc:  # a link where the session's file belongs: never followed
            if state in ("active", "parked"):
                return [self._mark_damaged(sid, exc.reason)]
            return [f"{sid}: left alone: {exc.reason}"] if state == "deleting" else []
        if state == "damaged":
            return self.recheck_damaged(record)
        has_journal, has_archive = journal_path.exists(), archive_path.exists()
        actions: list[str] = []
        if state == "deleting":  # a delete that crashed after hiding the session: finish it
            self._removal.remove_files(sid)
            with ctx.index.write() as txn:
                ctx.index.remove(txn, record)
            return [f"{sid}: finished an interrupted delete"]
        if state == "parked" and not has_archive and has_journal:
            with ctx.index.write() as txn:
                record = ctx.index.update(
                    txn, sid, state="active", problem="the archive was missing; the journal was kept"
                )
            state, actions = "active", [f"{sid}: archive missing, journal kept (session active again)"]
        if state == "active" and not has_journal and has_archive:
            with ctx.index.write() as txn:
                record = ctx.index.update(
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
                journal = KVFile.open(
                    journal_path,
                    writable=True,
                    lock_timeout=0,
                    dir_fd=ctx.dir_fd(ctx.journals),
                    sealing=ctx.sealing(sid),
                )
            except JournalLocked:
                return actions  # an outside tool is writing it; settle next time
            except (FormatError, OSError, IntegrityError) as exc:  # IntegrityError: a sealed frame refused
                if self._sidecar_failed(journal_path, exc):  # the lock, not the journal: no damage
                    return actions + [f"{sid}: left alone: {getattr(exc, 'reason', exc)}"]
                return actions + [self._mark_damaged(sid, f"the journal cannot be read: {getattr(exc, 'reason', exc)}")]
            with journal:
                _, more = self.reconcile_journal(record, journal)
            actions.extend(more)
        return actions

    @staticmethod
    def _sidecar_failed(journal_path: Path, exc: BaseException) -> bool:
        """Whether opening a journal failed on its lock sidecar rather than on the journal itself."""
        sidecar = journal_path.with_name(journal_path.name + ".lock")
        if isinstance(exc, PathRefused):
            sidecar_refused = os.path.islink(sidecar) or (os.path.lexists(sidecar) and not os.path.isfile(sidecar))
            return sidecar_refused and os.path.isfile(journal_path) and not os.path.islink(journal_path)
        return getattr(exc, "filename", None) in (str(sidecar), sidecar.name)  # opened by path or by name (openat)

    # ------------------------------------------------------------------ damaged sessions, again
    def recheck_damaged(self, record: IndexRecord) -> list[str]:
        """Give a damaged session back the state its files show, when they are sound again (its
        write lock held). Returns the action taken, or nothing when it stays damaged.

        The file must be there, a regular file, alone (a journal *and* an archive leave it unknown
        which is the truth), for the session's model, and every hashed turn it holds must re-hash:
        a file that came back is never served on trust.
        """
        ctx = self.ctx
        sid = record["id"]
        journal_path, archive_path = ctx.journal_path(sid), ctx.archive_path(sid)
        has_journal, has_archive = journal_path.is_file(), archive_path.is_file()
        if has_journal == has_archive:
            return []
        with ctx.index.read() as txn:
            turns = ctx.index.turns(txn, sid)
        if has_archive:
            return self._readmit(record, "parked", turns, record["n_records"], journal=None)
        try:
            journal = KVFile.open(
                journal_path, writable=True, lock_timeout=0, dir_fd=ctx.dir_fd(ctx.journals), sealing=ctx.sealing(sid)
            )
        except (FormatError, OSError):  # still unreadable, or its lock busy: stays damaged
            return []
        with journal:
            if journal.geometry != geometry_of(record):
                return []
            return self._readmit(record, "active", turns, min(journal.n_records, record["n_records"]), journal)

    def _readmit(self, record: IndexRecord, state: str, turns: list, stop: int, journal: KVFile | None) -> list[str]:
        ctx = self.ctx
        sid = record["id"]
        candidate: IndexRecord = {**record, "state": state}
        if journal is None or journal.stored_tier == tier_of(record):  # else reconcile adopts the new tier
            _, bad = self._integrity.check_turns(candidate, turns, stop)
            if bad is not None:
                return []
        with ctx.index.write() as txn:
            current = ctx.index.update(txn, sid, state=state, problem=None)
        what = "journal" if journal is not None else "archive"
        actions = [f"{sid}: its {what} is sound again (it was damaged: {record.get('problem')}); {state} again"]
        if journal is not None:
            _, more = self.reconcile_journal(current, journal)
            actions.extend(more)
        return actions

    # ------------------------------------------------------------------ sidecars
    def sweep_sidecars(self, *, known: set[str] | None = None, journals: dict[str, int] | None = None) -> list[str]:
        """Remove lock files that lock nothing; never count them as damage. Returns one line each.

        ``known``: the keys the index held when the caller read it, ``journals``: the journal
        folder's entries (:func:`_listing`); a lock file of a key in ``known``, or a journal's lock beside its
        journal, locks something and is passed over without being locked (None: every one is
        looked at under its locks).

        - a symbolic link where a lock file belongs (``locks/``, ``journals/*.coli_kv.lock``): the
          link goes (its target is neither opened nor touched);
        - ``locks/<key>.write`` / ``.read`` of a session the index does not hold;
        - ``journals/<key>.coli_kv.lock`` whose journal is gone with its session;
        - temporary files of writers that no longer run, in ``locks/`` and the data folder itself.

        A lock file is unlinked only while this process holds it (without waiting: a busy one is
        someone's, and stays), so whoever waits on it finds the name gone and locks a fresh file.
        """
        ctx = self.ctx
        actions: list[str] = []
        stale_sessions: set[str] = set()
        for entry in os.scandir(ctx.locks):
            stem, _, kind = entry.name.rpartition(".")
            if f".{kind}" not in SESSION_LOCK_SUFFIXES or not KEY_PATTERN.fullmatch(stem):
                continue  # evict.lock, temporary files (below), names the store never makes
            if entry.is_symlink():
                actions.append(self._remove_link(ctx.locks, entry.name))
            elif not entry.is_file(follow_symlinks=False):
                actions.append(self._not_a_file(ctx.locks, entry.name))
            else:
                stale_sessions.add(stem)
        for key in sorted(stale_sessions - (known or set())):
            if self._remove_session_locks(key):
                actions.append(f"removed the lock files of {key!r} in locks/: no such session")
        for entry in os.scandir(ctx.journals):
            if not entry.name.endswith(JOURNAL_LOCK_SUFFIX):
                continue
            if entry.is_symlink():
                actions.append(self._remove_link(ctx.journals, entry.name))
            elif not entry.is_file(follow_symlinks=False):
                actions.append(self._not_a_file(ctx.journals, entry.name))
            elif journals is not None and entry.name[: -len(".lock")] in journals:
                continue  # its journal is there: the lock is its writers'
            elif self._remove_journal_lock(ctx.journals / entry.name):
                actions.append(f"removed journals/{entry.name}: the lock of a journal that no longer exists")
        for folder in (ctx.locks, ctx.data_dir):
            for entry in os.scandir(folder):
                temp = TEMP_NAME.match(entry.name)
                if temp is not None and entry.is_file(follow_symlinks=False) and not pid_alive(int(temp["pid"])):
                    os.unlink(entry.path)
                    where = "the data folder" if folder == ctx.data_dir else f"{folder.name}/"
                    actions.append(f"removed {entry.name} in {where}, left by a writer that no longer runs")
        return actions

    @staticmethod
    def _remove_link(folder: Path, name: str) -> str:
        os.unlink(folder / name)  # unlink never follows: the link goes, its target stays as it was
        fsync_dir(folder)
        return f"removed {folder.name}/{name}: a symbolic link where a lock file belongs (its target was not touched)"

    @staticmethod
    def _not_a_file(folder: Path, name: str) -> str:
        """A folder, FIFO, socket or device where a lock file belongs: none can be locked. The name
        goes (an empty folder's too; unlinking a FIFO or device node opens nothing); a folder with
        something in it is left to the operator."""
        path = folder / name
        try:
            if os.path.isdir(path):
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError:
            return f"left {folder.name}/{name} alone: not a regular file, so its session cannot be locked; remove it"
        fsync_dir(folder)
        return f"removed {folder.name}/{name}: not a regular file where a lock file belongs"

    def _remove_session_locks(self, key: str) -> bool:
        """Unlink ``locks/<key>.write`` and ``.read`` of a session the index does not hold."""
        ctx = self.ctx
        paths = [ctx.locks / f"{key}{suffix}" for suffix in SESSION_LOCK_SUFFIXES]
        try:
            folder = ctx.dir_fd(ctx.locks)
            with FileLock(paths[0], timeout=0, dir_fd=folder), FileLock(paths[1], timeout=0, dir_fd=folder):
                with ctx.index.read() as txn:
                    if ctx.index.get(txn, key) is not None:
                        return False
                for path in paths:
                    path.unlink(missing_ok=True)
        except (JournalLocked, OSError):
            return False  # someone holds it (a create in flight), or it changed meanwhile: next time
        return True

    def _remove_journal_lock(self, path: Path) -> bool:
        """Unlink a journal's lock sidecar whose journal does not exist, of a session the index
        does not hold (a parked session keeps its own: unpark writes beside it again)."""
        journal = path.with_name(path.name[: -len(".lock")])
        key = journal.name[: -len(".coli_kv")]

        def gone() -> bool:
            if os.path.lexists(journal) or not KEY_PATTERN.fullmatch(key):
                return False
            with self.ctx.index.read() as txn:
                return self.ctx.index.get(txn, key) is None

        if not gone():
            return False
        try:
            with FileLock(path, timeout=0, dir_fd=self.ctx.dir_fd(self.ctx.journals)):
                if not gone():  # created meanwhile: the lock is its writer's
                    return False
                path.unlink()
        except (JournalLocked, OSError):
            return False
        return True

    def _mark_damaged(self, sid: str, reason: str) -> str:
        with self.ctx.index.write() as txn:
            self.ctx.index.update(txn, sid, state="damaged", problem=reason)
        return f"{sid}: {reason}; marked damaged"

    def _sweep_orphans(self, known: set[str] | None = None) -> list[str]:
        """Files without an index entry: temp files of dead writers, unacknowledged creations
        (``known``: the keys the index held when the caller read it; their files are not orphans)."""
        ctx = self.ctx
        actions: list[str] = []
        for folder, suffix in ((ctx.journals, ".coli_kv"), (ctx.archives, ".coli_kv.zst")):
            for entry in os.scandir(folder):
                temp = TEMP_NAME.match(entry.name)
                if temp is not None:
                    if not pid_alive(int(temp["pid"])):
                        os.unlink(entry.path)
                        actions.append(f"removed {folder.name}/{entry.name}, left by a writer that no longer runs")
                    elif folder == ctx.journals and self._remove_unowned_temp(entry.name, temp["name"]):
                        actions.append(f"removed {folder.name}/{entry.name}: a temporary file no writer holds")
                    continue
                if not entry.name.endswith(suffix):
                    continue
                sid = entry.name[: -len(suffix)]
                if not KEY_PATTERN.fullmatch(sid) or entry.is_symlink() or (known is not None and sid in known):
                    continue
                try:
                    with ctx.writing(sid, timeout=0):
                        with ctx.index.read() as txn:
                            if ctx.index.get(txn, sid) is not None:
                                continue
                        actions.append(self._orphan(folder, entry.name, suffix))
                except (JournalLocked, PathRefused):  # busy, or its lock file is not a file (reported above)
                    continue
        return actions

    def _remove_unowned_temp(self, temp_name: str, journal_name: str) -> bool:
        """Unlink ``journals/<temp_name>``, a temporary file of ``journal_name`` whose writer still
        runs, if nobody is writing it: e.g. the previous journal a migrate kept and then could not
        remove. Every writer of a journal's temporary file (a create, a rewrite, a migrate, a file
        tool) holds the session's write lock or the journal's writer lock; both free means none."""
        ctx = self.ctx
        key = journal_name[: -len(".coli_kv")] if journal_name.endswith(".coli_kv") else ""
        if not KEY_PATTERN.fullmatch(key):
            return False
        sidecar = ctx.journals / f"{journal_name}.lock"
        made = not os.path.lexists(sidecar)
        try:
            with ctx.writing(key, timeout=0):
                with FileLock(sidecar, timeout=0, dir_fd=ctx.dir_fd(ctx.journals)):
                    os.unlink(ctx.journals / temp_name)
                if made and not ctx.index.holds(key):
                    unlink_quietly(sidecar)  # the lock taken just now leaves no sidecar behind
        except (JournalLocked, PathRefused, FileNotFoundError):
            return False  # busy, a lock file that is not one (reported by sweep_sidecars), or gone
        return True

    def _orphan(self, folder: Path, name: str, suffix: str) -> str:
        path = folder / name
        empty = False
        if suffix == ".coli_kv":
            try:
                empty = read_any_header(path).nrec == 0  # plaintext or sealed
            except (FormatError, OSError):
                empty = False
        if empty:
            path.unlink()
            fsync_dir(folder)
            return f"removed {folder.name}/{name}: an empty journal never indexed (a creation that did not finish)"
        target = self.ctx.lost_found / f"{name}.{time.time_ns()}"
        move_durably(path, target)
        return f"moved {folder.name}/{name} to lost+found/{target.name}: it has no index entry"

    def _recount(self, txn, records: list[IndexRecord]) -> list[str]:
        """Set the usage counter and the counts to what ``records`` (every record, read in ``txn``) hold."""
        index = self.ctx.index
        actions = []
        # every record's bytes, a session being deleted's too: its files are there until the delete
        # finishes, and finishing it (Index.remove) takes them off the counter then
        counted = sum(r["size_bytes"] for r in records)
        before = index.usage(txn)
        if counted != before:
            index.set_usage(txn, counted)
            actions.append(f"disk usage recounted: {before} -> {counted} bytes")
        if index.recount(txn, records):
            actions.append("session counts recounted from the index's records")
        return actions


def _listing(folder_fd: int) -> dict[str, int]:
    """What one of the store's folders (its open descriptor) holds, name -> size of a regular file,
    or -1 for anything else (a link, a folder, a FIFO): one listing, no link followed."""
    out = {}
    with os.scandir(folder_fd) as entries:
        for entry in entries:
            try:
                regular = entry.is_file(follow_symlinks=False)
                out[entry.name] = entry.stat(follow_symlinks=False).st_size if regular else -1
            except FileNotFoundError:  # removed while listed
                continue
    return out
