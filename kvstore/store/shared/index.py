"""The shared index: sessions, leases with fencing tokens and the commit point, in PostgreSQL.

Every method is one transaction (``with conn.transaction()``) on a connection of a small pool per
:class:`SharedIndex` (``pool_size``, opened as concurrent calls need them, each used by one thread
at a time). Any failure to reach PostgreSQL — refused, dropped, the server shutting down or
starting up — closes the connection, retires every idle one opened before it (they reach the same
server) and raises :class:`~kvstore.errors.IndexUnavailable` with ``retry_after``; the next call
connects again, so the store resumes by itself when PostgreSQL is back. Decisions that depend on time (lease expiry,
GC grace) use PostgreSQL's ``clock_timestamp()``: one clock for every replica.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.types.json import Jsonb

from kvstore.errors import (
    IndexSchemaError,
    IndexUnavailable,
    InvalidRequest,
    LeaseExpired,
    LeaseHeld,
    RecordCountMismatch,
    SegmentLost,
    SessionExists,
    SessionNotFound,
    StaleLease,
)
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.migrations.index import PREFIX_BLOCK_TOKENS
from kvstore.store.shared import schema
from kvstore.store.values import public_id

T = TypeVar("T")

DEFAULT_POOL_SIZE = 4  # PostgreSQL connections per SharedIndex (100 replicas x 4 behind PgBouncer: docs/SCALE.md)

#: ``pg_advisory_xact_lock`` key serializing eviction across replicas.
EVICT_LOCK = 0x6B7673_0002


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

    @property
    def end(self) -> int:
        return self.first_record + self.n_records


@dataclass(frozen=True)
class ReadPlan:
    """What a read needs, from one snapshot: the header, the committed count, the segments."""

    header: bytes
    rec_bytes: int
    n_records: int
    segments: list[Segment]
    watermark: int = 0  # records of complete turns (what a resume serves), same snapshot


def redacted_url(url: str) -> str:
    """``url`` without its password, for messages and reports (a URL or a libpq ``key=value`` string)."""
    if "://" not in url:
        return re.sub(r"(password\s*=\s*)('[^']*'|\S+)", r"\1***", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _close_quietly(conn: psycopg.Connection) -> None:
    try:
        conn.close()
    except Exception:  # a dead connection: closing it is all that is left to do
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class SharedIndex:
    """A connection to the shared index at ``url`` (``postgresql://USER@HOST:PORT/DB``).

    Parameters
    ----------
    url : a libpq connection string or URL
    connect_timeout : seconds a connection attempt may take
    retry_after : the ``retry_after`` of :class:`IndexUnavailable` (seconds)
    pool_size : connections at most (calls beyond wait for one); a replica's concurrent requests
        use them in parallel
    """

    def __init__(
        self, url: str, *, connect_timeout: float = 3.0, retry_after: float = 1.0, pool_size: int = DEFAULT_POOL_SIZE
    ):
        self.url = url
        self.connect_timeout = connect_timeout
        self.retry_after = retry_after
        self._lock = threading.Lock()  # guards _idle, _generation, _closed
        self._slots = threading.BoundedSemaphore(max(1, pool_size))
        self._idle: list[tuple[int, psycopg.Connection]] = []  # (generation, connection), most recent last
        self._generation = 0  # bumped by every failure: connections of an older one are not reused
        self._closed = False
        self.run("creating the schema", self._ensure_schema)

    # ------------------------------------------------------------------ connection
    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for _, conn in idle:
            _close_quietly(conn)

    def __enter__(self) -> "SharedIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _checkout(self) -> tuple[int, psycopg.Connection]:
        with self._lock:
            while self._idle:
                generation, conn = self._idle.pop()  # the most recently used: its server answered last
                if generation == self._generation and not conn.closed:
                    return generation, conn
                _close_quietly(conn)
            generation = self._generation
        conn = psycopg.connect(
            self.url, autocommit=True, connect_timeout=max(1, int(self.connect_timeout)), application_name="kvstore"
        )
        return generation, conn

    def _checkin(self, generation: int, conn: psycopg.Connection) -> None:
        reusable = not conn.closed and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with self._lock:
            if reusable and generation == self._generation and not self._closed:
                self._idle.append((generation, conn))
                return
        _close_quietly(conn)

    def _failed(self) -> None:
        """PostgreSQL failed a call: the idle connections reach the same server, none is reused."""
        with self._lock:
            self._generation += 1
            idle, self._idle = self._idle, []
        for _, conn in idle:
            _close_quietly(conn)

    def run(self, what: str, body: Callable[[psycopg.Connection], T]) -> T:
        """``body(conn)`` on a pooled connection, PostgreSQL failures turned into :class:`IndexUnavailable`."""
        with self._slots:
            conn, generation = None, -1
            try:
                generation, conn = self._checkout()
                result = body(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if conn is not None:
                    _close_quietly(conn)
                self._failed()  # the next call connects again
                raise IndexUnavailable(
                    f"the shared index (PostgreSQL) is unavailable while {what} ({_first_line(exc)}); "
                    f"retry in {self.retry_after:g} s",
                    retry_after=self.retry_after,
                ) from None
            except BaseException:
                if conn is not None:
                    self._checkin(generation, conn)  # a refusal (typed error) leaves it idle and sound
                raise
            self._checkin(generation, conn)
            return result

    @staticmethod
    def _ensure_schema(conn: psycopg.Connection) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (schema.SCHEMA_LOCK,))
            conn.execute(schema.META_TABLE)
            row = conn.execute("SELECT value FROM kv_meta WHERE name = 'schema_version'").fetchone()
            current = int(row[0]) if row is not None else 0
            if current > schema.CURRENT_VERSION:
                raise IndexSchemaError(
                    f"the shared index is at schema version {current}, this kvstore knows up to "
                    f"{schema.CURRENT_VERSION}: upgrade kvstore on this replica"
                )
            for version in range(current + 1, schema.CURRENT_VERSION + 1):
                for statement in schema.STEPS[version]:
                    conn.execute(statement)  # type: ignore[arg-type]  # DDL text of our own, no parameters
            conn.execute(
                "INSERT INTO kv_meta (name, value) VALUES ('schema_version', %s) "
                "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value",
                (str(schema.CURRENT_VERSION),),
            )

    def version(self) -> int:
        def body(conn: psycopg.Connection) -> int:
            row = conn.execute("SELECT value FROM kv_meta WHERE name = 'schema_version'").fetchone()
            return int(row[0]) if row is not None else 0

        return self.run("reading the schema version", body)

    # ------------------------------------------------------------------ sessions
    def create_session(
        self, key: str, owner: str, header: bytes, rec_bytes: int, record: dict[str, Any], now_ns: int
    ) -> None:
        def body(conn: psycopg.Connection) -> None:
            with conn.transaction():
                row = conn.execute(
                    "INSERT INTO kv_sessions (key, owner, header, rec_bytes, record, created_ns, updated_ns, last_used_ns) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (key) DO NOTHING RETURNING key",
                    (key, owner, header, rec_bytes, Jsonb(record), now_ns, now_ns, now_ns),
                ).fetchone()
            if row is None:
                raise SessionExists(f"session {public_id(key)!r} already exists")

        self.run("creating a session", body)

    def session(self, key: str) -> dict[str, Any]:
        """The session's row as a dict (``SessionNotFound`` when there is none)."""

        def body(conn: psycopg.Connection) -> dict[str, Any]:
            cur = conn.execute(
                "SELECT key, owner, header, rec_bytes, n_records, size_bytes, watermark, record, state, "
                "created_ns, updated_ns, last_used_ns FROM kv_sessions WHERE key = %s",
                (key,),
            )
            row = cur.fetchone()
            if row is None:
                raise SessionNotFound(f"no session {public_id(key)!r}")
            names = [column.name for column in cur.description or ()]
            found = dict(zip(names, row))
            found["header"] = bytes(found["header"])
            return found

        return self.run("reading a session", body)

    def delete_session(self, key: str) -> list[str]:
        """Drop a session, its lease, segments and intents; returns the objects to delete from S3."""

        def body(conn: psycopg.Connection) -> list[str]:
            with conn.transaction():
                # the session's row first: a fork copying its segments holds it FOR SHARE, so the two
                # take turns and the check below sees the fork's rows
                gone = conn.execute("SELECT 1 FROM kv_sessions WHERE key = %s FOR UPDATE", (key,)).fetchone()
                if gone is None:
                    raise SessionNotFound(f"no session {public_id(key)!r}")
                listed = [r[0] for r in conn.execute("DELETE FROM kv_segments WHERE key = %s RETURNING object", (key,))]
                objects = _unlisted(conn, listed)
                objects += [
                    r[0] for r in conn.execute("DELETE FROM kv_pending WHERE key = %s RETURNING object", (key,))
                ]
                conn.execute("DELETE FROM kv_sessions WHERE key = %s", (key,))
            return objects

        return self.run("deleting a session", body)

    def sessions(self, owner: str | None = None) -> list[dict[str, Any]]:
        """Every session's row (``owner``: that owner's only), oldest first, as :meth:`session` gives it."""

        def body(conn: psycopg.Connection) -> list[dict[str, Any]]:
            cur = conn.execute(
                "SELECT key, owner, header, rec_bytes, n_records, size_bytes, watermark, record, state, "
                "created_ns, updated_ns, last_used_ns FROM kv_sessions WHERE %(owner)s::text IS NULL OR owner = %(owner)s "
                "ORDER BY created_ns, key",
                {"owner": owner},
            )
            names = [column.name for column in cur.description or ()]
            found = [dict(zip(names, row)) for row in cur.fetchall()]
            for row in found:
                row["header"] = bytes(row["header"])
            return found

        return self.run("listing sessions", body)

    def update_meta(
        self,
        key: str,
        token: int,
        *,
        record: dict[str, Any],
        watermark: int,
        created_ns: int,
        updated_ns: int,
        last_used_ns: int,
        complete: Iterable[int] = (),
        blocks: tuple[int, list[bytes]] = (0, []),
    ) -> None:
        """Set a session's metadata (the ``record`` fields, watermark, times) and mark the segments
        starting at ``complete`` as ending complete turns; fenced by ``token`` like a commit.

        Raises
        ------
        StaleLease, LeaseExpired : ``token`` no longer holds the lease; nothing was changed
        InvalidRequest : ``watermark`` is past the committed count
        """

        def body(conn: psycopg.Connection) -> None:
            with conn.transaction():
                _hold_lease(conn, key, token)
                row = conn.execute(
                    "UPDATE kv_sessions SET record = %s, watermark = %s, created_ns = %s, updated_ns = %s, "
                    "last_used_ns = %s WHERE key = %s AND n_records >= %s RETURNING key",
                    (Jsonb(record), watermark, created_ns, updated_ns, last_used_ns, key, watermark),
                ).fetchone()
                if row is None:
                    raise InvalidRequest(
                        f"session {public_id(key)!r}: watermark {watermark} is past its committed records"
                    )
                conn.execute(
                    "UPDATE kv_segments SET complete = true WHERE key = %s AND first_record = ANY(%s)",
                    (key, list(complete)),
                )
                _put_blocks(conn, key, *blocks)

        self.run("updating a session's metadata", body)

    def set_tags(self, key: str, tags: list[str], now_ns: int) -> None:
        """Replace a session's tags (metadata only: no lease, a commit never writes ``record``)."""

        def body(conn: psycopg.Connection) -> None:
            row = conn.execute(
                "UPDATE kv_sessions SET record = jsonb_set(record, '{tags}', %s), updated_ns = %s WHERE key = %s "
                "RETURNING key",
                (Jsonb(tags), now_ns, key),
            ).fetchone()
            if row is None:
                raise SessionNotFound(f"no session {public_id(key)!r}")

        self.run("setting a session's tags", body)

    def keys_of_id(self, session_id: str) -> list[str]:
        """The keys of every owner's session named ``session_id``."""

        def body(conn: psycopg.Connection) -> list[str]:
            prefix = session_id + "~"  # keys are <id>~<owner>; an id holds no '~'
            rows = conn.execute(
                "SELECT key FROM kv_sessions WHERE left(key, %s) = %s ORDER BY key", (len(prefix), prefix)
            )
            return [r[0] for r in rows]

        return self.run("looking up a session id", body)

    def usage(self) -> list[tuple[bytes, int, int]]:
        """``(header, sessions, bytes)`` per distinct header geometry and tier (40-byte header with nrec 0)."""

        def body(conn: psycopg.Connection) -> list[tuple[bytes, int, int]]:
            rows = conn.execute(
                "SELECT header, count(*), coalesce(sum(size_bytes), 0) FROM kv_sessions GROUP BY header"
            ).fetchall()
            return [(bytes(r[0]), int(r[1]), int(r[2])) for r in rows]

        return self.run("summing the store's use", body)

    def least_recently_used(self, limit: int = 100) -> list[str]:
        """Session keys, least recently used first, across every replica (the global LRU)."""

        def body(conn: psycopg.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT key FROM kv_sessions WHERE state = 'active' ORDER BY last_used_ns, key LIMIT %s", (limit,)
            )
            return [r[0] for r in rows]

        return self.run("reading the LRU", body)

    def evict(self, budget_bytes: int, keep: Iterable[str] = ()) -> list[tuple[str, int, list[str]]]:
        """Delete least recently used sessions (the global LRU, every replica's) until the store's
        bytes fit ``budget_bytes``, in one transaction: ``(key, freed bytes, objects no session
        lists any more)`` per session deleted, least recently used first.

        Skipped: ``keep``, sessions with a live lease (being written) and sessions whose row another
        transaction holds (a fork copying from it, a delete). One evictor at a time across replicas
        (a transaction advisory lock), so two replicas never evict twice for one excess.
        """
        kept = list(keep)

        def body(conn: psycopg.Connection) -> list[tuple[str, int, list[str]]]:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (EVICT_LOCK,))
                row = conn.execute("SELECT coalesce(sum(size_bytes), 0) FROM kv_sessions").fetchone()
                excess = (int(row[0]) if row is not None else 0) - budget_bytes
                if excess <= 0:
                    return []
                # the shortest run of least recently used sessions that covers the excess
                candidates = conn.execute(
                    "SELECT key FROM (SELECT key, size_bytes, last_used_ns, "
                    "sum(size_bytes) OVER (ORDER BY last_used_ns, key) AS running FROM kv_sessions s "
                    "WHERE s.state = 'active' AND NOT (s.key = ANY(%s)) AND NOT EXISTS "
                    "(SELECT 1 FROM kv_leases l WHERE l.key = s.key AND l.expires_at > clock_timestamp())) ranked "
                    "WHERE running - size_bytes < %s",
                    (kept, excess),
                ).fetchall()
                # locked first (as a delete does): a fork copying from one holds it, and is skipped
                locked = conn.execute(
                    "SELECT key, size_bytes FROM kv_sessions WHERE key = ANY(%s) ORDER BY last_used_ns, key "
                    "FOR UPDATE SKIP LOCKED",
                    ([r[0] for r in candidates],),
                ).fetchall()
                victims: list[tuple[str, int]] = []
                for key, size in locked:
                    if excess <= 0:
                        break
                    victims.append((str(key), int(size)))
                    excess -= int(size)
                names = [key for key, _ in victims]
                listed: dict[str, list[str]] = {key: [] for key in names}
                for key, name in conn.execute(
                    "DELETE FROM kv_segments WHERE key = ANY(%s) RETURNING key, object", (names,)
                ).fetchall():
                    listed[key].append(name)
                pending: dict[str, list[str]] = {key: [] for key in names}
                for key, name in conn.execute(
                    "DELETE FROM kv_pending WHERE key = ANY(%s) RETURNING key, object", (names,)
                ).fetchall():
                    pending[key].append(name)
                conn.execute("DELETE FROM kv_sessions WHERE key = ANY(%s)", (names,))
                return [(key, size, _unlisted(conn, listed[key]) + pending[key]) for key, size in victims]

        return self.run("evicting sessions", body)

    # ------------------------------------------------------------------ leases
    def acquire(self, key: str, holder: str, ttl: float) -> Grant:
        """Grant the session's lease with a new fencing token, if nobody holds a live one.

        Raises
        ------
        LeaseHeld : another holder's lease is live (``retry_after``: the seconds left on it)
        SessionNotFound : no such session
        """

        def body(conn: psycopg.Connection) -> Grant:
            with conn.transaction():
                granted = conn.execute(
                    "INSERT INTO kv_leases (key, holder, token, expires_at) "
                    "SELECT key, %(holder)s, nextval('kv_fencing'), clock_timestamp() + %(ttl)s * interval '1 second' "
                    "FROM kv_sessions WHERE key = %(key)s "
                    "ON CONFLICT (key) DO UPDATE SET holder = EXCLUDED.holder, token = EXCLUDED.token, "
                    "expires_at = EXCLUDED.expires_at WHERE kv_leases.expires_at <= clock_timestamp() "
                    "RETURNING token",
                    {"key": key, "holder": holder, "ttl": float(ttl)},
                ).fetchone()
                if granted is not None:
                    count = conn.execute("SELECT n_records FROM kv_sessions WHERE key = %s", (key,)).fetchone()
                    if count is None:  # the lease row references it: only a concurrent delete gets here
                        raise SessionNotFound(f"no session {public_id(key)!r}")
                    return Grant(key, holder, int(granted[0]), int(count[0]))
                held = conn.execute(
                    "SELECT holder, greatest(0, extract(epoch FROM expires_at - clock_timestamp()))::float8 "
                    "FROM kv_leases WHERE key = %s",
                    (key,),
                ).fetchone()
            if held is None:
                raise SessionNotFound(f"no session {public_id(key)!r}")
            raise LeaseHeld(
                f"session {public_id(key)!r} is being written by {held[0]} for {held[1]:.1f} s more; retry then",
                retry_after=float(held[1]),
            )

        return self.run("acquiring a lease", body)

    def renew(self, key: str, token: int, ttl: float) -> None:
        """Extend a live lease (``StaleLease``: taken over; ``LeaseExpired``: ran out)."""

        def body(conn: psycopg.Connection) -> None:
            with conn.transaction():
                _hold_lease(conn, key, token)
                conn.execute(
                    "UPDATE kv_leases SET expires_at = clock_timestamp() + %s * interval '1 second' WHERE key = %s",
                    (float(ttl), key),
                )

        self.run("renewing a lease", body)

    def release(self, key: str, token: int) -> None:
        """Expire the lease now, if ``token`` still holds it (the token stays: the next grant is larger)."""

        def body(conn: psycopg.Connection) -> None:
            conn.execute(
                "UPDATE kv_leases SET expires_at = clock_timestamp() WHERE key = %s AND token = %s", (key, token)
            )

        self.run("releasing a lease", body)

    # ------------------------------------------------------------------ the commit point
    def add_intent(self, key: str, token: int, object_name: str, nbytes: int) -> None:
        """Record an object about to be uploaded (so GC can find it if it is never committed)."""

        def body(conn: psycopg.Connection) -> None:
            conn.execute(
                "INSERT INTO kv_pending (object, key, token, nbytes) VALUES (%s, %s, %s, %s)",
                (object_name, key, token, nbytes),
            )

        self.run("recording an upload", body)

    def drop_intent(self, object_name: str) -> bool:
        """Forget an intent whose upload failed; True when it was still there (its object may go)."""

        def body(conn: psycopg.Connection) -> bool:
            return (
                conn.execute("DELETE FROM kv_pending WHERE object = %s RETURNING 1", (object_name,)).fetchone()
                is not None
            )

        return self.run("dropping an upload", body)

    def committed(self, key: str, object_name: str) -> Segment | None:
        """Session ``key``'s committed segment stored in ``object_name`` (None: not committed)."""

        def body(conn: psycopg.Connection) -> Segment | None:
            row = conn.execute(
                "SELECT first_record, n_records, object, nbytes, digest, token, complete FROM kv_segments "
                "WHERE key = %s AND object = %s",
                (key, object_name),
            ).fetchone()
            return _segment(row) if row is not None else None

        return self.run("looking up a segment", body)

    def commit(
        self,
        key: str,
        token: int,
        start: int,
        n_records: int,
        object_name: str,
        digest: bytes,
        ttl: float,
        now_ns: int,
        complete: bool = True,
        *,
        request: tuple[str, bytes] | None = None,
        blocks: tuple[int, list[bytes]] = (0, []),
    ) -> tuple[Segment, bool]:
        """The commit point: record the segment and the new count, fenced by ``token``.

        ``complete``: the segment ends a turn; the session's watermark moves to its end.
        ``request``: the client's idempotency key and the digest of its request, recorded with the
        result in the same transaction (:meth:`request_result` answers a retry from it).
        ``blocks``: ``(first block, chain hashes)`` of the prefix blocks the new watermark completes.

        Returns the segment and whether this call committed it (False: an earlier attempt did).

        Raises
        ------
        StaleLease : ``token`` is no longer the session's lease token (another writer took over)
        LeaseExpired : the lease ran out (PostgreSQL's clock)
        RecordCountMismatch : the session holds another count than ``start``
        SegmentLost : the upload's intent was collected (upload again)
        SessionNotFound : the session was deleted
        """

        def body(conn: psycopg.Connection) -> tuple[Segment, bool]:
            with conn.transaction():
                # an attempt whose answer was lost may have committed already: answer it the same
                row = conn.execute(
                    "SELECT first_record, n_records, object, nbytes, digest, token, complete FROM kv_segments "
                    "WHERE key = %s AND object = %s",
                    (key, object_name),
                ).fetchone()
                if row is not None:
                    return _segment(row), False
                _hold_lease(conn, key, token)
                count = conn.execute(
                    "SELECT n_records, rec_bytes FROM kv_sessions WHERE key = %s FOR UPDATE", (key,)
                ).fetchone()
                if count is None:
                    raise SessionNotFound(f"no session {public_id(key)!r}")
                if int(count[0]) != start:
                    raise RecordCountMismatch(
                        f"session {public_id(key)!r} holds {count[0]} records, the append expected {start}; "
                        "nothing was written",
                        current=int(count[0]),
                    )
                intent = conn.execute(
                    "DELETE FROM kv_pending WHERE object = %s AND key = %s RETURNING nbytes", (object_name, key)
                ).fetchone()
                if intent is None:
                    raise SegmentLost(
                        f"the upload {object_name} was collected before its commit (slower than the GC grace); "
                        "nothing was published: send the rows again"
                    )
                nbytes = int(intent[0])
                if nbytes != n_records * int(count[1]):
                    raise SegmentLost(f"the upload {object_name} holds {nbytes} bytes, not {n_records} records")
                conn.execute(
                    "INSERT INTO kv_segments (key, first_record, n_records, object, nbytes, digest, token, complete) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                    (key, start, n_records, object_name, nbytes, digest, token, complete),
                )
                conn.execute(
                    "UPDATE kv_sessions SET n_records = %(end)s, size_bytes = size_bytes + %(nbytes)s, "
                    "watermark = CASE WHEN %(complete)s THEN %(end)s ELSE watermark END, "
                    "updated_ns = %(now)s, last_used_ns = %(now)s WHERE key = %(key)s",
                    {"end": start + n_records, "nbytes": nbytes, "complete": complete, "now": now_ns, "key": key},
                )
                conn.execute(
                    "UPDATE kv_leases SET expires_at = clock_timestamp() + %s * interval '1 second' WHERE key = %s",
                    (float(ttl), key),
                )
                if request is not None:
                    # a key already there means two requests raced past request_result under one
                    # lease, which the fence rules out: the unique violation rolls this back
                    conn.execute(
                        "INSERT INTO kv_idempotency (key, request_key, request_digest, first_record, end_record) "
                        "VALUES (%s, %s, %s, %s, %s)",
                        (key, request[0], request[1], start, start + n_records),
                    )
                _put_blocks(conn, key, *blocks)
                return Segment(start, n_records, object_name, nbytes, digest, token, complete), True

        return self.run("committing an append", body)

    def request_result(self, key: str, request_key: str) -> tuple[bytes, int, int] | None:
        """``(request digest, first record, end record)`` of the append session ``key`` committed
        under the client's idempotency key ``request_key`` (None: none did)."""

        def body(conn: psycopg.Connection) -> tuple[bytes, int, int] | None:
            row = conn.execute(
                "SELECT request_digest, first_record, end_record FROM kv_idempotency WHERE key = %s AND request_key = %s",
                (key, request_key),
            ).fetchone()
            return (bytes(row[0]), int(row[1]), int(row[2])) if row is not None else None

        return self.run("looking up an idempotency key", body)

    # ------------------------------------------------------------------ fork and truncate
    def fork_session(
        self,
        source: str,
        new_key: str,
        at: int,
        expected: list[tuple[int, str]],
        replacement: Segment | None,
        record: dict[str, Any],
        watermark: int,
        now_ns: int,
    ) -> None:
        """Publish a fork in one transaction: the new session's row, the source's segment rows that
        end at or before ``at`` (the objects are shared: immutable, named once), ``replacement`` (a
        new object holding the records of a segment cut by ``at``) and the prefix blocks below the
        fork's watermark.

        ``expected``: ``(first_record, object)`` of the source's segments starting before ``at`` as the
        caller planned them; a source changed since (truncated) refuses the fork, nothing written.

        Raises
        ------
        SessionNotFound : the source is gone
        SessionExists : ``new_key`` exists
        RecordCountMismatch : the source changed since the plan (fork again)
        SegmentLost : the replacement's intent was collected (upload again)
        """

        def body(conn: psycopg.Connection) -> None:
            with conn.transaction():
                # FOR SHARE: a delete or truncate of the source waits for this fork (and sees its rows)
                src = conn.execute(
                    "SELECT owner, header, rec_bytes, n_records FROM kv_sessions WHERE key = %s FOR SHARE", (source,)
                ).fetchone()
                if src is None:
                    raise SessionNotFound(f"no session {public_id(source)!r}")
                listed = conn.execute(
                    "SELECT first_record, object FROM kv_segments WHERE key = %s AND first_record < %s ORDER BY first_record",
                    (source, at),
                ).fetchall()
                if int(src[3]) < at or [(int(r[0]), str(r[1])) for r in listed] != expected:
                    raise RecordCountMismatch(
                        f"session {public_id(source)!r} changed while it was being forked; nothing was written: fork again",
                        current=int(src[3]),
                    )
                made = conn.execute(
                    "INSERT INTO kv_sessions (key, owner, header, rec_bytes, n_records, size_bytes, watermark, record, "
                    "created_ns, updated_ns, last_used_ns) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (key) DO NOTHING RETURNING key",
                    (
                        new_key, src[0], src[1], src[2], at, HEADER_BYTES + at * int(src[2]), watermark, Jsonb(record),
                        now_ns, now_ns, now_ns,
                    ),
                ).fetchone()  # fmt: skip
                if made is None:
                    raise SessionExists(f"session {public_id(new_key)!r} already exists")
                conn.execute(
                    "INSERT INTO kv_segments (key, first_record, n_records, object, nbytes, digest, token, complete) "
                    "SELECT %s, first_record, n_records, object, nbytes, digest, token, complete FROM kv_segments "
                    "WHERE key = %s AND first_record + n_records <= %s",
                    (new_key, source, at),
                )
                if replacement is not None:
                    _publish_replacement(conn, new_key, replacement)
                conn.execute(
                    "INSERT INTO kv_prefix (key, block, chain) SELECT %s, block, chain FROM kv_prefix "
                    "WHERE key = %s AND block < %s",
                    (new_key, source, watermark // PREFIX_BLOCK_TOKENS),
                )

        self.run("forking a session", body)

    def truncate(
        self, key: str, token: int, keep: int, replacement: Segment | None, ttl: float, now_ns: int
    ) -> list[str]:
        """A commit that shortens session ``key`` to ``keep`` records, fenced by ``token``: the
        segment rows ending past ``keep`` go, ``replacement`` (a new object with the records of a
        segment cut by ``keep``) comes, the watermark becomes ``min(watermark, keep)`` and the
        prefix blocks past it go. The objects no session lists any more are queued for GC
        (``kv_dropped``: a reader of an older snapshot may still fetch them during the grace) and
        returned.

        Raises
        ------
        StaleLease, LeaseExpired : fenced; nothing changed
        InvalidRequest : ``keep`` is past the committed count
        SegmentLost : the replacement's intent was collected (upload again)
        """

        def body(conn: psycopg.Connection) -> list[str]:
            with conn.transaction():
                _hold_lease(conn, key, token)
                row = conn.execute(
                    "SELECT n_records, rec_bytes, watermark FROM kv_sessions WHERE key = %s FOR UPDATE", (key,)
                ).fetchone()
                if row is None:
                    raise SessionNotFound(f"no session {public_id(key)!r}")
                if keep > int(row[0]):
                    raise InvalidRequest(
                        f"session {public_id(key)!r} holds {row[0]} records; cannot truncate to {keep}"
                    )
                listed = [
                    r[0]
                    for r in conn.execute(
                        "DELETE FROM kv_segments WHERE key = %s AND first_record + n_records > %s RETURNING object",
                        (key, keep),
                    )
                ]
                if replacement is not None:
                    _publish_replacement(conn, key, replacement)
                watermark = min(int(row[2]), keep)
                conn.execute(
                    "UPDATE kv_sessions SET n_records = %s, watermark = %s, size_bytes = %s, updated_ns = %s "
                    "WHERE key = %s",
                    (keep, watermark, HEADER_BYTES + keep * int(row[1]), now_ns, key),
                )
                conn.execute(
                    "DELETE FROM kv_prefix WHERE key = %s AND block >= %s", (key, watermark // PREFIX_BLOCK_TOKENS)
                )
                conn.execute(
                    "UPDATE kv_leases SET expires_at = clock_timestamp() + %s * interval '1 second' WHERE key = %s",
                    (float(ttl), key),
                )
                dropped = _unlisted(conn, listed)
                conn.execute(
                    "INSERT INTO kv_dropped (object) SELECT unnest(%s::text[]) ON CONFLICT (object) DO NOTHING",
                    (dropped,),
                )
                return dropped

        return self.run("truncating a session", body)

    # ------------------------------------------------------------------ prefix blocks
    def prefix_tail(self, key: str) -> tuple[int, bytes | None]:
        """``(blocks recorded, chain hash of the last one)`` of session ``key`` (blocks 0.. are contiguous)."""

        def body(conn: psycopg.Connection) -> tuple[int, bytes | None]:
            row = conn.execute(
                "SELECT block, chain FROM kv_prefix WHERE key = %s ORDER BY block DESC LIMIT 1", (key,)
            ).fetchone()
            return (int(row[0]) + 1, bytes(row[1])) if row is not None else (0, None)

        return self.run("reading a session's prefix blocks", body)

    def prefix_matches(self, owner: str, chains: list[bytes]) -> list[dict[str, Any]]:
        """The sessions of ``owner`` whose block ``k`` has the chain hash ``chains[k]``, each with the
        number of leading blocks it matches (``depth``) and its counts, from one snapshot.

        A chain hash covers every block before it (and the owner and fingerprint: the seed), so the
        deepest block matched is the depth."""

        def body(conn: psycopg.Connection) -> list[dict[str, Any]]:
            cur = conn.execute(
                "SELECT p.key, max(q.i)::bigint AS depth, s.n_records, s.watermark, s.last_used_ns, s.state, s.header "
                "FROM unnest(%s::bytea[]) WITH ORDINALITY AS q(chain, i) "
                "JOIN kv_prefix p ON p.chain = q.chain AND p.block = q.i - 1 "
                "JOIN kv_sessions s ON s.key = p.key AND s.owner = %s "
                "GROUP BY p.key, s.n_records, s.watermark, s.last_used_ns, s.state, s.header",
                (chains, owner),
            )
            names = [column.name for column in cur.description or ()]
            found = [dict(zip(names, row)) for row in cur.fetchall()]
            for row in found:
                row["header"] = bytes(row["header"])
            return found

        return self.run("looking up a prefix", body) if chains else []

    # ------------------------------------------------------------------ reads
    def read_plan(self, key: str, start: int = 0, stop: int | None = None) -> ReadPlan:
        """The header, count and committed segments overlapping ``[start, stop)``, from one snapshot."""

        def body(conn: psycopg.Connection) -> ReadPlan:
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                row = conn.execute(
                    "SELECT header, rec_bytes, n_records, watermark FROM kv_sessions WHERE key = %s", (key,)
                ).fetchone()
                if row is None:
                    raise SessionNotFound(f"no session {public_id(key)!r}")
                n_records = int(row[2])
                end = n_records if stop is None else min(stop, n_records)
                rows = conn.execute(
                    "SELECT first_record, n_records, object, nbytes, digest, token, complete FROM kv_segments "
                    "WHERE key = %s AND first_record < %s AND first_record + n_records > %s ORDER BY first_record",
                    (key, end, start),
                ).fetchall()
            return ReadPlan(bytes(row[0]), int(row[1]), n_records, [_segment(r) for r in rows], int(row[3]))

        return self.run("reading a session's segments", body)

    def touch(self, key: str, now_ns: int) -> None:
        """Mark a session used now (the global LRU)."""

        def body(conn: psycopg.Connection) -> None:
            conn.execute(
                "UPDATE kv_sessions SET last_used_ns = greatest(last_used_ns, %s) WHERE key = %s", (now_ns, key)
            )

        self.run("marking a session used", body)

    # ------------------------------------------------------------------ API keys
    KEY_COLUMNS = ("id", "owner", "salt", "digest", "created", "expires", "revoked", "hint")

    def key_rows(self) -> list[dict[str, Any]]:
        """Every API key's row (:attr:`KEY_COLUMNS`), in the order they were added."""

        def body(conn: psycopg.Connection) -> list[dict[str, Any]]:
            rows = conn.execute(
                "SELECT id, owner, salt, digest, created, expires, revoked, hint FROM kv_keys ORDER BY position"
            ).fetchall()
            return [_key_row(row) for row in rows]

        return self.run("reading the API keys", body)

    def add_key(self, row: dict[str, Any]) -> None:
        """Store a new key's row; an id the index already holds is refused (:class:`InvalidRequest`)."""

        def body(conn: psycopg.Connection) -> None:
            added = conn.execute(
                "INSERT INTO kv_keys (id, owner, salt, digest, created, expires, revoked, hint) "
                "VALUES (%(id)s, %(owner)s, %(salt)s, %(digest)s, %(created)s, %(expires)s, %(revoked)s, %(hint)s) "
                "ON CONFLICT (id) DO NOTHING RETURNING id",
                {name: row.get(name) for name in self.KEY_COLUMNS},
            ).fetchone()
            if added is None:
                raise InvalidRequest(f"the shared index already holds an API key with id {row['id']!r}")

        self.run("storing an API key", body)

    def revoke_key(self, key_id: str, when: Any) -> tuple[dict[str, Any], bool] | None:
        """Mark key ``key_id`` revoked at ``when``: ``(row, changed)``; None when no key has that id.
        A key revoked before keeps its first revocation time."""

        def body(conn: psycopg.Connection) -> tuple[dict[str, Any], bool] | None:
            with conn.transaction():
                row = conn.execute(
                    "SELECT id, owner, salt, digest, created, expires, revoked, hint FROM kv_keys WHERE id = %s "
                    "FOR UPDATE",
                    (key_id,),
                ).fetchone()
                if row is None:
                    return None
                if row[6] is not None:
                    return _key_row(row), False
                row = conn.execute(
                    "UPDATE kv_keys SET revoked = %s WHERE id = %s "
                    "RETURNING id, owner, salt, digest, created, expires, revoked, hint",
                    (when, key_id),
                ).fetchone()
                return _key_row(row), True

        return self.run("revoking an API key", body)

    # ------------------------------------------------------------------ garbage collection
    def take_stale_intents(self, grace: float) -> list[str]:
        """Remove intents older than ``grace`` seconds; their objects are the caller's to delete.

        The rows go first, in their own transaction: a commit racing with this either took the
        intent (and this returns nothing for it) or finds it gone (``SegmentLost``).
        """

        def body(conn: psycopg.Connection) -> list[str]:
            rows = conn.execute(
                "DELETE FROM kv_pending WHERE created_at < clock_timestamp() - %s * interval '1 second' RETURNING object",
                (float(grace),),
            )
            return [r[0] for r in rows]

        return self.run("collecting stale uploads", body)

    def take_dropped(self, grace: float) -> list[str]:
        """Remove the objects a truncate dropped more than ``grace`` seconds ago and no session
        lists; they are the caller's to delete."""

        def body(conn: psycopg.Connection) -> list[str]:
            rows = conn.execute(
                "DELETE FROM kv_dropped d WHERE dropped_at < clock_timestamp() - %s * interval '1 second' "
                "AND NOT EXISTS (SELECT 1 FROM kv_segments s WHERE s.object = d.object) RETURNING object",
                (float(grace),),
            )
            return [r[0] for r in rows]

        return self.run("collecting dropped objects", body)

    def forget_requests(self, older_than: float) -> int:
        """Drop idempotency keys older than ``older_than`` seconds; how many went."""

        def body(conn: psycopg.Connection) -> int:
            cur = conn.execute(
                "DELETE FROM kv_idempotency WHERE created_at < clock_timestamp() - %s * interval '1 second'",
                (float(older_than),),
            )
            return cur.rowcount

        return self.run("forgetting old idempotency keys", body)

    def unreferenced(self, object_names: Iterable[str]) -> list[str]:
        """The names that neither a committed segment, a live intent nor the GC queue of dropped
        objects refers to (one snapshot)."""
        names = list(object_names)

        def body(conn: psycopg.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT n FROM unnest(%s::text[]) AS n WHERE NOT EXISTS (SELECT 1 FROM kv_segments s WHERE s.object = n) "
                "AND NOT EXISTS (SELECT 1 FROM kv_pending p WHERE p.object = n) "
                "AND NOT EXISTS (SELECT 1 FROM kv_dropped d WHERE d.object = n)",
                (names,),
            )
            return [r[0] for r in rows]

        return self.run("checking objects", body) if names else []

    def now(self) -> float:
        """PostgreSQL's clock, seconds since the epoch (the one clock of the protocol)."""

        def body(conn: psycopg.Connection) -> float:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
            if row is None:  # a SELECT of one value always returns its row
                raise IndexUnavailable("the shared index returned no clock reading", retry_after=self.retry_after)
            return float(row[0])

        return self.run("reading the clock", body)


def _unlisted(conn: psycopg.Connection, objects: list[str]) -> list[str]:
    """Those of ``objects`` no session's segment row lists (run after deleting the rows that did)."""
    if not objects:
        return []
    rows = conn.execute(
        "SELECT DISTINCT n FROM unnest(%s::text[]) AS n WHERE NOT EXISTS (SELECT 1 FROM kv_segments s WHERE s.object = n)",
        (objects,),
    )
    return [r[0] for r in rows]


def _publish_replacement(conn: psycopg.Connection, key: str, segment: Segment) -> None:
    """Insert a segment uploaded under an intent (the rows of a cut segment), taking its intent."""
    intent = conn.execute(
        "DELETE FROM kv_pending WHERE object = %s AND key = %s RETURNING nbytes", (segment.object, key)
    ).fetchone()
    if intent is None or int(intent[0]) != segment.nbytes:
        raise SegmentLost(
            f"the upload {segment.object} was collected before its commit (slower than the GC grace); "
            "nothing was published: try again"
        )
    conn.execute(
        "INSERT INTO kv_segments (key, first_record, n_records, object, nbytes, digest, token, complete) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
        (key, segment.first_record, segment.n_records, segment.object, segment.nbytes, segment.digest,
         segment.token, segment.complete),
    )  # fmt: skip


def _put_blocks(conn: psycopg.Connection, key: str, first: int, chains: list[bytes]) -> None:
    if chains:
        conn.execute(
            "INSERT INTO kv_prefix (key, block, chain) SELECT %s, %s + i - 1, c "
            "FROM unnest(%s::bytea[]) WITH ORDINALITY AS q(c, i) ON CONFLICT (key, block) DO UPDATE SET chain = EXCLUDED.chain",
            (key, first, chains),
        )


def _segment(row: Any) -> Segment:
    return Segment(int(row[0]), int(row[1]), str(row[2]), int(row[3]), bytes(row[4]), int(row[5]), bool(row[6]))


def _key_row(row: Any) -> dict[str, Any]:
    found: dict[str, Any] = dict(zip(SharedIndex.KEY_COLUMNS, row))
    found["salt"] = bytes(found["salt"]) if found["salt"] is not None else None
    found["digest"] = bytes(found["digest"])
    return found


def _hold_lease(conn: psycopg.Connection, key: str, token: int) -> None:
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
