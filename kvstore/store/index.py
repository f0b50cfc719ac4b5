# Over 700 lines: one LMDB environment and the records of its named databases; every write keeps the derived databases (owner, LRU, created, counts, expiry) in step inside the same transaction, so they stay in one class.
"""The embedded backend's session index: an LMDB environment with one named database per concern.

The layout and its versions are defined in ``kvstore.migrations.index``; this module opens the
environment, upgrades it, and offers the reads and writes the store composes inside its own
transactions. Every transaction is a ``with`` block; values come back as ``bytes`` (the
environment is never asked for buffers), so nothing outlives its transaction.

What a record's state means to every reader is here too (:func:`visible`, :func:`refuse_damaged`),
beside the reads that return records (:meth:`Index.current`: one session's visible record).

LMDB serializes write transactions across threads and processes, and a commit is durable when it
returns (``sync=True``): the store uses that single writer lock for disk-space reservations too.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Iterator, NamedTuple, TypeGuard, cast

import lmdb
import numpy as np

from kvstore.errors import (
    IndexFull,
    IndexIOError,
    IndexSchemaError,
    KVStoreError,
    PathRefused,
    SessionDamaged,
    SessionNotFound,
)
from kvstore.locks import pid_alive
from kvstore.migrations import index as schema
from kvstore.migrations.index import (
    COUNT_OWNER_STATE,
    COUNT_OWNER_TIER,
    COUNT_STATE,
    COUNT_TIER,
    DB_BY_CREATED,
    DB_BY_OWNER,
    DB_COUNTS,
    DB_CREATED,
    DB_EXPIRY,
    DB_LRU,
    DB_META,
    DB_OWNER_TTL,
    DB_PREFIX,
    DB_PREFIX_OF,
    DB_RESERVATIONS,
    DB_SESSIONS,
    DB_TURNS,
)
from kvstore.store.values import STATES, IndexRecord, expired, expires_ns

DEFAULT_MAP_SIZE = 1 << 30  # a sparse file: the map only reserves address space
_LMDB_FILES = ("data.mdb", "lock.mdb")
_LOW_DISK_BYTES = 16 << 20  # below this, an LMDB write failure is taken for a full disk
_ALL_DBS = schema.DATABASES_BY_VERSION[schema.CURRENT_VERSION]

# LMDB must not be opened twice by one process: stores on the same folder share one environment.
_ENVIRONMENTS: dict[str, list] = {}
_ENVIRONMENTS_LOCK = threading.Lock()


def visible(record: IndexRecord | None, owner: str | None) -> TypeGuard[IndexRecord]:
    """Whether ``owner`` (None: anyone) may see ``record``: a session being deleted is gone, and so
    is one whose time-to-live ran out, whether or not the sweep (``Maintenance.expire``) removed it
    yet, so expiry is exact to every caller however late the sweep runs."""
    return (
        record is not None
        and record["state"] != "deleting"
        and (owner is None or record["owner"] == owner)
        and not expired(record, time.time_ns())
    )


def refuse_damaged(record: IndexRecord) -> None:
    """Raise :class:`SessionDamaged` (with the recorded problem) for a session marked damaged."""
    if record["state"] == "damaged":
        raise SessionDamaged(f"session {schema.public_id(record['id'])!r} is damaged: {record.get('problem')}")


def lmdb_files(folder: Path) -> dict[str, tuple[int, int]]:
    """Check LMDB's two files in ``folder`` before LMDB opens them; ``{name: (device, inode)}``.

    A missing file is created here (empty, 0600, never through a link: LMDB starts a new
    environment in an empty file); one that exists must be a regular file, not a symbolic link.

    Raises
    ------
    PathRefused : a file is a symbolic link (dangling or a loop included) or not a regular file
    """
    found = {}
    for name in _LMDB_FILES:
        path = folder / name
        try:
            status = os.lstat(path)
        except FileNotFoundError:
            try:  # O_EXCL never follows a link, not even a dangling one
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            except FileExistsError:
                pass  # another process opening the store made it meanwhile: check what is there
            status = os.lstat(path)
        if stat.S_ISLNK(status.st_mode):
            raise PathRefused(
                f"{folder.name}/{name} is a symbolic link; the index's files must be regular files in {folder} "
                f"(nothing was opened through it: remove the link)"
            )
        if not stat.S_ISREG(status.st_mode):
            raise PathRefused(f"{folder.name}/{name} is not a regular file; the index cannot use it")
        found[name] = (status.st_dev, status.st_ino)
    return found


def _free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the disk holding ``folder`` (None: unknown)."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


_TIER_NAMES: dict[tuple, str] = {}  # a record's tier form -> its name (a few distinct forms in a store)


def _counted(record: IndexRecord | None) -> tuple[str, str, str, int] | None:
    """What a visible record adds to the counts: owner, state, tier name, bytes."""
    if record is None:
        return None
    stored = record["tier"]
    form = (stored["version"], stored.get("codec"), stored.get("bits"))
    name = _TIER_NAMES.get(form)
    if name is None:
        name = _TIER_NAMES[form] = schema.tier_name(stored)
    return record["owner"], record["state"], name, int(record["size_bytes"])


class Turn(NamedTuple):
    """One appended run of records ``[start, end)`` and the blake2b-256 of their bytes."""

    start: int
    end: int
    complete: bool
    digest: bytes


class _Context:
    """The ``MigrationContext`` the schema steps run with."""

    def __init__(self, index: "Index", txn, tokens_of, move_files):
        self.txn = txn
        self._index = index
        self._tokens_of = tokens_of
        self._move_files = move_files

    def db(self, name: bytes):
        return self._index._db(name, self.txn)

    def tokens_of(self, record, n_records):
        return self._tokens_of(record, n_records)

    def move_files(self, old_key, new_key):
        if self._move_files is None:
            raise IndexSchemaError("this index's upgrade renames session files: open it through a SessionStore")
        self._move_files(old_key, new_key)


class Index:
    """The LMDB environment under ``path`` (a folder, created 0700).

    Parameters
    ----------
    path : the index folder
    map_size : bytes of address space LMDB may use (the upper bound of the index's size)
    tokens_of : ``(record, n_records) -> int32 array | None``, used by schema upgrades that need
        a session's tokens
    move_files : ``(old_key, new_key) -> None``, used by schema upgrades that rename session files
    """

    def __init__(
        self,
        path: Path,
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        tokens_of: Callable | None = None,
        move_files: Callable[[str, str], None] | None = None,
        progress=None,
    ):
        self.path = Path(path)
        self._key = str(self.path.resolve())
        with _ENVIRONMENTS_LOCK:
            shared = _ENVIRONMENTS.get(self._key)
            if shared is None:
                self.path.mkdir(mode=0o700, exist_ok=True)
                # LMDB opens its files itself, following links and creating what is missing: it
                # only ever gets files checked (or made) here, and they are checked again after.
                made = lmdb_files(self.path)
                try:
                    env = lmdb.open(
                        str(self.path),
                        map_size=map_size,
                        max_dbs=schema.MAX_DBS,
                        subdir=True,
                        mode=0o600,
                        sync=True,
                        metasync=True,
                        max_readers=512,
                    )
                except lmdb.Error as exc:
                    raise IndexIOError(f"the session index in {self.path} cannot be opened (LMDB: {exc})") from None
                try:
                    if lmdb_files(self.path) != made:
                        raise PathRefused(
                            f"the files in {self.path} were replaced while the index opened; nothing was written"
                        )
                except BaseException:
                    env.close()
                    raise
                shared = [env, 0, {}]
                _ENVIRONMENTS[self._key] = shared
            shared[1] += 1
        self.env: lmdb.Environment = shared[0]
        self._handles: dict[bytes, Any] = shared[2]
        self._closed = False
        try:
            self._upgrade(tokens_of, move_files, progress)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _ENVIRONMENTS_LOCK:
            shared = _ENVIRONMENTS.get(self._key)
            if shared is None:
                return
            shared[1] -= 1
            if shared[1] == 0:
                del _ENVIRONMENTS[self._key]
                shared[0].close()

    def _db(self, name: bytes, txn=None):
        handle = self._handles.get(name)
        if handle is None:
            handle = self.env.open_db(name, txn=txn, create=True)
            self._handles[name] = handle
        return handle

    def read(self):
        """A read-only transaction (use in ``with``)."""
        return self.env.begin(write=False)

    @contextlib.contextmanager
    def write(self) -> Iterator[Any]:
        """A write transaction, committed when the block exits cleanly (durable on return).

        Raises
        ------
        IndexFull : the map or the disk holding the index is full; the transaction was rolled back
        IndexIOError : LMDB failed otherwise (an I/O error); the transaction was rolled back
        """
        try:
            with self.env.begin(write=True) as txn:
                yield txn
        except lmdb.Error as exc:
            raise self._write_failure(exc) from None

    def _write_failure(self, exc: lmdb.Error) -> KVStoreError:
        """The typed error for an LMDB failure inside a write transaction (which LMDB rolled back)."""
        if isinstance(exc, lmdb.MapFullError):
            return IndexFull(
                f"the session index is full (its map holds {self.env.info()['map_size']} bytes); nothing was "
                f"changed. Reopen the store with a larger map_size (kvstore serve --index-size)"
            )
        free = _free_bytes(self.path)
        # LMDB reports a disk that ran out while it wrote its pages as EIO, not ENOSPC: the free
        # space left on the index's disk tells the two apart.
        if isinstance(exc, lmdb.DiskError) or (free is not None and free < _LOW_DISK_BYTES):
            return IndexFull(
                f"the disk holding the session index ({self.path}) is full ({free} bytes free; LMDB: {exc}); "
                f"nothing was changed. Free space on it, then retry"
            )
        return IndexIOError(f"writing the session index failed (LMDB: {exc}); nothing was changed. Check the disk")

    def version(self) -> int:
        """The schema version the index is at."""
        with self.read() as txn:
            stored = txn.get(schema.SCHEMA_KEY, db=self._db(DB_META))
        if stored is None:
            raise IndexSchemaError("the index records no schema version")
        return int(stored)

    def _upgrade(self, tokens_of, move_files, progress) -> None:
        with self.write() as txn:
            meta = self._db(DB_META, txn)
            stored = txn.get(schema.SCHEMA_KEY, db=meta)
            if stored is None:  # a new index: create everything at the current version
                for name in _ALL_DBS:
                    self._db(name, txn)
                txn.put(schema.SCHEMA_KEY, str(schema.CURRENT_VERSION).encode(), db=meta)
                txn.put(schema.PREFIX_BLOCK_KEY, str(schema.PREFIX_BLOCK_TOKENS).encode(), db=meta)
                txn.put(schema.USAGE_KEY, b"0", db=meta)
                return
            try:
                current = int(stored)
            except ValueError:
                raise IndexSchemaError(f"the index's schema version {stored!r} is not a number") from None
        steps = schema.plan(current)
        for done, step in enumerate(steps, 1):
            with self.write() as txn:  # one step + its version bump commit together
                if int(txn.get(schema.SCHEMA_KEY, db=self._db(DB_META, txn))) != step.source:
                    continue  # another process upgraded this step meanwhile
                step.apply(_Context(self, txn, tokens_of, move_files))
                txn.put(schema.SCHEMA_KEY, str(step.target).encode(), db=self._db(DB_META, txn))
            if progress is not None:
                progress(done, len(steps))
        with self.write() as txn:
            for name in _ALL_DBS:
                self._db(name, txn)
            stored_block = txn.get(schema.PREFIX_BLOCK_KEY, db=self._db(DB_META, txn))
            if stored_block is not None and int(stored_block) != schema.PREFIX_BLOCK_TOKENS:
                raise IndexSchemaError(
                    f"the index hashes prefixes in blocks of {int(stored_block)} tokens, this kvstore in "
                    f"{schema.PREFIX_BLOCK_TOKENS}"
                )
            if txn.get(schema.USAGE_KEY, db=self._db(DB_META, txn)) is None:
                txn.put(schema.USAGE_KEY, b"0", db=self._db(DB_META, txn))

    # ------------------------------------------------------------------ session records
    def get(self, txn, session_id: str) -> IndexRecord | None:
        value = txn.get(schema.session_key(session_id), db=self._db(DB_SESSIONS))
        return cast(IndexRecord, schema.decode_record(value)) if value is not None else None

    def current(self, session_id: str, owner: str | None = None) -> IndexRecord:
        """The visible record of the session keyed ``session_id`` now (one read; SessionNotFound
        when it is missing, being deleted, or another owner's)."""
        with self.read() as txn:
            record = self.get(txn, session_id)
        if not visible(record, owner):
            raise SessionNotFound(f"no session {schema.public_id(session_id)!r}")
        return record

    def holds(self, session_id: str) -> bool:
        """Whether the index holds an entry for ``session_id`` (in any state)."""
        with self.read() as txn:
            return self.get(txn, session_id) is not None

    def update(self, txn, session_id: str, **changes: Any) -> IndexRecord:
        """Re-read a record inside ``txn`` and apply ``changes`` (readers update last_used concurrently)."""
        current = self.get(txn, session_id)
        if current is None:
            raise SessionNotFound(f"no session {session_id!r}")
        updated = cast(IndexRecord, {**current, **changes})
        self.put(txn, updated, current)
        return updated

    def touch(self, session_id: str) -> None:
        """Record a use of the session (its place in the LRU order).

        Best effort: a read is not refused because a full or failing index cannot move the session
        up the eviction order (the read itself needed no index write).
        """
        now_ns = time.time_ns()
        try:
            with self.write() as txn:
                record = self.get(txn, session_id)
                # an expired session is never brought back by a use (a reader that opened just before)
                if record is not None and record["state"] != "deleting" and not expired(record, now_ns):
                    self.update(txn, session_id, last_used=now_ns / 1e9, last_used_ns=now_ns)
        except (IndexFull, IndexIOError):
            pass

    def put(self, txn, record: IndexRecord, previous: IndexRecord | None = None) -> None:
        """Write ``record``; keeps the owner, LRU, listing and expiry indexes, the counts and the
        usage counter in step (``previous``: the record it replaces, None for a new one).

        ``record["expires_ns"]`` is set here (in ``record`` itself) from its last use and the TTL in
        force: its own ``ttl_s``, else its owner's (:meth:`owner_ttl`), so every write that moves
        ``last_used_ns`` (an append, a resume's touch) pushes the expiry back.
        """
        sid = record["id"]
        record["expires_ns"] = expires_ns(
            record["last_used_ns"], record.get("ttl_s"), self.owner_ttl(txn, record["owner"])
        )
        txn.put(schema.session_key(sid), schema.encode_record(dict(record)), db=self._db(DB_SESSIONS))
        visible = record["state"] != "deleting"
        was_visible = previous if previous is not None and previous["state"] != "deleting" else None
        self._expiry(txn, sid, record["expires_ns"] if visible else None, was_visible)
        if was_visible is not None and (not visible or was_visible["last_used_ns"] != record["last_used_ns"]):
            txn.delete(schema.lru_key(was_visible["last_used_ns"], sid), db=self._db(DB_LRU))
        if visible:
            txn.put(schema.lru_key(record["last_used_ns"], sid), b"", db=self._db(DB_LRU))
            txn.put(schema.owner_key(record["owner"], sid), b"", db=self._db(DB_BY_OWNER))
        elif was_visible is not None:
            txn.delete(schema.owner_key(was_visible["owner"], sid), db=self._db(DB_BY_OWNER))
        self._list(txn, sid, record if visible else None, was_visible)
        self._count(txn, record if visible else None, was_visible)
        delta = record["size_bytes"] - (previous["size_bytes"] if previous is not None else 0)
        if delta:
            self.add_usage(txn, delta)

    def _expiry(self, txn, sid: str, when: int | None, before: IndexRecord | None) -> None:
        """Keep the session's ``expiry`` entry at ``when`` (None: it has none)."""
        old = before.get("expires_ns") if before is not None else None
        if old == when:
            return
        if old is not None:
            txn.delete(schema.expiry_key(old, sid), db=self._db(DB_EXPIRY))
        if when is not None:
            txn.put(schema.expiry_key(when, sid), b"", db=self._db(DB_EXPIRY))

    # ------------------------------------------------------------------ expiry
    def owner_ttl(self, txn, owner: str) -> float | None:
        """``owner``'s default time-to-live in seconds (None: none)."""
        stored = txn.get(owner.encode(), db=self._db(DB_OWNER_TTL))
        return None if stored is None else schema.unpack_u64(bytes(stored)) / 1e9

    def set_owner_ttl(self, txn, owner: str, ttl_s: float | None) -> int:
        """Set (None: drop) ``owner``'s default time-to-live, and move the expiry of each of the
        owner's sessions without a TTL of its own to match (one ``by_owner`` range, in ``txn``);
        returns how many sessions it moved. A session expired already stays expired."""
        key = owner.encode()
        if ttl_s is None:
            txn.delete(key, db=self._db(DB_OWNER_TTL))
        else:
            txn.put(key, schema.pack_u64(int(round(ttl_s * 1e9))), db=self._db(DB_OWNER_TTL))
        moved, now_ns = 0, time.time_ns()
        for sid in self.owner_sessions(txn, owner):
            record = self.get(txn, sid)
            # an expired session stays expired (gone to every caller): never brought back by a longer TTL
            if visible(record, None) and record.get("ttl_s") is None and not expired(record, now_ns):
                self.put(txn, cast(IndexRecord, dict(record)), record)
                moved += 1
        return moved

    def expired_keys(self, txn, now_ns: int, limit: int) -> list[str]:
        """At most ``limit`` keys of sessions expired at ``now_ns``, soonest expired first: the
        front of the ``expiry`` range, read no further than ``now_ns`` (never every record)."""
        out: list[str] = []
        with txn.cursor(db=self._db(DB_EXPIRY)) as cursor:
            if not cursor.first():
                return out
            for key in cursor.iternext(keys=True, values=False):
                when, sid = schema.expiry_entry(bytes(key))
                if when > now_ns or len(out) >= limit:
                    break
                out.append(sid)
        return out

    def _list(self, txn, sid: str, now: IndexRecord | None, before: IndexRecord | None) -> None:
        """Keep the session's two listing entries (by owner, and store-wide) where its creation puts it."""
        old = (before["owner"], schema.created_ns(before)) if before is not None else None
        new = (now["owner"], schema.created_ns(now)) if now is not None else None
        if old == new:
            return  # most writes (appends, touches) move nothing
        by_created, created = self._db(DB_BY_CREATED), self._db(DB_CREATED)
        if old is not None:
            txn.delete(schema.listing_key(old[0], old[1], sid), db=by_created)
            txn.delete(schema.listing_key(None, old[1], sid), db=created)
        if new is not None:
            txn.put(schema.listing_key(new[0], new[1], sid), b"", db=by_created)
            txn.put(schema.listing_key(None, new[1], sid), b"", db=created)

    def _count(self, txn, now: IndexRecord | None, before: IndexRecord | None) -> None:
        """Move the session's contribution to the counts from what ``before`` held to what ``now`` holds."""
        old, new = _counted(before), _counted(now)
        if old == new:
            return  # a touch, or an append that did not change the size
        counts = self._db(DB_COUNTS)
        for part, sign in ((old, -1), (new, 1)):
            if part is None:
                continue
            owner, state, tier, size = part
            for key in (
                schema.count_key(COUNT_STATE, state),
                schema.count_key(COUNT_TIER, tier),
                schema.count_key(COUNT_OWNER_STATE, owner, state),
                schema.count_key(COUNT_OWNER_TIER, owner, tier),
            ):
                sessions, nbytes = schema.unpack_count(txn.get(key, db=counts))
                sessions, nbytes = sessions + sign, nbytes + sign * size
                if sessions == 0 and nbytes == 0:
                    txn.delete(key, db=counts)  # an owner who has gone leaves no entry behind
                else:
                    txn.put(key, schema.pack_count(sessions, nbytes), db=counts)

    def remove(self, txn, record: IndexRecord) -> None:
        """Drop a session and every entry that belongs to it."""
        sid = record["id"]
        self.put(txn, cast(IndexRecord, {**record, "state": "deleting", "size_bytes": 0}), record)
        self.drop_turns_after(txn, sid, -1)
        self.drop_prefix_blocks_from(txn, sid, 0)
        txn.delete(schema.session_key(sid), db=self._db(DB_SESSIONS))

    def records(self, txn) -> list[IndexRecord]:
        with txn.cursor(db=self._db(DB_SESSIONS)) as cursor:
            return [cast(IndexRecord, schema.decode_record(value)) for _, value in cursor]

    def listed(self, txn, owner: str | None, after: tuple[int, str] | None = None) -> Generator[str, None, None]:
        """Visible sessions' keys (``owner``'s, or every owner's), oldest first (``(created_ns,
        key)``), from just after ``after``: a cursor range scan, read as the caller goes."""
        prefix = owner.encode() + schema.SEP if owner is not None else b""
        start = prefix if after is None else schema.listing_key(owner, *after)
        with txn.cursor(db=self._db(DB_BY_CREATED if owner is not None else DB_CREATED)) as cursor:
            if not cursor.set_range(start):
                return
            for key in cursor.iternext(keys=True, values=False):
                if not key.startswith(prefix):
                    return
                if after is not None and key == start:
                    continue  # the last session of the page before
                yield schema.listing_session(bytes(key), owner)

    def counts(self, txn, owner: str | None = None) -> dict[str, dict[str, tuple[int, int]]]:
        """``{"state": {state: (sessions, bytes)}, "tier": {tier name: (sessions, bytes)}}`` of
        ``owner``'s sessions, or of every owner's: a few keys of ``counts``, never the records."""
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for kind, name in (
            (COUNT_STATE if owner is None else COUNT_OWNER_STATE, "state"),
            (COUNT_TIER if owner is None else COUNT_OWNER_TIER, "tier"),
        ):
            prefix = schema.count_key(kind, *(() if owner is None else (owner,))) + schema.SEP
            found: dict[str, tuple[int, int]] = {}
            with txn.cursor(db=self._db(DB_COUNTS)) as cursor:
                if cursor.set_range(prefix):
                    for key, value in cursor:
                        if not key.startswith(prefix):
                            break
                        found[bytes(key[len(prefix) :]).decode()] = schema.unpack_count(bytes(value))
            out[name] = found
        return out

    def owner_count(self, txn, owner: str) -> int:
        """How many visible sessions ``owner`` has (one key per state)."""
        counts = self._db(DB_COUNTS)
        return sum(
            schema.unpack_count(txn.get(schema.count_key(COUNT_OWNER_STATE, owner, state), db=counts))[0]
            for state in STATES
        )

    def recount(self, txn, records: list[IndexRecord]) -> bool:
        """Set ``counts`` to what ``records`` (every record) hold; whether it held something else."""
        wanted = {key: schema.pack_count(*value) for key, value in schema.tally(records).items()}
        counts = self._db(DB_COUNTS)
        with txn.cursor(db=counts) as cursor:
            held = {bytes(key): bytes(value) for key, value in cursor}
        if held == wanted:
            return False
        for key in held.keys() - wanted.keys():
            txn.delete(key, db=counts)
        for key, value in wanted.items():
            if held.get(key) != value:
                txn.put(key, value, db=counts)
        return True

    def keys_of_id(self, txn, session_id: str) -> list[tuple[str, IndexRecord]]:
        """(storage key, record) of every owner's session with the public id ``session_id``."""
        start = schema.session_key(schema.storage_key(session_id, ""))
        out = []
        with txn.cursor(db=self._db(DB_SESSIONS)) as cursor:
            if cursor.set_range(start):
                for key, value in cursor:
                    if not key.startswith(start):
                        break
                    out.append((bytes(key).decode(), cast(IndexRecord, schema.decode_record(value))))
        return out

    def owner_sessions(self, txn, owner: str) -> list[str]:
        start = owner.encode() + schema.SEP
        out = []
        with txn.cursor(db=self._db(DB_BY_OWNER)) as cursor:
            if cursor.set_range(start):
                for key in cursor.iternext(keys=True, values=False):
                    if not key.startswith(start):
                        break
                    out.append(key[len(start) :].decode())
        return out

    def owned(self, txn, owner: str, keys: Iterable[str]) -> list[str]:
        """Those of ``keys`` that are visible sessions of ``owner`` (one ``by_owner`` probe each, and
        the record of each found: an expired one is not among them)."""
        by_owner = self._db(DB_BY_OWNER)
        return [
            key
            for key in keys
            if txn.get(schema.owner_key(owner, key), db=by_owner) is not None and visible(self.get(txn, key), owner)
        ]

    def least_recently_used(self, txn) -> list[str]:
        """Visible session ids, least recently used first."""
        with txn.cursor(db=self._db(DB_LRU)) as cursor:
            return [schema.lru_session(key) for key in cursor.iternext(keys=True, values=False)]

    # ------------------------------------------------------------------ turns
    def turns(self, txn, session_id: str) -> list[Turn]:
        start = schema.scoped(session_id)
        out = []
        with txn.cursor(db=self._db(DB_TURNS)) as cursor:
            if cursor.set_range(start):
                for key, value in cursor:
                    if not key.startswith(start):
                        break
                    out.append(Turn(*schema.parse_turn_value(value)))
        return out

    def put_turn(self, txn, session_id: str, turn: Turn) -> None:
        txn.put(schema.turn_key(session_id, turn.end), schema.turn_value(*turn), db=self._db(DB_TURNS))

    def drop_turns_after(self, txn, session_id: str, end: int) -> None:
        """Delete the turns whose end is past ``end`` (``-1``: all of them)."""
        prefix = schema.scoped(session_id)
        first = schema.turn_key(session_id, end + 1) if end >= 0 else prefix
        self._delete_range(txn, self._db(DB_TURNS), first, prefix)

    def _delete_range(self, txn, db, first: bytes, prefix: bytes) -> None:
        with txn.cursor(db=db) as cursor:
            if not cursor.set_range(first):
                return
            while cursor.key().startswith(prefix):
                if not cursor.delete():  # delete() moves to the next entry
                    break

    # ------------------------------------------------------------------ prefix blocks
    def prefix_chain(self, txn, session_id: str, blocks: int) -> list[bytes]:
        """The first ``blocks`` chain hashes of a session."""
        start = schema.scoped(session_id)
        out = []
        with txn.cursor(db=self._db(DB_PREFIX_OF)) as cursor:
            if cursor.set_range(start):
                for key, value in cursor:
                    if not key.startswith(start) or len(out) >= blocks:
                        break
                    out.append(bytes(value))
        return out

    def last_chain_hash(self, txn, session_id: str, blocks: int) -> bytes | None:
        if blocks == 0:
            return None
        return txn.get(schema.prefix_of_key(session_id, blocks - 1), db=self._db(DB_PREFIX_OF))

    def extend_prefix(self, txn, record: IndexRecord, tokens: np.ndarray) -> int:
        """Add the chain hashes of whole blocks of ``tokens`` (int32, the tokens after the session's
        ``prefix_blocks`` stored blocks), chained from its last stored hash or, for the first block,
        from its owner and fingerprint; returns the session's new block count."""
        have = record["prefix_blocks"]
        if tokens.shape[0] < schema.PREFIX_BLOCK_TOKENS:
            return have
        previous = self.last_chain_hash(txn, record["id"], have)
        if previous is None:
            previous = schema.chain_seed(record["owner"], record["fingerprint"])
        hashes = schema.chain_hashes(previous, tokens)
        self.put_prefix_blocks(txn, record["id"], have, hashes)
        return have + len(hashes)

    def put_prefix_blocks(self, txn, session_id: str, first_block: int, hashes: list[bytes]) -> None:
        prefix, prefix_of = self._db(DB_PREFIX), self._db(DB_PREFIX_OF)
        for offset, chain in enumerate(hashes):
            block = first_block + offset
            txn.put(schema.prefix_key(chain, session_id), schema.pack_u32(block + 1), db=prefix)
            txn.put(schema.prefix_of_key(session_id, block), chain, db=prefix_of)

    def drop_prefix_blocks_from(self, txn, session_id: str, block: int) -> None:
        prefix, prefix_of = self._db(DB_PREFIX), self._db(DB_PREFIX_OF)
        scope = schema.scoped(session_id)
        doomed = []
        with txn.cursor(db=prefix_of) as cursor:
            if cursor.set_range(schema.prefix_of_key(session_id, block)):
                for key, value in cursor:
                    if not key.startswith(scope):
                        break
                    doomed.append((bytes(key), bytes(value)))
        for key, chain in doomed:
            txn.delete(key, db=prefix_of)
            txn.delete(schema.prefix_key(chain, session_id), db=prefix)

    def sessions_with_chain(self, txn, chain: bytes) -> list[str]:
        out = []
        with txn.cursor(db=self._db(DB_PREFIX)) as cursor:
            if cursor.set_range(chain):
                for key in cursor.iternext(keys=True, values=False):
                    if not key.startswith(chain):
                        break
                    out.append(key[len(chain) :].decode())
        return out

    def longest_chain(self, txn, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` some session holds (presence is monotone: binary search)."""
        lo, hi = 0, len(hashes)
        prefix = self._db(DB_PREFIX)
        with txn.cursor(db=prefix) as cursor:
            while lo < hi:
                mid = (lo + hi + 1) // 2
                chain = hashes[mid - 1]
                found = cursor.set_range(chain) and cursor.key().startswith(chain)
                if found:
                    lo = mid
                else:
                    hi = mid - 1
        return lo

    # ------------------------------------------------------------------ disk usage and reservations
    def usage(self, txn) -> int:
        return int(txn.get(schema.USAGE_KEY, db=self._db(DB_META)) or b"0")

    def add_usage(self, txn, delta: int) -> None:
        self.set_usage(txn, self.usage(txn) + delta)

    def set_usage(self, txn, value: int) -> None:
        txn.put(schema.USAGE_KEY, str(max(0, int(value))).encode(), db=self._db(DB_META))

    def reservations(self, txn) -> list[tuple[bytes, int, int]]:
        """(token, pid, bytes) of every reservation in flight."""
        out = []
        with txn.cursor(db=self._db(DB_RESERVATIONS)) as cursor:
            for key, value in cursor:
                pid, nbytes = np.frombuffer(value, dtype=">u8", count=2).tolist()
                out.append((bytes(key), int(pid), int(nbytes)))
        return out

    def reserve(self, txn, nbytes: int) -> bytes:
        token = uuid.uuid4().bytes
        txn.put(token, np.array([os.getpid(), nbytes], dtype=">u8").tobytes(), db=self._db(DB_RESERVATIONS))
        return token

    def release(self, txn, token: bytes) -> None:
        txn.delete(token, db=self._db(DB_RESERVATIONS))

    def purge_dead_reservations(self, txn) -> int:
        """Drop reservations of processes that no longer exist (killed mid-write); returns how many."""
        dead = [token for token, pid, _ in self.reservations(txn) if not pid_alive(pid)]
        for token in dead:
            self.release(txn, token)
        return len(dead)
