"""What a client of a replica gets: ``GET /sessions/{id}/resume`` through ``kvstore serve --index
--blobs`` against the same objects fetched directly, in one run.

Starts a throwaway PostgreSQL cluster and moto's standalone S3 server on loopback
(tests/shared/servers.py), writes DeepSeek-V3-geometry fp8 sessions (``--turns`` segments of
``--turn`` rows, 145.9 MB by default) from this process, then starts replicas that did not write
them, for each way of fetching a segment object (``KVSTORE_BLOBS_GET_SIZE``: the default 8 MiB
ranged GETs in parallel, and 0, one GET per object): one with no segment cache (every resume is
cold: every byte from the object store) and one with its cache (a first resume of each session
fills it, the next ones are warm). Each figure is the median of ``--reps`` whole downloads, timed at
the client, with two clients: ``curl -o /dev/null`` (a C client: the server's rate) and httpx (a
Python client reading the stream). The peers, same objects, same run:

- direct parallel fetch: the session's segment objects with boto3 from the same moto into one
  buffer made once (no page of it faulted in while timed), ranged GETs of 8 MiB or whole objects
  on 4, 8 or 16 threads — each way measured, the fastest is the peer;
- local read: the same bytes as one local file read whole into a new buffer (page cache), as a
  process reading a local journal does — the floor of a warm read.

moto is a Python stand-in sharing the machine's cores with the replica and the client: the
object-store figures are moto's on this box, not S3's. moto answers a ranged GET by reading the
whole object, which is why one GET per object suits it (and a real S3 wants parallel ranges).

    PYTHONPATH=. python3 bench/replica_resume.py [--turns 8] [--turn 512] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import botocore.config
import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_common import process_cpu_seconds, process_stat, server_metrics  # noqa: E402

from kvstore import tiers  # noqa: E402
from kvstore.formats import coli_kv  # noqa: E402
from kvstore.formats.coli_kv import Geometry  # noqa: E402
from kvstore.keys import IndexKeys  # noqa: E402
from kvstore.store.shared import BlobStore, SharedIndex, SharedStore  # noqa: E402
from served import ServeProcess  # noqa: E402
from shared.servers import MotoServer, PostgresCluster, postgres_bin  # noqa: E402

GEOMETRY = Geometry(n_layers=61, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=129280)  # DeepSeek-V3
TIER = tiers.get("fp8")
DIRECT_WAYS = [(part, threads) for part in (8 << 20, 0) for threads in (4, 8, 16)]  # (bytes per GET, 0: whole; threads)
GET_SIZES = ("8M", "0")  # KVSTORE_BLOBS_GET_SIZE of the replicas measured


def _write_sessions(
    index_url: str, blobs_url: str, endpoint: str, names: list[str], turns: int, turn: int
) -> tuple[str, int, list[str]]:
    """Sessions ``names`` of owner alice, each the same rows in its own objects: the first one's key,
    record bytes and segment object names."""
    rng = np.random.default_rng(0)
    encoded = []
    for t in range(turns):
        lat = rng.standard_normal((GEOMETRY.n_layers, turn, GEOMETRY.kv_lora), dtype=np.float32)
        rope = rng.standard_normal((GEOMETRY.n_layers, turn, GEOMETRY.qk_rope), dtype=np.float32)
        tokens = np.arange(t * turn, (t + 1) * turn, dtype=np.int32)
        encoded.append(coli_kv.encode_records(GEOMETRY, TIER, tokens, lat, rope))
    with SharedStore(SharedIndex(index_url), BlobStore(blobs_url, endpoint_url=endpoint)) as writer:
        keys = []
        for name in names:
            key = writer.create("alice", GEOMETRY, TIER, session_id=name)
            lease = writer.acquire(key)
            for rows in encoded:
                writer.append(lease, rows)
            writer.release(lease)
            keys.append(key)
        plan = writer.index.read_plan(keys[0])
        return keys[0], plan.n_records * plan.rec_bytes, [segment.object for segment in plan.segments]


def _direct_fetch(s3, bucket: str, objects: list[str], out: memoryview, part_bytes: int, threads: int) -> float:
    """Seconds to fetch every object into ``out`` (made by the caller, reused): ranged GETs of
    ``part_bytes`` (0: one GET per object) on ``threads`` threads."""
    sizes = [s3.head_object(Bucket=bucket, Key=name)["ContentLength"] for name in objects]
    jobs, at = [], 0
    for name, nbytes in zip(objects, sizes):
        step = part_bytes or nbytes
        for lo in range(0, nbytes, step):
            jobs.append((name, lo, min(lo + step, nbytes), at + lo))
        at += nbytes

    def get(job):
        name, lo, hi, where = job
        body = s3.get_object(Bucket=bucket, Key=name, Range=f"bytes={lo}-{hi - 1}")["Body"].read()
        out[where : where + len(body)] = body
        return len(body)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(get, jobs))
    elapsed = time.perf_counter() - t0
    assert got == len(out) == sum(sizes), (got, len(out))
    return elapsed


def _local_read(path: Path) -> float:
    """Seconds to read the file whole into a new buffer, as a process reading a local journal does."""
    t0 = time.perf_counter()
    got = len(path.read_bytes())
    elapsed = time.perf_counter() - t0
    assert got == path.stat().st_size
    return elapsed


def _curl(url: str, key: str, size: int) -> float:
    done = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-H", f"Authorization: Bearer {key}", "-w", "%{size_download} %{time_total}",
         url],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    got, seconds = done.stdout.split()
    assert int(got) == size, (got, size)
    return float(seconds)


def _httpx(url: str, key: str, size: int) -> float:
    t0 = time.perf_counter()
    got = 0
    with httpx.stream("GET", url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as answer:
        answer.raise_for_status()
        for chunk in answer.iter_raw(4 << 20):
            got += len(chunk)
    elapsed = time.perf_counter() - t0
    assert got == size, (got, size)
    return elapsed


def _cache_bytes(url: str) -> float:
    """The replica's segment cache bytes, from its ``/metrics``."""
    page = server_metrics(url)
    if "kvstore_cache_bytes" not in page:
        raise RuntimeError("the replica's /metrics has no kvstore_cache_bytes")
    return page["kvstore_cache_bytes"]


