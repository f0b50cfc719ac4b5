"""The shared index: sessions, leases with fencing tokens and the commit point, in PostgreSQL.

Every method is one transaction (``with conn.transaction()``) on one connection per
:class:`SharedIndex`, used by one thread at a time. Any failure to reach PostgreSQL — refused,
dropped, the server shutting down or starting up — closes the connection and raises
:class:`~kvstore.errors.IndexUnavailable` with ``retry_after``; the next call connects again, so
the store resumes by itself when PostgreSQL is back. Decisions that depend on time (lease expiry,
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
from kvstore.store.shared import schema
from kvstore.store.values import public_id

T = TypeVar("T")


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
    """

    def __init__(self, url: str, *, connect_timeout: float = 3.0, retry_after: float = 1.0):
        self.url = url
        self.connect_timeout = connect_timeout
        self.retry_after = retry_after
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()
        self.run("creating the schema", self._ensure_schema)

    # ------------------------------------------------------------------ connection
    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> "SharedIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # a dead connection: closing it is all that is left to do
                pass

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.url, autocommit=True, connect_timeout=max(1, int(self.connect_timeout)), application_name="kvstore"
            )
        return self._conn

    def run(self, what: str, body: Callable[[psycopg.Connection], T]) -> T:
        """``body(conn)`` with PostgreSQL failures turned into :class:`IndexUnavailable`."""
        with self._lock:
            try:
                return body(self._connection())
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                self._drop()  # the next call connects again
                raise IndexUnavailable(
                    f"the shared index (PostgreSQL) is unavailable while {what} ({_first_line(exc)}); "
                    f"retry in {self.retry_after:g} s",
                    retry_after=self.retry_after,
                ) from None

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
                objects = [
                    r[0] for r in conn.execute("DELETE FROM kv_segments WHERE key = %s RETURNING object", (key,))
                ]
                objects += [
                    r[0] for r in conn.execute("DELETE FROM kv_pending WHERE key = %s RETURNING object", (key,))
                ]
                gone = conn.execute("DELETE FROM kv_sessions WHERE key = %s RETURNING key", (key,)).fetchone()
            if gone is None:
                raise SessionNotFound(f"no session {public_id(key)!r}")
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
                lease = conn.execute(
                    "SELECT token, expires_at > clock_timestamp() FROM kv_leases WHERE key = %s FOR UPDATE", (key,)
                ).fetchone()
                _check_lease(key, token, lease)
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
                row = conn.execute(
                    "SELECT token, expires_at > clock_timestamp() FROM kv_leases WHERE key = %s FOR UPDATE", (key,)
                ).fetchone()
                _check_lease(key, token, row)
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

    def committed(self, object_name: str) -> Segment | None:
        """The committed segment stored in ``object_name`` (None: not committed)."""

        def body(conn: psycopg.Connection) -> Segment | None:
            row = conn.execute(
                "SELECT first_record, n_records, object, nbytes, digest, token, complete FROM kv_segments WHERE object = %s",
                (object_name,),
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
    ) -> tuple[Segment, bool]:
        """The commit point: record the segment and the new count, fenced by ``token``.

        ``complete``: the segment ends a turn; the session's watermark moves to its end.

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
                    "SELECT first_record, n_records, object, nbytes, digest, token, complete FROM kv_segments WHERE object = %s",
                    (object_name,),
                ).fetchone()
                if row is not None:
                    return _segment(row), False
                lease = conn.execute(
                    "SELECT token, expires_at > clock_timestamp() FROM kv_leases WHERE key = %s FOR UPDATE", (key,)
                ).fetchone()
                _check_lease(key, token, lease)
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
                return Segment(start, n_records, object_name, nbytes, digest, token, complete), True

        return self.run("committing an append", body)

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

    def unreferenced(self, object_names: Iterable[str]) -> list[str]:
        """The names that neither a committed segment nor a live intent refers to (one snapshot)."""
        names = list(object_names)

        def body(conn: psycopg.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT n FROM unnest(%s::text[]) AS n WHERE NOT EXISTS (SELECT 1 FROM kv_segments s WHERE s.object = n) "
                "AND NOT EXISTS (SELECT 1 FROM kv_pending p WHERE p.object = n)",
                (names,),
            )
            return [r[0] for r in rows]

        return self.run("checking objects", body) if names else []

    def now(self) -> float:
        """PostgreSQL's clock, seconds since the epoch (the one clock of the protocol)."""
        return self.run(
            "reading the clock",
            lambda conn: float(conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()[0]),
        )  # type: ignore[index]


def _segment(row: Any) -> Segment:
    return Segment(int(row[0]), int(row[1]), str(row[2]), int(row[3]), bytes(row[4]), int(row[5]), bool(row[6]))


def _key_row(row: Any) -> dict[str, Any]:
    found = dict(zip(SharedIndex.KEY_COLUMNS, row))
    found["salt"] = bytes(found["salt"]) if found["salt"] is not None else None
    found["digest"] = bytes(found["digest"])
    return found


def _check_lease(key: str, token: int, row: Any) -> None:
    if row is None:
        raise StaleLease(f"session {public_id(key)!r} has no lease (deleted?); nothing was published")
    if int(row[0]) != token:
        raise StaleLease(
            f"fencing token {token} of session {public_id(key)!r} was superseded by {row[0]} (another replica took "
            "the session over); nothing was published"
        )
    if not row[1]:
        raise LeaseExpired(f"the lease of token {token} on session {public_id(key)!r} expired; nothing was published")
