"""Many sessions of one owner (issue 42, item 5): what a list page, ``/health``, a restart and a
``/metrics`` scrape cost against a real ``kvstore serve`` on 127.0.0.1 holding them.

    .venv/bin/python bench/many_sessions.py                      # 20,000 sessions, this checkout
    .venv/bin/python bench/many_sessions.py --sessions 2000 --json
    .venv/bin/python bench/many_sessions.py --pythonpath DIR     # the server (and the fill) run
                                                                 # the kvstore laid out in DIR

The sessions are made directly through the store (``kvstore.store.open``, in a child process running
the same code as the server), then the server is started on them and measured:

- **restart**: from starting ``kvstore serve`` to its first ``/health`` 200 (the median and the
  most of ``--restarts`` starts, the store's reconcile on open included);
- **a list page**: every page of ``GET /sessions`` (the default ``limit``), one client, paged
  through to the end: p50 / p99 per page. A server without paging (``--pythonpath`` of an older
  kvstore: its answer has no ``next_cursor``) answers the whole list in one: that is its "page";
- **``/health`` while 4 clients page through everything**: each of 4 threads pages through every
  session (or fetches the whole list once, without paging) while one more polls ``/health`` every
  10 ms: p50 / p99 / max; and the server's resident memory growth meanwhile (its peak ``VmRSS``,
  sampled every 10 ms, over what it held before);
- **``/metrics`` CPU per scrape**: one write (a ``PATCH`` of a session's tags), then one scrape,
  ``--scrapes`` times; the server's CPU time (every thread's, ``/proc/PID/task/*/schedstat``)
  spent from just before each scrape was sent to its answer, averaged;
- **console**: ``GET /console/activity`` and ``/console/store`` latency (p50 of 20).

Prints a table (``--json``: the figures as JSON). The machine's other load shows in the figures:
the ones in RELIABILITY.md were taken on a 2-core CPU box.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

OWNER = "bench"
KEY = "bench-key-0123456789abcdef"
ROOT = Path(__file__).resolve().parent.parent

FILL = """
import sys, time
import kvstore.store
from kvstore import tiers
from kvstore.formats.coli_kv import Geometry
data, n = sys.argv[1], int(sys.argv[2])
geometry = Geometry(n_layers=2, kv_lora=32, qk_rope=8, index_hd=4, nic=1, vocab=1000)
model = {"name": "tiny-mla", "revision": "r1"}
with kvstore.store.open(data) as store:
    started = time.perf_counter()
    for i in range(n):
        store.create(%(owner)r, geometry, tiers.FP8, model, session_id=f"s{i:06d}", tags=["even"] if i %% 2 == 0 else [])
        if (i + 1) %% 5000 == 0:
            print(f"  {i + 1} sessions ({(i + 1) / (time.perf_counter() - started):.0f}/s)", flush=True)
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] if ordered else float("nan")


def child_env(pythonpath: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_API_KEYS"}
    env["KVSTORE_API_KEYS"] = f"{KEY}:{OWNER}"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def fill(data: Path, n: int, pythonpath: str | None) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", FILL % {"owner": OWNER}, str(data), str(n)],
        env=child_env(pythonpath),
        check=True,
        cwd=tempfile.gettempdir(),  # never this checkout's folders ahead of --pythonpath
    )
    return time.perf_counter() - started


class Server:
    """``kvstore serve`` on a free port of 127.0.0.1, its start timed to the first ``/health`` 200."""

    def __init__(self, data: Path, pythonpath: str | None):
        self.data, self.pythonpath = data, pythonpath
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> float:
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        self.url = f"http://127.0.0.1:{port}"
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--data", str(self.data), "--port", str(port),
             "--log-level", "warning"],
            env=child_env(self.pythonpath), cwd=tempfile.gettempdir(),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"kvstore serve exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.01)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(60)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self) -> float:
        """CPU time of every thread of the server, from the scheduler's nanosecond counters."""
        total = 0
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a worker thread that ended meanwhile
        return total / 1e9

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600)


def page_through(client: httpx.Client, timings: list[float] | None = None) -> tuple[int, bool]:
    """Every session of the owner, page after page (one request without paging); (count, paged)."""
    count, cursor, paged = 0, None, False
    while True:
        started = time.perf_counter()
        answer = client.get("/sessions", params={"cursor": cursor} if cursor else None)
        if timings is not None:
            timings.append(time.perf_counter() - started)
        answer.raise_for_status()
        body = answer.json()
        count += len(body["sessions"])
        cursor = body.get("next_cursor")
        paged = paged or "next_cursor" in body
        if not cursor:
            return count, paged


