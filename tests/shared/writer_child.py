"""A writer process for the shared backend's tests (run as a script; one line on stdout per event).

    writer_child.py append KEY WRITER COUNT ROWS TTL [--hold]
        COUNT appends of ROWS records (COUNT 0: until SIGTERM, which ends after the append in
        flight is acknowledged, or SIGKILL); the lease is released after each
        append unless --hold. Prints ``ACK writer seq start end token`` once an append is
        acknowledged, ``UNAVAILABLE <error>`` for each retry after a server was down, ``DONE``.
    writer_child.py late KEY WRITER ROWS TTL
        Takes the lease, uploads one segment, prints ``PREPARED token``, waits for a line on stdin,
        then commits with that (by then old) token: prints ``FENCED <error>`` or ``COMMITTED ...``.

The servers are named by KVSTORE_INDEX_URL, KVSTORE_BLOBS_URL and the AWS_* variables.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests folder: shared.rows

from kvstore.errors import LeaseHeld, StaleLease, Unavailable  # noqa: E402
from kvstore.store.shared import BlobStore, SharedIndex, SharedStore  # noqa: E402
from shared.rows import records  # noqa: E402


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def connect() -> SharedStore:
    while True:
        try:
            return SharedStore(
                SharedIndex(os.environ["KVSTORE_INDEX_URL"]),
                BlobStore(os.environ["KVSTORE_BLOBS_URL"], base_delay=0.02, max_delay=0.5, attempts=10),
            )
        except Unavailable as exc:
            say(f"UNAVAILABLE {type(exc).__name__}")
            time.sleep(0.2)


def acquire(store: SharedStore, key: str, ttl: float, carry=None):
    while True:
        try:
            return store.acquire(key, ttl=ttl, carry=carry)
        except LeaseHeld as exc:
            time.sleep(min(exc.retry_after, 0.05) + random.uniform(0, 0.02))
        except Unavailable as exc:
            say(f"UNAVAILABLE {type(exc).__name__}")
            time.sleep(0.2)


def run_append(key: str, writer: int, count: int, rows: int, ttl: float, hold: bool) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    store = connect()
    lease = None
    seq = 0
    while (count == 0 or seq < count) and not stop.is_set():
        payload = records(writer, seq, rows)
        if lease is None:
            lease = acquire(store, key, ttl)
        while True:  # the same bytes until acknowledged: a retry after an unanswered commit appends once
            try:
                ack = store.append(lease, payload)
                break
            except Unavailable as exc:
                say(f"UNAVAILABLE {type(exc).__name__}")
                time.sleep(0.2)
            except StaleLease:
                lease = acquire(store, key, ttl, carry=lease)
        say(f"ACK {writer} {seq} {ack.start} {ack.end} {ack.token}")
        seq += 1
        if not hold:
            try:
                store.release(lease)
            except Unavailable:
                pass  # it expires by itself
            lease = None
    store.close()
    say("DONE")


def run_late(key: str, writer: int, rows: int, ttl: float) -> None:
    store = connect()
    lease = acquire(store, key, ttl)
    prepared = store.prepare(lease, records(writer, 0, rows))
    say(f"PREPARED {lease.token}")
    sys.stdin.readline()
    try:
        ack = store.commit(lease, prepared)
    except StaleLease as exc:
        say(f"FENCED {type(exc).__name__} {exc}")
    else:
        say(f"COMMITTED {ack.start} {ack.end} {ack.token}")
    store.close()


if __name__ == "__main__":
    mode, key = sys.argv[1], sys.argv[2]
    if mode == "append":
        run_append(key, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), "--hold" in sys.argv)
    else:
        run_late(key, int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
