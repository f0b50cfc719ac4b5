"""Memory of the file tools (issue 42, items 3 and 4): what reading a large journal costs.

* **inspect**: a real ``kvstore serve`` with a ~100 MB fp8 session (GLM geometry); 4 clients send
  ``GET /sessions/big/file/inspect`` at once, with the session active, then parked. The figure is
  the growth of the server's peak RSS over its RSS before the requests (Linux ``VmHWM``, reset
  through ``/proc/PID/clear_refs`` before each round).
* **export**: ``kvstore export`` of int4 files (DeepSeek-V3 geometry: 61 layers of 512 + 64) of
  about 23 MB and 47 MB to ``.npz``, ``.arrow`` and ``.parquet``, each in a child process; the
  figure is the growth of its peak RSS (``resource.getrusage`` maxrss) over the peak it had with
  everything imported, before the command ran.

Usage::

    python bench/hardening.py                      # both, the sizes above
    python bench/hardening.py inspect --mb 100
    python bench/hardening.py export --mb 23 47

The code measured is whatever ``import kvstore`` finds: set ``PYTHONPATH`` to a tree laid out as the
installed package to measure another version, and run from outside the checkout (the server and the
export children are started with ``-m``/``-c``, which put their working folder first on the path).
RELIABILITY.md, "Hardening round 3", has the figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from api_common import GEOMETRY_JSON, GLM, MODEL, TIER, Server, v2_records

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Header
from kvstore.store import SessionStore

MiB = 1 << 20
#: DeepSeek-V3's MLA geometry (no indexer).
DSV3 = Geometry(n_layers=61, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=129280)


def _status(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` size in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


def _inspect_round(server: Server, session_id: str, clients: int) -> tuple[int, list[dict]]:
    pid = server.process.pid
    time.sleep(0.5)
    before = _status(pid, "VmRSS")
    _reset_peak(pid)

    def one(_: int) -> dict:
        with server.client() as client:
            answer = client.get(f"/sessions/{session_id}/file/inspect")
            answer.raise_for_status()
            return answer.json()

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        reports = list(pool.map(one, range(clients)))
    return _status(pid, "VmHWM") - before, reports


def bench_inspect(mb: int, clients: int) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="kvstore-hardening-") as folder:
        data = Path(folder) / "data"
        rec_bytes = coli_kv.record_bytes(GLM, TIER)
        n = mb * MiB // rec_bytes
        with SessionStore(data) as store:
            for session_id, count in (("big", n), ("small", 8)):
                store.create("bench", GLM, TIER, MODEL, session_id=session_id)
                step = 200
                for start in range(0, count, step):
                    store.append_records(session_id, v2_records(min(step, count - start), start).tobytes())
            journal_bytes = store.get("big").size_bytes
        server = Server(data)
        lines = []
        try:
            with server.client() as client:
                for _ in range(2):  # imports and first-call allocations, on a small session
                    client.get("/sessions/small/file/inspect").raise_for_status()
                grown, reports = _inspect_round(server, "big", clients)
                assert all(r["loadable_records"] == n for r in reports), reports[0]
                lines.append(
                    f"| inspect, active, {clients} at once | {journal_bytes / MiB:.1f} MiB journal | {grown / MiB:.1f} MiB |"
                )
                job = client.post("/sessions/big/park").json()
                while job["state"] not in ("done", "failed"):
                    time.sleep(0.2)
                    job = client.get(f"/jobs/{job['id']}").json()
                assert job["state"] == "done", job
                client.get("/sessions/small/file/inspect").raise_for_status()
                grown, reports = _inspect_round(server, "big", clients)
                assert all(r["loadable_records"] == n and r["session"]["state"] == "parked" for r in reports)
                archive = reports[0]["file"]["bytes"]
                lines.append(
                    f"| inspect, parked, {clients} at once | {archive / MiB:.1f} MiB archive of it | {grown / MiB:.1f} MiB |"
                )
        finally:
            server.stop()
    return lines


def _arrow_body(n: int, seed: int) -> bytes:
    """An Arrow IPC upload of ``n`` GLM-geometry rows (f32 values, one record batch per 256 rows)."""
    import pyarrow as pa

    from kvstore.api import arrow

    rng = np.random.default_rng(seed)
    schema = arrow.schema_for(GLM)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for start in range(0, n, 256):
            k = min(256, n - start)
            L = rng.standard_normal((k, GLM.n_layers * GLM.kv_lora), dtype=np.float32)
            R = rng.standard_normal((k, GLM.n_layers * GLM.qk_rope), dtype=np.float32)
            columns = [
                pa.array(np.arange(start, start + k, dtype=np.int32)),
                pa.FixedSizeListArray.from_arrays(pa.array(L.reshape(-1)), GLM.n_layers * GLM.kv_lora),
                pa.FixedSizeListArray.from_arrays(pa.array(R.reshape(-1)), GLM.n_layers * GLM.qk_rope),
            ]
            writer.write_batch(pa.record_batch(columns, schema=schema))
    return sink.getvalue().to_pybytes()


def bench_append(mb: int, clients: int) -> list[str]:
    """``clients`` concurrent appends of ``mb`` MiB bodies (Arrow, then raw records), each to its
    own fp8 session: the server's peak RSS growth against the bodies in flight."""
    rows_arrow = mb * MiB // (4 * GLM.n_layers * (GLM.kv_lora + GLM.qk_rope))
    rows_raw = mb * MiB // coli_kv.record_bytes(GLM, TIER)
    bodies = {
        "arrow": [_arrow_body(rows_arrow, seed) for seed in range(clients)],
        "raw": [v2_records(rows_raw, seed).tobytes() for seed in range(clients)],
    }
    media = {"arrow": "application/vnd.apache.arrow.stream", "raw": "application/octet-stream"}
    lines = []
    with tempfile.TemporaryDirectory(prefix="kvstore-hardening-") as folder:
        server = Server(Path(folder) / "data", "--max-body", f"{2 * mb}M")
        try:
            with server.client() as client:
                for i in range(clients + 1):
                    body = {"id": f"s{i}", "model": MODEL, "geometry": GEOMETRY_JSON, "tier": "fp8"}
                    client.post("/sessions", json=body).raise_for_status()
                warm = _arrow_body(64, 99)
                client.post("/sessions/s0/append", content=warm, headers={"Content-Type": media["arrow"]})
            for kind in ("arrow", "raw"):
                pid = server.process.pid
                time.sleep(0.5)
                before = _status(pid, "VmRSS")
                _reset_peak(pid)

                def one(i: int, kind: str = kind) -> int:
                    with server.client() as c:
                        answer = c.post(
                            f"/sessions/s{i + 1}/append",
                            content=bodies[kind][i],
                            headers={"Content-Type": media[kind]},
                        )
                        answer.raise_for_status()
                        return answer.json()["appended"]

                with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                    appended = list(pool.map(one, range(clients)))
                grown = _status(pid, "VmHWM") - before
                sent = sum(len(b) for b in bodies[kind])
                lines.append(
                    f"| append {kind}, {clients} at once | {clients} x {sent / clients / MiB:.0f} MiB bodies "
                    f"({sum(appended)} rows) | {grown / MiB:.0f} MiB | {grown / sent:.2f}x the bodies |"
                )
        finally:
            server.stop()
    return lines


