"""The shared index's connections: a small pool of PostgreSQL connections, one transaction per call.

Every call runs ``body(conn)`` on a connection of a small pool (``pool_size``, opened as concurrent
calls need them, each used by one thread at a time). Any failure to reach PostgreSQL — refused,
dropped, the server shutting down or starting up — closes the connection, retires every idle one
opened before it (they reach the same server) and raises :class:`~kvstore.errors.IndexUnavailable`
with ``retry_after``; the next call connects again, so the store resumes by itself when PostgreSQL
is back. The schema is created or upgraded on the first connection (``kvstore.store.shared.schema``).
"""

from __future__ import annotations

import re
import threading
from typing import Callable, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg

from kvstore.errors import IndexSchemaError, IndexUnavailable
from kvstore.store.shared import schema

T = TypeVar("T")

DEFAULT_POOL_SIZE = 4  # PostgreSQL connections per index client (100 replicas x 4 behind PgBouncer: docs/SCALE.md)


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


class ConnectionPool:
    """Connections to the shared index at ``url`` (``postgresql://USER@HOST:PORT/DB``).

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
        # The schema is made (or checked) by the first call that reaches PostgreSQL: a replica started
        # while the index is down starts anyway, answers 503 until it is back, then attaches by itself.
        self._schema_ready = False
        self._schema_lock = threading.Lock()
        try:
            self.run("creating the schema", lambda conn: None)
        except IndexUnavailable:
            pass  # every call raises it until the server answers; callers say so in their terms

    # ------------------------------------------------------------------ connection
    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for _, conn in idle:
            _close_quietly(conn)

    def __enter__(self) -> "ConnectionPool":
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
                if not self._schema_ready:
                    self._schema(conn)
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

    def _schema(self, conn: psycopg.Connection) -> None:
        """Make or upgrade the schema, once per pool (the first call that reaches PostgreSQL)."""
        with self._schema_lock:
            if not self._schema_ready:
                self._ensure_schema(conn)
                self._schema_ready = True

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

    def now(self) -> float:
        """PostgreSQL's clock, seconds since the epoch (the one clock of the protocol)."""

        def body(conn: psycopg.Connection) -> float:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
            if row is None:  # a SELECT of one value always returns its row
                raise IndexUnavailable("the shared index returned no clock reading", retry_after=self.retry_after)
            return float(row[0])

        return self.run("reading the clock", body)
