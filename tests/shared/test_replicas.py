"""``kvstore serve --index --blobs``: replica processes over one shared store (a real PostgreSQL
cluster, a real S3 server), driven over HTTP: concurrent appends to one session through three
replicas, a replica SIGKILLed mid-append, a replica restarted with an empty --data, PostgreSQL
stopped and started, keys from the index on every replica, park, migrate and the hard limit."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import psycopg
import pytest

from kvstore.api.errors import SessionBusy, retry_after
from kvstore.api.replica import MISS_REFRESH_S
from kvstore.api.settings import Settings
from kvstore.errors import ConfigError, IndexUnavailable, LeaseHeld, SessionNotFound
from kvstore.formats import coli_kv
from kvstore.keys import IndexKeys
from kvstore.store.shared import BlobStore, SharedIndex, SharedStore
from served import ServeProcess, wait_job
from shared.rows import GEOMETRY, TIER, fingerprint_fields, rec_bytes, records

RAW = "application/octet-stream"
ARROW = "application/vnd.apache.arrow.stream"
LEASE_TTL = "2"  # seconds a dead replica holds a session


@pytest.fixture
def api_key(index_url) -> str:
    with IndexKeys(index_url) as keys:
        return keys.create("alice")[1]


@pytest.fixture
def replicas(tmp_path, child_env, api_key):
    """``start(name, endpoint=None)``: a ``kvstore serve`` replica process with its own --data; the
    shared store named by flags for ``r0``, by KVSTORE_INDEX_URL / KVSTORE_BLOBS_URL otherwise."""
    started: list[ServeProcess] = []

    def start(
        name: str, *options: str, endpoint: str | None = None, data: Path | None = None, ready_status: int = 200
    ) -> ServeProcess:
        env = {**child_env}
        if endpoint is not None:
            env["AWS_ENDPOINT_URL"] = endpoint
        extra = ["--lease-ttl", LEASE_TTL, *options]
        if name == "r0":
            extra += ["--index", env.pop("KVSTORE_INDEX_URL"), "--blobs", env.pop("KVSTORE_BLOBS_URL")]
        server = ServeProcess(data or tmp_path / name, *extra, env=env, ready_status=ready_status)
        started.append(server.start())
        return server

    yield start
    for server in started:
        if server.running():
            server.stop_cleanly()


@pytest.fixture
def shared_store(child_env):
    blobs = BlobStore(child_env["KVSTORE_BLOBS_URL"], endpoint_url=child_env["AWS_ENDPOINT_URL"])
    with SharedStore(SharedIndex(child_env["KVSTORE_INDEX_URL"]), blobs) as opened:
        yield opened


def client(server: ServeProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def create(http: httpx.Client, session_id: str) -> dict:
    answer = http.post(
        "/sessions",
        json={
            "id": session_id,
            **fingerprint_fields(),
        },
    )
    assert answer.status_code == 201, answer.text
    return answer.json()


def append(http: httpx.Client, session_id: str, body: bytes) -> httpx.Response:
    return http.post(f"/sessions/{session_id}/append", content=body, headers={"Content-Type": RAW})


def resume(http: httpx.Client, session_id: str, **params) -> bytes:
    answer = http.get(f"/sessions/{session_id}/resume", params=params)
    assert answer.status_code == 200, answer.text
    assert int(answer.headers["X-KV-Reused-Tokens"]) * rec_bytes() == len(answer.content)
    return answer.content


def check_acked(stored: bytes, acks: list[tuple[int, int, int, int]], rows: int) -> None:
    """Every acknowledged append ``(writer, seq, start, end)`` is in ``stored`` once, at its place,
    with its bytes; the acks tile the session; each writer's appends are in its order."""
    size = rec_bytes()
    spans = sorted((start, end) for _, _, start, end in acks)
    assert spans == [(i * rows, (i + 1) * rows) for i in range(len(acks))], "acks overlap or leave a gap"
    assert len(stored) == len(acks) * rows * size
    for writer, seq, start, end in acks:
        assert end - start == rows
        assert stored[start * size : end * size] == records(writer, seq, rows), f"writer {writer} append {seq}"
    for writer in {a[0] for a in acks}:
        starts = [start for _, _, start, _ in sorted(a for a in acks if a[0] == writer)]
        assert starts == sorted(starts), f"writer {writer}'s appends out of order"


