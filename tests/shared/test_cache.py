"""A replica's local cache of segment objects: hits served without the object store, a damaged copy
(wrong length or digest) refused and fetched again, never served, a size budget kept by evicting
the least recently used copies, copies adopted across a restart, and the counts in ``/metrics``.
Real PostgreSQL, real S3 (moto's server, behind the fault proxy to prove a hit never reaches it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvstore.errors import BlobStoreUnavailable
from kvstore.store.shared import BlobStore, SharedIndex, SharedStore
from kvstore.store.shared.cache import SEGMENTS_DIR, SegmentCache
from shared.rows import GEOMETRY, TIER, rec_bytes, records
from shared.test_replicas import api_key, append, client, create, replicas, resume  # noqa: F401  (fixtures)

ROWS = 6  # records per segment


@pytest.fixture
def writer(index_url, blobs_url, s3_server):
    with SharedStore(SharedIndex(index_url), BlobStore(blobs_url, endpoint_url=s3_server.endpoint)) as store:
        yield store


def cached_store(index_url, blobs_url, endpoint, folder: Path, budget: int) -> SharedStore:
    blobs = BlobStore(blobs_url, endpoint_url=endpoint, attempts=2, base_delay=0.01)
    return SharedStore(SharedIndex(index_url), blobs, cache=SegmentCache(folder, budget))


def session_of(writer: SharedStore, segments: int) -> tuple[str, bytes]:
    key = writer.create("alice", GEOMETRY, TIER, session_id="chat")
    lease = writer.acquire(key)
    for seq in range(segments):
        writer.append(lease, records(1, seq, ROWS))
    writer.release(lease)
    return key, b"".join(records(1, seq, ROWS) for seq in range(segments))


def copies(folder: Path) -> list[Path]:
    return sorted(p for p in (folder / SEGMENTS_DIR).rglob("*") if p.is_file())


def test_hits_never_reach_the_object_store_and_damage_is_never_served(
    writer, index_url, blobs_url, fault_proxy, tmp_path
):
    key, image = session_of(writer, 3)
    folder = tmp_path / "replica"
    with cached_store(index_url, blobs_url, fault_proxy.endpoint, folder, 1 << 30) as store:
        assert store.read_records(key) == (3 * ROWS, image)  # misses: whole objects fetched and kept
        store.reads.flush()  # the copies are written off the reader's thread
        assert store.cache is not None
        counts = store.cache.counts()
        assert (counts.hits, counts.misses, counts.files, counts.bytes) == (0, 3, 3, len(image))
        fault_proxy.rate, fault_proxy.kinds = 1.0, ("500",)  # the object store now fails every request
        try:
            assert store.read_records(key) == (3 * ROWS, image)
            assert store.read_records(key, 2, 14) == (3 * ROWS, image[2 * rec_bytes() : 14 * rec_bytes()])
            assert store.cache.counts().hits == 6  # three whole segments, then three ranges
            # a copy changed on disk (a flipped byte): refused, and with S3 down nothing wrong is served
            victim = copies(folder)[0]
            body = bytearray(victim.read_bytes())
            body[len(body) // 2] ^= 0x01
            victim.write_bytes(bytes(body))
            os.utime(victim, ns=(2, 2))  # its identity changed (timestamps are coarse: set it apart)
            with pytest.raises(BlobStoreUnavailable):
                store.read_records(key)
            assert store.cache.counts().damaged == 1 and not victim.exists()
        finally:
            fault_proxy.rate = 0.0
        assert store.read_records(key) == (3 * ROWS, image)  # fetched again, kept again
        store.reads.flush()
        assert len(copies(folder)) == 3
        # a copy cut short, then one a ranged read meets after it changed on disk
        shorter = copies(folder)[1]
        shorter.write_bytes(shorter.read_bytes()[:-1])
        assert store.read_records(key, 0, 3 * ROWS) == (3 * ROWS, image)
        store.reads.flush()
        ranged = copies(folder)[2]
        body = bytearray(ranged.read_bytes())
        body[-1] ^= 0xFF
        ranged.write_bytes(bytes(body))
        os.utime(ranged, ns=(1, 1))  # another identity: the next ranged read checks the digest again
        assert store.read_records(key, 1, 3 * ROWS - 1) == (3 * ROWS, image[rec_bytes() : -rec_bytes()])
        assert store.cache.counts().damaged == 3
        # silent damage, the copy's identity kept: a resume with verify re-hashes the copies
        rotten = copies(folder)[0]
        before = rotten.stat()
        body = bytearray(rotten.read_bytes())
        body[0] ^= 0x10
        rotten.write_bytes(bytes(body))
        os.utime(rotten, ns=(before.st_atime_ns, before.st_mtime_ns))
        plan = store.index.read_plan(key)
        assert store.first_damaged(key, plan, plan.n_records) is None  # the copy refused, S3's bytes sound
        assert store.cache.counts().damaged == 4
        assert store.read_records(key) == (3 * ROWS, image)
    # a restart adopts the copies (a write a crash cut short is dropped): hits at once
    (copies(folder)[0].parent / ".tmpcut").write_bytes(b"half")
    with cached_store(index_url, blobs_url, fault_proxy.endpoint, folder, 1 << 30) as again:
        fault_proxy.rate, fault_proxy.kinds = 1.0, ("500",)
        try:
            assert again.read_records(key) == (3 * ROWS, image)
        finally:
            fault_proxy.rate = 0.0
        assert again.cache is not None and again.cache.counts().hits == 3
        assert not any(p.name.startswith(".") for p in copies(folder))


def test_the_budget_evicts_the_least_recently_used_copies(writer, index_url, blobs_url, s3_server, tmp_path):
    key, image = session_of(writer, 4)
    segment_bytes = ROWS * rec_bytes()
    folder = tmp_path / "replica"
    with cached_store(index_url, blobs_url, s3_server.endpoint, folder, int(2.5 * segment_bytes)) as store:
        segments = store.segments(key)
        for first in (0, 1, 0, 2):  # 0 was read again: 1 is the least recently used when 2 arrives
            start = segments[first].first_record
            assert store.read_records(key, start, start + ROWS)[1] == image[start * rec_bytes() :][:segment_bytes]
            store.reads.flush()
        assert store.cache is not None
        counts = store.cache.counts()
        assert counts.bytes <= counts.budget_bytes and counts.files == 2 and counts.evictions == 1
        assert (counts.hits, counts.misses) == (1, 3)
        assert store.read_records(key, 0, ROWS)[1] == image[:segment_bytes]  # kept though copied first
        assert store.cache.counts().hits == 2
        assert store.read_records(key, ROWS, 2 * ROWS)[1] == image[segment_bytes : 2 * segment_bytes]  # evicted
        store.reads.flush()  # its copy kept again: another eviction
        assert store.cache.counts().misses == 4 and store.cache.counts().evictions == 2
    with cached_store(index_url, blobs_url, s3_server.endpoint, folder, segment_bytes) as smaller:
        assert smaller.cache is not None and smaller.cache.counts().files == 1  # a smaller budget on restart


def wait_for_cached_bytes(http, size: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        lines = http.get("/metrics").text.splitlines()
        held = next(float(line.split()[1]) for line in lines if line.startswith("kvstore_cache_bytes "))
        if held >= size:
            return
        assert time.monotonic() < deadline, f"the cache holds {held:.0f} bytes after {timeout} s, not {size}"
        time.sleep(0.05)


def test_a_replica_serves_from_its_cache_and_reports_it(replicas, api_key, tmp_path):  # noqa: F811
    first = replicas("r1", "--cache-size", "64M")
    with client(first, api_key) as http:
        create(http, "chat")
        for seq in range(3):
            assert append(http, "chat", records(1, seq, ROWS)).status_code == 200
        image = resume(http, "chat")
        # the copies are written by the keeper thread after the bytes were served: wait for them
        wait_for_cached_bytes(http, 3 * ROWS * rec_bytes())
        assert resume(http, "chat") == image
        text = http.get("/metrics").text
    assert "kvstore_cache_hits_total 3.0" in text and "kvstore_cache_misses_total 3.0" in text
    assert "kvstore_cache_budget_bytes 6.7108864e+07" in text
    first.stop_cleanly()
    assert len(copies(tmp_path / "r1")) == 3
    victim = copies(tmp_path / "r1")[1]
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same length, other bytes
    again = replicas("r1", "--cache-size", "64M")  # the same --data: its copies are used, the bad one refused
    with client(again, api_key) as http:
        assert resume(http, "chat") == image
        text = http.get("/metrics").text
    assert "kvstore_cache_hits_total 2.0" in text and "kvstore_cache_damaged_total 1.0" in text
    off = replicas("r2", "--cache-size", "0")
    with client(off, api_key) as http:
        assert resume(http, "chat") == image
        assert "kvstore_cache_hits" not in http.get("/metrics").text
    assert not (tmp_path / "r2" / SEGMENTS_DIR).exists()
