"""Owner isolation timing: another owner's session id vs an id nobody has (issue 15, items 5 and 6).

Ids are per owner (``<id>~<owner>`` storage keys), so ``GET /sessions/chat-7`` by ``other`` for
``bench``'s ``chat-7`` is a lookup of ``chat-7~other``: a key that does not exist, exactly like
``nobody-7~other``. Neither takes a lock or touches a file. This measures whether the time of the
answer tells them apart anyway:

* **http**: a real ``kvstore serve``; ``other`` sends ``GET`` and ``DELETE`` for ``bench``'s ids and
  for ids nobody has, interleaved in random order on one keep-alive connection, ``--requests`` of
  each kind; every answer must be the same 404 body (the id aside);
* **store**: ``SessionStore.get`` in this process, ``--store-calls`` of each, interleaved the same way
  (no network noise);
* **busy**: while this process holds ``bench``'s write lock on ``chat-0`` (as a long append does;
  the server waits up to 10 s for a lock), ``other`` sends ``--requests`` ``DELETE`` and ``truncate``
  calls for ``chat-0``: each must answer the same 404 at once, never 409 after the lock timeout;
* **append**: ``bench`` appends one record to ``chat-1`` ``--appends`` times alone, then as many
  times while ``other`` sends ``DELETE /sessions/chat-1`` in a loop on its own connection (before
  the fix each of those took the session's write lock and made the append wait): the latency of
  the owner's appends either way, and every one of ``other``'s answers must be 404.

It prints mean, p50 and p99 per kind and Welch's t for the difference of the means (|t| < 2: no
difference the sample can see). RELIABILITY.md, "Hardening round 2", has the figures.

Usage::

    python bench/owner_isolation.py
    python bench/owner_isolation.py --requests 5000 --sessions 200
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from api_common import GEOMETRY_JSON, KEY, MODEL, Server, percentile, v2_records

from kvstore.errors import SessionNotFound
from kvstore.locks import FileLock
from kvstore.store import SessionStore

OTHER_KEY = "other-key-0123456789abcdef"
RAW = {"Content-Type": "application/octet-stream"}


def welch_t(a: list[float], b: list[float]) -> float:
    var = statistics.variance(a) / len(a) + statistics.variance(b) / len(b)
    return (statistics.fmean(a) - statistics.fmean(b)) / var**0.5


def row(name: str, seconds: list[float]) -> str:
    us = [s * 1e6 for s in seconds]
    mean, p50, p99 = statistics.fmean(us), percentile(us, 50), percentile(us, 99)
    return f"| {name} | {len(us)} | {mean:.1f} | {p50:.1f} | {p99:.1f} |"


def interleaved(kinds: dict[str, list], count: int, call, rng: random.Random) -> dict[str, list[float]]:
    """``call(kind, item)`` for ``count`` items of every kind, in one random order; the seconds of each."""
    order = [(kind, i) for kind in kinds for i in range(count)]
    rng.shuffle(order)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for kind, i in order:
        item = kinds[kind][i % len(kinds[kind])]
        began = time.perf_counter()
        call(kind, item)
        times[kind].append(time.perf_counter() - began)
    return times


def appends_under_deletes(server: Server, other, count: int) -> list[str]:
    """The owner's append latency on ``chat-1``, alone and while ``other`` deletes ``chat-1`` in a loop."""
    one = v2_records(1, seed=2).tobytes()

    def appends(owner) -> list[float]:
        times = []
        for _ in range(count):
            began = time.perf_counter()
            owner.post("/sessions/chat-1/append", content=one, headers=RAW).raise_for_status()
            times.append(time.perf_counter() - began)
        return times

    answers: dict[int, int] = {}
    stop = threading.Event()

    def delete_loop() -> None:
        while not stop.is_set():
            status = other.delete("/sessions/chat-1").status_code
            answers[status] = answers.get(status, 0) + 1

    with server.client() as owner:
        before = owner.get("/sessions/chat-1").json()["n_records"]
        alone = appends(owner)
        deleter = threading.Thread(target=delete_loop)
        deleter.start()
        try:
            contended = appends(owner)
        finally:
            stop.set()
            deleter.join()
        after = owner.get("/sessions/chat-1").json()["n_records"]
    if set(answers) != {404} or after != before + 2 * count:
        raise AssertionError(f"other's deletes answered {answers}; chat-1 went from {before} to {after} records")
    return [
        row("http append by the owner, alone", alone),
        row(f"http append by the owner while another owner sends DELETE ({answers[404]} x 404)", contended),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests of each kind over HTTP")
    parser.add_argument("--store-calls", type=int, default=20000, help="SessionStore.get calls of each kind")
    parser.add_argument("--sessions", type=int, default=100, help="sessions of the owner 'bench'")
    parser.add_argument("--appends", type=int, default=500, help="appends of the owner, alone and under deletes")
    args = parser.parse_args()
    rng = random.Random(15)
    theirs = [f"chat-{i}" for i in range(args.sessions)]
    nobodys = [f"nobody-{i}" for i in range(args.sessions)]
    record = v2_records(4, seed=1).tobytes()
    lines = ["| call (as another owner) | n | mean µs | p50 µs | p99 µs |", "|---|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        server = Server(Path(tmp) / "data", keys=f"{KEY}:bench,{OTHER_KEY}:other")
        try:
            with server.client() as owner:
                for sid in theirs:
                    owner.post("/sessions", json={"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON})
                    owner.post(f"/sessions/{sid}/append", content=record, headers=RAW).raise_for_status()
            with server.client() as other:
                other.headers["Authorization"] = f"Bearer {OTHER_KEY}"
                for method in ("GET", "DELETE"):

                    def call(kind: str, sid: str, method=method) -> None:
                        answer = other.request(method, f"/sessions/{sid}")
                        body = answer.json()
                        if answer.status_code != 404 or body != {
                            "error": "SessionNotFound",
                            "reason": f"no session {sid!r}",
                        }:
                            raise AssertionError(f"{method} {sid}: {answer.status_code} {answer.text}")

                    for sid in theirs[:20] + nobodys[:20]:  # warm up
                        call("", sid)
                    times = interleaved({"theirs": theirs, "nobody": nobodys}, args.requests, call, rng)
                    lines.append(row(f"http {method} another owner's id", times["theirs"]))
                    lines.append(row(f"http {method} an id nobody has", times["nobody"]))
                    lines.append(f"| Welch t ({method}) | | {welch_t(times['theirs'], times['nobody']):+.2f} | | |")
                with FileLock(Path(tmp) / "data" / "locks" / "chat-0~bench.write", timeout=0):
                    busy = []
                    for i in range(args.requests):
                        began = time.perf_counter()
                        if i % 2:
                            answer = other.delete("/sessions/chat-0")
                        else:
                            answer = other.post("/sessions/chat-0/truncate", json={"n_records": 0})
                        busy.append(time.perf_counter() - began)
                        if answer.status_code != 404:
                            raise AssertionError(f"chat-0 while busy: {answer.status_code} {answer.text}")
                    lines.append(row("http DELETE/truncate of another owner's busy session", busy))
                lines.extend(appends_under_deletes(server, other, args.appends))
            with server.client() as owner:
                assert len(owner.get("/sessions").json()["sessions"]) == args.sessions  # nothing deleted
        finally:
            server.stop()
        with SessionStore(Path(tmp) / "data") as store:

            def lookup(kind: str, sid: str) -> None:
                try:
                    store.get(sid, owner="other")
                except SessionNotFound:
                    return
                raise AssertionError(f"{sid} was found for another owner")

            times = interleaved({"theirs": theirs, "nobody": nobodys}, args.store_calls, lookup, rng)
            lines.append(row("store.get another owner's id", times["theirs"]))
            lines.append(row("store.get an id nobody has", times["nobody"]))
            lines.append(f"| Welch t (store.get) | | {welch_t(times['theirs'], times['nobody']):+.2f} | | |")
    print(f"owner isolation: {args.requests} requests / {args.store_calls} store calls of each kind, GLM geometry")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