def test_replicas_append_to_one_session_concurrently(replicas, api_key):
    servers = [replicas(f"r{i}") for i in range(3)]
    clients = [client(server, api_key) for server in servers]
    create(clients[0], "chat")
    appends, rows = 10, 3
    acks: list[tuple[int, int, int, int]] = []
    refused: list[str] = []
    lock = threading.Lock()

    def writer(w: int) -> None:
        for seq in range(appends):
            answer = append(clients[w], "chat", records(w, seq, rows))
            with lock:
                if answer.status_code != 200:
                    refused.append(answer.text)
                    return
                start, end = answer.json()["turn"]
                acks.append((w, seq, start, end))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not refused
    assert len(acks) == 3 * appends
    for http in clients:  # the same bytes through every replica
        check_acked(resume(http, "chat"), acks, rows)
        assert http.get("/sessions/chat").json()["n_records"] == 3 * appends * rows
    image = clients[2].get("/sessions/chat/resume", params={"format": "coli_kv", "verify": "true"})
    assert image.headers["X-KV-Verified"] == "true"
    assert coli_kv.parse_header(image.content[: coli_kv.HEADER_BYTES]).nrec == 3 * appends * rows
    assert image.content[coli_kv.HEADER_BYTES :] == resume(clients[0], "chat")
    for http in clients:
        http.close()


def test_sigkill_mid_append_another_replica_takes_over(replicas, api_key, fault_proxy, shared_store, index_url):
    # r1 reaches S3 through a proxy that can hold its uploads: it is caught inside an append, lease held
    victim = replicas("r1", endpoint=fault_proxy.endpoint)
    heir = replicas("r2")
    hasty = replicas("r3", "--lock-timeout", "0")  # does not wait for a lease
    to_victim, to_heir = client(victim, api_key), client(heir, api_key)
    create(to_victim, "chat")
    rows = 4
    acks = []
    for seq in range(5):
        answer = append(to_victim if seq % 2 == 0 else to_heir, "chat", records(1, seq, rows))
        assert answer.status_code == 200, answer.text
        acks.append((1, seq, *answer.json()["turn"]))
    fault_proxy.hold()
    outcome: list[object] = []
    caught = threading.Thread(
        target=lambda: outcome.append(_attempt(to_victim, "chat", records(1, 99, rows))), daemon=True
    )
    caught.start()
    with psycopg.connect(index_url, autocommit=True) as conn:
        while fault_proxy.held == 0:  # its upload waits at the proxy
            threading.Event().wait(0.02)
        lease = conn.execute(
            "SELECT holder, token, expires_at, expires_at > clock_timestamp() FROM kv_leases WHERE key = 'chat~alice'"
        ).fetchone()
        assert lease is not None and lease[3], "the victim holds the lease mid-append"
        with client(hasty, api_key) as to_hasty:
            refused = append(to_hasty, "chat", records(3, 0, rows))
        assert refused.status_code == 409 and refused.json()["error"] == "LeaseHeld", refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        victim.kill()
        caught.join(timeout=60)
        fault_proxy.release()
        assert outcome and isinstance(outcome[0], httpx.TransportError)  # never acknowledged
        answer = append(to_heir, "chat", records(2, 0, rows))  # waits out the dead replica's lease
        assert answer.status_code == 200, answer.text
        acks.append((2, 0, *answer.json()["turn"]))
        segment = conn.execute(
            "SELECT token, committed_at FROM kv_segments WHERE key = 'chat~alice' ORDER BY first_record DESC LIMIT 1"
        ).fetchone()
    assert segment is not None
    assert segment[0] > lease[1] and segment[1] >= lease[2]  # a newer token, after the lease ran out (PG's clock)
    check_acked(resume(to_heir, "chat"), acks, rows)  # 0 acknowledged rows lost, none unacknowledged
    shared_store.gc(grace=0)  # the victim's intent and upload are garbage; the session is untouched
    assert {i.name for i in shared_store.blobs.list("seg")} == {s.object for s in shared_store.segments("chat~alice")}
    check_acked(resume(to_heir, "chat"), acks, rows)
    to_victim.close()
    to_heir.close()


def _attempt(http: httpx.Client, session_id: str, body: bytes) -> object:
    try:
        return append(http, session_id, body)
    except httpx.TransportError as exc:
        return exc


def test_a_replica_restarted_with_an_empty_data_folder_serves_every_session(replicas, api_key, tmp_path):
    first = replicas("r1")
    with client(first, api_key) as http:
        written = {}
        for n in range(4):
            create(http, f"s{n}")
            for seq in range(n + 1):
                assert append(http, f"s{n}", records(n, seq, 5)).status_code == 200
            written[f"s{n}"] = resume(http, f"s{n}")
    first.stop_cleanly()
    shutil.rmtree(tmp_path / "r1")
    again = replicas("r1")  # the same folder, empty
    assert not any((tmp_path / "r1").iterdir())
    with client(again, api_key) as http:
        listed = {s["id"]: s for s in http.get("/sessions").json()["sessions"]}
        assert set(listed) == set(written)
        hits = 0
        for session_id, image in written.items():
            served = resume(http, session_id)
            hits += served == image and len(served) == listed[session_id]["watermark"] * rec_bytes()
        assert hits == len(written)  # every session, byte for byte: a 100% hit ratio across the restart
        # Arrow both ways: the rows served as Arrow batches, appended as Arrow to a new session
        rows = http.get("/sessions/s3/resume", params={"format": "arrow"})
        assert rows.status_code == 200, rows.text
        create(http, "copy")
        answer = http.post("/sessions/copy/append", content=rows.content, headers={"Content-Type": ARROW})
        assert answer.status_code == 200 and answer.json()["turn"] == [0, 20], answer.text
        dtype = coli_kv.record_dtype(GEOMETRY, TIER)
        copied = np.frombuffer(resume(http, "copy"), dtype=dtype)
        assert np.array_equal(copied["token"], np.frombuffer(written["s3"], dtype=dtype)["token"])


