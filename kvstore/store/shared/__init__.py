"""The shared backend: one session store for many replicas, on PostgreSQL and S3-compatible objects.

The protocol (tables, leases and fencing tokens, the commit point, reads, GC, failures) is
docs/SCALE.md; this package is its implementation. It needs the ``shared`` extra
(``pip install 'kvstore[shared]'``: psycopg 3 and boto3) and is imported only when a shared store
is configured, so the embedded store never loads either.

Where each concern lives::

    schema.py    the PostgreSQL tables and their ordered upgrade steps (kv_meta.schema_version)
    pool.py      ConnectionPool: a few PostgreSQL connections, one transaction per call;
                 PostgreSQL down -> IndexUnavailable (retry_after)
    rows.py      the index's row types (Segment, Grant, ReadPlan) and the SQL steps transactions
                 share: the fencing check, the hard limit, publishing an uploaded object
    housekeeping.py  idempotency keys, prefix blocks, API keys, GC's queries
    rewrites.py  fork, truncate and the swap of objects park, unpark and migrate commit
    index.py     SharedIndex: sessions, leases with fencing tokens, the fenced commit, read plans,
                 the global LRU and eviction (over the three above)
    blobs.py     BlobStore: segment objects through standard S3 calls, retries with backoff;
                 BlobStoreUnavailable when they run out
    store.py     SharedStore: create, acquire/renew/release, append (intent, upload, commit; an
                 idempotency key recorded by the commit), fork (segment rows copied, objects
                 shared), truncate (a fenced commit dropping rows), prefix blocks,
                 read_records / file_bytes (the .coli_kv image; a parked segment decompressed), gc
    recode.py    park, unpark, migrate: a session's objects rewritten and swapped in one commit
    cache.py     SegmentCache: a replica's local copies of segment objects in --data (checked by
                 length and digest, a size budget, its own LRU; ciphertext only when encrypted)
    keys.py      encryption at rest: SharedKeyring (owners' data keys wrapped by the KEK, in the
                 index: schema 10), SegmentSealer (objects sealed with kvstore.crypto's core),
                 attach (plaintext or encrypted, never mixed), the keys epoch a shred bumps
    transfer.py  push / pull: sessions between an embedded SessionStore and a SharedStore, turn by
                 turn (``kvstore store push|pull``); imported by its users only
    sessions.py  SharedSessionStore: the store interface (``kvstore.store.Store``; every capability
                 but ``journal_files``) over a SharedStore, for the service's routes (``kvstore
                 serve --index --blobs``), the command line, the engine and the store conformance
                 suite: leases taken inside each write, committed snapshots for resume, both
                 budgets; opened by ``kvstore.store.open`` given the index and blobs URLs
    upkeep.py    park, unpark, repair, migrate and the soft budget of SharedSessionStore
    reading.py   SharedReader (a ``kvstore.store.Reader``: a resume from one snapshot) and the checks
                 on rows to append
    reports.py   verify and inspect of a shared session, as the embedded store reports them

API keys in the index (table ``kv_keys``) are ``kvstore.keys.IndexKeys``, over ``SharedIndex``.

What a session made of objects does not have — journal, archive and lock files —
``SharedSessionStore`` refuses with ``NotOnSharedStore`` naming it. The value types it returns and
the checks it shares with the embedded store are ``kvstore.store.values`` and
``kvstore.store.results``: nothing here imports the embedded store's implementation, except
``transfer.py``, which copies sessions between the two.
"""

from kvstore.store.shared.blobs import BlobStore, ObjectInfo, parse_blobs_url
from kvstore.store.shared.index import Grant, ReadPlan, Segment, SharedIndex
from kvstore.store.shared.store import (
    AppendAck,
    GCReport,
    Lease,
    Prepared,
    RequestKey,
    SharedStore,
    default_holder,
    digest_of,
)

__all__ = [
    "AppendAck",
    "BlobStore",
    "GCReport",
    "Grant",
    "Lease",
    "ObjectInfo",
    "Prepared",
    "ReadPlan",
    "RequestKey",
    "Segment",
    "SharedIndex",
    "SharedStore",
    "default_holder",
    "digest_of",
    "parse_blobs_url",
]
