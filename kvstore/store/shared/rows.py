"""The shared index's row types, and the SQL steps several of its transactions share.

:class:`Segment` (a committed segment row), :class:`Grant` (a lease as granted) and
:class:`ReadPlan` (what a read needs, from one snapshot); the steps run inside a caller's
transaction: the fencing check (:func:`hold_lease`), the hard limit (:func:`fit`), publishing an
uploaded object (:func:`publish_replacement`), prefix blocks and the objects left unlisted.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
import psycopg

from kvstore.errors import (
    BudgetExceeded,
    KeyUnavailable,
    LeaseExpired,
    SegmentLost,
    SessionNotFound,
    StaleLease,
    TooManySessions,
)
from kvstore.store.values import public_id

if TYPE_CHECKING:
    from typing_extensions import LiteralString  # typing's own from Python 3.11

#: ``pg_advisory_xact_lock`` key serializing eviction across replicas.
EVICT_LOCK = 0x6B7673_0002
#: ``pg_advisory_xact_lock`` key serializing the writes that grow the store under a hard limit.
LIMIT_LOCK = 0x6B7673_0003

#: A segment row's columns, in :class:`Segment`'s order.
SEGMENT_COLUMNS = (
    "first_record, n_records, object, nbytes, digest, token, complete, codec, stored_bytes, check_digest, key_version"
)
#: The bytes a session takes: its header (kept in the index) and its segment objects.
SIZE_OF = "40 + coalesce((SELECT sum(coalesce(g.stored_bytes, g.nbytes)) FROM kv_segments g WHERE g.key = %s), 0)"


def digest_of(payload: bytes | memoryview) -> bytes:
    """blake2b-256 of a segment's bytes: the turn hash both backends record (push and pull compare
    them), kept in the index; what checks a segment committed before its BLAKE3 check existed."""
    return hashlib.blake2b(payload, digest_size=32).digest()


def check_of(payload: bytes | memoryview) -> bytes:
    """BLAKE3-256 of a segment's bytes, recorded at commit and matched before any byte of it is
    served: as strong as blake2b against an object changed in the bucket (the index and the bucket
    are apart), about six times faster on one core, which is what a read through a replica pays."""
    return blake3.blake3(payload).digest()


@dataclass(frozen=True)
class Grant:
    """A lease as granted: its fencing token and the session's committed count at the grant."""

    key: str
    holder: str
    token: int
    n_records: int


@dataclass(frozen=True)
class Segment:
    """One committed segment: records ``[first_record, first_record + n_records)`` in ``object``."""

    first_record: int
    n_records: int
    object: str
    nbytes: int
    digest: bytes
    token: int
    complete: bool = True  # the segment ends a complete turn (the watermark moved to its end)
    codec: str = "raw"  # "zstd": the object is the records compressed (a parked session's)
    stored_bytes: int | None = None  # the object's own bytes when compressed (``nbytes``: the records')
    check: bytes | None = None  # BLAKE3-256 of the records' bytes (None: committed before schema 8)
    # the owner's data-key version the object is sealed under (kvstore.store.shared.keys; None: a
    # plaintext object); a sealed object's stored_bytes is its own size, nbytes the records'
    key_version: int | None = None

    def holds(self, payload: bytes | memoryview) -> bool:
        """Whether ``payload`` is this segment's records: by its BLAKE3 check, or by its digest when
        it was committed without one."""
        if self.check is not None:
            return check_of(payload) == self.check
        return digest_of(payload) == self.digest

    @property
    def end(self) -> int:
        return self.first_record + self.n_records

    @property
    def object_bytes(self) -> int:
        """Bytes the object takes in the object store (sealed, compressed, or the records themselves)."""
        return self.nbytes if self.stored_bytes is None else self.stored_bytes


@dataclass(frozen=True)
class ReadPlan:
    """What a read needs, from one snapshot: the header, the committed count, the segments."""

    header: bytes
    rec_bytes: int
    n_records: int
    segments: list[Segment]
    watermark: int = 0  # records of complete turns (what a resume serves), same snapshot
    key_epoch: int = 0  # destructions of data keys so far (kv_meta 'keys_epoch'), same snapshot


def unlisted(conn: psycopg.Connection, objects: list[str]) -> list[str]:
    """Those of ``objects`` no session's segment row lists (run after deleting the rows that did)."""
    if not objects:
        return []
    rows = conn.execute(
        "SELECT DISTINCT n FROM unnest(%s::text[]) AS n WHERE NOT EXISTS (SELECT 1 FROM kv_segments s WHERE s.object = n)",
        (objects,),
    )
    return [r[0] for r in rows]


PLAINTEXT_REFUSED = "a plaintext segment in a shared store created encrypted"  # schema 10's trigger


def insert_segment(conn: psycopg.Connection, statement: LiteralString, params: tuple) -> None:
    """Insert a segment row; the trigger's refusal of a plaintext segment in a store created
    encrypted (a replica opened before a KEK made the store encrypted) becomes ``KeyUnavailable``."""
    try:
        conn.execute(statement, params)
    except psycopg.errors.CheckViolation as exc:
        if PLAINTEXT_REFUSED not in str(exc):
            raise
        raise KeyUnavailable(
            "this shared store is encrypted at rest and this replica was opened without its key-encryption key: "
            "nothing was published; restart it with --kek-file (or KVSTORE_KEK_FILE / KVSTORE_KEK)"
        ) from None


