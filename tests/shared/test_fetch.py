"""How a replica reads segments (``kvstore.store.shared.fetch``): pieces that tile any range, a download's read-ahead bounded, one GET per byte when concurrent reads of one object miss
the cache at once, and an object that does not match its digest never served nor kept. Real
PostgreSQL, real S3 (moto's server); a BlobStore subclass records each GET it makes."""

from __future__ import annotations

import threading
import time

import boto3
import numpy as np
import pytest

from kvstore.config import SettingError
from kvstore.errors import SessionDamaged
from kvstore.formats import coli_kv
from kvstore.store.results import records_report
from kvstore.store.shared import BlobStore, SharedIndex, SharedStore, fetch, reports
from kvstore.store.shared.cache import SegmentCache
from kvstore.store.shared.fetch import pieces
from kvstore.store.shared.index import ReadPlan, Segment
from kvstore.store.shared.sessions import SharedSessionStore
from shared.rows import GEOMETRY, TIER, rec_bytes, records

ROWS = 40  # records per segment


class CountedBlobs(BlobStore):
    """The real BlobStore, recording the byte range of every GET it makes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gets: list[tuple[str, int, int]] = []
        self._gets_lock = threading.Lock()

    def get(self, name: str, start: int = 0, stop: int | None = None) -> bytes:
        body = super().get(name, start, stop)
        with self._gets_lock:
            self.gets.append((name, start, start + len(body)))
        return body


def write_session(index_url, blobs_url, endpoint, segments: int) -> tuple[str, bytes]:
    with SharedStore(SharedIndex(index_url), BlobStore(blobs_url, endpoint_url=endpoint)) as writer:
        key = writer.create("alice", GEOMETRY, TIER, session_id="chat")
        lease = writer.acquire(key)
        for seq in range(segments):
            writer.append(lease, records(1, seq, ROWS))
        writer.release(lease)
    return key, b"".join(records(1, seq, ROWS) for seq in range(segments))


def reader_store(index_url, blobs_url, endpoint, cache: SegmentCache | None, *, part_records: int, ahead_records: int):
    blobs = CountedBlobs(blobs_url, endpoint_url=endpoint)
    store = SharedStore(SharedIndex(index_url), blobs, cache=cache)
    store.reads.part_bytes = part_records * rec_bytes()
    store.reads.read_ahead_bytes = ahead_records * rec_bytes()
    return store, blobs


def test_pieces_tile_any_range():
    rng = np.random.default_rng(5)
    for _ in range(300):
        sizes = rng.integers(1, 30, size=rng.integers(1, 8))
        firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        segments = [Segment(int(f), int(n), f"o{i}", int(n) * 7, b"", 1) for i, (f, n) in enumerate(zip(firsts, sizes))]
        plan = ReadPlan(b"", 7, int(sizes.sum()), segments)
        start = int(rng.integers(0, plan.n_records + 1))
        end = int(rng.integers(start, plan.n_records + 1))
        got = pieces(plan, start, end)
        assert sum(p.nbytes for p in got) == (end - start) * 7
        at = 0
        for piece in got:  # in order, contiguous, each within its own segment
            assert piece.at == at and 0 < piece.nbytes and piece.offset + piece.nbytes <= piece.segment.nbytes
            at += piece.nbytes


def test_concurrent_cold_reads_through_a_cache_get_each_byte_once_then_serve_from_the_copies(
    index_url, blobs_url, s3_server, tmp_path
):
    key, image = write_session(index_url, blobs_url, s3_server.endpoint, 4)
    cache = SegmentCache(tmp_path / "replica", 1 << 30)
    # parts of 7 records: each object is several ranged GETs; four downloads of it at once
    store, blobs = reader_store(index_url, blobs_url, s3_server.endpoint, cache, part_records=7, ahead_records=25)
    with store:
        plan = store.index.read_plan(key)
        start = threading.Barrier(4)
        served: list[bytes] = []

        def download() -> None:
            start.wait()
            chunks = list(store.stream_planned(key, plan, 0, plan.n_records, 3))
            assert all(len(chunk) <= 3 * rec_bytes() for chunk in chunks)
            served.append(b"".join(chunks))

        threads = [threading.Thread(target=download) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    # closing the store waited for its threads: the keeper has written the copies
    assert served == [image] * 4
    assert cache.counts().files == 4
    for segment in plan.segments:  # every byte of every object fetched exactly once
        ranges = sorted((lo, hi) for name, lo, hi in blobs.gets if name == segment.object)
        assert ranges[0][0] == 0 and ranges[-1][1] == segment.nbytes and len(ranges) == -(-ROWS // 7)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
    store, blobs = reader_store(index_url, blobs_url, s3_server.endpoint, cache, part_records=7, ahead_records=25)
    with store:
        again = b"".join(store.stream_planned(key, plan, 5, plan.n_records - 2, 4))
    assert again == image[5 * rec_bytes() : -2 * rec_bytes()] and blobs.gets == []  # the copies alone


def test_a_download_reads_ahead_a_bounded_window(index_url, blobs_url, s3_server):
    key, image = write_session(index_url, blobs_url, s3_server.endpoint, 6)
    store, blobs = reader_store(index_url, blobs_url, s3_server.endpoint, None, part_records=10, ahead_records=100)
    with store:
        plan = store.index.read_plan(key)
        stream = store.stream_planned(key, plan, 0, plan.n_records, 10)
        assert bytes(next(stream)) == image[: 10 * rec_bytes()]
        stream.close()  # a client gone after its first chunk: what was not started is cancelled
    # the pool has finished (closing the store waits): the block taken and a window of 100 records
    # behind it, in whole segments of 40: three of the six
    fetched = sum(hi - lo for _, lo, hi in blobs.gets)
    assert 0 < fetched <= 3 * ROWS * rec_bytes() < len(image)


def test_an_object_that_does_not_match_its_digest_is_never_served_nor_kept(index_url, blobs_url, s3_server, tmp_path):
    key, image = write_session(index_url, blobs_url, s3_server.endpoint, 3)
    with SharedStore(SharedIndex(index_url), BlobStore(blobs_url, endpoint_url=s3_server.endpoint)) as plain:
        plan = plain.index.read_plan(key)
    victim = plan.segments[1]
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint)
    bucket = blobs_url.removeprefix("s3://").split("/")[0]
    body = bytearray(s3.get_object(Bucket=bucket, Key=victim.object)["Body"].read())
    body[5] ^= 0x40
    s3.put_object(Bucket=bucket, Key=victim.object, Body=bytes(body))  # damaged in the object store
    cache = SegmentCache(tmp_path / "replica", 1 << 30)
    store, blobs = reader_store(index_url, blobs_url, s3_server.endpoint, cache, part_records=9, ahead_records=200)
    with store:
        chunks = store.stream_planned(key, plan, 0, plan.n_records, 4)
        served = b"".join(bytes(next(chunks)) for _ in range(ROWS // 4))  # the first segment's chunks
        with pytest.raises(SessionDamaged):
            next(chunks)  # the second segment's bytes are refused, not sent
        chunks.close()
        with pytest.raises(SessionDamaged):
            store.read_planned(key, plan, ROWS + 3, ROWS + 5)  # a range of it: the whole is checked
        assert store.first_damaged(key, plan, plan.n_records) == victim.first_record  # so does a verify
    assert served == image[: ROWS * rec_bytes()]
    held = memoryview(bytearray(victim.nbytes))
    assert cache.read(plan.segments[0], 0, memoryview(bytearray(plan.segments[0].nbytes)))  # the sound one kept
    assert not cache.read(victim, 0, held)  # the damaged one not
    assert sum(1 for name, _, _ in blobs.gets if name == victim.object) == 2 * 3 * -(
        -ROWS // 9
    )  # fetched twice, thrice


def test_segments_are_matched_by_their_blake3_check_and_older_ones_by_their_digest(index_url, blobs_url, s3_server):
    """Schema 8 records each segment's BLAKE3-256 (what a read matches); a segment committed before
    has none and is matched by its blake2b digest: both serve sound bytes and refuse changed ones."""
    import psycopg

    from kvstore.store.shared.rows import check_of, digest_of

    key, image = write_session(index_url, blobs_url, s3_server.endpoint, 2)
    with SharedStore(SharedIndex(index_url), BlobStore(blobs_url, endpoint_url=s3_server.endpoint)) as plain:
        plan = plain.index.read_plan(key)
    per = ROWS * rec_bytes()
    for i, segment in enumerate(plan.segments):
        body = image[i * per : (i + 1) * per]
        assert segment.check == check_of(body) and segment.digest == digest_of(body)
        assert segment.holds(body) and not segment.holds(body[:-1] + bytes([body[-1] ^ 1]))
    with psycopg.connect(index_url, autocommit=True) as conn:  # the first one as committed before schema 8
        conn.execute("UPDATE kv_segments SET check_digest = NULL WHERE object = %s", (plan.segments[0].object,))
    store, _ = reader_store(index_url, blobs_url, s3_server.endpoint, None, part_records=9, ahead_records=200)
    with store:
        older = store.index.read_plan(key)
        assert older.segments[0].check is None and older.segments[1].check is not None
        assert store.read_planned(key, older, 0, older.n_records) == image
        s3 = boto3.client("s3", endpoint_url=s3_server.endpoint)
        bucket = blobs_url.removeprefix("s3://").split("/")[0]
        for segment in older.segments:  # each damaged in turn: refused by its digest, then by its check
            whole = s3.get_object(Bucket=bucket, Key=segment.object)["Body"].read()
            s3.put_object(Bucket=bucket, Key=segment.object, Body=bytes([whole[0] ^ 0x10]) + whole[1:])
            with pytest.raises(SessionDamaged):
                store.read_planned(key, older, segment.first_record, segment.end)
            s3.put_object(Bucket=bucket, Key=segment.object, Body=whole)


def test_inspect_judges_the_records_as_they_stream_with_the_loaders_answers(
    index_url, blobs_url, s3_server, monkeypatch, tmp_path
):
    """``inspect`` on the shared store reads a block of whole segments at a time (each checked) and
    judges the image a chunk at a time: the report of loading the whole image, wherever the chunks
    end."""
    key, _ = write_session(index_url, blobs_url, s3_server.endpoint, 5)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    with SharedSessionStore(index_url, blobs_url, data_dir=tmp_path, cache_bytes=0) as store:
        store.shared.reads.part_bytes = 50 * rec_bytes()  # blocks of two segments
        whole = records_report(coli_kv.parse(store.shared.file_bytes(key)))
        for chunk_records in (1, 3, 7, 1000):
            monkeypatch.setattr(reports, "CHUNK_BYTES", chunk_records * rec_bytes())
            report = store.inspect("chat", owner="alice")
            assert {k: v for k, v in report.items() if k in whole} == whole
            assert report["file"] == {"objects": 5, "bytes": coli_kv.HEADER_BYTES + 5 * ROWS * rec_bytes()}


class WatchedCache(SegmentCache):
    """The real cache, recording how many reads were in progress at each copy it was given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.readers_at_put: list[int] = []
        self.keeper = None

    def put(self, segment, data):
        self.readers_at_put.append(self.keeper._readers)
        return super().put(segment, data)


