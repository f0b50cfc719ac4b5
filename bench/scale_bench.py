"""The shared store (PostgreSQL index + S3 segments, docs/SCALE.md) against the embedded one.

Starts a throwaway PostgreSQL cluster (Debian package) and moto's standalone S3 server on loopback
(tests/shared/servers.py), then measures, on one DeepSeek-V3-geometry fp8 session:

- restore: the session's bytes from the local disk (journal read; ``SessionStore.resume``) and from
  the shared store (``SharedStore.file_bytes``: one index snapshot, parallel ranged GETs), GB/s,
  same session, same run; ``store push`` and ``store pull`` of it too;
- park, unpark, migrate (fp8 -> int4 -> fp8) of that session on each backend;
- append: 1 vs 3 writer processes, each with its own connections (as replicas have), appending
  turns to different sessions, and to one session through its lease (acquire, append, release).

moto is a Python S3 stand-in on the same machine: the figures are this stand-in's and this box's,
not S3's (a real S3 stream gives ~100 MB/s per connection and scales with connections).

    PYTHONPATH=. python3 bench/scale_bench.py [--tokens 4096] [--turn 512] [--appends 20]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kvstore import tiers  # noqa: E402
from kvstore.errors import LeaseHeld  # noqa: E402
from kvstore.formats import coli_kv  # noqa: E402
from kvstore.formats.coli_kv import Geometry  # noqa: E402
from shared.servers import MotoServer, PostgresCluster, postgres_bin  # noqa: E402

GEOMETRY = Geometry(n_layers=61, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=129280)  # DeepSeek-V3
TIER = tiers.get("fp8")
MODEL = {"name": "deepseek-v3-geometry", "revision": "bench"}
REPEATS = 5


def encoded(n: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, GEOMETRY.vocab, n, dtype=np.int32)
    L = rng.standard_normal((GEOMETRY.n_layers, n, GEOMETRY.kv_lora), dtype=np.float32)
    R = rng.standard_normal((GEOMETRY.n_layers, n, GEOMETRY.qk_rope), dtype=np.float32)
    return coli_kv.encode_records(GEOMETRY, TIER, tokens, L, R).tobytes()


def best(fn, repeats: int = REPEATS) -> tuple[float, object]:
    """(median seconds, last result) of ``repeats`` calls."""
    times, result = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times), result


def shared_store(index_url: str, blobs_url: str):
    from kvstore.store.shared import BlobStore, SharedIndex, SharedStore

    return SharedStore(SharedIndex(index_url), BlobStore(blobs_url))


# ---------------------------------------------------------------------------- append workers
def _writer(
    index_url: str, blobs_url: str, key: str, payload: bytes, appends: int, leased: bool, start_at: float, queue
) -> None:
    """One replica: ``appends`` appends of ``payload`` to ``key`` (holding the lease throughout, or
    taking it for each append when ``leased``) from ``start_at`` on; then its end time and its retries."""
    store = shared_store(index_url, blobs_url)  # connected before the start: start-up is not timed
    waits = 0
    time.sleep(max(0.0, start_at - time.time()))
    if not leased:
        lease = store.acquire(key)
        for _ in range(appends):
            store.append(lease, payload)
        store.release(lease)
    else:
        for _ in range(appends):
            while True:
                try:
                    lease = store.acquire(key, ttl=30)
                    break
                except LeaseHeld:
                    waits += 1
                    time.sleep(0.002)
            try:
                store.append(lease, payload)
            finally:
                store.release(lease)
    queue.put((time.time(), waits))
    store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="records of the restored session")
    parser.add_argument("--turn", type=int, default=512, help="records per turn (one segment each)")
    parser.add_argument("--append-tokens", type=int, default=128, help="records per append in the append runs")
    parser.add_argument("--appends", type=int, default=20, help="appends per writer")
    args = parser.parse_args()
    bindir = postgres_bin()
    if bindir is None:
        print("PostgreSQL is not installed (apt-get install postgresql)", file=sys.stderr)
        return 2
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"})
    cluster, moto = PostgresCluster(bindir), MotoServer()
    os.environ["AWS_ENDPOINT_URL"] = moto.endpoint
    try:
        import boto3

        from kvstore.store import SessionStore
        from kvstore.store.shared.transfer import pull, push

        boto3.client("s3", endpoint_url=moto.endpoint).create_bucket(Bucket="bench")
        index_url, blobs_url = cluster.new_database(), "s3://bench/kv"
        rec_bytes = coli_kv.record_bytes(GEOMETRY, TIER)
        print(f"geometry DeepSeek-V3 fp8: {rec_bytes} bytes/token; PostgreSQL {bindir.parts[-2]}, moto S3 on loopback")
        with tempfile.TemporaryDirectory() as folder:
            # ---- restore: the same session from the local disk and from the shared store
            local = SessionStore(Path(folder) / "a")
            local.create("bench", GEOMETRY, TIER, MODEL, session_id="s")
            for seq, start in enumerate(range(0, args.tokens, args.turn)):
                local.append_records("s", encoded(min(args.turn, args.tokens - start), seq), owner="bench")
            path = local.journal_path("s", owner="bench")
            size = path.stat().st_size
            store = shared_store(index_url, blobs_url)
            seconds, report = best(lambda: push(local, store), 1)
            print(f"push   {size / 1e6:8.1f} MB  {size / seconds / 1e9:6.3f} GB/s  ({report.counts()})")
            disk_s, image = best(lambda: path.read_bytes())
            resume_s, _ = best(lambda: local.resume("s", owner="bench"))
            shared_s, shared_image = best(lambda: store.file_bytes("s~bench"))
            assert shared_image == image, "the shared image differs from the journal"
            print(
                f"restore local disk (journal read, page cache)  {size / disk_s / 1e9:6.3f} GB/s  {disk_s * 1e3:7.1f} ms"
            )
            print(
                f"restore local SessionStore.resume (parsed)    {size / resume_s / 1e9:6.3f} GB/s  {resume_s * 1e3:7.1f} ms"
            )
            print(
                f"restore shared SharedStore.file_bytes         {size / shared_s / 1e9:6.3f} GB/s  {shared_s * 1e3:7.1f} ms"
            )
            pulled = SessionStore(Path(folder) / "b")
            seconds, report = best(lambda: pull(pulled, store), 1)
            print(f"pull   {size / 1e6:8.1f} MB  {size / seconds / 1e9:6.3f} GB/s  ({report.counts()})")
            pulled.close()
            maintenance(local, index_url, blobs_url, Path(folder) / "replica", size)
            local.close()
            # ---- append: 1 vs 3 writers
            payload = encoded(args.append_tokens, 99)
            mb = len(payload) / 1e6
            print(f"append {args.append_tokens} records ({mb:.2f} MB) x {args.appends} per writer")
            for writers in (1, 3):
                keys = [
                    store.create("bench", GEOMETRY, TIER, MODEL, session_id=uuid.uuid4().hex) for _ in range(writers)
                ]
                wall, _ = timed_writers(index_url, blobs_url, keys, payload, args.appends, leased=False)
                total = writers * args.appends
                print(
                    f"  {writers} writer(s), own sessions: {total / wall:7.1f} appends/s  {total * mb / wall:7.1f} MB/s"
                )
            for writers in (1, 3):
                key = store.create("bench", GEOMETRY, TIER, MODEL, session_id=uuid.uuid4().hex)
                wall, waits = timed_writers(index_url, blobs_url, [key] * writers, payload, args.appends, leased=True)
                total = writers * args.appends
                assert store.n_records(key) == total * args.append_tokens
                print(
                    f"  {writers} writer(s), one session via the lease: {total / wall:7.1f} appends/s  "
                    f"{total * mb / wall:7.1f} MB/s  ({waits} lease retries)"
                )
            store.close()
    finally:
        moto.close()
        cluster.close()
    return 0


def maintenance(local, index_url: str, blobs_url: str, replica_dir: Path, size: int) -> None:
    """Park, unpark and migrate (fp8 -> int4) of the same session on both backends, GB/s of its image."""
    from kvstore.store.shared.sessions import SharedSessionStore

    shared = SharedSessionStore(index_url, blobs_url, data_dir=replica_dir, cache_bytes=0)
    print(f"maintenance of the {size / 1e6:.1f} MB session (one run each; sizes after the operation)")
    try:
        for name, store in (("embedded", local), ("shared", shared)):
            for op, call in (
                ("park", lambda on=store: on.park("s", owner="bench")),
                ("unpark", lambda on=store: on.unpark("s", owner="bench")),
                ("migrate int4", lambda on=store: on.migrate("s", tiers.get("int4"), owner="bench")),
                ("migrate fp8", lambda on=store: on.migrate("s", TIER, owner="bench")),
            ):
                seconds, info = best(call, 1)
                print(
                    f"  {name:8s} {op:12s} {size / seconds / 1e9:6.3f} GB/s  {seconds * 1e3:8.1f} ms  "
                    f"{info.size_bytes / 1e6:8.1f} MB {info.state}"
                )
    finally:
        shared.close()


def timed_writers(index_url, blobs_url, keys, payload, appends, leased) -> tuple[float, int]:
    """(seconds from the common start to the last writer's end, lease retries). The writers are
    separate processes started together once each has connected (spawn start-up is not timed)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    start_at = time.time() + 8.0
    workers = [
        context.Process(target=_writer, args=(index_url, blobs_url, key, payload, appends, leased, start_at, queue))
        for key in keys
    ]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    return max(end for end, _ in results) - start_at, sum(waits for _, waits in results)


if __name__ == "__main__":
    raise SystemExit(main())