def publish_replacement(conn: psycopg.Connection, key: str, segment: Segment) -> None:
    """Insert a segment uploaded under an intent (the rows of a cut segment), taking its intent."""
    intent = conn.execute(
        "DELETE FROM kv_pending WHERE object = %s AND key = %s RETURNING nbytes", (segment.object, key)
    ).fetchone()
    if intent is None or int(intent[0]) != segment.object_bytes:
        raise SegmentLost(
            f"the upload {segment.object} was collected before its commit (slower than the GC grace); "
            "nothing was published: try again"
        )
    insert_segment(
        conn,
        f"INSERT INTO kv_segments (key, {SEGMENT_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (key, segment.first_record, segment.n_records, segment.object, segment.nbytes, segment.digest,
         segment.token, segment.complete, segment.codec, segment.stored_bytes, segment.check, segment.key_version),
    )  # fmt: skip


def put_blocks(conn: psycopg.Connection, key: str, first: int, chains: list[bytes]) -> None:
    if chains:
        conn.execute(
            "INSERT INTO kv_prefix (key, block, chain) SELECT %s, %s + i - 1, c "
            "FROM unnest(%s::bytea[]) WITH ORDINALITY AS q(c, i) ON CONFLICT (key, block) DO UPDATE SET chain = EXCLUDED.chain",
            (key, first, chains),
        )


def segment_of(row: Any) -> Segment:
    return Segment(
        int(row[0]), int(row[1]), str(row[2]), int(row[3]), bytes(row[4]), int(row[5]), bool(row[6]), str(row[7]),
        None if row[8] is None else int(row[8]), None if row[9] is None else bytes(row[9]),
        None if row[10] is None else int(row[10]),
    )  # fmt: skip


def hold_lease(conn: psycopg.Connection, key: str, token: int) -> None:
    """Lock the session's lease row for this transaction and check that ``token`` still holds it,
    unexpired on PostgreSQL's clock: the fencing check every write under a lease starts with."""
    row = conn.execute(
        "SELECT token, expires_at > clock_timestamp() FROM kv_leases WHERE key = %s FOR UPDATE", (key,)
    ).fetchone()
    if row is None:
        raise StaleLease(f"session {public_id(key)!r} has no lease (deleted?); nothing was published")
    if int(row[0]) != token:
        raise StaleLease(
            f"fencing token {token} of session {public_id(key)!r} was superseded by {row[0]} (another replica took "
            "the session over); nothing was published"
        )
    if not row[1]:
        raise LeaseExpired(f"the lease of token {token} on session {public_id(key)!r} expired; nothing was published")


def lock_session(conn: psycopg.Connection, key: str, columns: LiteralString = "1") -> tuple:
    """Lock the session's row for this transaction and return ``columns`` of it (SQL column names
    of ``kv_sessions``, written by the caller); :class:`SessionNotFound` when there is none."""
    row = conn.execute(f"SELECT {columns} FROM kv_sessions WHERE key = %s FOR UPDATE", (key,)).fetchone()
    if row is None:
        raise SessionNotFound(f"no session {public_id(key)!r}")
    return row


def fit(conn: psycopg.Connection, grow: int, limit: int | None) -> None:
    """Refuse a write that takes the store past ``limit`` bytes (every session's header and
    objects), run last in the write's transaction, after its rows are written: the advisory lock
    serializes the writes that grow the store until they commit, so concurrent ones cannot overshoot
    the limit together, and the sum already counts this write's ``grow`` bytes."""
    if limit is None or grow <= 0:
        return
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (LIMIT_LOCK,))
    row = conn.execute("SELECT coalesce(sum(size_bytes), 0) FROM kv_sessions").fetchone()
    used = int(row[0]) if row is not None else 0
    if used > limit:
        raise BudgetExceeded(
            f"writing {grow} bytes would take the shared store to {used} bytes, over its hard limit of {limit}; "
            "nothing was written. Delete or park sessions, or raise the limit"
        )


def within_cap(conn: psycopg.Connection, owner: str, cap: int | None) -> None:
    """Refuse a new session of ``owner`` past ``cap`` sessions, run in the transaction that inserted
    its row: the insert's trigger counted it in ``kv_owners`` and holds that owner's row until the
    commit, so concurrent creates of one owner (on any replica) take turns and cannot overshoot."""
    if cap is None:
        return
    row = conn.execute("SELECT sessions FROM kv_owners WHERE owner = %s", (owner,)).fetchone()
    held = (int(row[0]) if row is not None else 0) - 1  # the owner's sessions before this one
    if held >= cap:
        raise TooManySessions(
            f"owner {owner!r} has {held} sessions, the most one owner may have (--max-sessions-per-owner "
            f"{cap}); nothing was created: delete sessions no longer needed, then create again"
        )


def extend_lease(conn: psycopg.Connection, key: str, ttl: float) -> None:
    """Extend the session's lease by ``ttl`` seconds from now (PostgreSQL's clock), inside a
    transaction that checked it (:func:`hold_lease`): a write under the lease renews it."""
    conn.execute(
        "UPDATE kv_leases SET expires_at = clock_timestamp() + %s * interval '1 second' WHERE key = %s",
        (float(ttl), key),
    )


def drop_objects(conn: psycopg.Connection, listed: list[str]) -> list[str]:
    """Queue for GC those of ``listed`` (objects whose rows were just deleted) no session lists
    any more; returned. A reader of an older snapshot may still fetch them during the grace."""
    dropped = unlisted(conn, listed)
    conn.execute(
        "INSERT INTO kv_dropped (object) SELECT unnest(%s::text[]) ON CONFLICT (object) DO NOTHING", (dropped,)
    )
    return dropped
