"""The session store: resumable conversations as ``.coli_kv`` journals indexed in LMDB.

Layout under ``data_dir`` (folders 0700, files 0600)::

    index/                    the LMDB environment (schema: kvstore.migrations.index)
    journals/<id>.coli_kv     one journal per active session (kvstore.journal.KVFile)
    archive/<id>.coli_kv.zst  parked sessions (kvstore.archive)
    locks/<id>.write|.read    per-session locks (kvstore.store_locks)
    lost+found/               journals found without an index entry on open (never deleted)

Commit order — the index is the store's commit record, the journal holds the rows:

- **append**: the journal append is durable first (data fsync, then its nrec fsync), then one
  index transaction records the new count, the turn's hash and the watermark. The append is
  acknowledged only after both. A crash in between leaves journal records the index does not
  know: they were never acknowledged, so opening the store rolls them back (truncates them),
  and a client that retries the append does not duplicate rows.
- **truncate**: the index commits the shorter count first, then the journal is cut; a crash in
  between is the same roll-back.
- **create / fork / unpark**: the new file is published atomically first, then indexed; a file
  without an index entry is an unacknowledged creation (removed if empty, else moved to
  ``lost+found``).
- **park**: archive written atomically, index switched to ``parked``, journal unlinked; **unpark**
  the reverse. The index's state says which file is the truth; opening removes the other one.
- **delete**: the index hides the session (state ``deleting``), the files go, the entries go.
- An index that claims more records than its journal holds (the journal lost its tail outside
  kvstore) is clamped to the last whole hashed turn the journal still has, and the session's
  ``problem`` says so; a journal that is gone marks the session ``damaged`` with the reason.

Integrity beyond the format: every append records the blake2b-256 of the record bytes it wrote
("a turn", with its record range). :meth:`SessionStore.verify` re-hashes the journal and reports the
first bad turn; ``resume(verify=True)`` serves only what precedes it.

Disk budget: ``budget_bytes`` is a soft target kept by LRU eviction (park the least recently used
active sessions, then delete the least recently used parked ones); ``hard_limit_bytes`` refuses a
write with :class:`BudgetExceeded` before anything is written. Writers reserve their bytes in the
index's write transaction (LMDB's writer lock spans threads and processes), so concurrent writers
cannot overshoot the limit together. Both count journal and archive bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import re
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from kvstore import archive
from kvstore.errors import (
    BudgetExceeded,
    CodecMismatch,
    FingerprintMismatch,
    FormatError,
    GeometryMismatch,
    IntegrityError,
    InvalidRequest,
    InvalidSessionId,
    JournalLocked,
    JournalWriteError,
    PathRefused,
    SessionDamaged,
    SessionExists,
    SessionNotFound,
)
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header, KVRecords, Tier
from kvstore.index import DEFAULT_MAP_SIZE, Index, Turn
from kvstore.journal import KVFile, fsync_dir, move_durably, write_atomic, write_errors
from kvstore.migrations import formats as format_migrations
from kvstore.migrations import index as schema
from kvstore.store_locks import FileLock
from kvstore import tiers

__all__ = [
    "AppendResult",
    "Eviction",
    "Fingerprint",
    "LookupResult",
    "ModelInfo",
    "RepairReport",
    "Resumed",
    "SessionInfo",
    "SessionReader",
    "SessionStore",
    "VerifyReport",
    "validate_session_id",
]

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
OWNER_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")
TAG_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:=@/-]{0,63}$")
MAX_TAGS = 32
STATES = ("active", "parked", "damaged")
COPY_CHUNK_BYTES = 8 << 20
# The header allows widths no model has; a record this large (GLM v1 is ~180 KB) is refused
# before numpy is asked for a record type it cannot build.
MAX_RECORD_BYTES = 64 << 20
DIR_MODE = 0o700
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-\d+$")

Progress = Callable[[int, int], None]  # (done, total)


# ---------------------------------------------------------------------------- validation
def validate_session_id(session_id: Any) -> str:
    """Return ``session_id`` if it is a valid id, else raise :class:`InvalidSessionId`.

    Ids are 1-64 characters of ``[A-Za-z0-9_-]`` starting with a letter or digit, so a path built
    from one can never leave its folder.
    """
    if not isinstance(session_id, str) or not ID_PATTERN.fullmatch(session_id):
        shown = session_id if isinstance(session_id, str) and len(session_id) <= 80 else "that value"
        raise InvalidSessionId(
            f"invalid session id {shown!r}: use 1-64 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return session_id


def validate_owner(owner: Any) -> str:
    if not isinstance(owner, str) or not OWNER_PATTERN.fullmatch(owner):
        raise InvalidRequest("invalid owner name: use 1-128 letters, digits, '_', '.', '@' or '-', starting with a letter or digit")
    return owner


def _validate_tags(tags: Iterable[str] | None) -> list[str]:
    tags = sorted(set(tags or ()))
    if len(tags) > MAX_TAGS:
        raise InvalidRequest(f"at most {MAX_TAGS} tags per session")
    for tag in tags:
        if not isinstance(tag, str) or not TAG_PATTERN.fullmatch(tag):
            raise InvalidRequest(f"invalid tag {tag!r}: 1-64 of letters, digits and _ . : = @ / -")
    return tags


def _check_record_size(geometry: Geometry, tier: Tier) -> None:
    coli_kv.check_geometry(geometry, tier)
    size = coli_kv.record_bytes(geometry, tier)
    if size > MAX_RECORD_BYTES:
        raise InvalidRequest(f"a record of this geometry and tier is {size} bytes; kvstore stores records of at most {MAX_RECORD_BYTES}")


def _tier_record(tier: Tier) -> dict[str, Any]:
    return {"version": tier.version, "codec": tier.codec, "bits": tier.bits}


def _tier_of(record: dict[str, Any]) -> Tier:
    t = record["tier"]
    return tiers.from_file(t["version"], t.get("codec"), t.get("bits"))


def _geometry_of(record: dict[str, Any]) -> Geometry:
    return Geometry(*record["geometry"])


# ---------------------------------------------------------------------------- public value types
_MODEL_FIELDS = ("name", "revision", "weights_hash", "tokenizer_hash", "chat_template_hash", "attention_variant")


@dataclass(frozen=True)
class ModelInfo:
    """What the caller says about the model that produced a session's rows.

    ``name`` and ``revision`` are required; the hashes (of the weights, tokenizer and chat
    template) and the engine's attention variant are compared when present.
    """

    name: str
    revision: str
    weights_hash: str | None = None
    tokenizer_hash: str | None = None
    chat_template_hash: str | None = None
    attention_variant: str | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any] | "ModelInfo") -> "ModelInfo":
        if isinstance(values, ModelInfo):
            return values
        if not isinstance(values, dict):
            raise InvalidRequest("model must be an object with at least name and revision")
        unknown = sorted(set(values) - set(_MODEL_FIELDS))
        if unknown:
            raise InvalidRequest(f"unknown model fields {unknown}; known: {list(_MODEL_FIELDS)}")
        for required in ("name", "revision"):
            if not isinstance(values.get(required), str) or not values[required]:
                raise InvalidRequest(f"model.{required} is required (a non-empty string)")
        for name in _MODEL_FIELDS:
            value = values.get(name)
            if value is not None and (not isinstance(value, str) or len(value) > 256 or "\0" in value):
                raise InvalidRequest(f"model.{name} must be a string of at most 256 characters")
        return cls(**{name: values.get(name) for name in _MODEL_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Fingerprint:
    """Everything a cache depends on: the model, the six geometry words and the cache tier."""

    model: ModelInfo
    geometry: Geometry
    tier: Tier

    def key(self) -> str:
        return schema.fingerprint_key(self.model.to_dict(), self.geometry.words(), _tier_record(self.tier))

    def mismatches(self, expected: "Fingerprint") -> list[str]:
        """``field: session X, expected Y`` for each field that differs."""
        out = [
            f"geometry.{field.name}: session {getattr(self.geometry, field.name)}, expected {getattr(expected.geometry, field.name)}"
            for field in dataclasses.fields(Geometry)
            if getattr(self.geometry, field.name) != getattr(expected.geometry, field.name)
        ]
        if self.tier != expected.tier:
            out.append(f"tier: session {self.tier.describe()}, expected {expected.tier.describe()}")
        for name in _MODEL_FIELDS:
            mine, theirs = getattr(self.model, name), getattr(expected.model, name)
            if mine != theirs:
                out.append(f"model.{name}: session {mine!r}, expected {theirs!r}")
        return out


@dataclass(frozen=True)
class SessionInfo:
    """One session as the index records it (times are seconds since the epoch)."""

    id: str
    owner: str
    model: ModelInfo
    geometry: Geometry
    tier: Tier
    n_records: int
    watermark: int
    created: float
    updated: float
    last_used: float
    size_bytes: int
    tags: tuple[str, ...]
    state: str
    parent: str | None
    fork_point: int | None
    problem: str | None
    fingerprint_key: str
    prefix_blocks: int

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "SessionInfo":
        return cls(
            id=record["id"],
            owner=record["owner"],
            model=ModelInfo.from_dict(record["model"]),
            geometry=_geometry_of(record),
            tier=_tier_of(record),
            n_records=record["n_records"],
            watermark=record["watermark"],
            created=record["created"],
            updated=record["updated"],
            last_used=record["last_used"],
            size_bytes=record["size_bytes"],
            tags=tuple(record["tags"]),
            state=record["state"],
            parent=record.get("parent"),
            fork_point=record.get("fork_point"),
            problem=record.get("problem"),
            fingerprint_key=record["fingerprint"],
            prefix_blocks=record.get("prefix_blocks", 0),
        )

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.model, self.geometry, self.tier)

    @property
    def record_bytes(self) -> int:
        return coli_kv.record_bytes(self.geometry, self.tier)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what the API and ``--json`` print)."""
        return {
            "id": self.id,
            "owner": self.owner,
            "model": self.model.to_dict(),
            "geometry": dataclasses.asdict(self.geometry),
            "tier": {
                "version": self.tier.version,
                "codec": self.tier.codec_name,
                "bits": self.tier.bits,
                "description": self.tier.describe(),
            },
            "record_bytes": self.record_bytes,
            "n_records": self.n_records,
            "watermark": self.watermark,
            "created": self.created,
            "updated": self.updated,
            "last_used": self.last_used,
            "size_bytes": self.size_bytes,
            "tags": list(self.tags),
            "state": self.state,
            "parent": self.parent,
            "fork_point": self.fork_point,
            "problem": self.problem,
            "fingerprint": self.fingerprint_key,
        }


