"""The shared index's side tables: idempotency keys, prefix blocks, API keys and garbage collection.

:class:`Housekeeping` holds the calls on the tables beside sessions, segments and leases
(``kv_idempotency``, ``kv_prefix``, ``kv_keys``, ``kv_pending``, ``kv_dropped``); each is one
transaction. :class:`~kvstore.store.shared.index.SharedIndex` adds sessions, leases and commits.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import psycopg
from psycopg.types.json import Jsonb

from kvstore.errors import InvalidRequest
from kvstore.store.shared.pool import ConnectionPool


class Housekeeping(ConnectionPool):
    """Idempotency keys, prefix blocks, API keys and garbage collection of the shared index."""

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
                "AND (s.expires_ns IS NULL OR s.expires_ns > %s) "  # an expired session is gone: never matched
                "GROUP BY p.key, s.n_records, s.watermark, s.last_used_ns, s.state, s.header",
                (chains, owner, time.time_ns()),
            )
            names = [column.name for column in cur.description or ()]
            found = [dict(zip(names, row)) for row in cur.fetchall()]
            for row in found:
                row["header"] = bytes(row["header"])
            return found

        return self.run("looking up a prefix", body) if chains else []

    # ------------------------------------------------------------------ jobs
    def put_job(self, job: dict[str, Any]) -> None:
        """Publish a job's state (``kvstore.api.jobs.Job.to_dict`` plus its ``owner``), replacing
        what was published of it before."""

        def body(conn: psycopg.Connection) -> None:
            conn.execute(
                "INSERT INTO kv_jobs (id, owner, job, finished) VALUES (%s, %s, %s, %s) ON CONFLICT (id) DO UPDATE "
                "SET job = EXCLUDED.job, finished = EXCLUDED.finished, updated_at = clock_timestamp()",
                (job["id"], job["owner"], Jsonb(job), job.get("finished") is not None),
            )

        self.run("publishing a job", body)

    def jobs_of(self, owner: str, job_id: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        """The jobs ``owner`` has (``job_id``: that one only), most recently updated last."""

        def body(conn: psycopg.Connection) -> list[dict[str, Any]]:
            rows = conn.execute(
                "SELECT job FROM (SELECT job, updated_at FROM kv_jobs WHERE owner = %s AND (%s::text IS NULL OR id = %s) "
                "ORDER BY updated_at DESC LIMIT %s) recent ORDER BY updated_at",
                (owner, job_id, job_id, limit),
            ).fetchall()
            return [dict(row[0]) for row in rows]

        return self.run("reading jobs", body)

    def forget_jobs(self, older_than: float) -> int:
        """Drop finished jobs last updated more than ``older_than`` seconds ago; how many went."""

        def body(conn: psycopg.Connection) -> int:
            cur = conn.execute(
                "DELETE FROM kv_jobs WHERE finished AND updated_at < clock_timestamp() - %s * interval '1 second'",
                (float(older_than),),
            )
            return cur.rowcount

        return self.run("forgetting old jobs", body)

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


def _key_row(row: Any) -> dict[str, Any]:
    found: dict[str, Any] = dict(zip(Housekeeping.KEY_COLUMNS, row))
    found["salt"] = bytes(found["salt"]) if found["salt"] is not None else None
    found["digest"] = bytes(found["digest"])
    return found
