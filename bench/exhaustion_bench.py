"""One request must not take the server down: the figures of RELIABILITY.md "Hardening round 2".

    .venv/bin/python bench/exhaustion_bench.py                 # every scenario, ~1 minute
    .venv/bin/python bench/exhaustion_bench.py --only health   # bombs, health, locks, jobs, waiters
    .venv/bin/python bench/exhaustion_bench.py --seconds 20    # longer load phases

Against a real ``kvstore serve`` on 127.0.0.1 (a child process, default settings unless a scenario
says otherwise), it measures:

- **bombs**: the server's peak RSS growth (``VmHWM`` after a reset, Linux) per refused zstd Arrow
  upload that decodes to 1 GB (~30 KB on the wire), per upload whose buffer lies about its size, and
  per upload of 10,000 empty record batches (``--max-body 4M`` for all three);
- **health**: ``GET /health`` latency (p50, p99, max) while 8 clients send oversized JSON bodies to
  ``/lookup`` without pause (chunked, 24 MiB each; or declaring 95 MB by Content-Length), bodies
  just under the route's 8 MiB limit made of millions of small values that are not token ids
  (empty lists, strings, objects; floats, nulls), and valid lookups just under the limit. The load runs in child processes
  that write pre-built bytes to raw sockets (so the client costs the machine as little as it can);
- **locks**: lock files left after requests for ids that do not exist;
- **jobs**: jobs accepted before the queue answers 429, and the ``Retry-After`` it gives;
- **waiters**: 60 appends at once on a session whose lock another process holds for 3 s: how long
  the 429s take (in the burst, and one more append alone), the latency of appends to another session
  meanwhile, and how long the 16 admitted waiters took (they go in once the lock is free).

On a small machine the load generator would take most of the CPU from the server it measures: it
runs at ``nice 19`` by default (``--client-nice 0`` to compete). The machine, its cores and the
commit are printed with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from reliability.exhaustion import (  # noqa: E402
    Prober,
    arrow_bomb,
    arrow_rows,
    json_load,
    lying_arrow_upload,
    many_batches,
    peak_rss_growth,
    session_lock_held,
)
from reliability.service import KEYS, Service  # noqa: E402
from reliability.store_workload import MODEL  # noqa: E402
from reliability.workload import GEOMETRY  # noqa: E402

MiB = 1 << 20
ARROW = "application/vnd.apache.arrow.stream"
GEOMETRY_JSON = dataclasses.asdict(GEOMETRY)


def _ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    a = np.asarray(values) * 1000
    return f"p50 {np.percentile(a, 50):.1f} ms, p99 {np.percentile(a, 99):.1f} ms, max {a.max():.1f} ms (n={a.size})"


def _create(service: Service, sid: str) -> None:
    with service.client() as alice:
        response = alice.post("/sessions", json={"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON})
        if response.status_code != 201:
            raise RuntimeError(response.text)


# ---------------------------------------------------------------------------------- bombs
def bombs(data: Path, count: int) -> None:
    service = Service(data, "--max-body", "4M").start()
    try:
        _create(service, "bombed")
        bomb, liar = arrow_bomb(GEOMETRY, 1 << 30), lying_arrow_upload(GEOMETRY, 1 << 30)
        many = many_batches(GEOMETRY, 10_000)
        with service.client() as alice:
            for name, body in (
                ("1 GB zstd bomb", bomb),
                ("buffer lying about its size (1 GB)", liar),
                ("10,000 empty record batches", many),
            ):
                growths, statuses = [], set()

                def send(body: bytes = body, statuses: set = statuses) -> None:
                    response = alice.post("/sessions/bombed/append", content=body, headers={"Content-Type": ARROW})
                    statuses.add(response.status_code)

                for _ in range(count):
                    growths.append(peak_rss_growth(service.process.pid, send))
                print(
                    f"bombs: {name}: {len(body)} bytes on the wire, answers {sorted(statuses)}, peak RSS growth per "
                    f"upload max {max(growths) / MiB:.1f} MiB, mean {np.mean(growths) / MiB:.1f} MiB (n={count})"
                )
    finally:
        service.stop()


# ---------------------------------------------------------------------------------- health
def health(data: Path, seconds: float, nice: int) -> None:
    service = Service(data).start()
    try:
        for kind, what in (
            ("idle", "no load"),
            ("chunked", "8 clients sending 24 MiB chunked bodies (refused at 8 MiB)"),
            ("declared", "8 clients declaring 95 MB bodies"),
            ("lists", "8 clients sending 8 MiB lookups of 2.8M empty lists (under the limit)"),
            ("strings", "8 clients sending 8 MiB lookups of 2.8M empty strings (under the limit)"),
            ("floats", "8 clients sending 8 MiB lookups of 2.1M floats (under the limit)"),
            ("objects", "8 clients sending 8 MiB lookups of 2.8M empty objects (under the limit)"),
            ("nulls", "8 clients sending 8 MiB lookups of 1.7M nulls (under the limit)"),
            ("valid", "8 clients sending valid lookups of 8 MiB (just under the limit)"),
        ):
            prober = Prober(service.url + "/health", every=0.01)
            prober.start()
            if kind == "idle":
                time.sleep(seconds)
                counts: dict[int, int] = {}
            else:
                counts = json_load(service.url, KEYS["alice"], kind, seconds, clients=8, nice=nice)
            prober.stop()
            print(f"health: {what}: /health {_ms(prober.latencies)}; load answers {counts}")
    finally:
        service.stop()


# ---------------------------------------------------------------------------------- locks, jobs
def locks(data: Path, requests: int) -> None:
    service = Service(data).start()
    try:
        before = len(list((data / "locks").iterdir())) + len(list((data / "journals").iterdir()))
        with service.client() as alice:
            calls = ["append", "truncate", "fork", "delete", "park", "verify", "repair"]
            for i in range(requests):
                call = calls[i % len(calls)]
                sid = f"nobody-{i}"
                if call == "delete":
                    alice.delete(f"/sessions/{sid}")
                elif call == "verify":
                    alice.get(f"/sessions/{sid}/verify")
                elif call == "repair":
                    alice.post(f"/sessions/{sid}/file/repair")
                elif call == "append":
                    alice.post(
                        f"/sessions/{sid}/append", content=b"", headers={"Content-Type": "application/octet-stream"}
                    )
                elif call == "fork":
                    alice.post(f"/sessions/{sid}/fork", json={})
                else:
                    alice.post(f"/sessions/{sid}/{call}", json={"n_records": 0} if call == "truncate" else None)
        after = len(list((data / "locks").iterdir())) + len(list((data / "journals").iterdir()))
        print(
            f"locks: {requests} requests for ids that do not exist: {after - before} files left in locks/ and journals/"
        )
    finally:
        service.stop()


def jobs(data: Path) -> None:
    for name, extra in (("default limits", ()), ("--max-jobs-per-owner 1000", ("--max-jobs-per-owner", "1000"))):
        service = Service(data / name.replace(" ", "_"), *extra).start()
        try:
            _create(service, "queued")
            accepted, refused = 0, None
            with service.client() as alice, session_lock_held(service.data, "queued"):
                while refused is None and accepted < 10_000:
                    response = alice.post("/sessions/queued/park")
                    if response.status_code == 202:
                        accepted += 1
                    else:
                        refused = response
            assert refused is not None
            print(
                f"jobs ({name}): {accepted} jobs of one owner accepted, then {refused.status_code} "
                f"{refused.json()['error']} with Retry-After {refused.headers.get('Retry-After')}: "
                f"{refused.json()['reason']}"
            )
        finally:
            service.stop()


# ---------------------------------------------------------------------------------- waiters
def waiters(data: Path, hold_s: float) -> None:
    service = Service(data).start()
    try:
        _create(service, "busy")
        _create(service, "other")
        rows = arrow_rows(GEOMETRY, 2)
        clients = [service.client() for _ in range(61)]

        def append(client: httpx.Client, sid: str):
            started = time.perf_counter()
            response = client.post(f"/sessions/{sid}/append", content=rows, headers={"Content-Type": ARROW})
            return response.status_code, time.perf_counter() - started

        other: list[float] = []
        alone: list[float] = []
        pool = ThreadPoolExecutor(60)
        with session_lock_held(data, "busy"):
            held_until = time.monotonic() + hold_s
            busy = [pool.submit(append, client, "busy") for client in clients[:60]]
            while time.monotonic() < held_until:
                status, took = append(clients[60], "other")
                assert status == 200
                other.append(took)
                if len(other) % 5 == 0 and sum(f.done() for f in busy) >= 44:  # one more, alone, on the busy one
                    status, took = append(clients[60], "busy")
                    assert status == 429
                    alone.append(took)
            burst = [f.result() for f in busy if f.done()]
        results = [f.result() for f in busy]  # the waiters go in once the lock is free
        pool.shutdown()
        for client in clients:
            client.close()
        statuses = {s: sum(1 for r, _ in results if r == s) for s in sorted({r for r, _ in results})}
        print(
            f"waiters: 60 appends at once on a session held by another process for {hold_s:g} s (default "
            f"--session-waiters 16): answers {statuses}; the 429s of the burst: {_ms([t for s, t in burst if s == 429])}; "
            f"one more append alone while held: {_ms(alone)}; appends to another session meanwhile: {_ms(other)}; "
            f"the waiters, once the lock was freed: {_ms([t for s, t in results if s == 200])}"
        )
    finally:
        service.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated: bombs, health, locks, jobs, waiters")
    parser.add_argument("--seconds", type=float, default=8.0, help="each load phase of the health scenario")
    parser.add_argument("--bombs", type=int, default=20)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument(
        "--client-nice",
        type=int,
        default=19,
        help="niceness of the load generator (19: on a small machine the server gets the CPU, as it would with "
        "clients elsewhere; 0: the clients compete with it)",
    )
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"# {platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, commit {commit.strip()}+")
    names = args.only.split(",") if args.only else ["bombs", "health", "locks", "jobs", "waiters"]
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            data = Path(folder) / name / "data"
            if name == "bombs":
                bombs(data, args.bombs)
            elif name == "health":
                health(data, args.seconds, args.client_nice)
            elif name == "locks":
                locks(data, args.requests)
            elif name == "jobs":
                jobs(data)
            elif name == "waiters":
                waiters(data, 3.0)
            else:
                parser.error(f"unknown scenario {name!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
