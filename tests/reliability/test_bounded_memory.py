"""Reading a large journal holds a bounded amount of memory (issue 42, items 3 and 4).

* A session's ``inspect`` (``GET /sessions/{id}/file/inspect``) loaded the whole journal, and a
  parked one its whole archive unpacked then copied: 4 concurrent inspects of a 100 MB journal took
  the server's RSS up by 543 MB, 656 MB parked. It now judges the journal (or the archive as it is
  decompressed) a chunk at a time: one call holds at most 1.5 chunks, whatever the session's size,
  and counts against the session's request limit (``--session-waiters``) while it runs.
* ``kvstore export`` built the whole table in memory (a 23 MB int4 file: +541 MB to ``.arrow``,
  +770 MB to ``.parquet``). It now streams record batches and row groups: its peak RSS grows by at
  most 256 MB, whatever the file's size.

Peaks are each child process's ``resource.getrusage`` maxrss, grown from what it had with
everything imported. A child starts from a small shell that waits for it: a process's maxrss starts
at its parent's when the parent execs it, so a child of this (large) test process would report the
test process's peak instead of its own.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import numpy as np

from kvstore import tiers
from kvstore.filetools import CHUNK_BYTES
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Header
from kvstore.locks import FileLock
from kvstore.store import SessionStore
from kvstore.store.results import records_report
from served import ServeProcess

MiB = 1 << 20
#: A child of a small shell that waits for it (see the module docstring).
FRESH = ("/bin/sh", "-c", '"$0" "$@"; exit $?')
GEOMETRY = Geometry(n_layers=8, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=1000)
MODEL = {"name": "bounded", "revision": "r1"}
KEY = "bounded-memory-key-0123456789"


def fp8_records(n: int, seed: int) -> np.ndarray:
    """``n`` valid fp8 records of :data:`GEOMETRY` (random codes without NaN codes, scales in range)."""
    rng = np.random.default_rng(seed)
    dtype = coli_kv.record_dtype(GEOMETRY, tiers.FP8)
    records = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)
    records["token"] = rng.integers(0, GEOMETRY.vocab, n)
    for codes in ("Lc", "Rc"):
        view = records["layers"][codes]
        view[(view & 0x7F) == 0x7F] = 0
    for scales in ("Ls", "Rs"):
        records["layers"][scales] = rng.uniform(0.01, 1.0, (n, GEOMETRY.n_layers)).astype(np.float32)
    return records


def fill(store: SessionStore, session_id: str, n: int) -> None:
    store.create("alice", GEOMETRY, tiers.FP8, MODEL, session_id=session_id)
    for start in range(0, n, 2000):
        store.append_records(session_id, fp8_records(min(2000, n - start), start).tobytes())


_INSPECT_CHILD = """
import json, resource, sys
from kvstore.store import SessionStore
with SessionStore(sys.argv[1]) as store:
    for _ in range(2):
        store.inspect(sys.argv[2])  # imports and first-call allocations, on a small session
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = store.inspect(sys.argv[3])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grown_kib": grown, "report": report}))
"""


def test_inspect_of_a_large_session_holds_one_chunk_active_and_parked(tmp_path):
    data = tmp_path / "data"
    n = 64 * MiB // coli_kv.record_bytes(GEOMETRY, tiers.FP8)
    with SessionStore(data) as store:
        for session_id, count in (("big", n), ("parked", n), ("small", 4), ("small-parked", 4)):
            fill(store, session_id, count)
        store.park("parked")
        store.park("small-parked")
        journal = coli_kv.load(store.journal_path("big"))
    expected = records_report(journal)
    for small, big in (("small", "big"), ("small-parked", "parked")):
        done = subprocess.run(
            [*FRESH, sys.executable, "-c", _INSPECT_CHILD, str(data), small, big],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        report = result["report"]
        assert {key: report[key] for key in expected} == expected
        assert report["file"]["journal_bytes" if big == "parked" else "bytes"] == journal.file_size
        grown = result["grown_kib"] * 1024
        assert grown <= 1.5 * CHUNK_BYTES, (
            f"inspect of the {journal.file_size / MiB:.0f} MiB {big} session: +{grown / MiB:.1f} MiB"
        )


def test_inspect_finds_what_a_whole_load_finds_active_and_parked(tmp_path):
    data = tmp_path / "data"
    with SessionStore(data) as store:
        fill(store, "s", 50)
        path = store.journal_path("s")
        records = np.memmap(
            path, dtype=coli_kv.record_dtype(GEOMETRY, tiers.FP8), mode="r+", offset=coli_kv.HEADER_BYTES, shape=(50,)
        )
        records["layers"]["Ls"][7, 3] = np.float32(1e37)  # a scale no encoder writes
        records["layers"]["Rc"][20, 1, 5] = 0xFF  # an fp8 NaN code
        records.flush()
        del records
        expected = records_report(coli_kv.load(path))
        assert expected["problems"] == [
            "1 rows with a bad fp8 scale were made inert (zeros)",
            "1 fp8 NaN codes read as 0",
        ]
        active = store.inspect("s")
        store.park("s")
        parked = store.inspect("s")
    for report in (active, parked):
        assert {key: report[key] for key in expected} == expected


_EXPORT_CHILD = """
import json, resource, sys
import numpy, pyarrow, pyarrow.ipc, pyarrow.parquet, zipfile
import kvstore.cli, kvstore.export, kvstore.filetools
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = kvstore.cli.main(["export", sys.argv[1], sys.argv[2], "-q"])
print(json.dumps({"code": code, "grown_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}))
"""


def test_export_of_a_large_file_grows_the_peak_by_at_most_256_mib(tmp_path):
    # DeepSeek-V3's geometry, int4: each record decodes to 7.8 times its size in f32
    geometry = Geometry(n_layers=61, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=129280)
    dtype = coli_kv.record_dtype(geometry, tiers.INT4)
    n = 40 * MiB // dtype.itemsize
    rng = np.random.default_rng(0)
    records = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)
    records["token"] = rng.integers(0, geometry.vocab, n)
    for radii in ("Ls", "Rs"):
        records["layers"][radii] = rng.uniform(0.5, 4.0, (n, geometry.n_layers)).astype(np.float32)
    source = tmp_path / "big.coli_kv"
    source.write_bytes(Header(geometry, tiers.INT4, n).to_bytes() + records.tobytes())
    del records
    for suffix in (".npz", ".arrow", ".parquet"):
        out = tmp_path / f"rows{suffix}"
        done = subprocess.run(
            [*FRESH, sys.executable, "-c", _EXPORT_CHILD, str(source), str(out)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["code"] == 0
        grown = result["grown_kib"] * 1024
        decoded = n * geometry.n_layers * (geometry.kv_lora + geometry.qk_rope) * 4
        assert grown <= 256 * MiB, f"export to {suffix} of {decoded / MiB:.0f} MiB of rows: +{grown / MiB:.0f} MiB"
        out.unlink()


def test_inspects_count_against_the_sessions_request_limit(tmp_path):
    data = tmp_path / "data"
    with SessionStore(data) as store:
        fill(store, "s", 10)
    server = ServeProcess(
        data, "--session-waiters", "2", "--lock-timeout", "30", env={"KVSTORE_API_KEYS": f"{KEY}:alice"}
    )
    server.start()
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        # A writer that holds the session's read lock exclusively (a truncate, a park's switch) makes
        # the inspects wait, each counted as one of the session's requests in flight.
        lock = FileLock(data / "locks" / "s~alice.read").acquire()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            waiting = [
                pool.submit(httpx.get, f"{server.url}/sessions/s/file/inspect", headers=headers, timeout=60)
                for _ in range(2)
            ]
            time.sleep(1.0)
            third = httpx.get(f"{server.url}/sessions/s/file/inspect", headers=headers, timeout=60)
            assert third.status_code == 429 and third.json()["error"] == "SessionBusy", third.text
            assert third.headers["retry-after"] == "1"
            lock.release()
            assert [f.result().status_code for f in waiting] == [200, 200]
    finally:
        server.stop_cleanly()
