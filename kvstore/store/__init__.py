"""The session store: resumable conversations as ``.coli_kv`` journals indexed in LMDB, or shared.

Public names: :func:`open` (the one factory: a data folder, or a shared store's index and blobs
URLs), :class:`Store` and :class:`Reader` (the interface every backend implements, capabilities as
data), :class:`SessionStore` (the embedded backend) and the values they take and return
(:class:`SessionInfo`, :class:`ModelInfo`, :class:`Fingerprint`, :class:`AppendResult`, ...).
The shared backend (``kvstore.store.shared``, PostgreSQL + S3) is imported only when
:func:`open` is given its URLs.

Where each concern lives (one file each; the facade delegates to one object per concern, all
sharing one :class:`~kvstore.store.context.StoreContext`)::

    base.py           Store and Reader: the interface, CAPABILITIES, open(), interface_drift()
    values.py         ModelInfo, Fingerprint, SessionInfo, IndexRecord, ListCursor (a list's page
                      position); id/owner/tag validation; record fields (both backends)
    results.py        AppendResult, Resumed, VerifyReport, RepairReport, LookupResult, Eviction,
                      CacheCounts, SessionCounts; the checks both backends make (fingerprint,
                      lookup tokens, NaN)
    session_store.py  SessionStore: the embedded backend's facade, the wiring of the concerns
    context.py        StoreContext: folders and confined paths, the index, the per-session locks,
                      the limits, opening a session's journal; SessionHandle (a session resolved once)
    writes.py         create, append, truncate, fork: the commit order of each
    records.py        chunked reads of stored records and tokens (journal or archive)
    reader.py         SessionReader: opening a session for resuming, and serving its records
    integrity.py      turn hashes (TurnHasher), verify, re-hashing a cut turn
    removal.py        cut (index first, then journal) and delete (hide, remove files, drop entries)
    recovery.py       reconcile on open: roll back, clamp, adopt, orphan sweep, usage and counts
                      recount (one index scan; a session's files are looked at under its locks only
                      when their names, sizes or headers disagree with its record)
    parking.py        park / unpark (archive.py: the zstd archive of a parked journal); the active
                      record and open journal a write starts from
    prefix.py         prefix lookup; the tokens of the blocks an append completes
    budget.py         hard limit (reservations) and soft budget (LRU eviction)
    maintenance.py    inspect, repair, migrate
    index.py          Index: the embedded backend's LMDB index (schema: kvstore.migrations.index);
                      what a record's state means (visible, refuse_damaged)
    stats.py          StoreStats: the counts GET /metrics reports
    shared/           the shared backend: PostgreSQL index, S3 segments, leases and fencing tokens,
                      SharedSessionStore (docs/SCALE.md; ``shared/__init__.py`` is its map)

Why composition: each concern is an object holding the context and the concerns it calls, wired
once in ``SessionStore.__init__`` (integrity <- removal <- recovery <- parking <- budget's evictor
<- writes, maintenance), so a file's collaborators are its constructor's parameters and the
dependencies have no cycle. The state they share is small (the context); none keeps its own,
except the evictor's one-evicting-thread lock.

Session ids are per owner: a session is stored under its **key** ``<id>~<owner>``
(``values.storage_key``; index schema 4). The facade turns a request's id and owner into the key
before anything else (``StoreContext.resolve``, or ``StoreContext.session`` for a handle: one index
read, no lock, no file), so another owner's session is a key that does not exist; every concern
below the facade speaks in keys (or handles that carry one).

A data path reads as a straight line (``bench/walks.py`` measures it): a migrate, an append or a
resume resolves the session once into a ``SessionHandle`` (``StoreContext.session``: the key, the
record, what it names, the journal's path, the locks) and hands it to the one module that owns the
operation — ``maintenance``, ``writes``, ``reader`` — which takes the lock, reads the record again
(``Parking.active`` / ``open_active``), works on the journal and commits in the index.

Layout under ``data_dir`` (folders 0700, files 0600)::

    index/                         the LMDB environment (index.py)
    journals/<id>~<owner>.coli_kv  one journal per active session (kvstore.journal.KVFile)
    archive/<id>~<owner>.coli_kv.zst  parked sessions (archive.py)
    locks/<id>~<owner>.write|.read per-session locks (kvstore.locks.FileLock); locks/evict.lock
    lost+found/                    journals found without an index entry on open (never deleted)

Nothing in it is followed through a symbolic link: the folders are opened once with ``O_NOFOLLOW``
and kept open, lock files and journals are opened relative to them (``openat``, ``O_NOFOLLOW``), the
index's two files are checked before LMDB opens them, and a link, folder or FIFO where a store file
belongs is a typed ``PathRefused`` (a link where a lock file belongs is removed on open).

The index is the store's commit record, the journal holds the rows. Appends are durable in the
journal first, then committed by one index transaction; cuts and deletes commit in the index
first; new files (create, fork, unpark, park's archive) are published atomically first, then
indexed. A crash at any point leaves a state ``recovery`` settles on the next open (each file's
docstring gives its order). Integrity beyond the format: a blake2b-256 per appended turn, in the
index (``integrity``).

Locks, always taken in this order (never the reverse, so they cannot deadlock):

1. ``locks/<key>.write`` exclusive — one mutation of a session at a time (append, truncate,
   park, unpark, fork into it, migrate, repair, delete; eviction and reconcile try it without
   waiting and skip a session they cannot lock).
2. the journal's own writer lock (``journals/<key>.coli_kv.lock``, taken by ``KVFile`` when the
   store opens a journal to write it), which also keeps tools outside the store off it.
3. ``locks/<key>.read`` — shared by readers that hold a journal or archive open (resume streams,
   verify, inspect, fork sources, prefix confirmation); exclusive for the operations that
   shrink, remove or replace the files, so a reader never sees bytes vanish under it.
4. the index's write transaction (LMDB's writer lock), never held while waiting for a file lock.

``locks/evict.lock`` (with a thread lock) lets one evictor run per store at a time.

Index layout (LMDB named databases, versioned by ``kvstore.migrations.index``)::

    meta          schema_version, prefix block size, usage (bytes of journals + archives)
    sessions      key -> JSON record (values.SessionInfo is its typed view; "id" holds the key)
    turns         key \\0 end:u32be -> start, end, complete, blake2b-256 of the records' bytes
    by_owner      owner \\0 key -> b""                 (an owner's sessions without a scan)
    lru           last_used_ns:u64be key -> b""        (eviction order)
    prefix        chain_hash[16] key -> blocks:u32be    (lookup: sessions holding a chain hash)
    prefix_of     key \\0 block:u32be -> chain_hash[16] (a session's chain, to extend or drop)
    reservations  token -> pid:u64be bytes:u64be        (hard-limit bytes of writers in flight)
    by_created    owner \\0 created_ns:u64be key -> b""  (an owner's sessions oldest first: paged lists)
    created       created_ns:u64be key -> b""          (every owner's, oldest first)
    counts        kind \\0 [owner \\0] state|tier -> sessions:i64be bytes:i64be (summaries, the owner cap)
"""

from kvstore.store.base import CAPABILITIES, Reader, Store, interface_drift
from kvstore.store.base import open as open  # kvstore.store.open; not in __all__: a star import would shadow open()
from kvstore.store.reader import SessionReader
from kvstore.store.results import (
    AppendResult,
    CacheCounts,
    Eviction,
    Expiry,
    LookupResult,
    RepairReport,
    Resumed,
    SessionCounts,
    Tally,
    VerifyReport,
)
from kvstore.store.session_store import SessionStore
from kvstore.store.values import (
    Fingerprint,
    IndexRecord,
    ListCursor,
    ModelInfo,
    SessionInfo,
    validate_owner,
    validate_session_id,
)

__all__ = [
    "CAPABILITIES",
    "AppendResult",
    "CacheCounts",
    "Eviction",
    "Expiry",
    "Fingerprint",
    "IndexRecord",
    "ListCursor",
    "LookupResult",
    "ModelInfo",
    "Reader",
    "RepairReport",
    "Resumed",
    "SessionCounts",
    "SessionInfo",
    "SessionReader",
    "SessionStore",
    "Store",
    "Tally",
    "VerifyReport",
    "interface_drift",
    "validate_owner",
    "validate_session_id",
]