def test_postgres_stopped_answers_503_then_resumes(replicas, api_key, pg_cluster):
    server = replicas("r1")
    with client(server, api_key) as http:
        create(http, "chat")
        acks = []
        for seq in range(3):
            answer = append(http, "chat", records(1, seq, 2))
            acks.append((1, seq, *answer.json()["turn"]))
        pg_cluster.stop("immediate")
        try:
            for answer in (
                append(http, "chat", records(1, 3, 2)),
                http.get("/sessions/chat"),
                http.get("/sessions/chat/resume"),
                http.get("/sessions"),
                http.get("/health"),
                http.get("/metrics"),
                http.get("/console/store"),
            ):
                assert answer.status_code == 503, (answer.request.url, answer.text)
                assert answer.json()["error"] == "IndexUnavailable"
                assert int(answer.headers["Retry-After"]) >= 1
        finally:
            pg_cluster.start()
        answer = append(http, "chat", records(1, 3, 2))  # the client's retry: the service reconnected by itself
        assert answer.status_code == 200, answer.text
        acks.append((1, 3, *answer.json()["turn"]))
        check_acked(resume(http, "chat"), acks, 2)


def test_a_replica_started_while_postgres_is_down_serves_once_it_is_back(replicas, api_key, pg_cluster):
    """A replica (re)started during an index outage starts anyway, answers 503 IndexUnavailable with
    Retry-After (not 401: its keys are in the index it cannot read), and attaches by itself — the
    schema, the keys, the sessions — once PostgreSQL answers, with no restart."""
    pg_cluster.stop("immediate")
    try:
        server = replicas("r1", ready_status=503)
        with client(server, api_key) as http:
            for answer in (http.get("/health"), http.get("/sessions"), http.post("/sessions", json={"id": "x"})):
                assert answer.status_code == 503, (answer.request.url, answer.text)
                assert answer.json()["error"] == "IndexUnavailable"
                assert int(answer.headers["Retry-After"]) >= 1
    finally:
        pg_cluster.start()
    with client(server, api_key) as http:
        for _ in range(30):  # a client retries after the Retry-After it was given
            answer = http.get("/sessions")
            if answer.status_code != 503:
                break
            threading.Event().wait(int(answer.headers["Retry-After"]))
        assert answer.status_code == 200 and http.get("/health").status_code == 200, answer.text
        create(http, "after")
        answer = append(http, "after", records(1, 0, 3))
        assert answer.status_code == 200 and answer.json()["turn"] == [0, 3], answer.text
        assert resume(http, "after") == records(1, 0, 3)
        assert http.get("/sessions", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_every_replica_accepts_the_index_keys(replicas, api_key, index_url):
    servers = [replicas("r0"), replicas("r1")]
    # An unknown key re-reads the keys once they are older than MISS_REFRESH_S (the re-reads a
    # stream of bad keys causes are bounded so): a key made after that works at once.
    threading.Event().wait(MISS_REFRESH_S)
    with IndexKeys(index_url) as keys:
        record, bob = keys.create("bob")
    for server in servers:
        for key, owner in ((api_key, "alice"), (bob, "bob")):
            answer = httpx.get(server.url + "/console/me", headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 200 and answer.json()["owner"] == owner, answer.text
        assert httpx.get(server.url + "/sessions", headers={"Authorization": "Bearer nope"}).status_code == 401
    with IndexKeys(index_url) as keys:
        keys.revoke(record.id)
    for server in servers:  # refused from the next refresh of the keys (a second) on
        for _ in range(200):
            answer = httpx.get(server.url + "/sessions", headers={"Authorization": f"Bearer {bob}"})
            if answer.status_code == 401:
                break
            threading.Event().wait(0.05)
        assert answer.status_code == 401


def test_park_migrate_and_the_hard_limit_across_replicas(replicas, api_key, index_url):
    """A session parked through one replica is parked for all (the park job answers through the
    other replica too, to its owner only); a resume through another unparks it and serves every row. A hard limit given to every replica bounds the whole shared store: a
    migrate, a create or an append that would take it past answers with BudgetExceeded and writes
    nothing, whichever replica it reaches."""
    body = records(1, 0, 6)
    limit = 2 * coli_kv.HEADER_BYTES + 8 * rec_bytes()  # this session, one more header, two rows to spare
    with IndexKeys(index_url) as keys:
        bob_key = keys.create("bob")[1]
    r0, r1 = replicas("r0", "--hard-limit", str(limit)), replicas("r1", "--hard-limit", str(limit))
    with client(r0, api_key) as first, client(r1, api_key) as second:
        create(first, "chat")
        assert append(first, "chat", body).status_code == 200
        # a job runs in the replica that accepted it, and answers through every replica
        job = first.post("/sessions/chat/park").json()
        done = wait_job(second, job, expect="done")
        assert done["result"]["state"] == "parked" and done["id"] == job["id"]
        assert job["id"] in [j["id"] for j in second.get("/jobs").json()]
        with client(r1, bob_key) as bob:
            assert bob.get(f"/jobs/{job['id']}").status_code == 404 and bob.get("/jobs").json() == []
        info = second.get("/sessions/chat").json()
        assert info["state"] == "parked" and info["size_bytes"] <= coli_kv.HEADER_BYTES + len(body)
        assert second.get("/sessions/chat/verify").json()["ok"]  # read as it is, still parked
        assert resume(second, "chat") == body  # unparked by the resume, every row served
        assert first.get("/sessions/chat").json()["state"] == "active"

        # f32 rows are four times the fp8 ones: past the limit, refused, the session as it was
        job = second.post("/sessions/chat/file/migrate", json={"tier": "f32"}).json()
        failed = wait_job(second, job, expect="failed")
        assert failed["error"]["error"] == "BudgetExceeded", failed
        assert first.get("/sessions/chat").json()["tier"]["name"] == TIER.name and resume(first, "chat") == body
        create(second, "other")  # one more header fits
        refused = append(first, "other", records(1, 1, 3))
        assert refused.status_code == 507 and refused.json()["error"] == "BudgetExceeded", refused.text
        assert second.get("/sessions/other").json()["n_records"] == 0
        assert append(second, "other", records(1, 1, 2)).status_code == 200  # exactly fits
        assert first.get("/metrics").status_code == 200


def test_retry_after_of_the_errors_that_say_when(tmp_path):
    assert retry_after(IndexUnavailable("down", retry_after=0.3)) == 1
    assert retry_after(LeaseHeld("held", retry_after=2.5)) == 3
    assert retry_after(SessionBusy("busy", retry_after=4)) == 4
    assert retry_after(SessionNotFound("no session 'x'")) is None


@pytest.mark.parametrize(
    "given, refused",
    [
        ({"index_url": "postgresql://kv@127.0.0.1:1/kv"}, "both"),
        ({"blobs_url": "s3://b/p"}, "both"),
        ({"cache_bytes": 1 << 30}, "--cache-size"),
        ({"index_url": "postgresql://kv@127.0.0.1:1/kv", "blobs_url": "s3://b/p", "lease_ttl": 0}, "lease_ttl"),
    ],
)
def test_settings_refuse_what_a_replica_cannot_do(tmp_path, given, refused):
    with pytest.raises(ConfigError, match=refused):
        Settings(data_dir=tmp_path, **given)


def test_an_append_whose_commit_was_cut_is_settled_by_the_retry(replicas, api_key, index_url, shared_store):
    server = replicas("r1")
    with client(server, api_key) as http, psycopg.connect(index_url, autocommit=True) as other:
        create(http, "chat")
        assert append(http, "chat", records(1, 0, 2)).status_code == 200
        outcome: list[httpx.Response] = []
        with other.transaction():
            # the commit waits for this lock (a lease's foreign key check does not), then its connection dies
            other.execute("SELECT 1 FROM kv_sessions WHERE key = 'chat~alice' FOR NO KEY UPDATE")
            thread = threading.Thread(target=lambda: outcome.append(append(http, "chat", records(1, 1, 3))))
            thread.start()
            while True:
                waiting = other.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'kvstore' AND wait_event_type = 'Lock'"
                ).fetchone()
                if waiting is not None:
                    break
            other.execute("SELECT pg_terminate_backend(%s)", (waiting[0],))
            thread.join(timeout=60)
        assert outcome[0].status_code == 503 and outcome[0].headers["Retry-After"] == "1", outcome[0].text
        answer = append(http, "chat", records(1, 1, 3))  # the client retries the same rows, same replica
        assert answer.status_code == 200 and answer.json()["turn"] == [2, 5], answer.text
        stored = resume(http, "chat")
        assert stored == records(1, 0, 2) + records(1, 1, 3)
    # the retry committed the first attempt's upload: no second object, nothing for GC
    assert {i.name for i in shared_store.blobs.list("seg")} == {s.object for s in shared_store.segments("chat~alice")}
