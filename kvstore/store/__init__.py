"""The session store: resumable conversations as ``.coli_kv`` journals indexed in LMDB.

Public names: :class:`SessionStore` (the facade) and the values it takes and returns
(:class:`SessionInfo`, :class:`ModelInfo`, :class:`Fingerprint`, :class:`SessionReader`, ...).

Where each concern lives (one file each; the facade delegates to one object per concern, all
sharing one :class:`~kvstore.store.context.StoreContext`)::

    session_store.py  SessionStore: the public interface, the wiring of the concerns
    context.py        StoreContext: folders and confined paths, the index, the per-session locks,
                      the limits; reading/updating an index record, opening a session's journal
    values.py         ModelInfo, Fingerprint, SessionInfo; id/owner/tag validation; record fields
    writes.py         create, append (AppendResult), truncate, fork: the commit order of each
    records.py        chunked reads of stored records and tokens (journal or archive)
    reader.py         SessionReader, Resumed, the fingerprint check on resume
    integrity.py      turn hashes (TurnHasher), verify (VerifyReport), re-hashing a cut turn
    removal.py        cut (index first, then journal) and delete (hide, remove files, drop entries)
    recovery.py       reconcile on open: roll back, clamp, adopt, orphan sweep, usage recount
    parking.py        park / unpark (archive.py: the zstd archive of a parked journal)
    prefix.py         prefix blocks and lookup (LookupResult)
    budget.py         hard limit (reservations) and soft budget (LRU eviction, Eviction)
    maintenance.py    inspect, repair (RepairReport), migrate
    index.py          Index: the embedded backend's LMDB index (schema: kvstore.migrations.index)
    shared/           the shared backend's protocol: PostgreSQL index, S3 segments, leases and
                      fencing tokens (docs/SCALE.md; not yet behind this facade)

Why composition: each concern is an object holding the context and the concerns it calls, wired
once in ``SessionStore.__init__`` (integrity <- removal <- recovery <- parking <- budget's evictor
<- writes, maintenance), so a file's collaborators are its constructor's parameters and the
dependencies have no cycle. The state they share is small (the context); none keeps its own,
except the evictor's one-evicting-thread lock.

Session ids are per owner: a session is stored under its **key** ``<id>~<owner>``
(``values.storage_key``; index schema 4). The facade turns a request's id and owner into the key
before anything else (``StoreContext.resolve``: one index read, no lock, no file), so another
owner's session is a key that does not exist; every concern below the facade speaks in keys.

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
"""

from kvstore.store.budget import Eviction
from kvstore.store.integrity import VerifyReport
from kvstore.store.maintenance import RepairReport
from kvstore.store.prefix import LookupResult
from kvstore.store.reader import Resumed, SessionReader
from kvstore.store.session_store import SessionStore
from kvstore.store.values import Fingerprint, ModelInfo, SessionInfo, validate_owner, validate_session_id
from kvstore.store.writes import AppendResult

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
    "validate_owner",
    "validate_session_id",
]