def under_load(server: Server, clients: int = 4) -> dict[str, float]:
    """``/health`` latency and the server's memory while ``clients`` threads page through everything."""
    health: list[float] = []
    peak_rss = before_rss = server.rss_bytes()
    done = threading.Event()
    counts: list[int] = []

    def reader() -> None:
        with server.client() as client:
            counts.append(page_through(client)[0])

    def prober() -> None:
        nonlocal peak_rss
        with httpx.Client(base_url=server.url, timeout=600) as client:
            while not done.is_set():
                started = time.perf_counter()
                client.get("/health").raise_for_status()
                health.append(time.perf_counter() - started)
                peak_rss = max(peak_rss, server.rss_bytes())
                time.sleep(0.01)

    probe = threading.Thread(target=prober)
    probe.start()
    time.sleep(0.2)
    started = time.perf_counter()
    readers = [threading.Thread(target=reader) for _ in range(clients)]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join()
    elapsed = time.perf_counter() - started
    done.set()
    probe.join()
    return {
        "health_p50_ms": percentile(health, 50) * 1e3,
        "health_p99_ms": percentile(health, 99) * 1e3,
        "health_max_ms": max(health) * 1e3,
        "health_probes": len(health),
        "page_through_s": elapsed,
        "sessions_each": min(counts) if counts else 0,
        "rss_growth_mib": (peak_rss - before_rss) / 2**20,
    }


def metrics_cpu(server: Server, scrapes: int, session_id: str) -> float:
    """The server's CPU seconds per ``/metrics`` scrape, each scrape right after a write."""
    spent = 0.0
    with server.client() as client:
        for i in range(scrapes):
            client.patch(f"/sessions/{session_id}", json={"tags": [f"t{i % 2}"]}).raise_for_status()
            time.sleep(0.05)  # the write's own work (and its thread) done before the clock starts
            before = server.cpu_seconds()
            client.get("/metrics").raise_for_status()
            spent += server.cpu_seconds() - before
    return spent / scrapes


def latency(client: httpx.Client, path: str, n: int = 20) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        client.get(path).raise_for_status()
        times.append(time.perf_counter() - started)
    return percentile(times, 50) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20_000)
    parser.add_argument("--data", type=Path, help="a data folder to use (sessions are added only when it has none)")
    parser.add_argument("--pythonpath", help="run the server and the fill with this PYTHONPATH (another kvstore)")
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.pythonpath:
        args.pythonpath = str(Path(args.pythonpath).resolve())

    holder = tempfile.TemporaryDirectory(prefix="kvstore-many-")
    data = args.data or Path(holder.name) / "data"
    figures: dict[str, float | int | str] = {"sessions": args.sessions}
    if not (data / "index" / "data.mdb").exists():
        print(f"making {args.sessions} sessions of one owner in {data} ...", file=sys.stderr)
        figures["fill_s"] = fill(data, args.sessions, args.pythonpath)

    server = Server(data, args.pythonpath)
    starts = []
    for _ in range(args.restarts):
        starts.append(server.start())
        server.stop()
    figures["restart_median_s"] = statistics.median(starts)
    figures["restart_max_s"] = max(starts)

    server.start()
    try:
        with server.client() as client:
            pages: list[float] = []
            count, paged = page_through(client, pages)
            if not paged:  # a server without paging: its one "page" is the whole list, timed a few times
                for _ in range(2):
                    page_through(client, pages)
            figures["paged"] = "yes" if paged else "no (one answer holds every session)"
            figures["listed"] = count
            figures["pages"] = len(pages) if paged else 1
            figures["page_p50_ms"] = percentile(pages, 50) * 1e3
            figures["page_p99_ms"] = percentile(pages, 99) * 1e3
            figures["console_activity_ms"] = latency(client, "/console/activity")
            figures["console_store_ms"] = latency(client, "/console/store")
        figures.update(under_load(server))
        figures["metrics_cpu_ms"] = metrics_cpu(server, args.scrapes, "s000000") * 1e3
    finally:
        server.stop()

    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    rows = [
        ("sessions of one owner", f"{figures['sessions']:,}"),
        ("list paged", figures["paged"]),
        ("a list page (p50 / p99)", f"{figures['page_p50_ms']:.1f} / {figures['page_p99_ms']:.1f} ms "
         f"({figures['pages']} pages, {figures['listed']:,} sessions)"),
        ("/health while 4 clients page through everything (p50 / p99 / max)",
         f"{figures['health_p50_ms']:.1f} / {figures['health_p99_ms']:.1f} / {figures['health_max_ms']:.1f} ms"),
        ("4 page-throughs at once: wall, server RSS growth",
         f"{figures['page_through_s']:.1f} s, {figures['rss_growth_mib']:.0f} MiB"),
        ("restart to /health (median / max)", f"{figures['restart_median_s']:.2f} / {figures['restart_max_s']:.2f} s"),
        ("/metrics scrape after a write, server CPU", f"{figures['metrics_cpu_ms']:.1f} ms"),
        ("/console/activity, /console/store (p50)",
         f"{figures['console_activity_ms']:.1f} ms, {figures['console_store_ms']:.1f} ms"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