@dataclass(frozen=True)
class AppendResult:
    info: SessionInfo
    appended: int  # records written by this call
    turn: tuple[int, int] | None  # the record range hashed as this call's turn (None for an empty call)


@dataclass(frozen=True)
class VerifyReport:
    """What re-hashing a session found. ``first_bad`` is the first turn whose bytes differ."""

    session_id: str
    ok: bool
    n_records: int
    turns_checked: int
    first_bad: dict[str, int] | None  # {"turn": index, "start": record, "end": record}
    good_records: int  # records before the first bad turn (all of them when ok)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LookupResult:
    """The owner's session sharing the longest token prefix with a query."""

    session_id: str
    matched_tokens: int  # common prefix, at most the session's watermark
    state: str
    n_records: int
    watermark: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RepairReport:
    session_id: str
    dry_run: bool
    actions: list[str]
    kept_records: int
    dropped_records: int
    first_bad: dict[str, int] | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Eviction:
    session_id: str
    action: str  # "parked" or "deleted"
    freed_bytes: int


@dataclass(frozen=True)
class Resumed:
    """A resumed session: the records to restore, trimmed to the watermark (or before damage)."""

    info: SessionInfo
    records: KVRecords
    reused_tokens: int
    verified: bool
    damaged_from: int | None  # first record of the first bad turn, when verify found one

    @property
    def tokens(self) -> np.ndarray:
        return self.records.tokens

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(L f32[n_layers,n,kv_lora], R f32[n_layers,n,qk_rope], I f32[nic,n,index_hd] | None)``."""
        return self.records.dequantize()


# ---------------------------------------------------------------------------- helpers
def _turn_digest(payload) -> bytes:
    return hashlib.blake2b(payload, digest_size=schema.DIGEST_BYTES).digest()


def _as_bytes_view(records: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(records)).cast("B")


def _read_tokens(fd: int, rec_bytes: int, start: int, stop: int) -> np.ndarray:
    """Tokens of records ``[start, stop)`` of a journal, touching only their pages.

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


