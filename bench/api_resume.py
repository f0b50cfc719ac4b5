"""Resume of a 32k-token GLM-geometry v2 session through the HTTP API vs reading its file from disk.

Geometry: 78 layers, kv_lora 512, qk_rope 64, no indexer (nic 0), vocab 151552; v2 (fp8) records
of 45,556 bytes, so a 32,768-token session is a 1.49 GB journal. Both sides end with the same
thing — the records parsed into a structured array (``KVRecords``):

* **disk**: ``coli_kv.load(journal)`` (one read of the whole file + one ``frombuffer``);
* **api**: ``GET /sessions/{id}/resume`` (raw record bytes) through a real uvicorn server on
  127.0.0.1, read into one preallocated buffer, then one ``frombuffer`` — with two clients:
  httpx (h11 parses the body 64 KiB at a time in Python), and ``http.client`` reading the body
  straight into the buffer (``readinto``), which shows the server's own cost.

The file is in the page cache for both (it was just written and is read before timing), so the
ratio is the cost of the service itself. Prints the median of ``--repeat`` runs of each.

Usage::

    python bench/api_resume.py               # 32768 tokens
    python bench/api_resume.py --tokens 4096 # quicker
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from api_common import GEOMETRY_JSON, GLM, KEY, MODEL, TIER, Server, own_cpu_seconds, process_cpu_seconds, v2_records

from kvstore.formats import coli_kv


def fetch(client, session_id: str) -> tuple[np.ndarray, int]:
    """The served records, parsed; and the reused-tokens count the server reported."""
    with client.stream("GET", f"/sessions/{session_id}/resume") as response:
        response.raise_for_status()
        body = np.empty(int(response.headers["content-length"]), dtype=np.uint8)
        view = memoryview(body)
        got = 0
        for chunk in response.iter_raw():
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        reused = int(response.headers["x-kv-reused-tokens"])
    return np.frombuffer(body, dtype=coli_kv.record_dtype(GLM, TIER)), reused


def fetch_readinto(url: str, session_id: str) -> tuple[np.ndarray, int]:
    """The same request with ``http.client``: the body lands in the buffer with no extra copy."""
    host, port = url.split("//")[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        connection.request("GET", f"/sessions/{session_id}/resume", headers={"Authorization": f"Bearer {KEY}"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"resume answered {response.status}: {response.read()[:200]!r}")
        body = np.empty(int(response.getheader("content-length")), dtype=np.uint8)
        view = memoryview(body)
        got = 0
        while got < len(body):
            n = response.readinto(view[got:])
            if not n:
                raise RuntimeError("the body ended early")
            got += n
        reused = int(response.getheader("x-kv-reused-tokens"))
    finally:
        connection.close()
    return np.frombuffer(body, dtype=coli_kv.record_dtype(GLM, TIER)), reused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        data = Path(tmp) / "data"
        server = Server(data)
        try:
            with server.client() as client:
                created = client.post(
                    "/sessions", json={"id": "long", "model": MODEL, "geometry": GEOMETRY_JSON, "tier": "fp8"}
                )
                created.raise_for_status()
                for start in range(0, args.tokens, 1024):
                    chunk = v2_records(min(1024, args.tokens - start), seed=start)
                    client.post(
                        "/sessions/long/append",
                        content=chunk.tobytes(),
                        headers={"Content-Type": "application/octet-stream"},
                    ).raise_for_status()
                journal = data / "journals" / "long~bench.coli_kv"  # <id>~<owner>
                size = journal.stat().st_size
                reference = coli_kv.load(journal)  # warms the page cache
                timings = {name: ([], []) for name in ("disk", "httpx", "readinto")}

                def measure(name, fn, with_server):
                    cpu = own_cpu_seconds() + (process_cpu_seconds(server.process.pid) if with_server else 0.0)
                    began = time.perf_counter()
                    out = fn()
                    timings[name][0].append(time.perf_counter() - began)
                    timings[name][1].append(
                        own_cpu_seconds() + (process_cpu_seconds(server.process.pid) if with_server else 0.0) - cpu
                    )
                    return out

                for _ in range(args.repeat):  # interleaved, so load from elsewhere hits all three alike
                    loaded = measure("disk", lambda: coli_kv.load(journal), False)
                    by_httpx, reused = measure("httpx", lambda: fetch(client, "long"), True)
                    by_readinto, reused_too = measure("readinto", lambda: fetch_readinto(server.url, "long"), True)
                    assert loaded.n == by_httpx.shape[0] == by_readinto.shape[0] == reused == reused_too == args.tokens
                assert by_httpx.tobytes() == by_readinto.tobytes() == reference.records.tobytes()
        finally:
            server.stop()
    disk_s, disk_c = statistics.median(timings["disk"][0]), statistics.median(timings["disk"][1])
    print(
        f"resume of {args.tokens} tokens, GLM geometry (78 x 512/64, nic 0), v2: {size / 1e9:.2f} GB, median of {args.repeat}"
    )
    print(f"{'path':<40}{'wall s':>8}{'GB/s':>7}{'ratio':>7}{'cpu s':>8}{'cpu ratio':>10}")
    for name, label in (
        ("disk", "disk: coli_kv.load"),
        ("readinto", "api: GET /resume, http.client readinto"),
        ("httpx", "api: GET /resume, httpx"),
    ):
        wall, cpu = statistics.median(timings[name][0]), statistics.median(timings[name][1])
        print(f"{label:<40}{wall:>8.3f}{size / wall / 1e9:>7.2f}{wall / disk_s:>7.2f}{cpu:>8.3f}{cpu / disk_c:>10.2f}")
    print("cpu s: this process (+ the server process for the API rows), user + system")


if __name__ == "__main__":
    main()
