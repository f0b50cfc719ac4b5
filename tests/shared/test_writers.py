"""Several writer processes on one session, on a real PostgreSQL cluster and a real S3 server:
concurrent appends through leases, a writer SIGKILLed mid-append, a late commit with an old token,
PostgreSQL restarted under load (docs/SCALE.md, "Failure cases")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstore.errors import IndexUnavailable, LeaseHeld
from kvstore.store.shared import BlobStore, SharedIndex, SharedStore
from shared.rows import GEOMETRY, TIER, rec_bytes, records

CHILD = Path(__file__).resolve().parent / "writer_child.py"


class Child:
    """A writer process (writer_child.py) whose stdout lines are collected as they come."""

    def __init__(self, env: dict[str, str], *args: str):
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.strip())

    def acks(self) -> list[tuple[int, int, int, int, int]]:
        return [tuple(map(int, line.split()[1:])) for line in list(self.lines) if line.startswith("ACK ")]  # type: ignore[misc]

    def count(self, prefix: str) -> int:
        return sum(line.startswith(prefix) for line in list(self.lines))

    def wait_for(self, done, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline or self.process.poll() is not None and not done():
                self._reader.join(timeout=2)
                if done():
                    return
                stderr = self.process.stderr.read() if self.process.poll() is not None and self.process.stderr else ""
                raise AssertionError(
                    f"child stalled or exited {self.process.poll()}: {self.lines[-5:]}\n{stderr[-3000:]}"
                )
            time.sleep(0.02)

    def finish(self, timeout: float = 180.0) -> None:
        self.wait_for(lambda: "DONE" in self.lines, timeout)
        assert self.process.wait(timeout=30) == 0

    def end(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(timeout=5)
        for stream in (self.process.stdin, self.process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def store(child_env):
    blobs = BlobStore(child_env["KVSTORE_BLOBS_URL"], endpoint_url=child_env["AWS_ENDPOINT_URL"])
    with SharedStore(SharedIndex(child_env["KVSTORE_INDEX_URL"]), blobs) as opened:
        yield opened


@pytest.fixture
def children():
    started: list[Child] = []
    yield started
    for child in started:
        child.end()


def check_acknowledged(store: SharedStore, key: str, acks, *, rows: int) -> bytes:
    """Every acknowledged append is in the session once, at its acknowledged place, with its bytes;
    each writer's appends are in its order. Returns the session's records."""
    n, stored = store.read_records(key)
    size = rec_bytes()
    spans = sorted((start, end) for _, _, start, end, _ in acks)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "overlapping acks"
    for writer, seq, start, end, _ in acks:
        assert end - start == rows and end <= n
        assert stored[start * size : end * size] == records(writer, seq, rows), f"writer {writer} append {seq}"
    for writer in {a[0] for a in acks}:
        starts = [start for w, _, start, _, _ in sorted(a for a in acks if a[0] == writer)]
        assert starts == sorted(starts), f"writer {writer}'s appends out of order"
    return stored


def test_concurrent_writers_each_ack_once_in_order(store, child_env, children):
    key = store.create("alice", GEOMETRY, TIER, session_id="shared")
    writers, appends, rows = 3, 12, 2
    for writer in range(writers):
        children.append(Child(child_env, "append", key, str(writer), str(appends), str(rows), "10"))
    for child in children:
        child.finish()
    acks = [ack for child in children for ack in child.acks()]
    assert len(acks) == writers * appends
    check_acknowledged(store, key, acks, rows=rows)
    # nothing but acknowledged appends: they tile the session exactly, one segment each
    assert store.n_records(key) == writers * appends * rows
    assert sorted((a[2], a[3]) for a in acks) == [
        (s.first_record, s.first_record + s.n_records) for s in store.segments(key)
    ]
    # the writers interleaved (leases changed hands), with tokens growing along the session
    tokens = [a[4] for a in sorted(acks, key=lambda a: a[2])]
    assert tokens == sorted(tokens) and len(set(tokens)) > writers
    store.gc(grace=0)
    assert {i.name for i in store.blobs.list("seg")} == {s.object for s in store.segments(key)}


def test_sigkill_mid_append_then_takeover_loses_nothing_acknowledged(store, child_env, children):
    key = store.create("alice", GEOMETRY, TIER, session_id="shared")
    rows, ttl = 3, 3.0
    victim = Child(child_env, "append", key, "7", "0", str(rows), str(ttl), "--hold")  # appends until killed
    children.append(victim)
    victim.wait_for(lambda: len(victim.acks()) >= 6)
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.end()
    acks = victim.acks()
    # its lease outlives it: nobody writes until it expires (PostgreSQL's clock), then a takeover
    waited = 0
    while True:
        try:
            lease = store.acquire(key, "successor")
            break
        except LeaseHeld:
            waited += 1
            time.sleep(0.05)
    assert waited > 0 and lease.token > max(a[4] for a in acks)
    stored = check_acknowledged(store, key, acks, rows=rows)
    last = max(a[3] for a in acks)
    # at most the one append it was in when killed was committed unacknowledged, and whole
    assert lease.n_records in (last, last + rows)
    if lease.n_records > last:
        assert stored[last * rec_bytes() :] == records(7, len(acks), rows)
    ack = store.append(lease, records(8, 0, rows))
    assert ack.start == lease.n_records - rows
    # the dead writer's uploads are garbage; the committed session is untouched by collecting them
    store.gc(grace=0)
    assert {i.name for i in store.blobs.list("seg")} == {s.object for s in store.segments(key)}
    assert store.read_records(key)[1] == stored + records(8, 0, rows)


def test_a_late_process_with_an_old_token_is_fenced(store, child_env, children):
    key = store.create("alice", GEOMETRY, TIER, session_id="shared")
    late = Child(child_env, "late", key, "3", "2", "1.0")
    children.append(late)
    late.wait_for(lambda: late.count("PREPARED") == 1)
    old_token = int(next(line for line in late.lines if line.startswith("PREPARED")).split()[1])
    while True:  # its lease expires; another writer takes over and appends
        try:
            lease = store.acquire(key, "successor")
            break
        except LeaseHeld:
            time.sleep(0.05)
    assert lease.token > old_token
    store.append(lease, records(4, 0, 5))
    assert late.process.stdin is not None
    late.process.stdin.write("go\n")
    late.process.stdin.flush()
    late.wait_for(lambda: late.count("FENCED") + late.count("COMMITTED") == 1)
    assert late.count("FENCED") == 1 and "superseded" in late.lines[-1], late.lines
    assert store.n_records(key) == 5 and store.read_records(key)[1] == records(4, 0, 5)
    assert store.gc(grace=0).intents == 1
    assert {i.name for i in store.blobs.list("seg")} == {s.object for s in store.segments(key)}


def test_postgres_restart_under_load(pg_cluster, store, child_env, children):
    key = store.create("alice", GEOMETRY, TIER, session_id="shared")
    rows = 2
    for writer in range(2):  # each appends until told to stop
        children.append(Child(child_env, "append", key, str(writer), "0", str(rows), "5"))
    for child in children:
        child.wait_for(lambda child=child: len(child.acks()) >= 3)
    pg_cluster.stop("immediate")  # a crash: WAL replay on the next start
    try:
        for child in children:  # each writer sees the index unavailable, typed, and keeps trying
            child.wait_for(lambda child=child: child.count("UNAVAILABLE IndexUnavailable") >= 1, timeout=60)
        during = [len(child.acks()) for child in children]
        time.sleep(0.5)
        assert [len(child.acks()) for child in children] == during  # nothing acknowledged while down
    finally:
        pg_cluster.start()
    for child, before in zip(children, during):  # they resume by themselves
        child.wait_for(lambda child=child, before=before: len(child.acks()) >= before + 3)
        child.process.terminate()  # ends after the append in flight is acknowledged
    for child in children:
        child.finish()
    acks = [ack for child in children for ack in child.acks()]
    with pytest.raises(IndexUnavailable):  # this process's connection died with the server ...
        store.n_records(key)
    check_acknowledged(store, key, acks, rows=rows)  # ... and the next call connects again
    # a retried append whose commit had no answer was appended once: the session holds only acks
    assert store.n_records(key) == len(acks) * rows
