"""Concurrency on one session, in threads of one process and in separate processes.

- Two writers never interleave: every acknowledged append sits whole at the record range the
  store returned for it, the ranges tile the journal exactly, each writer's turns keep its
  order; a writer that does not wait (``lock_timeout=0``) gets a clear ``JournalLocked`` (409).
- An appender racing a writer that parks, unparks, forks and deletes: every turn is there, in
  order, and the session verifies.
- Readers during appends only ever see a whole-turn prefix of what was written (bytes checked),
  and a verify racing them always finds the session sound.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvstore.formats import coli_kv
from kvstore.store import SessionStore
from reliability.concurrency_roles import ROLES, SESSION, digest
from reliability.store_checks import acks_of, check_appends, snapshot, turn_bytes
from reliability.store_workload import MODEL, OWNER, TIER_NAMES
from reliability.workload import GEOMETRY

ROLE_SCRIPT = Path(__file__).with_name("concurrency_roles.py")


def run_roles(mode: str, data: Path, roles: list[tuple[str, int, int, float]]) -> list[list[list[str]]]:
    """Run ``(role, seed, count, lock_timeout)`` together; returns each role's output lines."""
    outputs: list[list[list[str]]] = [[] for _ in roles]
    if mode == "processes":
        gate = data.parent / "gate"
        procs = [
            subprocess.Popen(
                [sys.executable, str(ROLE_SCRIPT), role, str(data), str(seed), str(count), str(timeout), str(gate)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for role, seed, count, timeout in roles
        ]
        for proc in procs:
            assert proc.stdout.readline() == "READY\n", proc.stderr.read()
        gate.touch()  # every store is open: start together
        for proc, out in zip(procs, outputs):
            stdout, stderr = proc.stdout.read(), proc.stderr.read()
            assert proc.wait(timeout=600) == 0, stderr
            out.extend(line.split() for line in stdout.splitlines())
            proc.stdout.close()
            proc.stderr.close()
        return outputs
    stores = [SessionStore(data, lock_timeout=timeout) for _, _, _, timeout in roles]
    failures: list[BaseException] = []

    def work(i: int) -> None:
        role, seed, count, _ = roles[i]
        try:
            ROLES[role](stores[i], seed, count, lambda *fields: outputs[i].append([str(f) for f in fields]))
            outputs[i].append(["DONE"])
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(roles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for store in stores:
        store.close()
    assert failures == [], failures
    return outputs


def new_store(data: Path) -> None:
    with SessionStore(data) as store:
        store.create(OWNER, GEOMETRY, TIER_NAMES["v2"], MODEL, session_id=SESSION)


def count_lines(outputs, tag: str) -> int:
    return sum(1 for lines in outputs for fields in lines if fields[0] == tag)


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_two_writers_never_interleave(tmp_path, trials, figures, mode):
    data = tmp_path / "data"
    new_store(data)
    turns = trials(12, 150)
    # One writer waits for the lock; the other does not, so it meets the busy answer and retries.
    outputs = run_roles(mode, data, [("append", 1, turns, 10.0), ("append", 2, turns, 0.0)])
    assert all(lines[-1] == ["DONE"] for lines in outputs)
    with SessionStore(data) as store:
        sessions = snapshot(store)
        body = sessions[SESSION].body
        acked = check_appends(body, sessions[SESSION].record_bytes, [acks_of(lines) for lines in outputs])
        assert acked == 2 * turns
        report = store.verify(SESSION)
        assert report.ok and report.turns_checked == 2 * turns
    figures.add(
        "store_concurrency",
        f"two_writers_{mode}",
        appends=acked,
        busy_answers=count_lines(outputs, "BUSY"),
        interleaved=0,
    )


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_appends_racing_park_fork_delete_and_readers(tmp_path, trials, figures, mode):
    data = tmp_path / "data"
    new_store(data)
    turns, rounds, reads = trials(16, 150), trials(4, 40), trials(20, 300)
    outputs = run_roles(mode, data, [("append", 3, turns, 30.0), ("churn", 4, rounds, 30.0), ("read", 5, reads, 30.0)])
    assert all(lines[-1] == ["DONE"] for lines in outputs)
    expected = b"".join(turn_bytes(3, t) for t in range(turns))
    record_bytes = coli_kv.record_bytes(GEOMETRY, TIER_NAMES["v2"])
    boundaries = {0}
    total = 0
    for t in range(turns):
        total += len(turn_bytes(3, t)) // record_bytes
        boundaries.add(total)
    seen = [(int(f[1]), f[2]) for f in outputs[2] if f[0] == "SEEN"]
    assert seen, "the reader never got through"
    for records, seen_digest in seen:
        assert records in boundaries, f"a reader saw {records} records: not a whole-turn prefix"
        assert seen_digest == digest(expected[: records * record_bytes]), (
            f"a reader's {records} records are not what was written"
        )
    with SessionStore(data) as store:
        sessions = snapshot(store)
        assert sorted(sessions) == [SESSION]  # every fork was deleted again
        assert sessions[SESSION].body == expected
        check_appends(sessions[SESSION].body, record_bytes, [acks_of(outputs[0])])
        assert store.verify(SESSION).ok
    figures.add(
        "store_concurrency",
        f"append_vs_park_fork_delete_read_{mode}",
        appends=turns,
        churn_rounds=rounds,
        reads=len(seen),
        verifies=count_lines(outputs, "VERIFIED"),
        busy_answers=count_lines(outputs, "BUSY"),
        inconsistent_reads=0,
    )
