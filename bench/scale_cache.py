"""A replica's local segment cache against the object store, on one session, in one run.

Starts a throwaway PostgreSQL cluster and moto's standalone S3 server on loopback
(tests/shared/servers.py), writes one DeepSeek-V3-geometry fp8 session of ``--segments`` segments of
``--turn`` rows through ``SharedStore``, then reads it whole with ``SharedStore.read_records``
(medians of 5): with no cache (every byte from the object store), the first read through a cache
(misses: whole objects fetched, checked against their digests, written to local files), warm (hits),
and the same bytes as plain file reads of the cached copies (the floor of any cached read here).
moto is a Python stand-in on the same machine: the object-store figure is moto's, not S3's.

    PYTHONPATH=. python3 bench/scale_cache.py [--segments 16] [--turn 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import boto3
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kvstore import tiers  # noqa: E402
from kvstore.formats import coli_kv  # noqa: E402
from kvstore.formats.coli_kv import Geometry  # noqa: E402
from kvstore.store.shared import BlobStore, SharedIndex, SharedStore  # noqa: E402
from kvstore.store.shared.cache import SegmentCache  # noqa: E402
from shared.servers import MotoServer, PostgresCluster, postgres_bin  # noqa: E402

GEOMETRY = Geometry(n_layers=61, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=129280)  # DeepSeek-V3


def _median_read(store, key, reps: int = 5) -> tuple[int, float]:
    times, size = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        _, body = store.read_records(key)
        times.append(time.perf_counter() - t0)
        size = len(body)
    return size, statistics.median(times)


def _plain_reads(files: list[Path], reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        buffer = bytearray(sum(p.stat().st_size for p in files))
        view, at = memoryview(buffer), 0
        for path in files:
            with open(path, "rb") as f:
                at += f.readinto(view[at:])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=16)
    parser.add_argument("--turn", type=int, default=256, help="rows per segment")
    args = parser.parse_args()
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_REGION", "us-east-1"),
    ):
        os.environ.setdefault(name, value)
    tier = tiers.get("fp8")
    cluster, moto = PostgresCluster(postgres_bin()), MotoServer()
    try:
        bucket = f"kv-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=moto.endpoint).create_bucket(Bucket=bucket)
        url, index_url = f"s3://{bucket}/kv", cluster.new_database()
        rng = np.random.default_rng(0)
        with SharedStore(SharedIndex(index_url), BlobStore(url, endpoint_url=moto.endpoint)) as writer:
            key = writer.create("alice", GEOMETRY, tier, session_id="chat")
            lease = writer.acquire(key)
            for t in range(args.segments):
                lat = rng.standard_normal((GEOMETRY.n_layers, args.turn, GEOMETRY.kv_lora), dtype=np.float32)
                rope = rng.standard_normal((GEOMETRY.n_layers, args.turn, GEOMETRY.qk_rope), dtype=np.float32)
                tokens = np.arange(t * args.turn, (t + 1) * args.turn, dtype=np.int32)
                writer.append(lease, coli_kv.encode_records(GEOMETRY, tier, tokens, lat, rope))
            writer.release(lease)
        folder = Path(tempfile.mkdtemp(prefix="kvstore-cache-bench-"))
        with SharedStore(SharedIndex(index_url), BlobStore(url, endpoint_url=moto.endpoint)) as plain:
            size, remote_s = _median_read(plain, key)
        cache = SegmentCache(folder, 1 << 34)
        with SharedStore(SharedIndex(index_url), BlobStore(url, endpoint_url=moto.endpoint), cache=cache) as cached:
            t0 = time.perf_counter()
            cached.read_records(key)
            fill_s = time.perf_counter() - t0
            _, hit_s = _median_read(cached, key)
            counts = cached.cache.counts()
        files = sorted(p for p in (folder / "segments").rglob("*") if p.is_file())
        disk_s = _plain_reads(files)
        print(f"session {size / 1e6:.1f} MB ({args.segments} segments of {args.turn} fp8 DeepSeek-V3 rows)")
        print(f"object store (moto), no cache   {size / remote_s / 1e9:.3f} GB/s  ({remote_s * 1e3:.0f} ms)")
        print(f"first read, filling the cache   {size / fill_s / 1e9:.3f} GB/s  ({fill_s * 1e3:.0f} ms)")
        print(
            f"local cache (hits)              {size / hit_s / 1e9:.3f} GB/s  ({hit_s * 1e3:.0f} ms)"
            f"   {remote_s / hit_s:.1f}x the object store"
        )
        print(f"same bytes, plain file reads    {size / disk_s / 1e9:.3f} GB/s  ({disk_s * 1e3:.0f} ms)")
        print(f"cache counts: hits {counts.hits} misses {counts.misses} bytes {counts.bytes}")
    finally:
        moto.close()
        cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
