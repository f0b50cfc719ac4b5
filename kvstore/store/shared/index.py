# Over 700 lines: one class, one PostgreSQL transaction per method (sessions, leases with fencing, expiry), each method short; splitting would scatter the fencing rules they share.
"""The shared index: sessions, leases with fencing tokens and the commit point, in PostgreSQL.

Every method is one transaction (``with conn.transaction()``) on a pooled connection
(:class:`~kvstore.store.shared.pool.ConnectionPool`: a server that cannot be reached is
:class:`~kvstore.errors.IndexUnavailable`, and the next call connects again). Decisions that depend
on time (lease expiry, GC grace) use PostgreSQL's ``clock_timestamp()``: one clock for every replica.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import psycopg
from psycopg.types.json import Jsonb

from kvstore.errors import (
    InvalidRequest,
    LeaseHeld,
    RecordCountMismatch,
    SegmentLost,
    SessionExists,
    SessionNotFound,
)
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.store.shared.pool import DEFAULT_POOL_SIZE, redacted_url
from kvstore.store.shared.rewrites import Rewrites
from kvstore.store.shared.rows import (
    SEGMENT_COLUMNS,
    Grant,
    ReadPlan,
    Segment,
    extend_lease,
    fit,
    hold_lease,
    insert_segment,
    lock_session,
    put_blocks,
    segment_of,
    unlisted,
    within_cap,
)
from kvstore.store.values import public_id


def _drop_if_expired(conn: psycopg.Connection, key: str, now_ns: int) -> list[str]:
    """Delete session ``key`` in ``conn``'s transaction if it expired at ``now_ns`` and no writer
    holds its lease (a row another transaction holds is left to it); the objects to delete."""
    gone = conn.execute(
        "SELECT key FROM kv_sessions s WHERE key = %(key)s AND s.expires_ns <= %(now_ns)s AND NOT EXISTS "
        "(SELECT 1 FROM kv_leases l WHERE l.key = s.key AND l.expires_at > clock_timestamp()) "
        "FOR UPDATE SKIP LOCKED",
        {"key": key, "now_ns": now_ns},
    ).fetchall()
    return drop_sessions(conn, [key])[key] if gone else []


__all__ = ["DEFAULT_POOL_SIZE", "Grant", "ReadPlan", "Segment", "SharedIndex", "redacted_url"]

#: ``pg_advisory_xact_lock`` key serializing eviction across replicas.
EVICT_LOCK = 0x6B7673_0002

#: The columns of a session's row as :meth:`SharedIndex.session` gives it.
SESSION_COLUMNS = (
    "key, owner, header, rec_bytes, n_records, size_bytes, watermark, record, state, "
    "created_ns, updated_ns, last_used_ns, ttl_ns, expires_ns"
)
#: The condition a row of ``kv_sessions`` (as ``s``) meets while its session has not expired; the
#: statement passes ``now_ns`` (this replica's clock, the one its writes stamp last_used_ns with).
LIVE = "(s.expires_ns IS NULL OR s.expires_ns > %(now_ns)s)"


def drop_sessions(conn: psycopg.Connection, keys: list[str]) -> dict[str, list[str]]:
    """Delete the sessions ``keys`` (rows locked by the caller), their segments and intents, in the
    caller's transaction: per key, the objects no session lists any more (the caller deletes them
    from the object store after the commit). What a delete, an eviction and the expiry sweep share."""
    listed: dict[str, list[str]] = {key: [] for key in keys}
    for key, name in conn.execute("DELETE FROM kv_segments WHERE key = ANY(%s) RETURNING key, object", (keys,)):
        listed[key].append(name)
    pending: dict[str, list[str]] = {key: [] for key in keys}
    for key, name in conn.execute("DELETE FROM kv_pending WHERE key = ANY(%s) RETURNING key, object", (keys,)):
        pending[key].append(name)
    conn.execute("DELETE FROM kv_sessions WHERE key = ANY(%s)", (keys,))
    return {key: unlisted(conn, listed[key]) + pending[key] for key in keys}


class SharedIndex(Rewrites):
    """The shared index at ``url``: sessions, leases, commits and reads (one transaction per call);
    the side tables are :class:`Housekeeping`'s, the connections :class:`ConnectionPool`'s."""

    def __init__(self, url: str, **options: Any):
        super().__init__(url, **options)
        # told the keys epoch (kv_meta 'keys_epoch') every read plan saw, in the plan's snapshot:
        # the encrypted store's keyring drops the keys a shred destroyed (kvstore.store.shared.keys)
        self.on_key_epoch: list[Callable[[int], None]] = []

    # ------------------------------------------------------------------ sessions
    def create_session(
        self,
        key: str,
        owner: str,
        header: bytes,
        rec_bytes: int,
        record: dict[str, Any],
        now_ns: int,
        *,
        hard_limit: int | None = None,
        max_sessions: int | None = None,
        ttl_ns: int | None = None,
    ) -> list[str]:
        """A new empty session (``SessionExists``; ``BudgetExceeded`` past ``hard_limit``;
        ``TooManySessions`` when its owner already has ``max_sessions``); ``ttl_ns``: its own
        time-to-live. An expired session of that key not swept yet (no live lease) is deleted first,
        in the same transaction: returns its objects, for the caller to delete."""

        def body(conn: psycopg.Connection) -> list[str]:
            with conn.transaction():
                objects = _drop_if_expired(conn, key, now_ns)
                row = conn.execute(
                    "INSERT INTO kv_sessions (key, owner, header, rec_bytes, record, created_ns, updated_ns, last_used_ns, "
                    "ttl_ns) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (key) DO NOTHING RETURNING key",
                    (key, owner, header, rec_bytes, Jsonb(record), now_ns, now_ns, now_ns, ttl_ns),
                ).fetchone()
                if row is None:
                    raise SessionExists(f"session {public_id(key)!r} already exists")
                within_cap(conn, owner, max_sessions)
                fit(conn, HEADER_BYTES, hard_limit)
                return objects

        return self.run("creating a session", body)

    def session(self, key: str) -> dict[str, Any]:
        """The session's row as a dict (``SessionNotFound`` when there is none, or it expired: an
        expired session is gone whether or not the sweep deleted it yet)."""

        def body(conn: psycopg.Connection) -> dict[str, Any]:
            cur = conn.execute(
                f"SELECT {SESSION_COLUMNS} FROM kv_sessions s WHERE key = %(key)s AND {LIVE}",
                {"key": key, "now_ns": time.time_ns()},
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
                lock_session(conn, key)
                return drop_sessions(conn, [key])[key]

        return self.run("deleting a session", body)

    def sessions(
        self,
        owner: str | None = None,
        *,
        after: tuple[int, str] | None = None,
        limit: int | None = None,
        state: str | None = None,
    ) -> list[dict[str, Any]]:
        """Live sessions' rows (``owner``: that owner's only; ``state``: in that state only), oldest first
        (``created_ns``, then key), as :meth:`session` gives them: after the position ``after``
        (keyset paging: an index range, ``kv_sessions_listing`` or ``kv_sessions_created``), at most
        ``limit`` (None: all)."""
        created, key = after if after is not None else (-1, "")

        def body(conn: psycopg.Connection) -> list[dict[str, Any]]:
            cur = conn.execute(
                f"SELECT {SESSION_COLUMNS} FROM kv_sessions s "
                "WHERE (%(owner)s::text IS NULL OR owner = %(owner)s) AND (%(state)s::text IS NULL OR state = %(state)s) "
                f"AND (created_ns, key) > (%(created)s, %(key)s) AND {LIVE} ORDER BY created_ns, key LIMIT %(limit)s",
                {
                    "owner": owner,
                    "state": state,
                    "created": created,
                    "key": key,
                    "limit": limit,
                    "now_ns": time.time_ns(),
                },
            )
            names = [column.name for column in cur.description or ()]
            found = [dict(zip(names, row)) for row in cur.fetchall()]
            for row in found:
                row["header"] = bytes(row["header"])
            return found

        return self.run("listing sessions", body)

    def counts(self, owner: str | None = None) -> list[tuple[str, bytes, int, int]]:
        """``(state, header, sessions, bytes)`` per state and distinct header (model geometry and
        tier) of ``owner``'s sessions (None: every owner's): one aggregate in PostgreSQL."""

        def body(conn: psycopg.Connection) -> list[tuple[str, bytes, int, int]]:
            rows = conn.execute(
                "SELECT state, header, count(*), coalesce(sum(size_bytes), 0) FROM kv_sessions "
                "WHERE %(owner)s::text IS NULL OR owner = %(owner)s GROUP BY state, header",
                {"owner": owner},
            ).fetchall()
            return [(str(r[0]), bytes(r[1]), int(r[2]), int(r[3])) for r in rows]

        return self.run("counting sessions", body)

    def existing(self, keys: list[str]) -> set[str]:
        """Those of ``keys`` that are sessions, not expired (one query)."""

        def body(conn: psycopg.Connection) -> set[str]:
            found = conn.execute(
                f"SELECT key FROM kv_sessions s WHERE key = ANY(%(keys)s) AND {LIVE}",
                {"keys": keys, "now_ns": time.time_ns()},
            )
            return {str(r[0]) for r in found}

        return self.run("looking up sessions", body)

    def owner_sessions(self, owner: str) -> int:
        """How many sessions ``owner`` has (``kv_owners``, kept by a trigger: one row)."""

        def body(conn: psycopg.Connection) -> int:
            row = conn.execute("SELECT sessions FROM kv_owners WHERE owner = %s", (owner,)).fetchone()
            return int(row[0]) if row is not None else 0

        return self.run("counting an owner's sessions", body)

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
                hold_lease(conn, key, token)
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
                put_blocks(conn, key, *blocks)

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
        """The keys of every owner's session named ``session_id`` (expired ones are gone)."""

        def body(conn: psycopg.Connection) -> list[str]:
            prefix = session_id + "~"  # keys are <id>~<owner>; an id holds no '~'
            rows = conn.execute(
                f"SELECT key FROM kv_sessions s WHERE left(key, %(n)s) = %(prefix)s AND {LIVE} ORDER BY key",
                {"n": len(prefix), "prefix": prefix, "now_ns": time.time_ns()},
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

    def evict(
        self, budget_bytes: int, keep: Iterable[str] = (), states: Iterable[str] = ("active", "parked")
    ) -> list[tuple[str, int, list[str]]]:
        """Delete least recently used sessions (the global LRU, every replica's) until the store's
        bytes fit ``budget_bytes``, in one transaction: ``(key, freed bytes, objects no session
        lists any more)`` per session deleted, least recently used first.

        Only sessions in ``states`` are deleted. Skipped: ``keep``, sessions with a live lease (being written) and sessions whose row another
        transaction holds (a fork copying from it, a delete). One evictor at a time across replicas
        (a transaction advisory lock), so two replicas never evict twice for one excess.
        """
        kept, wanted = list(keep), list(states)

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
                    "WHERE s.state = ANY(%s) AND NOT (s.key = ANY(%s)) AND NOT EXISTS "
                    "(SELECT 1 FROM kv_leases l WHERE l.key = s.key AND l.expires_at > clock_timestamp())) ranked "
                    "WHERE running - size_bytes < %s",
                    (wanted, kept, excess),
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
                dropped = drop_sessions(conn, [key for key, _ in victims])
                return [(key, size, dropped[key]) for key, size in victims]

        return self.run("evicting sessions", body)

    # ------------------------------------------------------------------ expiry
    def set_ttl(self, key: str, ttl_ns: int | None, now_ns: int) -> None:
        """Set (None: drop) a live session's own time-to-live; the change is a use (last_used_ns =
        ``now_ns``), so it expires that long from now (``SessionNotFound``: none, or expired)."""

        def body(conn: psycopg.Connection) -> None:
            row = conn.execute(
                f"UPDATE kv_sessions s SET ttl_ns = %(ttl)s, last_used_ns = greatest(last_used_ns, %(now_ns)s), "
                f"updated_ns = %(now_ns)s WHERE key = %(key)s AND {LIVE} RETURNING key",
                {"ttl": ttl_ns, "now_ns": now_ns, "key": key},
            ).fetchone()
            if row is None:
                raise SessionNotFound(f"no session {public_id(key)!r}")

        self.run("setting a session's time-to-live", body)

    def owner_ttl(self, owner: str) -> int | None:
        """``owner``'s default time-to-live in ns (None: none)."""

        def body(conn: psycopg.Connection) -> int | None:
            row = conn.execute("SELECT ttl_ns FROM kv_owner_ttl WHERE owner = %s", (owner,)).fetchone()
            return int(row[0]) if row is not None else None

        return self.run("reading an owner's time-to-live", body)

    def set_owner_ttl(self, owner: str, ttl_ns: int | None, now_ns: int) -> int:
        """Set (None: drop) ``owner``'s default time-to-live, and move the expiry of the owner's live
        sessions without one of their own to match (the trigger recomputes it), in one transaction;
        how many sessions it moved. An expired session stays expired."""

        def body(conn: psycopg.Connection) -> int:
            with conn.transaction():
                if ttl_ns is None:
                    conn.execute("DELETE FROM kv_owner_ttl WHERE owner = %s", (owner,))
                else:
                    conn.execute(
                        "INSERT INTO kv_owner_ttl (owner, ttl_ns) VALUES (%s, %s) "
                        "ON CONFLICT (owner) DO UPDATE SET ttl_ns = EXCLUDED.ttl_ns",
                        (owner, ttl_ns),
                    )
                moved = conn.execute(
                    f"UPDATE kv_sessions s SET ttl_ns = ttl_ns WHERE owner = %(owner)s AND ttl_ns IS NULL AND {LIVE}",
                    {"owner": owner, "now_ns": now_ns},
                )
                return moved.rowcount

        return self.run("setting an owner's time-to-live", body)

    def drop_expired(self, key: str, now_ns: int) -> list[str]:
        """Delete session ``key`` if it expired at ``now_ns`` and no writer holds its lease (before a
        fork into its id; a create does the same in its own transaction); the objects to delete."""

        def body(conn: psycopg.Connection) -> list[str]:
            with conn.transaction():
                return _drop_if_expired(conn, key, now_ns)

        return self.run("deleting an expired session", body)

    def expired_keys(self, now_ns: int, limit: int) -> list[str]:
        """At most ``limit`` keys of sessions expired at ``now_ns``, soonest expired first (the
        front of ``kv_sessions_expiry``, never every row)."""

        def body(conn: psycopg.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT key FROM kv_sessions WHERE expires_ns <= %s ORDER BY expires_ns, key LIMIT %s",
                (now_ns, limit),
            )
            return [str(r[0]) for r in rows]

        return self.run("finding expired sessions", body)

    def expire(self, keys: list[str], now_ns: int) -> list[tuple[str, str, int, int, list[str]]]:
        """Delete those of ``keys`` still expired at ``now_ns`` in one transaction: each row locked
        (``FOR UPDATE SKIP LOCKED``: one a fork, a delete or a lease grant holds is skipped), then
        its expiry read again under the lock, and any live lease looked for again (a writer using
        it keeps it). ``(key, owner, expires_ns, freed bytes, objects no session lists any more)``
        per session deleted; the caller deletes the objects."""

        def body(conn: psycopg.Connection) -> list[tuple[str, str, int, int, list[str]]]:
            with conn.transaction():
                locked = conn.execute(
                    "SELECT key FROM kv_sessions WHERE key = ANY(%s) ORDER BY key FOR UPDATE SKIP LOCKED", (keys,)
                ).fetchall()
                # read again now that they are locked (a statement of its own: it sees every commit
                # before it), so a use or a lease since the list was read keeps the session
                victims = conn.execute(
                    "SELECT key, owner, expires_ns, size_bytes FROM kv_sessions s WHERE key = ANY(%s) "
                    "AND expires_ns <= %s AND NOT EXISTS (SELECT 1 FROM kv_leases l WHERE l.key = s.key "
                    "AND l.expires_at > clock_timestamp()) ORDER BY expires_ns, key",
                    ([r[0] for r in locked], now_ns),
                ).fetchall()
                dropped = drop_sessions(conn, [str(r[0]) for r in victims])
                return [(str(k), str(o), int(e), int(n), dropped[str(k)]) for k, o, e, n in victims]

        return self.run("deleting expired sessions", body) if keys else []

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
                hold_lease(conn, key, token)
                extend_lease(conn, key, ttl)

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
                f"SELECT {SEGMENT_COLUMNS} FROM kv_segments WHERE key = %s AND object = %s",
                (key, object_name),
            ).fetchone()
            return segment_of(row) if row is not None else None

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
        hard_limit: int | None = None,
        check: bytes | None = None,
        stored_bytes: int | None = None,
        key_version: int | None = None,
    ) -> tuple[Segment, bool]:
        """The commit point: record the segment and the new count, fenced by ``token``.

        ``complete``: the segment ends a turn; the session's watermark moves to its end.
        ``request``: the client's idempotency key and the digest of its request, recorded with the
        result in the same transaction (:meth:`request_result` answers a retry from it).
        ``blocks``: ``(first block, chain hashes)`` of the prefix blocks the new watermark completes.
        ``check``: the records' BLAKE3-256, which reads match (``rows.check_of``).
        ``stored_bytes``, ``key_version``: a sealed object's own size and the owner's data-key
        version it is sealed under (kvstore.store.shared.keys; None: a plaintext object).

        Returns the segment and whether this call committed it (False: an earlier attempt did).

        Raises
        ------
        StaleLease : ``token`` is no longer the session's lease token (another writer took over)
        LeaseExpired : the lease ran out (PostgreSQL's clock)
        RecordCountMismatch : the session holds another count than ``start``
        SegmentLost : the upload's intent was collected (upload again)
        SessionNotFound : the session was deleted
        BudgetExceeded : the segment would take the store past ``hard_limit`` bytes
        """

        def body(conn: psycopg.Connection) -> tuple[Segment, bool]:
            with conn.transaction():
                # an attempt whose answer was lost may have committed already: answer it the same
                row = conn.execute(
                    f"SELECT {SEGMENT_COLUMNS} FROM kv_segments WHERE key = %s AND object = %s",
                    (key, object_name),
                ).fetchone()
                if row is not None:
                    return segment_of(row), False
                hold_lease(conn, key, token)
                count = lock_session(conn, key, "n_records, rec_bytes")
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
                nbytes = n_records * int(count[1])
                if int(intent[0]) != (nbytes if stored_bytes is None else stored_bytes):
                    raise SegmentLost(f"the upload {object_name} holds {intent[0]} bytes, not {n_records} records")
                stored = nbytes if stored_bytes is None else stored_bytes
                insert_segment(
                    conn,
                    "INSERT INTO kv_segments (key, first_record, n_records, object, nbytes, digest, token, complete, "
                    "check_digest, stored_bytes, key_version) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                    (key, start, n_records, object_name, nbytes, digest, token, complete, check, stored_bytes,
                     key_version),
                )  # fmt: skip
                conn.execute(
                    "UPDATE kv_sessions SET n_records = %(end)s, size_bytes = size_bytes + %(nbytes)s, "
                    "watermark = CASE WHEN %(complete)s THEN %(end)s ELSE watermark END, "
                    "updated_ns = %(now)s, last_used_ns = %(now)s WHERE key = %(key)s",
                    {"end": start + n_records, "nbytes": stored, "complete": complete, "now": now_ns, "key": key},
                )
                extend_lease(conn, key, ttl)
                if request is not None:
                    # a key already there means two requests raced past request_result under one
                    # lease, which the fence rules out: the unique violation rolls this back
                    conn.execute(
                        "INSERT INTO kv_idempotency (key, request_key, request_digest, first_record, end_record) "
                        "VALUES (%s, %s, %s, %s, %s)",
                        (key, request[0], request[1], start, start + n_records),
                    )
                put_blocks(conn, key, *blocks)
                fit(conn, stored, hard_limit)
                segment = Segment(
                    start, n_records, object_name, nbytes, digest, token, complete, check=check,
                    stored_bytes=stored_bytes, key_version=key_version,
                )  # fmt: skip
                return segment, True

        return self.run("committing an append", body)

    # ------------------------------------------------------------------ reads
    def read_plan(self, key: str, start: int = 0, stop: int | None = None) -> ReadPlan:
        """The header, count and committed segments overlapping ``[start, stop)``, from one snapshot
        (``SessionNotFound``: no such session, or it expired)."""

        def body(conn: psycopg.Connection) -> ReadPlan:
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                row = conn.execute(
                    "SELECT header, rec_bytes, n_records, watermark, "
                    "(SELECT value FROM kv_meta WHERE name = 'keys_epoch') "
                    f"FROM kv_sessions s WHERE key = %(key)s AND {LIVE}",
                    {"key": key, "now_ns": time.time_ns()},
                ).fetchone()
                if row is None:
                    raise SessionNotFound(f"no session {public_id(key)!r}")
                n_records = int(row[2])
                end = n_records if stop is None else min(stop, n_records)
                rows = conn.execute(
                    f"SELECT {SEGMENT_COLUMNS} FROM kv_segments "
                    "WHERE key = %s AND first_record < %s AND first_record + n_records > %s ORDER BY first_record",
                    (key, end, start),
                ).fetchall()
            epoch = int(row[4]) if row[4] is not None else 0
            return ReadPlan(bytes(row[0]), int(row[1]), n_records, [segment_of(r) for r in rows], int(row[3]), epoch)

        plan = self.run("reading a session's segments", body)
        for seen in self.on_key_epoch:  # a shred elsewhere: the keys held here go before any object is read
            seen(plan.key_epoch)
        return plan

    def touch(self, key: str, now_ns: int) -> None:
        """Mark a session used now (the global LRU)."""

        def body(conn: psycopg.Connection) -> None:
            # an expired session is never brought back by a use (a reader that opened just before)
            conn.execute(
                f"UPDATE kv_sessions s SET last_used_ns = greatest(last_used_ns, %(now_ns)s) WHERE key = %(key)s AND {LIVE}",
                {"now_ns": now_ns, "key": key},
            )

        self.run("marking a session used", body)
