"""A replica's PostgreSQL connections are a small pool: a request held up in PostgreSQL (a commit
waiting for a row lock) does not hold up the replica's other requests, and a pool that saw
PostgreSQL fail reconnects by itself."""

from __future__ import annotations

import threading

import httpx
import psycopg
import pytest

from kvstore.errors import IndexUnavailable
from kvstore.store.shared import SharedIndex
from shared.rows import records
from shared.test_replicas import api_key, append, client, create, replicas  # noqa: F401  (fixtures)


def test_a_request_waiting_in_postgres_does_not_hold_up_the_others(replicas, api_key, index_url):  # noqa: F811
    server = replicas("r1")
    with client(server, api_key) as http, psycopg.connect(index_url, autocommit=True) as other:
        create(http, "busy")
        create(http, "free")
        held: list[httpx.Response] = []
        with other.transaction():
            other.execute("SELECT 1 FROM kv_sessions WHERE key = 'busy~alice' FOR NO KEY UPDATE")
            thread = threading.Thread(target=lambda: held.append(append(http, "busy", records(1, 0, 2))))
            thread.start()
            while not other.execute(  # the append's commit waits for the row lock, on one connection
                "SELECT 1 FROM pg_stat_activity WHERE application_name = 'kvstore' AND wait_event_type = 'Lock'"
            ).fetchone():
                pass
            with client(server, api_key) as second:
                second.timeout = httpx.Timeout(20.0)
                for _ in range(3):  # answered on the other connections meanwhile
                    assert second.get("/sessions/free").status_code == 200
                    assert append(second, "free", records(2, 0, 1)).status_code == 200
            assert not held  # still waiting
        thread.join(timeout=60)
    assert held[0].status_code == 200 and held[0].json()["turn"] == [0, 2], held[0].text


def backend_pid(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def test_the_pool_reconnects_after_postgres_failed(index_url):
    with SharedIndex(index_url, pool_size=3) as index:
        pids = set()
        barrier = threading.Barrier(3)

        def busy(conn):
            barrier.wait(timeout=10)  # three calls at once: three connections
            return backend_pid(conn)

        threads = [threading.Thread(target=lambda: pids.add(index.run("pid", busy))) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(pids) == 3
        with psycopg.connect(index_url, autocommit=True) as admin:  # the server drops every pooled connection
            admin.execute("SELECT pg_terminate_backend(pid, 10000) FROM unnest(%s::int[]) AS pid", (list(pids),))
        with pytest.raises(IndexUnavailable):
            index.run("pid", backend_pid)
        fresh = index.run("pid", backend_pid)  # the next call: a new connection, the other dead ones retired
        assert fresh not in pids
        assert index.now() > 0 and index.run("pid", backend_pid) == fresh