#: Run a command as the child of a small shell, which waits for it: a process's peak RSS
#: (``ru_maxrss``) starts at its parent's when the parent execs it, so a child forked by this process
#: (large after building the files) would report this process's peak, not its own.
FRESH = ("/bin/sh", "-c", '"$0" "$@"; exit $?')

_EXPORT_CHILD = """
import json, resource, sys
import numpy, pyarrow, pyarrow.ipc, pyarrow.parquet, zipfile
import kvstore.cli, kvstore.export, kvstore.filetools
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = kvstore.cli.main(["export", sys.argv[1], sys.argv[2], "--force", "-q"])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"code": code, "grown_kib": after - before}))
"""


def int4_file(path: Path, mb: float, seed: int = 0) -> int:
    """A valid int4 file of about ``mb`` MiB (random codes, radii in range); returns its records."""
    rec_bytes = coli_kv.record_bytes(DSV3, tiers.INT4)
    n = int(mb * MiB) // rec_bytes
    rng = np.random.default_rng(seed)
    dtype = coli_kv.record_dtype(DSV3, tiers.INT4)
    records = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)
    records["token"] = rng.integers(0, DSV3.vocab, n)
    records["layers"]["Ls"] = rng.uniform(0.5, 4.0, (n, DSV3.n_layers)).astype(np.float32)
    records["layers"]["Rs"] = rng.uniform(0.5, 4.0, (n, DSV3.n_layers)).astype(np.float32)
    path.write_bytes(Header(DSV3, tiers.INT4, n).to_bytes() + records.tobytes())
    return n


def bench_export(sizes: list[float]) -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory(prefix="kvstore-hardening-") as folder:
        for mb in sizes:
            source = Path(folder) / f"s{mb:g}.coli_kv"
            int4_file(source, mb)
            for suffix in (".npz", ".arrow", ".parquet"):
                out = Path(folder) / f"out{suffix}"
                started = time.perf_counter()
                done = subprocess.run(
                    [*FRESH, sys.executable, "-c", _EXPORT_CHILD, str(source), str(out)],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=folder,  # not a checkout: ``import kvstore`` finds the version measured
                )
                seconds = time.perf_counter() - started
                result = json.loads(done.stdout.strip().splitlines()[-1])
                assert result["code"] == 0, done.stderr
                lines.append(
                    f"| export int4 -> {suffix} | {source.stat().st_size / MiB:.1f} MiB | "
                    f"{result['grown_kib'] / 1024:.1f} MiB | {out.stat().st_size / MiB:.0f} MiB out, {seconds:.1f} s |"
                )
                out.unlink()
            source.unlink()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=["inspect", "export", "append", "both"], default="both")
    parser.add_argument("--mb", type=float, nargs="+", help="journal size(s) in MiB (inspect: 100; export: 23 47)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent inspects (default 4)")
    args = parser.parse_args()
    print("| what | input | peak RSS growth | |")
    print("|---|---|---:|---|")
    if args.what in ("inspect", "both"):
        for line in bench_inspect(int((args.mb or [100])[0]), args.clients):
            print(line)
    if args.what in ("export", "both"):
        for line in bench_export(args.mb or [23, 47]):
            print(line)
    if args.what == "append":
        for line in bench_append(int((args.mb or [100])[0]), args.clients):
            print(line)


if __name__ == "__main__":
    main()
