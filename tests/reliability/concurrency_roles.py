"""What the concurrency suites run on one session, in threads or in processes.

    python concurrency_roles.py ROLE DATA SEED COUNT LOCK_TIMEOUT GATE

The store is opened, ``READY`` printed, and the role starts once the file GATE exists (so the
processes of one test really run together).

Each role prints one line per call: ``ACK <seed> <turn> <start> <end>`` for an append (the
record range the store says it hashed as this turn), ``BUSY <error> <reason>`` when the store
answered that another writer holds the session, ``SEEN <records> <blake2b of the bytes>`` for
each resume a reader made, ``DONE`` at the end.

- ``append``: COUNT turns of rows ``workload.turn_rows(SEED, i)``, each a complete turn; a busy
  answer is retried.
- ``churn``: COUNT rounds of park, unpark, fork (into ``<SEED>-<i>``, deleted again) and verify.
- ``read``: COUNT resumes of the session, each followed by a verify (which must find it sound).
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/

from kvstore.api.errors import http_status  # noqa: E402
from kvstore.errors import JournalLocked  # noqa: E402
from kvstore.store import SessionStore  # noqa: E402
from reliability.workload import turn_rows  # noqa: E402

SESSION = "shared"


def digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def busy(say: Callable[..., None], exc: JournalLocked) -> None:
    assert exc.reason and http_status(exc) == 409
    say("BUSY", type(exc).__name__, exc.reason.replace(" ", "_"))


def append_role(store: SessionStore, seed: int, count: int, say: Callable[..., None]) -> None:
    for turn in range(count):
        while True:
            try:
                result = store.append(SESSION, *turn_rows(seed, turn))
                break
            except JournalLocked as exc:
                busy(say, exc)
        say("ACK", seed, turn, *result.turn)


def churn_role(store: SessionStore, seed: int, count: int, say: Callable[..., None]) -> None:
    def verify(i: int) -> None:
        report = store.verify(SESSION)
        if not report.ok:
            raise AssertionError(f"round {i}: verify found {report.first_bad}")

    calls = (
        lambda i: store.park(SESSION),
        lambda i: store.unpark(SESSION),
        lambda i: store.fork(SESSION, new_id=f"fork-{seed}-{i}"),
        lambda i: store.delete(f"fork-{seed}-{i}"),
        verify,
    )
    for i in range(count):
        for call in calls:
            while True:
                try:
                    call(i)
                    break
                except JournalLocked as exc:
                    busy(say, exc)
        say("ROUND", i)


def read_role(store: SessionStore, seed: int, count: int, say: Callable[..., None]) -> None:
    for _ in range(count):
        try:
            resumed = store.resume(SESSION)
        except JournalLocked as exc:
            busy(say, exc)
            continue
        body = resumed.records.record_bytes()
        say("SEEN", resumed.reused_tokens, digest(body))
        try:
            report = store.verify(SESSION)  # while the other roles append, park and unpark
        except JournalLocked as exc:
            busy(say, exc)
            continue
        if not report.ok:
            raise AssertionError(f"verify during the race found {report.first_bad} in {report.n_records} records")
        say("VERIFIED", report.n_records)


ROLES = {"append": append_role, "churn": churn_role, "read": read_role}


def main() -> None:
    role, data, seed, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    lock_timeout, gate = float(sys.argv[5]), Path(sys.argv[6])

    def say(*fields) -> None:
        sys.stdout.write(" ".join(map(str, fields)) + "\n")
        sys.stdout.flush()

    with SessionStore(data, lock_timeout=lock_timeout) as store:
        say("READY")
        while not gate.exists():
            time.sleep(0.001)
        ROLES[role](store, seed, count, say)
    say("DONE")


if __name__ == "__main__":
    main()
