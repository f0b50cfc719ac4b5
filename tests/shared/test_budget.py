"""The global budget of a shared store (``kvstore serve --index --blobs --budget``): after a write, the
least recently used sessions of every replica (the index's LRU, ``kv_sessions.last_used_ns``) are
parked, then deleted, until the whole store fits; the session written, sessions being written and objects still
listed by a fork are kept. Two replicas over a real PostgreSQL and a real S3 server."""

from __future__ import annotations

from shared.rows import rec_bytes, records
from shared.test_replicas import api_key, append, client, create, replicas, resume, shared_store  # noqa: F401  (fixtures)

ROWS = 10


def test_the_budget_deletes_the_least_recently_used_sessions_of_every_replica(
    replicas,  # noqa: F811
    api_key,  # noqa: F811
    shared_store,  # noqa: F811
):
    session_bytes = 40 + ROWS * rec_bytes()
    budget = 3 * session_bytes + session_bytes // 2  # room for three sessions
    first = replicas("r1", "--budget", str(budget))
    second = replicas("r2", "--budget", str(budget))
    with client(first, api_key) as to_first, client(second, api_key) as to_second:
        for n, http in enumerate((to_first, to_second, to_first)):  # s0, s1, s2: within the budget
            create(http, f"s{n}")
            assert append(http, f"s{n}", records(n, 0, ROWS)).status_code == 200
        kept_image = resume(to_second, "s0")  # s0 is now the most recently used
        forked = to_second.post("/sessions/s1/fork", json={"id": "f1", "at": ROWS // 2})  # past the budget
        assert forked.status_code == 201, forked.text
        # the fork (half a session) pushed the store over: s1, least recently used, went, through r2
        assert to_first.get("/sessions/s1").status_code == 404
        listed = {s["id"] for s in to_first.get("/sessions").json()["sessions"]}
        assert listed == {"s0", "s2", "f1"}
        assert resume(to_first, "f1") == records(1, 0, ROWS)[: (ROWS // 2) * rec_bytes()]  # its objects stayed
        create(to_first, "s3")
        assert append(to_first, "s3", records(3, 0, ROWS)).status_code == 200  # written through r1: s2 goes
        listed = {s["id"] for s in to_second.get("/sessions").json()["sessions"]}
        assert listed == {"s0", "f1", "s3"}
        assert resume(to_second, "s0") == kept_image
        usage = sum(s["size_bytes"] for s in to_second.get("/sessions").json()["sessions"])
        assert usage <= budget
        metrics = to_first.get("/metrics").text
        assert 'kvstore_evictions_total{action="deleted"} 1.0' in metrics
        assert f"kvstore_store_budget_bytes {float(budget)}" in metrics
    # nothing a session lists was deleted; what the evicted sessions alone listed is gone once GC
    # has taken the objects parking replaced (they wait out a grace for readers of older snapshots)
    shared_store.gc(grace=0)
    listed_objects = {s.object for key in ("s0~alice", "f1~alice", "s3~alice") for s in shared_store.segments(key)}
    assert {i.name for i in shared_store.blobs.list("seg")} == listed_objects