def _kept(url: str, before: float, size: int, waits: list[float]) -> None:
    """Wait until the replica's cache holds the download's copies (its keeper writes them once no
    read is in progress), appending how long that took after the download to ``waits``: the next
    cold download then starts on an idle replica, as a user's would after a pause."""
    t0 = time.perf_counter()
    while _cache_bytes(url) < before + size and time.perf_counter() - t0 < 60:
        time.sleep(0.02)
    waits.append(time.perf_counter() - t0)


def _median(fn, reps: int) -> float:
    return statistics.median(fn() for _ in range(reps))


def _pid_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; 0 once it is gone (a PostgreSQL
    backend may exit between the listing and the read)."""
    try:
        return process_cpu_seconds(pid)
    except OSError:
        return 0.0


def _children_of(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(process_stat(int(entry.name))[1]) == parent:
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def _pid_faults(pid: int) -> int:
    """Minor page faults a process has taken so far (fresh memory it touched); 0 once it is gone."""
    try:
        return int(process_stat(pid)[7])
    except (OSError, ValueError, IndexError):
        return 0


class CpuMeter:
    """CPU seconds per timed download of each party on the box: the replica, moto, PostgreSQL (its
    postmaster and backends) and the client (curl as this process's child, httpx or boto3 in it),
    and the replica's minor page faults."""

    def __init__(self, moto_pid: int, postmaster: int):
        self.moto, self.postmaster = moto_pid, postmaster

    def _now(self, replica: int | None) -> dict[str, float]:
        mine = os.times()
        return {
            "replica": _pid_cpu_s(replica) if replica else 0.0,
            "moto": _pid_cpu_s(self.moto),
            "postgres": sum(_pid_cpu_s(p) for p in [self.postmaster, *_children_of(self.postmaster)]),
            "client": mine.user + mine.system + mine.children_user + mine.children_system,
            "faults": _pid_faults(replica) if replica else 0,
        }

    def median(self, fn, reps: int, replica: int | None = None) -> tuple[float, dict[str, float]]:
        """The median of ``reps`` timed calls, and each party's mean CPU seconds per call."""
        before = self._now(replica)
        seconds = _median(fn, reps)
        after = self._now(replica)
        return seconds, {k: (after[k] - before[k]) / reps for k in before}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8, help="segments (one per append)")
    parser.add_argument("--turn", type=int, default=512, help="rows per segment")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    aws = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}
    os.environ.update(aws)
    cluster, moto = PostgresCluster(postgres_bin()), MotoServer()
    servers: list[ServeProcess] = []
    try:
        bucket = f"kv-{uuid.uuid4().hex[:8]}"
        s3 = boto3.client("s3", endpoint_url=moto.endpoint, config=botocore.config.Config(max_pool_connections=16))
        s3.create_bucket(Bucket=bucket)
        blobs_url, index_url = f"s3://{bucket}/kv", cluster.new_database()
        # one session per cold read of a cache-filling replica (its cache meets each once), one to
        # warm each replica up
        cold_names = {get: [f"cold-{get}-{i}" for i in range(2 * args.reps)] for get in GET_SIZES}
        names = ["chat", "warm-up", *(name for group in cold_names.values() for name in group)]
        session_key, size, objects = _write_sessions(index_url, blobs_url, moto.endpoint, names, args.turns, args.turn)
        with IndexKeys(index_url) as keys:
            key = keys.create("alice")[1]
        env = {**aws, "AWS_ENDPOINT_URL": moto.endpoint}
        folder = Path(tempfile.mkdtemp(prefix="kvstore-replica-bench-"))
        shared = ("--index", index_url, "--blobs", blobs_url)
        path = "/sessions/chat/resume"

        def replica(name: str, get_size: str, *options: str) -> ServeProcess:
            server = ServeProcess(
                folder / name, *shared, *options, env={**env, "KVSTORE_BLOBS_GET_SIZE": get_size}
            ).start()
            servers.append(server)
            return server

        postmaster = int((cluster.datadir / "postmaster.pid").read_text().split()[0])
        meter = CpuMeter(moto.process.pid, postmaster)
        out = memoryview(bytearray(size))
        out[:] = b"\1" * size  # every page faulted in before any fetch is timed
        direct = {}
        for part, threads in DIRECT_WAYS:
            direct[part, threads] = meter.median(
                lambda part=part, threads=threads: _direct_fetch(s3, bucket, objects, out, part, threads), args.reps
            )
        best = min(direct, key=lambda way: direct[way][0])
        direct_s = direct[best][0]
        local = folder / "chat.rows"
        with SharedStore(SharedIndex(index_url), BlobStore(blobs_url, endpoint_url=moto.endpoint)) as store:
            local.write_bytes(store.read_records(session_key)[1])
        local_s = _median(lambda: _local_read(local), args.reps)

        rows = []
        kept_after: list[float] = []

        def per_client(label: str, server: ServeProcess, download, peer_s: float, peer: str) -> None:
            """A row per client: the median of ``download(fetch)`` with ``fetch`` curl, then httpx."""
            for client, fetch in (("curl", _curl), ("httpx", _httpx)):
                seconds, cpu = meter.median(lambda fetch=fetch: download(fetch), args.reps, server.process.pid)
                rows.append((f"{label}, {client}", seconds, cpu, peer_s, peer))

        for get in GET_SIZES:
            cold = replica(f"cold-{get}", get)
            _curl(cold.url + "/sessions/warm-up/resume", key, size)  # its first request, not timed
            fresh = iter(cold_names[get])

            def cold_download(fetch, cold=cold, fresh=fresh) -> float:
                before = _cache_bytes(cold.url)
                seconds = fetch(f"{cold.url}/sessions/{next(fresh)}/resume", key, size)
                _kept(cold.url, before, size, kept_after)  # untimed; its CPU is counted in the rep's
                return seconds

            per_client(f"GET {get}: cold, its cache filling", cold, cold_download, direct_s, "direct fetch")
            uncached = replica(f"uncached-{get}", get, "--cache-size", "0")
            _curl(uncached.url + "/sessions/warm-up/resume", key, size)  # its first request, not timed
            chat = uncached.url + path
            per_client(
                f"GET {get}: cold, no cache",
                uncached,
                lambda fetch, url=chat: fetch(url, key, size),
                direct_s,
                "direct fetch",
            )
            uncached.stop_cleanly()
            servers.remove(uncached)
            if get == GET_SIZES[0]:
                chat = cold.url + path  # its cache holds "chat" once it has read it
                _curl(chat, key, size)  # fills its cache
                _curl(chat, key, size)  # its copies kept by then: this one is warm
                per_client(
                    "warm (cache hits)", cold, lambda fetch, url=chat: fetch(url, key, size), local_s, "local read"
                )
            cold.stop_cleanly()
            servers.remove(cold)

        print(
            f"session {size / 1e6:.1f} MB ({args.turns} segments of {args.turn} fp8 DeepSeek-V3 rows), "
            f"PostgreSQL + moto on loopback, {os.cpu_count()} cores, medians of {args.reps}"
        )
        print("CPU ms per download: replica / moto / PostgreSQL / client (curl, httpx or boto3); faults: the replica's")
        print(f"{'':44s} {'GB/s':>7s} {'ms':>7s}  {'CPU ms':>19s} {'faults':>7s}")

        def cpu_ms(cpu: dict[str, float]) -> str:
            return " / ".join(f"{cpu[k] * 1e3:.0f}" for k in ("replica", "moto", "postgres", "client"))

        for (part, threads), (seconds, cpu) in direct.items():
            way = f"{part >> 20} MiB GETs" if part else "whole objects"
            name = f"direct fetch, {way}, {threads} threads{' *' if (part, threads) == best else ''}"
            print(f"{name:44s} {size / seconds / 1e9:7.3f} {seconds * 1e3:7.0f}  {cpu_ms(cpu):>19s}")
        print(f"{'local read (Path.read_bytes, page cache)':44s} {size / local_s / 1e9:7.3f} {local_s * 1e3:7.0f}")
        print(f"{'resume through a replica':44s} {'GB/s':>7s} {'ms':>7s}  {'CPU ms':>19s} {'faults':>7s}  ratio")
        for name, seconds, cpu, peer_s, peer in rows:
            print(
                f"{name:44s} {size / seconds / 1e9:7.3f} {seconds * 1e3:7.0f}  {cpu_ms(cpu):>19s} {cpu['faults']:7.0f}"
                f"  {peer_s / seconds:.2f}x {peer}"
            )
        print("* the fastest direct fetch: the peer of the cold rows")
        print(
            f"a cold download's copies were in the replica's cache {statistics.median(kept_after) * 1e3:.0f} ms "
            "(median) after its last byte (written once no read is in progress; their CPU is in its row)"
        )
    finally:
        for server in servers:
            server.stop_cleanly()
        moto.close()
        cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
