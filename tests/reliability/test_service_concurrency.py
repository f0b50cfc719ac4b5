"""Concurrent HTTP clients against a real uvicorn server on 127.0.0.1.

Eight clients on eight sessions, and eight on one session with two readers downloading as they
write. No response is a 5xx; every acknowledged append is in the session exactly once, whole, at
the range the server returned, in each client's order; a writer that finds the session busy gets
409 ``JournalLocked`` and retries; every download is a whole-turn prefix of the final rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading

import pytest

from kvstore.formats import coli_kv
from reliability.service import Service
from reliability.store_checks import check_appends, turn_bytes
from reliability.store_workload import MODEL, TIER_NAMES
from reliability.workload import GEOMETRY

RAW = "application/octet-stream"
CLIENTS = 8
RECORD_BYTES = coli_kv.record_bytes(GEOMETRY, TIER_NAMES["v2"])


@pytest.fixture
def service(tmp_path):
    running = Service(tmp_path / "data").start()
    yield running
    output = running.stop()
    assert "Traceback" not in output and "Exception" not in output, output


def create(service: Service, sid: str) -> None:
    with service.client() as client:
        response = client.post("/sessions", json={"id": sid, "model": MODEL, "geometry": dataclasses.asdict(GEOMETRY)})
        assert response.status_code == 201, response.text


class Run:
    """Threads that talk to the service; every status they saw, every failure they met."""

    def __init__(self):
        self.statuses: list[int] = []
        self.failures: list[BaseException] = []
        self.lock = threading.Lock()

    def saw(self, status: int) -> None:
        with self.lock:
            self.statuses.append(status)

    def thread(self, target, *args) -> threading.Thread:
        def body():
            try:
                target(*args)
            except BaseException as exc:
                self.failures.append(exc)

        return threading.Thread(target=body)

    def writer(self, service: Service, sid: str, seed: int, turns: int, acks: list) -> None:
        with service.client() as client:
            for turn in range(turns):
                while True:
                    response = client.post(
                        f"/sessions/{sid}/append", content=turn_bytes(seed, turn), headers={"Content-Type": RAW}
                    )
                    self.saw(response.status_code)
                    if response.status_code == 409 and response.json()["error"] == "JournalLocked":
                        continue  # the clear "busy" answer: try again
                    assert response.status_code == 200, response.text
                    acks.append((seed, turn, *response.json()["turn"]))
                    break

    def reader(self, service: Service, sid: str, until: threading.Event, seen: list) -> None:
        with service.client() as client:
            while not until.is_set():
                response = client.get(f"/sessions/{sid}/resume")
                self.saw(response.status_code)
                assert response.status_code == 200, response.text
                records = int(response.headers["x-kv-records"])
                assert len(response.content) == records * RECORD_BYTES
                seen.append((records, hashlib.blake2b(response.content).digest()))


def resume(service: Service, sid: str) -> bytes:
    with service.client() as client:
        response = client.get(f"/sessions/{sid}/resume")
        assert response.status_code == 200
        return response.content


def test_eight_clients_on_eight_sessions(service, trials, figures):
    turns = trials(5, 40)
    run = Run()
    acks = [[] for _ in range(CLIENTS)]
    for i in range(CLIENTS):
        create(service, f"client-{i}")
    threads = [run.thread(run.writer, service, f"client-{i}", 100 + i, turns, acks[i]) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert run.failures == [], run.failures
    assert all(status < 500 for status in run.statuses)
    for i in range(CLIENTS):
        body = resume(service, f"client-{i}")
        assert body == b"".join(turn_bytes(100 + i, t) for t in range(turns))
        assert check_appends(body, RECORD_BYTES, [acks[i]]) == turns
    figures.add(
        "service_concurrency",
        "8_clients_8_sessions",
        requests=len(run.statuses),
        appends=CLIENTS * turns,
        server_errors=sum(s >= 500 for s in run.statuses),
        lost_or_duplicated=0,
    )


def test_eight_clients_on_one_session_with_readers(service, trials, figures):
    turns = trials(5, 40)
    run = Run()
    create(service, "shared")
    acks = [[] for _ in range(CLIENTS)]
    seen: list[tuple[int, bytes]] = []
    done = threading.Event()
    writers = [run.thread(run.writer, service, "shared", 200 + i, turns, acks[i]) for i in range(CLIENTS)]
    readers = [run.thread(run.reader, service, "shared", done, seen) for _ in range(2)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    for t in readers:
        t.join()
    assert run.failures == [], run.failures
    assert all(status < 500 for status in run.statuses)
    body = resume(service, "shared")
    acked = check_appends(body, RECORD_BYTES, acks)
    assert acked == CLIENTS * turns
    boundaries = sorted({0} | {end for writer in acks for (_, _, _, end) in writer})
    assert seen
    for records, digest in seen:  # every download: a whole-turn prefix of the final rows
        assert records in boundaries
        assert digest == hashlib.blake2b(body[: records * RECORD_BYTES]).digest()
    with service.client() as client:
        assert client.get("/sessions/shared/verify").json()["ok"] is True
    figures.add(
        "service_concurrency",
        "8_clients_1_session_2_readers",
        requests=len(run.statuses),
        appends=acked,
        busy_answers=run.statuses.count(409),
        downloads=len(seen),
        server_errors=sum(s >= 500 for s in run.statuses),
        lost_or_duplicated=0,
    )