def test_copies_are_written_once_no_read_is_in_progress(index_url, blobs_url, s3_server, tmp_path):
    """Write-behind: a cold download's copies wait in memory while it runs (served from there if
    read again) and are written once it ends, with no flush; a flush writes them at once."""
    key, image = write_session(index_url, blobs_url, s3_server.endpoint, 4)
    cache = WatchedCache(tmp_path / "replica", 1 << 30)
    store, _ = reader_store(index_url, blobs_url, s3_server.endpoint, cache, part_records=7, ahead_records=200)
    with store:
        cache.keeper = store.reads._keeper
        plan = store.index.read_plan(key)
        download = store.stream_planned(key, plan, 0, plan.n_records, 5)
        served = [bytes(next(download)) for _ in range(-(-plan.n_records // 5))]  # every chunk; still open
        assert b"".join(served) == image
        # a second reader meanwhile gets the bytes waiting for the keeper (no GET, no copy written)
        assert bytes(store.read_planned(key, plan, 3, 50)) == image[3 * rec_bytes() : 50 * rec_bytes()]
        for _ in range(50):  # the keeper holds the copies while the download is open
            if cache.readers_at_put:
                break
            time.sleep(0.01)
        assert cache.readers_at_put == [] and cache.counts().files == 0
        download.close()
        for _ in range(3000):  # then writes them by itself
            if cache.counts().files == 4:
                break
            time.sleep(0.01)
        assert cache.counts().files == 4 and cache.readers_at_put == [0, 0, 0, 0]
    # a flush writes the copies of a read still in progress
    cache = WatchedCache(tmp_path / "other", 1 << 30)
    store, _ = reader_store(index_url, blobs_url, s3_server.endpoint, cache, part_records=7, ahead_records=200)
    with store:
        cache.keeper = store.reads._keeper
        download = store.stream_planned(key, plan, 0, plan.n_records, 5)
        assert b"".join(bytes(next(download)) for _ in range(-(-plan.n_records // 5))) == image
        store.reads.flush()
        assert cache.counts().files == 4 and cache.readers_at_put == [1, 1, 1, 1]
        download.close()


def test_the_get_size_sets_the_ranged_gets_of_a_cold_read(index_url, blobs_url, s3_server, monkeypatch):
    """``KVSTORE_BLOBS_GET_SIZE`` (``BlobStore.get_bytes``): each segment object in parts of that
    many bytes, or, at 0, in one GET (for a server that reads a whole object to answer any range);
    the bytes served are the same either way, and a size that does not parse is refused naming it."""
    key, image = write_session(index_url, blobs_url, s3_server.endpoint, 3)
    per = ROWS * rec_bytes()
    for text, gets_per_object, largest in (
        (str(9 * rec_bytes()), -(-ROWS // 9), 9 * rec_bytes()),
        ("0", 1, per),
        ("64M", 1, per),
    ):
        monkeypatch.setenv("KVSTORE_BLOBS_GET_SIZE", text)
        blobs = CountedBlobs(blobs_url, endpoint_url=s3_server.endpoint)
        with SharedStore(SharedIndex(index_url), blobs) as store:
            plan = store.index.read_plan(key)
            assert store.read_planned(key, plan, 0, plan.n_records) == image
        assert len(blobs.gets) == 3 * gets_per_object, (text, blobs.gets)
        assert max(hi - lo for _, lo, hi in blobs.gets) == largest
    monkeypatch.setenv("KVSTORE_BLOBS_GET_SIZE", "lots")
    with pytest.raises(SettingError, match="KVSTORE_BLOBS_GET_SIZE='lots': takes a size"):
        BlobStore(blobs_url, endpoint_url=s3_server.endpoint)


def test_an_object_shorter_than_its_commit_is_damage_at_once(index_url, blobs_url, s3_server):
    """An object cut short in the object store answers fewer bytes than the range asked: a typed
    ``SessionDamaged`` at the first GET (not a retried, then unavailable, store), the sound segment
    before it still served."""
    key, image = write_session(index_url, blobs_url, s3_server.endpoint, 2)
    store, blobs = reader_store(index_url, blobs_url, s3_server.endpoint, None, part_records=9, ahead_records=200)
    with store:
        plan = store.index.read_plan(key)
        victim = plan.segments[1]
        s3 = boto3.client("s3", endpoint_url=s3_server.endpoint)
        bucket = blobs_url.removeprefix("s3://").split("/")[0]
        whole = s3.get_object(Bucket=bucket, Key=victim.object)["Body"].read()
        s3.put_object(Bucket=bucket, Key=victim.object, Body=whole[: len(whole) - rec_bytes() // 2])
        with pytest.raises(SessionDamaged, match="shorter than its commit recorded"):
            store.read_planned(key, plan, 0, plan.n_records)
        assert blobs.retries == 0
        assert store.read_planned(key, plan, 0, ROWS) == image[: ROWS * rec_bytes()]


def test_a_reused_buffer_never_changes_bytes_still_held(index_url, blobs_url, s3_server, monkeypatch):
    """Fetched objects land in reused buffers (no fresh pages to fault in): a buffer is reused only
    once nothing made from it is left — the chunks of a download still held keep their bytes while
    later downloads reuse the buffers the others let go."""
    monkeypatch.setattr(fetch._Buffers, "MIN_BYTES", 64)  # this test's objects are small
    key, image = write_session(index_url, blobs_url, s3_server.endpoint, 4)
    store, _ = reader_store(index_url, blobs_url, s3_server.endpoint, None, part_records=9, ahead_records=ROWS)
    with store:
        plan = store.index.read_plan(key)
        held = list(store.stream_planned(key, plan, 0, plan.n_records, 7))  # every chunk kept
        kept, at = [], 0  # every third chunk of another download, with where it starts
        for i, view in enumerate(store.stream_planned(key, plan, 0, plan.n_records, 7)):
            if i % 3 == 0:
                kept.append((at, view))
            at += len(view)
        for _ in range(3):
            assert b"".join(store.stream_planned(key, plan, 0, plan.n_records, 7)) == image
        assert store.reads._buffers.made < 6 * len(plan.segments)  # the later downloads reused buffers
        assert b"".join(held) == image  # ... never one still held
        assert all(bytes(view) == image[at : at + len(view)] for at, view in kept)


@pytest.mark.timeout(30)  # a deadlock fails here, not at the suite's 10 minutes
def test_a_buffer_let_go_inside_the_pool_is_kept_without_a_deadlock():
    """The last reference to a fetched object can go anywhere — in a collection that runs while
    the pool itself holds its lock: the slab is queued, not waited for, and the next take reuses it;
    past the idle budget a slab is let go."""
    buffers = fetch._Buffers(idle_bytes=3 << 20)
    first = buffers.take(2 << 20)
    with buffers._lock:
        del first  # a finalizer on the lock holder's own thread: would deadlock on a blocking lock
    again = buffers.take((2 << 20) - 100)
    assert buffers.made == 1 and len(again) == (2 << 20) - 100
    other = buffers.take(2 << 20)
    assert buffers.made == 2
    del again, other  # 4 MiB let go against a budget of 3: one slab kept
    assert buffers._idle_total == 2 << 20
    assert len(buffers.take(100)) == 100 and buffers.made == 2  # a small object: a fresh buffer of its own