def _pread_exact(fd: int, nbytes: int, offset: int) -> bytes:
    parts, got = [], 0
    while got < nbytes:
        chunk = os.pread(fd, nbytes - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _complete_end(turns: list[Turn], keep: int, record: dict) -> int:
    """The watermark after cutting at ``keep``: the last complete turn that ends by then."""
    return min(record["watermark"], max((t.end for t in turns if t.end <= keep and t.complete), default=0))


def _unlink_quietly(path: Path) -> None:
    """Remove a file whose removal is housekeeping only (a failure leaves a harmless leftover)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Reservation:
    """Bytes reserved against the hard limit; released in the commit transaction or on failure."""

    def __init__(self, token: bytes | None, nbytes: int):
        self.token = token
        self.nbytes = nbytes
        self.settled = token is None


# ---------------------------------------------------------------------------- the store
class SessionStore:
    """Sessions of MLA latent KV rows: create, append, resume, fork, look up, park, evict.

    Parameters
    ----------
    data_dir : the store's folder (created 0700 if missing)
    budget_bytes : soft disk budget kept by LRU eviction (None: no eviction)
    hard_limit_bytes : writes that would cross it are refused with BudgetExceeded (None: no limit)
    map_size : the LMDB map size of the index in bytes
    lock_timeout : seconds an operation waits for a session another writer holds
    reconcile : repair the index from the journals on open (see the module docstring)
    progress : callback ``(done, total)`` for index schema upgrades on open

    Every method that takes ``owner`` treats another owner's session as missing
    (:class:`SessionNotFound`, the same reason as for an id that does not exist).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        budget_bytes: int | None = None,
        hard_limit_bytes: int | None = None,
        map_size: int = DEFAULT_MAP_SIZE,
        lock_timeout: float = 10.0,
        reconcile: bool = True,
        progress: Progress | None = None,
    ):
        for name, value in (("budget_bytes", budget_bytes), ("hard_limit_bytes", hard_limit_bytes)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidRequest(f"{name} must be a non-negative number of bytes")
        self.budget_bytes = budget_bytes
        self.hard_limit_bytes = hard_limit_bytes
        self.lock_timeout = lock_timeout
        root = Path(data_dir)
        root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self.data_dir = root.resolve()
        self.journals = self._folder("journals")
        self.archives = self._folder("archive")
        self.locks = self._folder("locks")
        self.lost_found = self._folder("lost+found")
        self._folder("index")
        self._evicting = threading.Lock()
        self.index = Index(self.data_dir / "index", map_size=map_size, tokens_of=self._tokens_for_schema, progress=progress)
        self.reconcile_actions: list[str] = []
        if reconcile:
            try:
                self.reconcile_actions = self.reconcile()
            except BaseException:
                self.index.close()
                raise

    # ------------------------------------------------------------------ lifecycle and paths
    def close(self) -> None:
        self.index.close()

    def __enter__(self) -> "SessionStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _folder(self, name: str) -> Path:
        path = self.data_dir / name
        if path.is_symlink():
            raise PathRefused(f"{path} is a symbolic link; the store's folders must be real folders inside {self.data_dir}")
        path.mkdir(mode=DIR_MODE, exist_ok=True)
        os.chmod(path, DIR_MODE)
        return path

    def _confined(self, folder: Path, name: str) -> Path:
        path = folder / name
        # The name comes from a validated id, so only a symbolic link can lead out of the folder.
        if path.is_symlink():
            raise PathRefused(f"{folder.name}/{name} is a symbolic link; session files must be regular files in {folder}")
        return path

    def journal_path(self, session_id: str) -> Path:
        return self._confined(self.journals, f"{validate_session_id(session_id)}.coli_kv")

    def archive_path(self, session_id: str) -> Path:
        return self._confined(self.archives, f"{validate_session_id(session_id)}.coli_kv.zst")

    def _writing(self, session_id: str, timeout: float | None = None) -> FileLock:
        return FileLock(
            self.locks / f"{session_id}.write",
            timeout=self.lock_timeout if timeout is None else timeout,
            busy_reason=f"session {session_id!r} is being changed by another request; try again",
        )

    def _reading(self, session_id: str, *, exclusive: bool = False, timeout: float | None = None) -> FileLock:
        return FileLock(
            self.locks / f"{session_id}.read",
            shared=not exclusive,
            timeout=self.lock_timeout if timeout is None else timeout,
            busy_reason=f"session {session_id!r} is being read; try again when the download ends",
        )

    # ------------------------------------------------------------------ index records
    def _visible(self, record: dict | None, owner: str | None) -> bool:
        return record is not None and record["state"] != "deleting" and (owner is None or record["owner"] == owner)

    def _record(self, session_id: str, owner: str | None = None) -> dict:
        validate_session_id(session_id)
        with self.index.read() as txn:
            record = self.index.get(txn, session_id)
        if not self._visible(record, owner):
            raise SessionNotFound(f"no session {session_id!r}")
        return record

    def _update(self, txn, session_id: str, **changes) -> dict:
        """Re-read a record inside ``txn`` and apply ``changes`` (readers update last_used concurrently)."""
        current = self.index.get(txn, session_id)
        if current is None:
            raise SessionNotFound(f"no session {session_id!r}")
        updated = {**current, **changes}
        self.index.put(txn, updated, current)
        return updated

    def get(self, session_id: str, *, owner: str | None = None) -> SessionInfo:
        """The session's index record."""
        return SessionInfo.from_record(self._record(session_id, owner))

    def list(
        self,
        *,
        owner: str | None = None,
        model_name: str | None = None,
        tags: Iterable[str] = (),
        state: str | None = None,
        fingerprint: Fingerprint | None = None,
    ) -> list[SessionInfo]:
        """Sessions matching every filter given (all ``tags`` must be present), oldest first."""
        if state is not None and state not in STATES:
            raise InvalidRequest(f"unknown state {state!r}: use one of {list(STATES)}")
        wanted_tags = set(tags)
        key = fingerprint.key() if fingerprint is not None else None
        with self.index.read() as txn:
            if owner is not None:
                records = [self.index.get(txn, sid) for sid in self.index.owner_sessions(txn, owner)]
            else:
                records = self.index.records(txn)
        out = []
        for record in records:
            if not self._visible(record, owner):
                continue
            if model_name is not None and record["model"]["name"] != model_name:
                continue
            if state is not None and record["state"] != state:
                continue
            if not wanted_tags <= set(record["tags"]):
                continue
            if key is not None and record["fingerprint"] != key:
                continue
            out.append(SessionInfo.from_record(record))
        out.sort(key=lambda info: (info.created, info.id))
        return out

    def usage(self) -> dict[str, int | None]:
        """Bytes the store holds (journals + archives), bytes reserved by writers, and the limits."""
        with self.index.read() as txn:
            used = self.index.usage(txn)
            reserved = sum(nbytes for _, _, nbytes in self.index.reservations(txn))
        return {"used_bytes": used, "reserved_bytes": reserved, "budget_bytes": self.budget_bytes, "hard_limit_bytes": self.hard_limit_bytes}

    # ------------------------------------------------------------------ budget
    @contextmanager
    def _reservation(self, nbytes: int) -> Iterator[_Reservation]:
        """Reserve ``nbytes`` under the hard limit before writing them (BudgetExceeded if they do not fit)."""
        if self.hard_limit_bytes is None or nbytes <= 0:
            yield _Reservation(None, nbytes)
            return
        with self.index.write() as txn:
            token = self._reserve_in(txn, nbytes)
        reservation = _Reservation(token, nbytes)
        try:
            yield reservation
        finally:
            if not reservation.settled:
                with self.index.write() as txn:
                    self.index.release(txn, token)

    def _reserve_in(self, txn, nbytes: int) -> bytes:
        def total() -> int:
            return self.index.usage(txn) + sum(n for _, _, n in self.index.reservations(txn))

        committed = total()
        if committed + nbytes > self.hard_limit_bytes and self.index.purge_dead_reservations(txn):
            committed = total()  # a writer killed mid-write no longer holds its bytes
        if committed + nbytes > self.hard_limit_bytes:
            raise BudgetExceeded(
                f"writing {nbytes} bytes would take the store to {committed + nbytes} bytes, over its hard "
                f"limit of {self.hard_limit_bytes}; nothing was written. Delete or park sessions, or raise the limit"
            )
        return self.index.reserve(txn, nbytes)

    def _settle(self, txn, reservation: _Reservation) -> None:
        if not reservation.settled:
            self.index.release(txn, reservation.token)
            reservation.settled = True

    def _after_write(self, keep: str) -> list[Eviction]:
        if self.budget_bytes is None:
            return []
        with self.index.read() as txn:
            over = self.index.usage(txn) > self.budget_bytes
        return self.enforce_budget(keep=(keep,)) if over else []

    def enforce_budget(self, *, keep: Iterable[str] = (), progress: Progress | None = None) -> list[Eviction]:
        """Evict until the store fits ``budget_bytes``: park the least recently used active sessions,
        then delete the least recently used parked ones. Sessions in ``keep`` and sessions another
        request is using are skipped. Returns what was evicted, in order."""
        if self.budget_bytes is None:
            return []
        if not self._evicting.acquire(blocking=False):
            return []  # another thread of this process is evicting
        try:
            with FileLock(self.locks / "evict.lock", timeout=0) as _:
                return self._evict(set(keep), progress)
        except JournalLocked:
            return []  # another process is evicting
        finally:
            self._evicting.release()

    def _evict(self, keep: set[str], progress: Progress | None) -> list[Eviction]:
        evictions: list[Eviction] = []
        tried = {"parked": set(keep), "deleted": set(keep)}  # a session parked here may be deleted later
        while True:
            with self.index.read() as txn:
                used = self.index.usage(txn)
                if used <= self.budget_bytes:
                    return evictions
                order = [(sid, self.index.get(txn, sid)) for sid in self.index.least_recently_used(txn)]
            action, victim = "parked", None
            for action, state in (("parked", "active"), ("deleted", "parked")):
                victim = next(((sid, r) for sid, r in order if sid not in tried[action] and r and r["state"] == state), None)
                if victim is not None:
                    break
            if victim is None:
                return evictions
            sid, record = victim
            tried[action].add(sid)
            before = record["size_bytes"]
            try:
                with self._writing(sid, timeout=0):
                    if action == "parked":
                        after = self._park_locked(sid, None, progress, read_timeout=0)["size_bytes"]
                    else:
                        self._delete_locked(sid, None, read_timeout=0)
                        after = 0
            except (JournalLocked, SessionNotFound, IntegrityError):
                continue  # in use, gone, or damaged: try the next one
            evictions.append(Eviction(sid, action, before - after))

    # ------------------------------------------------------------------ create
    def create(
        self,
        owner: str,
        geometry: Geometry,
        tier: Tier,
        model: ModelInfo | dict[str, Any],
        *,
        session_id: str | None = None,
        tags: Iterable[str] = (),
    ) -> SessionInfo:
        """Create an empty session (its journal holds only the header).

        Raises
        ------
        SessionExists, InvalidSessionId, BadHeader (a geometry no model has), BudgetExceeded
        """
        validate_owner(owner)
        model = ModelInfo.from_dict(model)
        tags = _validate_tags(tags)
        session_id = validate_session_id(session_id) if session_id is not None else uuid.uuid4().hex
        _check_record_size(geometry, tier)
        with self._writing(session_id):
            path = self.journal_path(session_id)
            self._finish_interrupted_delete(session_id)
            with self.index.read() as txn:
                if self.index.get(txn, session_id) is not None:
                    raise SessionExists(f"session {session_id!r} already exists")
            self._clear_orphan(session_id, path)
            with self._reservation(HEADER_BYTES) as reservation:
                KVFile.create(path, geometry, tier, lock_timeout=self.lock_timeout).close()
                now_ns = time.time_ns()
                record = {
                    "id": session_id,
                    "owner": owner,
                    "model": model.to_dict(),
                    "geometry": list(geometry.words()),
                    "tier": _tier_record(tier),
                    "n_records": 0,
                    "watermark": 0,
                    "created": now_ns / 1e9,
                    "updated": now_ns / 1e9,
                    "last_used": now_ns / 1e9,
                    "last_used_ns": now_ns,
                    "size_bytes": os.stat(path).st_size,
                    "tags": tags,
                    "state": "active",
                    "parent": None,
                    "fork_point": None,
                    "problem": None,
                    "fingerprint": Fingerprint(model, geometry, tier).key(),
                    "prefix_blocks": 0,
                }
                try:
                    with self.index.write() as txn:
                        if self.index.get(txn, session_id) is not None:
                            raise SessionExists(f"session {session_id!r} already exists")
                        self.index.put(txn, record)
                        self._settle(txn, reservation)
                except BaseException:
                    path.unlink(missing_ok=True)  # never indexed: nobody was told it exists
                    raise
        self._after_write(session_id)
        return SessionInfo.from_record(record)

    def _clear_orphan(self, session_id: str, path: Path) -> None:
        """A journal left by a creation that crashed before it was indexed: empty ones go."""
        if not path.exists():
            return
        try:
            header, _ = coli_kv.read_header(path)
            empty = header.nrec == 0
        except (FormatError, OSError):
            empty = False
        if not empty:
            raise SessionExists(
                f"a journal for {session_id!r} exists without an index entry; reopen the store to move it to lost+found"
            )
        path.unlink()

    # ------------------------------------------------------------------ append
    def append(
        self,
        session_id: str,
        tokens,
        L,
        R,
        I=None,
        *,
        complete_turn: bool = True,
        owner: str | None = None,
    ) -> AppendResult:
        """Append rows, encoded in the session's tier.

        Parameters
        ----------
        tokens : int32[k]
        L : f32[n_layers, k, kv_lora]
        R : f32[n_layers, k, qk_rope]
        I : f32[nic, k, index_hd], required when the model has indexer layers
        complete_turn : the rows end a turn: the watermark moves to the new count
        """
        record = self._record(session_id, owner)
        encoded = coli_kv.encode_records(_geometry_of(record), _tier_of(record), tokens, L, R, I)
        return self.append_records(session_id, encoded, complete_turn=complete_turn, owner=owner)

    def append_records(
        self,
        session_id: str,
        records: np.ndarray | bytes | bytearray | memoryview,
        *,
        complete_turn: bool = True,
        owner: str | None = None,
    ) -> AppendResult:
        """Append already-encoded records of the session's tier (raw ``.coli_kv`` record bytes, no header).

        The bytes are validated before anything is written (whole records, token ids in the
        vocabulary, no corrupt scale/radius or NaN code). An empty call with ``complete_turn``
        marks the rows appended so far as a complete turn.

        Returns
        -------
        AppendResult — acknowledged only after the journal and the index both committed.
        """
        validate_session_id(session_id)
        with self._writing(session_id):
            record = self._active_locked(session_id, owner)
            with self._open_journal(record, writable=True) as journal:
                record = self._match_journal(record, journal)
                rows = journal.validate_records(records)
                count = record["n_records"]
                if rows.shape[0] == 0:
                    record = self._mark_complete(record, journal) if complete_turn else record
                    return AppendResult(SessionInfo.from_record(record), 0, None)
                payload = _as_bytes_view(rows)
                digest = _turn_digest(payload)
                with self._reservation(len(payload)) as reservation:
                    total = journal.append_records(rows, validate=False)  # validated above
                    size = os.stat(journal.path).st_size
                    new_wm = total if complete_turn else record["watermark"]
                    hashes, first_block = self._new_prefix_blocks(record, journal, rows, new_wm)
                    now_ns = time.time_ns()
                    with self.index.write() as txn:
                        self.index.put_turn(txn, session_id, Turn(count, total, complete_turn, digest))
                        if hashes:
                            self.index.put_prefix_blocks(txn, session_id, first_block, hashes)
                        record = self._update(
                            txn,
                            session_id,
                            n_records=total,
                            watermark=new_wm,
                            size_bytes=size,
                            updated=now_ns / 1e9,
                            last_used=now_ns / 1e9,
                            last_used_ns=now_ns,
                            prefix_blocks=first_block + len(hashes) if hashes else record["prefix_blocks"],
                        )
                        self._settle(txn, reservation)
        self._after_write(session_id)
        return AppendResult(SessionInfo.from_record(record), total - count, (count, total))

    def _mark_complete(self, record: dict, journal: KVFile) -> dict:
        sid = record["id"]
        if record["watermark"] == record["n_records"]:
            return record
        hashes, first_block = self._new_prefix_blocks(record, journal, None, record["n_records"])
        with self.index.write() as txn:
            turns = self.index.turns(txn, sid)
            if turns:
                self.index.put_turn(txn, sid, turns[-1]._replace(complete=True))
            if hashes:
                self.index.put_prefix_blocks(txn, sid, first_block, hashes)
            return self._update(
                txn,
                sid,
                watermark=record["n_records"],
                updated=time.time(),
                prefix_blocks=first_block + len(hashes) if hashes else record["prefix_blocks"],
            )

    def _new_prefix_blocks(self, record: dict, journal: KVFile, fresh: np.ndarray | None, new_wm: int) -> tuple[list[bytes], int]:
        """Chain hashes of the blocks that ``new_wm`` completes (tokens of journal records before
        ``record['n_records']``, then of ``fresh``)."""
        block = schema.PREFIX_BLOCK_TOKENS
        have = record["prefix_blocks"]
        want = new_wm // block
        if want <= have:
            return [], have
        start, stop = have * block, want * block
        old_count = record["n_records"]
        rec_bytes = coli_kv.record_bytes(journal.geometry, journal.tier)
        fd = os.open(journal.path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            parts = [_read_tokens(fd, rec_bytes, start, min(stop, old_count))]
        finally:
            os.close(fd)
        if stop > old_count and fresh is not None:
            parts.append(np.asarray(fresh["token"][: stop - old_count], dtype=np.int32))
        tokens = np.concatenate(parts)
        with self.index.read() as txn:
            previous = self.index.last_chain_hash(txn, record["id"], have)
        if previous is None:
            previous = schema.chain_seed(record["owner"], record["fingerprint"])
        return schema.chain_hashes(previous, tokens), have

    # ------------------------------------------------------------------ journals
    def _open_journal(self, record: dict, *, writable: bool) -> KVFile:
        sid = record["id"]
        path = self.journal_path(sid)
        try:
            return KVFile.open(
                path, geometry=_geometry_of(record), tier=_tier_of(record), writable=writable, lock_timeout=self.lock_timeout
            )
        except FileNotFoundError:
            reason = f"the journal of session {sid!r} is missing"
        except (GeometryMismatch, CodecMismatch, FormatError) as exc:
            reason = f"the journal of session {sid!r} does not match its index entry: {exc.reason}"
        self._mark_damaged(sid, reason)
        raise SessionDamaged(reason + "; the session is marked damaged (delete it, or restore the file and reopen)")

    def _mark_damaged(self, session_id: str, reason: str) -> None:
        with self.index.write() as txn:
            record = self.index.get(txn, session_id)
            if record is not None and record["state"] != "deleting":
                self._update(txn, session_id, state="damaged", problem=reason)

    def _match_journal(self, record: dict, journal: KVFile) -> dict:
        """Reconcile one session whose journal count differs from the index (under its write lock)."""
        if journal.n_records == record["n_records"] and os.stat(journal.path).st_size == HEADER_BYTES + record["n_records"] * coli_kv.record_bytes(journal.geometry, journal.tier):
            return record
        record, _ = self._reconcile_journal(record, journal)
        return record

    def _active_locked(self, session_id: str, owner: str | None) -> dict:
        """The record of an active session, unparking it first if needed (write lock held)."""
        record = self._record(session_id, owner)
        if record["state"] == "parked":
            record = self._unpark_locked(session_id, owner, None)
        if record["state"] == "damaged":
            raise SessionDamaged(f"session {session_id!r} is damaged: {record.get('problem')}")
        return record

    # ------------------------------------------------------------------ reading records
    def _record_chunks(self, record: dict, start: int, stop: int, chunk_bytes: int = COPY_CHUNK_BYTES) -> Iterator[bytes]:
        """The stored bytes of records ``[start, stop)`` in order, from the journal or the archive.

        The caller holds the session's read or write lock.
        """
        rec_bytes = coli_kv.record_bytes(_geometry_of(record), _tier_of(record))
        first, last = HEADER_BYTES + start * rec_bytes, HEADER_BYTES + stop * rec_bytes
        if record["state"] == "active":
            fd = os.open(self.journal_path(record["id"]), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                offset = first
                while offset < last:
                    chunk = os.pread(fd, min(chunk_bytes, last - offset), offset)
                    if not chunk:
                        raise IntegrityError(f"the journal of {record['id']!r} ends before record {stop}")
                    yield chunk
                    offset += len(chunk)
            finally:
                os.close(fd)
            return
        offset = 0
        for chunk in archive.stream_archive(self.archive_path(record["id"]), chunk_bytes=chunk_bytes):
            lo, hi = max(first - offset, 0), min(last - offset, len(chunk))
            if lo < hi:
                yield chunk[lo:hi]
            offset += len(chunk)
            if offset >= last:
                return
        raise IntegrityError(f"the archive of {record['id']!r} ends before record {stop}")

    def _check_turns(self, record: dict, turns: list[Turn], stop: int) -> tuple[int, int | None]:
        """Re-hash the turns ending at or before ``stop``; returns (turns checked, first bad index)."""
        rec_bytes = coli_kv.record_bytes(_geometry_of(record), _tier_of(record))
        checked = [t for t in turns if t.end <= stop]
        if not checked:
            return 0, None
        expected_start = 0
        for index, turn in enumerate(checked):
            if turn.start != expected_start or turn.end <= turn.start:
                return index, index  # a gap or overlap in the hashed ranges: nothing past it is vouched for
            expected_start = turn.end
        hasher = hashlib.blake2b(digest_size=schema.DIGEST_BYTES)
        turn_index, remaining = 0, (checked[0].end - checked[0].start) * rec_bytes
        try:
            for chunk in self._record_chunks(record, 0, checked[-1].end):
                view = memoryview(chunk)
                while len(view):
                    take = min(remaining, len(view))
                    hasher.update(view[:take])
                    view = view[take:]
                    remaining -= take
                    if remaining == 0:
                        if hasher.digest() != checked[turn_index].digest:
                            return turn_index, turn_index
                        turn_index += 1
                        if turn_index == len(checked):
                            return turn_index, None
                        hasher = hashlib.blake2b(digest_size=schema.DIGEST_BYTES)
                        remaining = (checked[turn_index].end - checked[turn_index].start) * rec_bytes
        except IntegrityError:
            return turn_index, turn_index  # the file ends inside this turn
        return turn_index, (turn_index if turn_index < len(checked) else None)

    def verify(self, session_id: str, *, owner: str | None = None) -> VerifyReport:
        """Re-hash every turn of a session (journal or archive) against the hashes in the index.

        Returns
        -------
        VerifyReport with the first turn whose bytes differ (a silent bit flip the format cannot
        see), or ``ok=True``.
        """
        record = self._record(session_id, owner)
        with self._reading(session_id):
            # One snapshot for the count and the turns: an append (which needs no read lock)
            # commits both together, and a turn read past the count looked like damage.
            with self.index.read() as txn:
                record = self.index.get(txn, session_id)
                turns = self.index.turns(txn, session_id)
            if not self._visible(record, owner):
                raise SessionNotFound(f"no session {session_id!r}")
            if record["state"] == "damaged":
                raise SessionDamaged(f"session {session_id!r} is damaged: {record.get('problem')}")
            checked, bad = self._check_turns(record, turns, record["n_records"])
        covered = turns[-1].end if turns else 0
        first_bad = None
        if bad is not None:
            turn = turns[bad]
            first_bad = {"turn": bad, "start": turn.start, "end": turn.end}
        elif covered != record["n_records"]:
            first_bad = {"turn": len(turns), "start": covered, "end": record["n_records"]}
        good = first_bad["start"] if first_bad else record["n_records"]
        return VerifyReport(session_id, first_bad is None, record["n_records"], checked, first_bad, good)

    # ------------------------------------------------------------------ resume
    def reader(
        self,
        session_id: str,
        *,
        owner: str | None = None,
        verify: bool = False,
        expect: Fingerprint | None = None,
        override: Iterable[str] = (),
    ) -> "SessionReader":
        """Open a session for resuming (unparking it if parked). Use as a context manager.

        Parameters
        ----------
        verify : re-hash the turns first; a mismatch is a miss: only the records before the
            first bad turn (down to a complete turn) are served
        expect : the fingerprint of the engine that will restore the rows; any field that differs
            raises :class:`FingerprintMismatch` naming it
        override : fields of ``expect`` not to compare (e.g. ``{"model.weights_hash"}`` for the
            same weights re-saved) — an explicit, documented escape hatch

        The reader serves records ``[0, reused_tokens)``; appends may continue meanwhile, and
        nothing that shrinks or replaces the journal runs until the reader is closed.
        """
        validate_session_id(session_id)
        for _ in range(3):  # a parked session is unparked, then read; eviction may race us once
            record = self._record(session_id, owner)
            if expect is not None:
                self._check_fingerprint(record, expect, override)
            if record["state"] == "parked":
                self.unpark(session_id, owner=owner)
                continue
            if record["state"] == "damaged":
                raise SessionDamaged(f"session {session_id!r} is damaged: {record.get('problem')}")
            lock = self._reading(session_id).acquire()
            try:
                record = self._record(session_id, owner)
                if record["state"] != "active":
                    lock.release()
                    continue
                return SessionReader(self, record, lock, verify)
            except BaseException:
                lock.release()
                raise
        raise JournalLocked(f"session {session_id!r} keeps being parked while it is resumed; try again")

    def _check_fingerprint(self, record: dict, expect: Fingerprint, override: Iterable[str]) -> None:
        skip = set(override)
        unknown = skip - {f"model.{n}" for n in _MODEL_FIELDS} - {"tier"}
        if unknown:
            raise InvalidRequest(f"cannot override {sorted(unknown)}: only model.* fields and tier can be overridden")
        found = SessionInfo.from_record(record).fingerprint.mismatches(expect)
        blocking = [m for m in found if m.split(":")[0] not in skip]
        if blocking:
            raise FingerprintMismatch(
                f"session {record['id']!r} was written by another model or cache tier: " + "; ".join(blocking)
                + " (pass an override only if you know the caches are interchangeable)"
            )

    def resume(
        self,
        session_id: str,
        *,
        owner: str | None = None,
        verify: bool = False,
        expect: Fingerprint | None = None,
        override: Iterable[str] = (),
    ) -> Resumed:
        """Load a session's records up to its watermark (see :meth:`reader` for the options).

        Returns
        -------
        Resumed — ``records`` (KVRecords of the served prefix), ``reused_tokens`` (how many records
        the engine need not prefill), ``damaged_from`` when ``verify`` found a bad turn.
        """
        with self.reader(session_id, owner=owner, verify=verify, expect=expect, override=override) as reader:
            return Resumed(reader.info, reader.load(), reader.n_records, reader.verified, reader.damaged_from)

    def _touch(self, session_id: str) -> None:
        now_ns = time.time_ns()
        with self.index.write() as txn:
            record = self.index.get(txn, session_id)
            if record is not None and record["state"] != "deleting":
                self._update(txn, session_id, last_used=now_ns / 1e9, last_used_ns=now_ns)

    # ------------------------------------------------------------------ truncate
    def truncate(self, session_id: str, n_records: int, *, owner: str | None = None) -> SessionInfo:
        """Keep the first ``n_records`` records (the watermark becomes ``min(watermark, n)``).

        The index commits first, then the journal is cut (see the module docstring).
        """
        validate_session_id(session_id)
        if not isinstance(n_records, (int, np.integer)) or isinstance(n_records, bool) or n_records < 0:
            raise InvalidRequest("n_records must be a non-negative integer")
        n_records = int(n_records)
        with self._writing(session_id):
            record = self._active_locked(session_id, owner)
            if n_records > record["n_records"]:
                raise InvalidRequest(f"session {session_id!r} holds {record['n_records']} records; cannot truncate to {n_records}")
            with self._open_journal(record, writable=True) as journal:
                record = self._match_journal(record, journal)
                if n_records == record["n_records"]:
                    return SessionInfo.from_record(record)
                with self._reading(session_id, exclusive=True):
                    record = self._cut(record, journal, n_records, complete=n_records <= record["watermark"])
        return SessionInfo.from_record(record)

    def _cut(
        self,
        record: dict,
        journal: KVFile,
        keep: int,
        *,
        complete: bool,
        watermark: int | None = None,
        problem: str | None = None,
    ) -> dict:
        """Index first, then journal: shorten a session to ``keep`` records (locks held).

        The watermark becomes ``min(watermark, keep)`` unless given; a turn cut by ``keep`` is
        checked against its hash and re-hashed (``complete`` is its new flag).
        """
        sid = record["id"]
        with self.index.read() as txn:
            turns = self.index.turns(txn, sid)
        straddler = next((t for t in turns if t.start < keep < t.end), None)
        replacement = None
        if straddler is not None:
            replacement = self._rehash_prefix(record, straddler, keep, complete)
        new_wm = min(record["watermark"], keep) if watermark is None else min(watermark, keep)
        rec_bytes = coli_kv.record_bytes(journal.geometry, journal.tier)
        changes: dict[str, Any] = {
            "n_records": keep,
            "watermark": new_wm,
            "size_bytes": HEADER_BYTES + keep * rec_bytes,
            "updated": time.time(),
            "prefix_blocks": min(record["prefix_blocks"], new_wm // schema.PREFIX_BLOCK_TOKENS),
        }
        if problem is not None:
            changes["problem"] = problem
        with self.index.write() as txn:
            self.index.drop_turns_after(txn, sid, keep)
            if replacement is not None:
                self.index.put_turn(txn, sid, replacement)
            self.index.drop_prefix_blocks_from(txn, sid, changes["prefix_blocks"])
            record = self._update(txn, sid, **changes)
        journal.truncate(keep)
        return record

    def _rehash_prefix(self, record: dict, turn: Turn, keep: int, complete: bool) -> Turn:
        """The turn ``[start, keep)`` cut out of ``turn``, after checking the whole turn's hash."""
        rec_bytes = coli_kv.record_bytes(_geometry_of(record), _tier_of(record))
        whole = hashlib.blake2b(digest_size=schema.DIGEST_BYTES)
        part = hashlib.blake2b(digest_size=schema.DIGEST_BYTES)
        remaining_part = (keep - turn.start) * rec_bytes
        for chunk in self._record_chunks(record, turn.start, turn.end):
            whole.update(chunk)
            if remaining_part > 0:
                part.update(chunk[:remaining_part])
                remaining_part -= min(remaining_part, len(chunk))
        if whole.digest() != turn.digest:
            raise IntegrityError(
                f"records {turn.start}..{turn.end} of session {record['id']!r} do not match their hash; "
                f"cut at or before record {turn.start}, or run repair"
            )
        return Turn(turn.start, keep, complete, part.digest())

    # ------------------------------------------------------------------ fork
    def fork(
        self,
        session_id: str,
        *,
        at: int | None = None,
        new_id: str | None = None,
        owner: str | None = None,
        tags: Iterable[str] | None = None,
    ) -> SessionInfo:
        """A new session holding a copy of the first ``at`` records (default: the watermark).

        The copy is published atomically, then indexed with the source's turn hashes (a turn cut
        by ``at`` is checked, then re-hashed) and prefix blocks. The fork's watermark is
        ``min(source watermark, at)``.
        """
        validate_session_id(session_id)
        new_id = validate_session_id(new_id) if new_id is not None else uuid.uuid4().hex
        if new_id == session_id:
            raise SessionExists(f"session {new_id!r} already exists")
        with self._writing(new_id):
            self._finish_interrupted_delete(new_id)
            with self.index.read() as txn:
                if self.index.get(txn, new_id) is not None:
                    raise SessionExists(f"session {new_id!r} already exists")
            path = self.journal_path(new_id)
            self._clear_orphan(new_id, path)
            with self._reading(session_id):
                source = self._record(session_id, owner)
                if source["state"] == "damaged":
                    raise SessionDamaged(f"session {session_id!r} is damaged: {source.get('problem')}")
                at = source["watermark"] if at is None else at
                if not isinstance(at, (int, np.integer)) or isinstance(at, bool) or not 0 <= at <= source["n_records"]:
                    raise InvalidRequest(f"fork point must be in 0..{source['n_records']}, got {at!r}")
                at = int(at)
                geometry, tier = _geometry_of(source), _tier_of(source)
                new_wm = min(source["watermark"], at)
                with self.index.read() as txn:
                    turns = [t for t in self.index.turns(txn, session_id) if t.start < at]
                    chain = self.index.prefix_chain(txn, session_id, min(source["prefix_blocks"], new_wm // schema.PREFIX_BLOCK_TOKENS))
                if turns and turns[-1].end > at:
                    turns[-1] = self._rehash_prefix(source, turns[-1], at, complete=at <= source["watermark"])
                size = HEADER_BYTES + at * coli_kv.record_bytes(geometry, tier)
                with self._reservation(size) as reservation:
                    chunks = (np.frombuffer(c, np.uint8) for c in self._record_chunks(source, 0, at))
                    try:
                        write_atomic(path, Header(geometry, tier, at), _CountingChunks(chunks, coli_kv.record_bytes(geometry, tier)), replace=False)
                    except FileExistsError:
                        raise
                    except BaseException:
                        # write_atomic can fail after publishing the copy (its directory fsync): the
                        # copy is ours and indexed nowhere, so take it back before reporting, or the
                        # same fork again would find an unindexed journal in its way.
                        _unlink_quietly(path)
                        raise
                    now_ns = time.time_ns()
                    record = {
                        **source,
                        "id": new_id,
                        "n_records": at,
                        "watermark": new_wm,
                        "created": now_ns / 1e9,
                        "updated": now_ns / 1e9,
                        "last_used": now_ns / 1e9,
                        "last_used_ns": now_ns,
                        "size_bytes": os.stat(path).st_size,
                        "tags": _validate_tags(source["tags"] if tags is None else tags),
                        "state": "active",
                        "parent": session_id,
                        "fork_point": at,
                        "problem": None,
                        "prefix_blocks": len(chain),
                    }
                    try:
                        with self.index.write() as txn:
                            self.index.put(txn, record)
                            for turn in turns:
                                self.index.put_turn(txn, new_id, turn)
                            self.index.put_prefix_blocks(txn, new_id, 0, chain)
                            self._settle(txn, reservation)
                    except BaseException:
                        path.unlink(missing_ok=True)
                        raise
        self._after_write(new_id)
        return SessionInfo.from_record(record)

    # ------------------------------------------------------------------ prefix lookup
    def lookup(self, owner: str, fingerprint: Fingerprint, tokens) -> LookupResult | None:
        """The owner's session (same fingerprint) sharing the longest token prefix with ``tokens``.

        Block-aligned chain hashes in the index find the candidates (a few key probes, no journal
        scan); the winners are then confirmed against their journal's (or archive's) tokens and
        the match extended past the last whole block. Matches are capped at each session's
        watermark; a query sharing fewer than one block (64 tokens) with every session finds none.
        """
        validate_owner(owner)
        tokens = np.asarray(tokens)
        if tokens.size == 0:
            return None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise InvalidRequest("tokens must be a 1-D list of integers")
        if tokens.min() < 0 or tokens.max() >= fingerprint.geometry.vocab:
            raise InvalidRequest(f"token ids must be in [0, {fingerprint.geometry.vocab})")
        tokens = tokens.astype(np.int32)
        hashes = schema.chain_hashes(schema.chain_seed(owner, fingerprint.key()), tokens)
        block = schema.PREFIX_BLOCK_TOKENS
        with self.index.read() as txn:
            depth = self.index.longest_chain(txn, hashes)
        while depth > 0:
            with self.index.read() as txn:
                ids = self.index.sessions_with_chain(txn, hashes[depth - 1])
                records = [self.index.get(txn, sid) for sid in ids]
            best: tuple[int, float, dict] | None = None
            for record in records:
                if not self._visible(record, owner) or record["state"] not in ("active", "parked"):
                    continue
                matched = self._confirm_prefix(record, tokens)
                if matched >= depth * block and (best is None or (matched, record["last_used"]) > best[:2]):
                    best = (matched, record["last_used"], record)
            if best is not None:
                matched, _, record = best
                return LookupResult(record["id"], matched, record["state"], record["n_records"], record["watermark"])
            depth -= 1  # every candidate's tokens disagreed (its index entry went stale): look shallower
        return None

    def _confirm_prefix(self, record: dict, tokens: np.ndarray) -> int:
        """Length of the common prefix of ``tokens`` and the session's tokens up to its watermark."""
        upto = min(record["watermark"], tokens.shape[0])
        try:
            with self._reading(record["id"], timeout=1.0):
                current = self._record(record["id"])
                upto = min(upto, current["watermark"])
                stored = self._tokens_of(current, upto)
        except (JournalLocked, SessionNotFound, IntegrityError, OSError):
            return 0
        if stored is None:
            return 0
        return _common_prefix(stored, tokens[:upto])

    def _tokens_of(self, record: dict, n_records: int) -> np.ndarray | None:
        """The first ``n_records`` tokens of a session (journal, or archive when parked)."""
        rec_bytes = coli_kv.record_bytes(_geometry_of(record), _tier_of(record))
        if record["state"] == "active":
            fd = os.open(self.journal_path(record["id"]), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                complete = (os.fstat(fd).st_size - HEADER_BYTES) // rec_bytes
                return _read_tokens(fd, rec_bytes, 0, min(n_records, complete))
            finally:
                os.close(fd)
        if record["state"] == "parked":
            head = archive.read_prefix(self.archive_path(record["id"]), HEADER_BYTES + n_records * rec_bytes)
            complete = (len(head) - HEADER_BYTES) // rec_bytes
            return np.ndarray((max(complete, 0),), "<i4", head, HEADER_BYTES, (rec_bytes,)).astype(np.int32)
        return None

    def _tokens_for_schema(self, record: dict, n_records: int) -> np.ndarray | None:
        try:
            return self._tokens_of(record, n_records)
        except (OSError, IntegrityError, PathRefused):
            return None

    # ------------------------------------------------------------------ park / unpark
    def park(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> SessionInfo:
        """Compress a session's journal into the archive (zstd) and free the journal.

        ``progress(bytes_done, bytes_total)`` is called as the journal is compressed. Parking a
        parked session does nothing.
        """
        validate_session_id(session_id)
        with self._writing(session_id):
            return SessionInfo.from_record(self._park_locked(session_id, owner, progress))

    def _park_locked(self, session_id: str, owner: str | None, progress: Progress | None, *, read_timeout: float | None = None) -> dict:
        record = self._record(session_id, owner)
        if record["state"] == "parked":
            return record
        if record["state"] == "damaged":
            raise SessionDamaged(f"session {session_id!r} is damaged: {record.get('problem')}")
        journal_path, archive_path = self.journal_path(session_id), self.archive_path(session_id)
        with self._open_journal(record, writable=True) as journal:  # also keeps outside writers off
            record = self._match_journal(record, journal)
            length = HEADER_BYTES + record["n_records"] * coli_kv.record_bytes(journal.geometry, journal.tier)
            fd = os.open(journal_path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                with write_errors(f"parking session {session_id!r}", "the session is still active and its journal intact"):
                    archive_path.unlink(missing_ok=True)  # a leftover of a park that crashed before its commit
                    size = archive.compress_journal(fd, length, archive_path, progress=progress)
            finally:
                os.close(fd)
            try:
                with self._reading(session_id, exclusive=True, timeout=read_timeout):
                    with self.index.write() as txn:
                        record = self._update(txn, session_id, state="parked", size_bytes=size, updated=time.time())
                    with write_errors(
                        f"session {session_id!r} was parked, but removing its journal",
                        "its archive holds every record; the journal left behind is removed on the next unpark or store open",
                    ):
                        journal_path.unlink()
                        fsync_dir(self.journals)
            except BaseException:
                with self.index.read() as txn:
                    still_active = (self.index.get(txn, session_id) or {}).get("state") == "active"
                if still_active:
                    archive_path.unlink(missing_ok=True)
                raise
        return record

    def unpark(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> SessionInfo:
        """Restore a parked session's journal from its archive (byte for byte) and free the archive."""
        validate_session_id(session_id)
        with self._writing(session_id):
            record = self._unpark_locked(session_id, owner, progress)
        self._after_write(session_id)
        return SessionInfo.from_record(record)

    def _unpark_locked(self, session_id: str, owner: str | None, progress: Progress | None) -> dict:
        record = self._record(session_id, owner)
        if record["state"] != "parked":
            if record["state"] == "damaged":
                raise SessionDamaged(f"session {session_id!r} is damaged: {record.get('problem')}")
            return record
        journal_path, archive_path = self.journal_path(session_id), self.archive_path(session_id)
        try:
            size = archive.content_size(archive_path)
        except FileNotFoundError:
            reason = f"the archive of parked session {session_id!r} is missing"
            self._mark_damaged(session_id, reason)
            raise SessionDamaged(reason) from None
        geometry, tier = _geometry_of(record), _tier_of(record)
        expected = HEADER_BYTES + record["n_records"] * coli_kv.record_bytes(geometry, tier)
        if size != expected:
            raise IntegrityError(f"the archive of {session_id!r} holds {size} bytes, the index expects {expected}")
        with self._reservation(size) as reservation:
            with write_errors(f"unparking session {session_id!r}", "the session is still parked and its archive intact"):
                journal_path.unlink(missing_ok=True)  # a leftover of an unpark that crashed before its commit
                archive.restore_journal(archive_path, journal_path, progress=progress)
            committed = False
            try:
                header, _ = coli_kv.read_header(journal_path)
                if header.geometry != geometry or header.tier != tier or header.nrec != record["n_records"]:
                    raise IntegrityError(f"the archive of {session_id!r} does not hold the journal its index entry describes")
                # Readers of a parked session (verify, lookup) stream its archive under the read
                # lock: switch to the journal and remove the archive only when none is reading.
                with self._reading(session_id, exclusive=True):
                    with self.index.write() as txn:
                        record = self._update(txn, session_id, state="active", size_bytes=size, updated=time.time())
                        self._settle(txn, reservation)
                    committed = True
                    with write_errors(
                        f"session {session_id!r} was unparked, but removing its archive",
                        "its journal holds every record; the archive left behind is removed on the next park or store open",
                    ):
                        archive_path.unlink()
                        fsync_dir(self.archives)
            except BaseException:
                if not committed:
                    journal_path.unlink(missing_ok=True)
                raise
        return record

    # ------------------------------------------------------------------ delete / tags
    def delete(self, session_id: str, *, owner: str | None = None) -> None:
        """Remove a session, its files and its index entries."""
        validate_session_id(session_id)
        with self._writing(session_id):
            self._delete_locked(session_id, owner)

    def _delete_locked(self, session_id: str, owner: str | None, *, read_timeout: float | None = None) -> None:
        with self._reading(session_id, exclusive=True, timeout=read_timeout):
            with self.index.read() as txn:
                record = self.index.get(txn, session_id)
            # A session a failed delete already hid ("deleting") is finished by deleting it again.
            if record is None or (owner is not None and record["owner"] != owner):
                raise SessionNotFound(f"no session {session_id!r}")
            if record["state"] != "deleting":
                with self.index.write() as txn:
                    self._update(txn, session_id, state="deleting")  # invisible from here on
            with write_errors(
                f"deleting session {session_id!r}",
                "the session is hidden; deleting it again (or reopening the store) removes what is left",
            ):
                self._remove_files(session_id)
            with self.index.write() as txn:
                current = self.index.get(txn, session_id)
                if current is not None:
                    self.index.remove(txn, current)
        for suffix in (".read", ".write"):
            _unlink_quietly(self.locks / f"{session_id}{suffix}")  # a lock file left behind is harmless

    def _finish_interrupted_delete(self, session_id: str) -> None:
        """Finish a delete that hid ``session_id`` but could not remove its files (write lock held),
        so the id can be used again without reopening the store."""
        with self.index.read() as txn:
            record = self.index.get(txn, session_id)
        if record is not None and record["state"] == "deleting":
            self._delete_locked(session_id, None)

    def _remove_files(self, session_id: str) -> None:
        for path in (self.journal_path(session_id), self.archive_path(session_id)):
            path.unlink(missing_ok=True)
        (self.journals / f"{session_id}.coli_kv.lock").unlink(missing_ok=True)
        fsync_dir(self.journals)
        fsync_dir(self.archives)

    def set_tags(self, session_id: str, tags: Iterable[str], *, owner: str | None = None) -> SessionInfo:
        """Replace a session's tags."""
        tags = _validate_tags(tags)
        self._record(session_id, owner)
        with self.index.write() as txn:
            record = self._update(txn, session_id, tags=tags, updated=time.time())
        return SessionInfo.from_record(record)

    # ------------------------------------------------------------------ file tools: inspect, repair, migrate
    def inspect(self, session_id: str, *, owner: str | None = None) -> dict[str, Any]:
        """What the session's file holds: header fields, sizes and what a loader would neutralize."""
        record = self._record(session_id, owner)
        with self._reading(session_id):
            record = self._record(session_id, owner)
            out: dict[str, Any] = {"session": SessionInfo.from_record(record).to_dict()}
            with self.index.read() as txn:
                out["turns"] = len(self.index.turns(txn, session_id))
            if record["state"] == "active":
                path = self.journal_path(session_id)
                records = coli_kv.load(path)
                out["file"] = {"path": f"journals/{path.name}", "bytes": records.file_size}
            elif record["state"] == "parked":
                path = self.archive_path(session_id)
                records = coli_kv.parse(b"".join(self._archive_whole(path)))
                out["file"] = {"path": f"archive/{path.name}", "bytes": os.stat(path).st_size, "journal_bytes": records.file_size}
            else:
                out["file"] = None
                out["problems"] = [record.get("problem")]
                return out
        header = records.header
        out["header"] = {
            "version": header.version,
            "codec": header.tier.codec_name,
            "bits": header.bits,
            "tag": header.tag,
            "nrec": header.nrec,
            **dataclasses.asdict(header.geometry),
        }
        out["record_bytes"] = header.rec_bytes
        out["complete_records"] = records.complete_records
        out["loadable_records"] = records.n
        out["problems"] = records.problems.messages()
        return out

    def _archive_whole(self, path: Path) -> Iterator[bytes]:
        return archive.stream_archive(path)

    def repair(self, session_id: str, *, owner: str | None = None, dry_run: bool = False) -> RepairReport:
        """Make a session's journal and index agree and drop what cannot be trusted.

        Drops journal bytes past the acknowledged count (a torn or unacknowledged tail) and, when a
        turn's hash no longer matches, every record from that turn on (the damaged tail is never
        served); the watermark falls back to the last complete turn kept. ``dry_run`` reports
        without changing anything.
        """
        validate_session_id(session_id)
        with self._writing(session_id):
            record = self._active_locked(session_id, owner)
            with self._open_journal(record, writable=True) as journal, self._reading(session_id, exclusive=True):
                actions: list[str] = []
                rec_bytes = coli_kv.record_bytes(journal.geometry, journal.tier)
                on_disk, indexed = journal.n_records, record["n_records"]
                limit = min(on_disk, indexed)
                if on_disk > indexed:
                    actions.append(f"drop {on_disk - indexed} unacknowledged records past record {indexed}")
                elif on_disk < indexed:
                    actions.append(f"the journal holds {on_disk} of the {indexed} indexed records: shorten the index")
                extra = os.stat(journal.path).st_size - HEADER_BYTES - on_disk * rec_bytes
                if extra > 0:
                    actions.append(f"cut {extra} bytes past the last committed record")
                with self.index.read() as txn:
                    whole = [t for t in self.index.turns(txn, session_id) if t.end <= limit]
                _, bad = self._check_turns(record, whole, limit)
                keep = whole[bad].start if bad is not None else (whole[-1].end if whole else 0)
                first_bad = {"turn": bad, "start": whole[bad].start, "end": whole[bad].end} if bad is not None else None
                why = None
                if keep < limit:
                    why = (
                        f"turn {bad} (records {whole[bad].start}..{whole[bad].end}) does not match its hash"
                        if bad is not None
                        else "records not covered by a turn hash"
                    )
                    actions.append(f"drop records {keep}..{limit}: {why}")
                if not dry_run and actions:
                    if keep < indexed:
                        record = self._cut(
                            record, journal, keep, complete=False, watermark=_complete_end(whole, keep, record),
                            problem=f"repaired: {why or 'the journal was shorter than the index'}",
                        )
                    else:
                        journal.truncate(indexed)  # also cuts a torn tail
                        with self.index.write() as txn:
                            record = self._update(txn, session_id, size_bytes=os.stat(journal.path).st_size)
        dropped = (indexed - keep) + max(on_disk - indexed, 0)
        return RepairReport(session_id, dry_run, actions, keep, dropped, first_bad)

    def migrate(
        self,
        session_id: str,
        tier: Tier,
        *,
        owner: str | None = None,
        progress: Progress | None = None,
    ) -> SessionInfo:
        """Convert a session's journal to another tier (lossy unless the target is v1).

        The turns are verified first (a damaged session is refused: repair it), the journal is
        rewritten atomically through ``kvstore.migrations``, and the index takes the new tier,
        fingerprint, turn hashes and prefix blocks in one transaction. ``progress(records_done,
        records_total)``.
        """
        validate_session_id(session_id)
        with self._writing(session_id):
            record = self._active_locked(session_id, owner)
            source_tier, geometry = _tier_of(record), _geometry_of(record)
            if tier == source_tier:
                return SessionInfo.from_record(record)
            _check_record_size(geometry, tier)
            format_migrations.plan(source_tier, tier)
            with self._open_journal(record, writable=True) as journal:
                record = self._match_journal(record, journal)
                with self.index.read() as txn:
                    turns = self.index.turns(txn, session_id)
                _, bad = self._check_turns(record, turns, record["n_records"])
                if bad is not None:
                    raise IntegrityError(
                        f"turn {bad} of session {session_id!r} does not match its hash; repair the session before migrating"
                    )
                records = journal.load().slice(0, record["n_records"])
                new_rec_bytes = coli_kv.record_bytes(geometry, tier)
                total = records.n
                done = [0]

                def step(n: int, _total: int) -> None:
                    done[0] += n
                    if progress is not None:
                        progress(min(done[0], total), total)

                hasher = _TurnHasher(turns, new_rec_bytes)
                chunks = hasher.wrap(format_migrations.convert_chunks(records, tier, progress=step))
                size = HEADER_BYTES + total * new_rec_bytes
                with self._reservation(size) as reservation, self._reading(session_id, exclusive=True):
                    unsynced = None
                    try:
                        write_atomic(journal.path, Header(geometry, tier, total), chunks, replace=True)
                    except JournalWriteError as exc:
                        if coli_kv.read_header(journal.path)[0].tier != tier:
                            raise  # the old journal is in place: nothing changed
                        # The rename happened and a later step (the directory fsync) failed: the
                        # journal is in the new tier now, so the index must follow it before the
                        # failure is reported (else the next call finds a journal it cannot open).
                        unsynced = exc
                    new_turns = hasher.turns()
                    model = ModelInfo.from_dict(record["model"])
                    key = Fingerprint(model, geometry, tier).key()
                    hashes = schema.chain_hashes(schema.chain_seed(record["owner"], key), records.tokens[: record["watermark"]])
                    with self.index.write() as txn:
                        self.index.drop_turns_after(txn, session_id, -1)
                        for turn in new_turns:
                            self.index.put_turn(txn, session_id, turn)
                        self.index.drop_prefix_blocks_from(txn, session_id, 0)
                        self.index.put_prefix_blocks(txn, session_id, 0, hashes)
                        record = self._update(
                            txn,
                            session_id,
                            tier=_tier_record(tier),
                            fingerprint=key,
                            prefix_blocks=len(hashes),
                            size_bytes=os.stat(journal.path).st_size,
                            updated=time.time(),
                        )
                        self._settle(txn, reservation)
                    if unsynced is not None:
                        raise JournalWriteError(
                            f"session {session_id!r} was migrated to {tier.describe()}, but syncing the journal's folder failed "
                            f"({unsynced.__cause__}); a power loss now may bring the old journal back (the store follows whichever it finds)"
                        ) from unsynced
        self._after_write(session_id)
        return SessionInfo.from_record(record)

    # ------------------------------------------------------------------ reconcile
    def reconcile(self) -> list[str]:
        """Repair the index from the journals (run on open; safe while other processes use the store).

        Sessions another request holds are skipped (that request settles them). Returns one line
        per repair made.
        """
        actions: list[str] = []
        with self.index.write() as txn:
            purged = self.index.purge_dead_reservations(txn)
        if purged:
            actions.append(f"released {purged} space reservations of writers that no longer run")
        with self.index.read() as txn:
            ids = [r["id"] for r in self.index.records(txn)]
        for sid in ids:
            try:
                with self._writing(sid, timeout=0):
                    actions.extend(self._reconcile_locked(sid))
            except JournalLocked:
                continue
        actions.extend(self._sweep_orphans())
        actions.extend(self._recount_usage())
        return actions

    def _reconcile_locked(self, sid: str) -> list[str]:
        with self.index.read() as txn:
            record = self.index.get(txn, sid)
        if record is None:
            return []
        journal_path, archive_path = self.journal_path(sid), self.archive_path(sid)
        has_journal, has_archive = journal_path.exists(), archive_path.exists()
        state = record["state"]
        actions: list[str] = []
        if state == "deleting":  # a delete that crashed after hiding the session: finish it
            self._remove_files(sid)
            with self.index.write() as txn:
                self.index.remove(txn, record)
            return [f"{sid}: finished an interrupted delete"]
        if state == "parked" and not has_archive and has_journal:
            with self.index.write() as txn:
                record = self._update(txn, sid, state="active", problem="the archive was missing; the journal was kept")
            state, actions = "active", [f"{sid}: archive missing, journal kept (session active again)"]
        if state == "active" and not has_journal and has_archive:
            with self.index.write() as txn:
                record = self._update(txn, sid, state="parked", size_bytes=os.stat(archive_path).st_size, problem="the journal was missing; the archive was kept")
            return [f"{sid}: journal missing, archive kept (session parked)"]
        if state == "parked":
            if has_journal:  # an unpark that crashed before its commit (or a park after it)
                journal_path.unlink()
                fsync_dir(self.journals)
                actions.append(f"{sid}: removed a journal left by an interrupted park/unpark")
            if not has_archive:
                reason = "the archive is missing"
                with self.index.write() as txn:
                    self._update(txn, sid, state="damaged", problem=reason)
                return actions + [f"{sid}: {reason}; marked damaged"]
            return actions
        if state == "active":
            if has_archive:  # a park that crashed before its commit
                archive_path.unlink()
                fsync_dir(self.archives)
                actions.append(f"{sid}: removed an archive left by an interrupted park")
            if not has_journal:
                reason = "the journal is missing"
                with self.index.write() as txn:
                    self._update(txn, sid, state="damaged", problem=reason)
                return actions + [f"{sid}: {reason}; marked damaged"]
            try:
                journal = KVFile.open(journal_path, writable=True, lock_timeout=0)
            except JournalLocked:
                return actions  # an outside tool is writing it; settle next time
            except (FormatError, OSError) as exc:
                reason = f"the journal cannot be read: {getattr(exc, 'reason', exc)}"
                with self.index.write() as txn:
                    self._update(txn, sid, state="damaged", problem=reason)
                return actions + [f"{sid}: {reason}; marked damaged"]
            with journal:
                _, more = self._reconcile_journal(record, journal)
            actions.extend(more)
        return actions

    def _reconcile_journal(self, record: dict, journal: KVFile) -> tuple[dict, list[str]]:
        """Settle one active session's index against its open (writable) journal."""
        sid = record["id"]
        actions: list[str] = []
        if journal.geometry != _geometry_of(record):
            reason = "the journal is for another model: " + "; ".join(journal.geometry.mismatches(_geometry_of(record)))
            with self.index.write() as txn:
                record = self._update(txn, sid, state="damaged", problem=reason)
            return record, [f"{sid}: {reason}; marked damaged"]
        if journal.stored_tier != _tier_of(record):
            record = self._adopt_tier(record, journal)
            actions.append(f"{sid}: the journal was rewritten as {journal.stored_tier.describe()} (an interrupted migrate); index follows it")
        rec_bytes = coli_kv.record_bytes(journal.geometry, journal.stored_tier)
        on_disk = journal.n_records
        indexed = record["n_records"]
        if on_disk < indexed:
            with self.index.read() as txn:
                turns = self.index.turns(txn, sid)
            keep = max((t.end for t in turns if t.end <= on_disk), default=0)
            why = f"the journal holds {on_disk} records, the index {indexed}: kept the {keep} covered by whole turns"
            record = self._cut(record, journal, keep, complete=False, watermark=_complete_end(turns, keep, record), problem=why)
            actions.append(f"{sid}: {why}")
        elif on_disk > indexed or os.stat(journal.path).st_size != HEADER_BYTES + indexed * rec_bytes:
            if on_disk > indexed:
                actions.append(f"{sid}: rolled back {on_disk - indexed} unacknowledged records")
            else:
                actions.append(f"{sid}: cut a torn tail")
            journal.truncate(indexed)
        size = os.stat(journal.path).st_size
        if size != record["size_bytes"]:
            with self.index.write() as txn:
                record = self._update(txn, sid, size_bytes=size)
        return record, actions

    def _adopt_tier(self, record: dict, journal: KVFile) -> dict:
        """Follow a journal rewritten in another tier: new fingerprint, re-hashed turns, prefixes."""
        sid = record["id"]
        tier = journal.stored_tier
        records = coli_kv.load(journal.path)
        n = min(records.n, record["n_records"])
        with self.index.read() as txn:
            turns = [t for t in self.index.turns(txn, sid) if t.end <= n]
        hasher = _TurnHasher(turns, coli_kv.record_bytes(journal.geometry, tier))
        for _ in hasher.wrap(iter([records.records[:n]])):
            pass
        key = Fingerprint(ModelInfo.from_dict(record["model"]), journal.geometry, tier).key()
        wm = min(record["watermark"], n)
        hashes = schema.chain_hashes(schema.chain_seed(record["owner"], key), records.tokens[:wm])
        with self.index.write() as txn:
            self.index.drop_turns_after(txn, sid, -1)
            for turn in hasher.turns():
                self.index.put_turn(txn, sid, turn)
            self.index.drop_prefix_blocks_from(txn, sid, 0)
            self.index.put_prefix_blocks(txn, sid, 0, hashes)
            return self._update(txn, sid, tier=_tier_record(tier), fingerprint=key, prefix_blocks=len(hashes), problem=f"adopted a journal rewritten as {tier.describe()}")

    def _sweep_orphans(self) -> list[str]:
        """Files without an index entry: temp files of dead writers, unacknowledged creations."""
        actions: list[str] = []
        for folder, suffix in ((self.journals, ".coli_kv"), (self.archives, ".coli_kv.zst")):
            for entry in os.scandir(folder):
                temp = _TEMP_NAME.match(entry.name)
                if temp is not None:
                    if not _pid_alive(int(temp["pid"])):
                        os.unlink(entry.path)
                        actions.append(f"removed {folder.name}/{entry.name}, left by a writer that no longer runs")
                    continue
                if not entry.name.endswith(suffix):
                    continue
                sid = entry.name[: -len(suffix)]
                if not ID_PATTERN.fullmatch(sid) or entry.is_symlink():
                    continue
                try:
                    with self._writing(sid, timeout=0):
                        with self.index.read() as txn:
                            if self.index.get(txn, sid) is not None:
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
        target = self.lost_found / f"{name}.{time.time_ns()}"
        move_durably(path, target)
        return f"moved {folder.name}/{name} to lost+found/{target.name}: it has no index entry"

    def _recount_usage(self) -> list[str]:
        with self.index.write() as txn:
            records = [r for r in self.index.records(txn) if r["state"] != "deleting"]
            counted = sum(r["size_bytes"] for r in records)
            if counted != self.index.usage(txn):
                before = self.index.usage(txn)
                self.index.set_usage(txn, counted)
                return [f"disk usage recounted: {before} -> {counted} bytes"]
        return []


class _CountingChunks:
    """Record-sized views of byte chunks, so ``write_atomic`` can count the records it writes."""

    def __init__(self, chunks: Iterator[np.ndarray], rec_bytes: int):
        self._chunks = chunks
        self._rec_bytes = rec_bytes
        self._carry = np.empty(0, np.uint8)

    def __iter__(self) -> Iterator[np.ndarray]:
        rec_dtype = np.dtype((np.void, self._rec_bytes))
        for chunk in self._chunks:
            if self._carry.size:
                chunk = np.concatenate([self._carry, chunk])
            whole = chunk.size - chunk.size % self._rec_bytes
            if whole:
                yield chunk[:whole].view(rec_dtype)
            self._carry = chunk[whole:].copy()
        if self._carry.size:
            raise IntegrityError("the source ended inside a record")


class _TurnHasher:
    """Hash a stream of record chunks at the given turns' boundaries (ranges kept, bytes new)."""

    def __init__(self, turns: list[Turn], rec_bytes: int):
        self._turns = turns
        self._rec_bytes = rec_bytes
        self._digests: list[bytes] = []
        self._hasher = hashlib.blake2b(digest_size=schema.DIGEST_BYTES)
        self._remaining = (turns[0].end - turns[0].start) * rec_bytes if turns else 0

    def wrap(self, chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        for chunk in chunks:
            view = _as_bytes_view(chunk)
            while len(view) and len(self._digests) < len(self._turns):
                take = min(self._remaining, len(view))
                self._hasher.update(view[:take])
                view = view[take:]
                self._remaining -= take
                if self._remaining == 0:
                    self._digests.append(self._hasher.digest())
                    self._hasher = hashlib.blake2b(digest_size=schema.DIGEST_BYTES)
                    if len(self._digests) < len(self._turns):
                        nxt = self._turns[len(self._digests)]
                        self._remaining = (nxt.end - nxt.start) * self._rec_bytes
            yield chunk

    def turns(self) -> list[Turn]:
        if len(self._digests) != len(self._turns):
            raise IntegrityError("the rewritten journal ended before its last turn")
        return [turn._replace(digest=digest) for turn, digest in zip(self._turns, self._digests)]


class SessionReader:
    """An open, consistent view of a session's records ``[0, n_records)`` for resuming.

    Holds the session's read lock (nothing shrinks or replaces the journal meanwhile) and a file
    descriptor of the journal. Close it (or use ``with``) to release both.

    Attributes
    ----------
    info : SessionInfo at open
    n_records : records served (the watermark, or less after a failed verify) = reused tokens
    record_bytes : bytes per record
    verified : whether the turns were re-hashed
    damaged_from : first record of the first bad turn, when verify found one
    """

    def __init__(self, store: SessionStore, record: dict, lock: FileLock, verify: bool):
        self._store = store
        self._lock = lock
        self._fd = -1
        sid = record["id"]
        try:
            self._fd = os.open(store.journal_path(sid), os.O_RDONLY | os.O_NOFOLLOW)
            header = coli_kv.parse_header(os.pread(self._fd, HEADER_BYTES, 0))
            if header.geometry != _geometry_of(record) or header.tier != _tier_of(record):
                raise IntegrityError(f"the journal of {sid!r} no longer matches its index entry; reopen the store to reconcile it")
            self.info = SessionInfo.from_record(record)
            self.record_bytes = header.rec_bytes
            served = record["watermark"]
            self.verified = bool(verify)
            self.damaged_from: int | None = None
            if verify:
                with store.index.read() as txn:
                    turns = store.index.turns(txn, sid)
                _, bad = store._check_turns(record, turns, served)
                covered = max((t.end for t in turns if t.end <= served), default=0)
                limit = turns[bad].start if bad is not None else covered
                if limit < served:
                    self.damaged_from = limit
                    served = max((t.end for t in turns if t.end <= limit and t.complete), default=0)
            self.n_records = served
            store._touch(sid)
        except FileNotFoundError:
            self.close()
            raise SessionDamaged(f"the journal of session {sid!r} is missing") from None
        except BaseException:
            self.close()
            raise

    @property
    def reused_tokens(self) -> int:
        return self.n_records

    @property
    def body_bytes(self) -> int:
        return self.n_records * self.record_bytes

    def header_bytes(self) -> bytes:
        """A ``.coli_kv`` header for the served records (nrec = ``n_records``)."""
        return Header(self.info.geometry, self.info.tier, self.n_records).to_bytes()

    def iter_bytes(self, chunk_bytes: int = COPY_CHUNK_BYTES) -> Iterator[bytes]:
        """The served records' raw bytes, in chunks (a whole number of records each, when it fits)."""
        chunk_bytes = max(self.record_bytes, chunk_bytes - chunk_bytes % self.record_bytes)
        offset, end = HEADER_BYTES, HEADER_BYTES + self.body_bytes
        while offset < end:
            chunk = os.pread(self._fd, min(chunk_bytes, end - offset), offset)
            if not chunk:
                raise IntegrityError(f"the journal of {self.info.id!r} ended at byte {offset} of {end}")
            yield chunk
            offset += len(chunk)

    def load(self) -> KVRecords:
        """All served records with one read (KVRecords, ``n = n_records``)."""
        body = bytearray(self.body_bytes)
        view = memoryview(body)
        got = 0
        while got < len(body):
            n = os.preadv(self._fd, [view[got:]], HEADER_BYTES + got)
            if n == 0:
                raise IntegrityError(f"the journal of {self.info.id!r} ended at record {got // self.record_bytes}")
            got += n
        dtype = coli_kv.record_dtype(self.info.geometry, self.info.tier)
        records = np.frombuffer(body, dtype=dtype, count=self.n_records)
        return KVRecords(Header(self.info.geometry, self.info.tier, self.n_records), records, HEADER_BYTES + len(body))

    def iter_batches(self, batch_records: int) -> Iterator[KVRecords]:
        """Served records as KVRecords batches of at most ``batch_records``."""
        dtype = coli_kv.record_dtype(self.info.geometry, self.info.tier)
        for start in range(0, self.n_records, batch_records):
            stop = min(start + batch_records, self.n_records)
            raw = _pread_exact(self._fd, (stop - start) * self.record_bytes, HEADER_BYTES + start * self.record_bytes)
            if len(raw) != (stop - start) * self.record_bytes:
                raise IntegrityError(f"the journal of {self.info.id!r} ended inside record {start + len(raw) // self.record_bytes}")
            records = np.frombuffer(raw, dtype=dtype)
            yield KVRecords(Header(self.info.geometry, self.info.tier, stop - start), records, HEADER_BYTES + len(raw))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._lock.release()

    def __enter__(self) -> "SessionReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
