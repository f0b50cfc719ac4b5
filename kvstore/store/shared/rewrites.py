"""The shared index's transactions that rewrite a session's segment list: fork, truncate, and the
swap of objects that park, unpark and migrate commit (``kvstore.store.shared.recode``)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from kvstore.errors import InvalidRequest, RecordCountMismatch, SessionExists, SessionNotFound
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.migrations.index import PREFIX_BLOCK_TOKENS
from kvstore.store.shared.housekeeping import Housekeeping
from kvstore.store.shared.rows import (
    SEGMENT_COLUMNS,
    SIZE_OF,
    Segment,
    drop_objects,
    extend_lease,
    fit,
    hold_lease,
    lock_session,
    publish_replacement,
    put_blocks,
    within_cap,
)
from kvstore.store.values import public_id


class Rewrites(Housekeeping):
    """Fork, truncate and object swaps of the shared index (each one transaction)."""

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
        *,
        hard_limit: int | None = None,
        max_sessions: int | None = None,
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
        BudgetExceeded : the fork would take the store past ``hard_limit`` bytes
        TooManySessions : the source's owner already has ``max_sessions``
        """

        def body(conn: psycopg.Connection) -> None:
            with conn.transaction():
                # FOR SHARE: a delete or truncate of the source waits for this fork (and sees its rows)
                src = conn.execute(
                    "SELECT owner, header, rec_bytes, n_records, state, ttl_ns FROM kv_sessions WHERE key = %s FOR SHARE",
                    (source,),
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
                    "created_ns, updated_ns, last_used_ns, ttl_ns) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (key) DO NOTHING RETURNING key",
                    (
                        new_key, src[0], src[1], src[2], at, HEADER_BYTES + at * int(src[2]), watermark, Jsonb(record),
                        now_ns, now_ns, now_ns, src[5],  # a fork keeps its source's own time-to-live
                    ),
                ).fetchone()  # fmt: skip
                if made is None:
                    raise SessionExists(f"session {public_id(new_key)!r} already exists")
                within_cap(conn, str(src[0]), max_sessions)
                conn.execute(
                    f"INSERT INTO kv_segments (key, {SEGMENT_COLUMNS}) SELECT %s, {SEGMENT_COLUMNS} FROM kv_segments "
                    "WHERE key = %s AND first_record + n_records <= %s",
                    (new_key, source, at),
                )
                if replacement is not None:
                    publish_replacement(conn, new_key, replacement)
                # a parked source's objects are compressed: the fork takes its state and their sizes
                size = conn.execute(
                    f"UPDATE kv_sessions SET state = %s, size_bytes = {SIZE_OF} WHERE key = %s RETURNING size_bytes",
                    (src[4], new_key, new_key),
                ).fetchone()
                fit(conn, int(size[0]) if size is not None else 0, hard_limit)
                conn.execute(
                    "INSERT INTO kv_prefix (key, block, chain) SELECT %s, block, chain FROM kv_prefix "
                    "WHERE key = %s AND block < %s",
                    (new_key, source, watermark // PREFIX_BLOCK_TOKENS),
                )

        self.run("forking a session", body)

    def truncate(
        self,
        key: str,
        token: int,
        keep: int,
        replacement: Segment | None,
        ttl: float,
        now_ns: int,
        *,
        record_patch: dict[str, Any] | None = None,
    ) -> list[str]:
        """A commit that shortens session ``key`` to ``keep`` records, fenced by ``token``: the
        segment rows ending past ``keep`` go, ``replacement`` (a new object with the records of a
        segment cut by ``keep``) comes, the watermark becomes ``min(watermark, keep)`` and the
        prefix blocks past it go; ``record_patch`` (fields of the record: a repair's problem) is
        merged in. The objects no session lists any more are queued for GC
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
                hold_lease(conn, key, token)
                row = lock_session(conn, key, "n_records, rec_bytes, watermark")
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
                    publish_replacement(conn, key, replacement)
                watermark = min(int(row[2]), keep)
                conn.execute(
                    f"UPDATE kv_sessions SET n_records = %s, watermark = %s, size_bytes = {SIZE_OF}, updated_ns = %s, "
                    "record = record || %s WHERE key = %s",
                    (keep, watermark, key, now_ns, Jsonb(record_patch or {}), key),
                )
                conn.execute(
                    "DELETE FROM kv_prefix WHERE key = %s AND block >= %s", (key, watermark // PREFIX_BLOCK_TOKENS)
                )
                extend_lease(conn, key, ttl)
                return drop_objects(conn, listed)

        return self.run("truncating a session", body)

    def replace_segments(
        self,
        key: str,
        token: int,
        replaced: list[Segment],
        new: list[Segment],
        ttl: float,
        now_ns: int,
        *,
        state: str | None = None,
        header: bytes | None = None,
        record_patch: dict[str, Any] | None = None,
        blocks: list[bytes] | None = None,
        hard_limit: int | None = None,
    ) -> list[str]:
        """Swap segment objects of session ``key`` for others holding the same records, fenced by
        ``token``: what park (compressed copies), unpark (plain copies) and migrate (the records in
        another tier) commit. The rows of ``replaced`` go, ``new`` (uploaded under intents) come; the
        session's size follows its objects; ``state``, ``header`` (with its record size),
        ``record_patch`` and ``blocks`` (every prefix block, from block 0) are set when given. The
        objects no session lists any more are queued for GC and returned.

        Raises
        ------
        StaleLease, LeaseExpired : fenced; nothing changed
        RecordCountMismatch : the session's segments are no longer ``replaced`` (do it again)
        SegmentLost : an upload's intent was collected (upload again)
        BudgetExceeded : the new objects would take the store past ``hard_limit`` bytes
        """

        def body(conn: psycopg.Connection) -> list[str]:
            with conn.transaction():
                hold_lease(conn, key, token)
                row = lock_session(conn, key, "size_bytes")
                gone = conn.execute(
                    "DELETE FROM kv_segments WHERE key = %s AND (first_record, object) IN "
                    "(SELECT * FROM unnest(%s::bigint[], %s::text[])) RETURNING object",
                    (key, [r.first_record for r in replaced], [r.object for r in replaced]),
                ).fetchall()
                if len(gone) != len(replaced):
                    raise RecordCountMismatch(
                        f"session {public_id(key)!r} changed while its objects were rewritten; nothing was changed",
                        current=-1,
                    )
                for segment in new:
                    publish_replacement(conn, key, segment)
                if header is not None:
                    conn.execute(
                        "UPDATE kv_sessions SET header = %s, rec_bytes = %s WHERE key = %s",
                        (header, coli_kv.parse_header(header).rec_bytes, key),
                    )
                size = conn.execute(
                    f"UPDATE kv_sessions SET size_bytes = {SIZE_OF}, state = coalesce(%s, state), updated_ns = %s, "
                    "record = record || %s WHERE key = %s RETURNING size_bytes",
                    (key, state, now_ns, Jsonb(record_patch or {}), key),
                ).fetchone()
                if blocks is not None:
                    conn.execute("DELETE FROM kv_prefix WHERE key = %s", (key,))
                    put_blocks(conn, key, 0, blocks)
                extend_lease(conn, key, ttl)
                dropped = drop_objects(conn, [str(r[0]) for r in gone])
                fit(conn, (int(size[0]) if size is not None else 0) - int(row[0]), hard_limit)
                return dropped

        return self.run("rewriting a session's objects", body)
