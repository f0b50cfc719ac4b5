"""Append over HTTP: throughput for 256-token turns, and 8 concurrent clients on different sessions.

Geometry: GLM-4.5 style (78 layers, kv_lora 512, qk_rope 64, nic 0), v2 records of 45,556 bytes,
so a 256-token turn is an 11.7 MB request body. Each acknowledged append is durable: the records
are fsynced, then the journal's commit counter, then the LMDB index commit.

* **direct**: ``SessionStore.append_records`` in this process (same validation, fsyncs, index
  commit) — the peer the HTTP path is compared with, measured in the same run;
* **http**: ``POST /sessions/{id}/append`` (raw record bytes) through a real uvicorn server;
* **8 clients**: 8 threads, each with its own httpx client and session, appending ``--turns``
  256-token turns at once; every response must be 200; latency p50/p99 per request.

Usage::

    python bench/api_append.py
    python bench/api_append.py --turns 10 --clients 8
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from api_common import GEOMETRY_JSON, GLM, MODEL, TIER, Server, percentile, v2_records

from kvstore.store import SessionStore

TURN = 256
RAW = {"Content-Type": "application/octet-stream"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20, help="256-token turns per session")
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    payloads = [v2_records(TURN, seed=i).tobytes() for i in range(4)]
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        with SessionStore(Path(tmp) / "direct") as store:
            store.create("bench", GLM, TIER, MODEL, session_id="direct")
            began = time.perf_counter()
            for turn in range(args.turns):
                store.append_records("direct", payloads[turn % len(payloads)])
            direct_s = time.perf_counter() - began

        server = Server(Path(tmp) / "data")
        try:
            with server.client() as client:
                client.post(
                    "/sessions", json={"id": "one", "model": MODEL, "geometry": GEOMETRY_JSON}
                ).raise_for_status()
                began = time.perf_counter()
                for turn in range(args.turns):
                    client.post(
                        "/sessions/one/append", content=payloads[turn % len(payloads)], headers=RAW
                    ).raise_for_status()
                http_s = time.perf_counter() - began
                for i in range(args.clients):
                    client.post(
                        "/sessions", json={"id": f"c{i}", "model": MODEL, "geometry": GEOMETRY_JSON}
                    ).raise_for_status()

            latencies: list[float] = []
            errors: list[str] = []
            lock = threading.Lock()
            start = threading.Barrier(args.clients)

            def worker(i: int) -> None:
                with server.client() as own:
                    start.wait()
                    for turn in range(args.turns):
                        began = time.perf_counter()
                        response = own.post(
                            f"/sessions/c{i}/append", content=payloads[(i + turn) % len(payloads)], headers=RAW
                        )
                        took = time.perf_counter() - began
                        with lock:
                            latencies.append(took)
                            if response.status_code != 200:
                                errors.append(f"{response.status_code} {response.text[:200]}")

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.clients)]
            began = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            concurrent_s = time.perf_counter() - began
            with server.client() as client:
                counts = [client.get(f"/sessions/c{i}").json()["n_records"] for i in range(args.clients)]
        finally:
            server.stop()
    tokens = args.turns * TURN
    mb = len(payloads[0]) / 1e6
    print(f"append, GLM geometry (78 x 512/64, nic 0), v2, {TURN}-token turns ({mb:.1f} MB each), {args.turns} turns")
    print(f"{'path':<34}{'tokens/s':>10}{'MB/s':>8}{'ratio':>8}")
    print(f"{'direct: SessionStore.append':<34}{tokens / direct_s:>10.0f}{args.turns * mb / direct_s:>8.0f}{1.0:>8.2f}")
    print(
        f"{'http: POST /append (1 client)':<34}{tokens / http_s:>10.0f}{args.turns * mb / http_s:>8.0f}{http_s / direct_s:>8.2f}"
    )
    total = args.clients * tokens
    print(
        f"{args.clients} clients x {args.turns} turns: {total / concurrent_s:.0f} tokens/s aggregate, "
        f"errors {len(errors)}, latency p50 {percentile(latencies, 50) * 1e3:.0f} ms, p99 {percentile(latencies, 99) * 1e3:.0f} ms, "
        f"records per session {sorted(set(counts))} (expected {tokens})"
    )
    if errors:
        print("first error:", errors[0])


if __name__ == "__main__":
    main()
