"""The shared backend's protocol in one process, on a real PostgreSQL cluster and a real S3 server
(docs/SCALE.md): the byte image, leases and fencing, the commit check, GC, S3 faults, multipart,
PostgreSQL going away and coming back."""

from __future__ import annotations

import threading

import numpy as np
import psycopg
import pytest

from kvstore.errors import (
    BlobStoreError,
    BlobStoreUnavailable,
    IndexUnavailable,
    InvalidRequest,
    LeaseExpired,
    LeaseHeld,
    RecordCountMismatch,
    SessionExists,
    SessionNotFound,
    StaleLease,
)
from kvstore.formats import coli_kv
from kvstore.journal import KVFile
from kvstore.store.shared import BlobStore, SharedIndex, SharedStore
from kvstore.store.shared import schema as shared_schema
from shared.rows import GEOMETRY, TIER, rec_bytes, records

# every test twice: plaintext, and with every SharedStore encrypted at rest (conftest.at_rest)
pytestmark = pytest.mark.usefixtures("at_rest")


@pytest.fixture
def store(index_url, blobs_url, s3_server):
    with SharedStore(SharedIndex(index_url), BlobStore(blobs_url, endpoint_url=s3_server.endpoint), ttl=30) as opened:
        yield opened


def objects(store: SharedStore) -> set[str]:
    return {info.name for info in store.blobs.list("seg")}


def test_schema_is_created_once_and_versioned(index_url, store):
    assert store.index.version() == shared_schema.CURRENT_VERSION
    again = SharedIndex(index_url)  # a second replica opening the same index changes nothing
    assert again.version() == shared_schema.CURRENT_VERSION
    again.close()


def test_image_is_the_coli_kv_file(store, tmp_path):
    # the same records through the embedded journal and through the shared store: the same bytes
    path = tmp_path / "s.coli_kv"
    journal = KVFile.create(path, GEOMETRY, TIER)
    key = store.create("alice", GEOMETRY, TIER, session_id="s1")
    lease = store.acquire(key)
    for seq, n in enumerate([3, 1, 5]):
        payload = records(0, seq, n)
        journal.append_records(payload)
        ack = store.append(lease, payload)
        assert (ack.end - ack.start, ack.token) == (n, lease.token)
    journal.close()
    image = store.file_bytes(key)
    assert image == path.read_bytes()
    assert coli_kv.parse_header(image).nrec == 9 and store.n_records(key) == 9
    # a range read is the same slice; reads past the end stop at the committed count
    n, middle = store.read_records(key, 2, 6)
    assert n == 9 and middle == image[40 + 2 * rec_bytes() : 40 + 6 * rec_bytes()]
    assert store.read_records(key, 8, 100)[1] == image[40 + 8 * rec_bytes() :]
    assert store.read_records(key, 9)[1] == b""
    for start, stop in [(-1, None), (5, 4), (10, None)]:
        with pytest.raises(InvalidRequest):
            store.read_records(key, start, stop)
    assert [(s.first_record, s.n_records) for s in store.segments(key)] == [(0, 3), (3, 1), (4, 5)]


def test_bad_appends_are_refused_with_nothing_written(store):
    key = store.create("alice", GEOMETRY, TIER, session_id="s1")
    with pytest.raises(SessionExists):
        store.create("alice", GEOMETRY, TIER, session_id="s1")
    lease = store.acquire(key)
    with pytest.raises(InvalidRequest, match="not whole records"):
        store.append(lease, records(0, 0, 2)[:-1])
    with pytest.raises(RecordCountMismatch) as refused:
        store.append(lease, records(0, 0, 2), at=5)
    assert refused.value.current == 0
    assert store.append(lease, b"").end == 0
    assert store.n_records(key) == 0 and objects(store) == set()
    with pytest.raises(SessionNotFound):
        store.acquire("nobody~alice")
    with pytest.raises(SessionNotFound):
        store.read_records("nobody~alice")


def test_one_lease_at_a_time_and_tokens_only_grow(store):
    key = store.create("alice", GEOMETRY, TIER, session_id="s1")
    first = store.acquire(key, "replica-a")
    with pytest.raises(LeaseHeld) as held:
        store.acquire(key, "replica-b")
    assert "replica-a" in str(held.value) and 0 < held.value.retry_after <= 30
    store.append(first, records(0, 0, 2))
    store.release(first)
    second = store.acquire(key, "replica-b")
    assert second.token > first.token and second.n_records == 2
    # the released holder is fenced by the token, whatever its clock says
    with pytest.raises(StaleLease, match="superseded"):
        store.append(first, records(0, 1, 2))
    with pytest.raises(StaleLease):
        store.renew(first)
    store.renew(second)
    assert store.append(second, records(1, 0, 1)).start == 2
    assert store.n_records(key) == 3


def test_a_late_commit_is_fenced_by_the_token_not_by_time(store):
    key = store.create("alice", GEOMETRY, TIER, session_id="s1")
    old = store.acquire(key, "replica-a", ttl=0.2)
    prepared = store.prepare(old, records(0, 0, 4))  # uploaded, not committed
    # the old lease runs out (PostgreSQL's clock), a new writer takes over and appends
    new = None
    while new is None:
        try:
            new = store.acquire(key, "replica-b", ttl=30)
        except LeaseHeld:
            pass
    store.append(new, records(1, 0, 2))
    with pytest.raises(StaleLease, match="superseded") as fenced:
        store.commit(old, prepared)
    assert not isinstance(fenced.value, LeaseExpired)  # the token decided, not the expiry
    assert store.n_records(key) == 2
    assert store.read_records(key)[1] == records(1, 0, 2)
    assert prepared.object not in {s.object for s in store.segments(key)}
    # its object is garbage: collected, and the committed one stays
    assert prepared.object in objects(store)
    report = store.gc(grace=0)
    assert report.intents == 1 and objects(store) == {s.object for s in store.segments(key)}
    assert store.read_records(key)[1] == records(1, 0, 2)


def test_an_expired_lease_cannot_commit_even_untaken(store):
    key = store.create("alice", GEOMETRY, TIER, session_id="s1")
    lease = store.acquire(key, ttl=0.05)
    prepared = store.prepare(lease, records(0, 0, 1))
    deadline = store.index.now() + 0.1
    while store.index.now() < deadline:
        pass
    with pytest.raises(LeaseExpired):
        store.commit(lease, prepared)
    assert store.n_records(key) == 0


def test_gc_deletes_only_uncommitted_objects(store):
    key = store.create("alice", GEOMETRY, TIER, session_id="s1")
    lease = store.acquire(key)
    store.append(lease, records(0, 0, 3))
    dangling = store.prepare(lease, records(0, 1, 3))  # a writer that died after its upload
    stray = store.segment_name(key, 99, 0)  # an object no row knows (a GC that died midway)
    store.blobs.put(stray, b"x" * 10)
    committed = {s.object for s in store.segments(key)}
    assert objects(store) == committed | {dangling.object, stray}
    kept = store.gc(grace=3600)  # younger than the grace: nothing goes
    assert (kept.intents, kept.swept) == (0, 0) and len(objects(store)) == 3
    report = store.gc(grace=0)
    assert (report.intents, report.swept) == (1, 1)
    assert objects(store) == committed
    assert store.read_records(key)[1] == records(0, 0, 3)
    # the collected upload's commit is refused, then uploaded again by the same call
    ack = store.commit(lease, dangling)
    assert (ack.start, ack.end) == (3, 6) and store.read_records(key)[1] == records(0, 0, 3) + records(0, 1, 3)


def test_delete_removes_rows_then_objects(store):
    key = store.create("alice", GEOMETRY, TIER, session_id="s1")
    lease = store.acquire(key)
    store.append(lease, records(0, 0, 3))
    store.delete(key)
    assert objects(store) == set()
    with pytest.raises(SessionNotFound):
        store.n_records(key)


def test_large_segments_go_up_in_parts(index_url, blobs_url, s3_server):
    geometry = coli_kv.Geometry(n_layers=61, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=129280)
    blobs = BlobStore(blobs_url, endpoint_url=s3_server.endpoint, part_bytes=5 << 20)
    with SharedStore(SharedIndex(index_url), blobs) as store:
        key = store.create("alice", geometry, TIER, session_id="big")
        n = 400  # 400 x 35,628 bytes = 13.6 MB: three parts
        rows = np.random.default_rng(0).integers(0, 256, size=n * coli_kv.record_bytes(geometry, TIER), dtype=np.uint8)
        rows.reshape(n, -1)[:, :4] = 0  # tokens
        lease = store.acquire(key)
        store.append(lease, rows)
        assert store.read_records(key)[1] == rows.tobytes()
        assert blobs.client.list_multipart_uploads(Bucket=blobs.bucket).get("Uploads", []) == []


def test_s3_faults_are_retried_and_never_show_a_partial_segment(index_url, bucket, fault_proxy):
    blobs = BlobStore(
        f"s3://{bucket}/kv", endpoint_url=fault_proxy.endpoint, base_delay=0.01, max_delay=0.1, attempts=12
    )
    with SharedStore(SharedIndex(index_url), blobs) as store:
        key = store.create("alice", GEOMETRY, TIER, session_id="s1")
        lease = store.acquire(key)
        fault_proxy.rate = 0.4
        expected = b""
        for seq in range(25):
            payload = records(0, seq, 1 + seq % 4)
            store.append(lease, payload)
            expected += payload
            n, got = store.read_records(key)  # every read: exactly the acknowledged records
            assert got == expected and n * rec_bytes() == len(expected)
        fault_proxy.rate = 0.0
        assert store.file_bytes(key)[40:] == expected
        assert blobs.retries > 0 and all(fault_proxy.counts.get(k, 0) > 0 for k in fault_proxy.kinds), (
            fault_proxy.counts
        )
        # objects: the committed ones (a "drop-after" PUT was confirmed by If-None-Match, not repeated)
        store.gc(grace=0)
        assert {i.name for i in blobs.list("seg")} == {s.object for s in store.segments(key)}


def test_s3_down_for_good_is_a_typed_error_and_nothing_is_committed(index_url, bucket, fault_proxy):
    blobs = BlobStore(
        f"s3://{bucket}/kv", endpoint_url=fault_proxy.endpoint, base_delay=0.001, max_delay=0.01, attempts=3
    )
    with SharedStore(SharedIndex(index_url), blobs) as store:
        key = store.create("alice", GEOMETRY, TIER, session_id="s1")
        lease = store.acquire(key)
        fault_proxy.rate = 1.0
        fault_proxy.kinds = ("503",)
        with pytest.raises(BlobStoreUnavailable) as down:
            store.append(lease, records(0, 0, 2))
        assert down.value.retry_after >= 1 and "3 times" in str(down.value)
        fault_proxy.rate = 0.0
        assert store.n_records(key) == 0
        assert store.append(lease, records(0, 1, 2)).start == 0  # and it resumes by itself


def test_a_missing_bucket_is_not_retried(index_url, s3_server):
    blobs = BlobStore("s3://no-such-bucket/kv", endpoint_url=s3_server.endpoint, attempts=5)
    with SharedStore(SharedIndex(index_url), blobs) as store:
        key = store.create("alice", GEOMETRY, TIER, session_id="s1")
        with pytest.raises(BlobStoreError, match="NoSuchBucket"):
            store.append(store.acquire(key), records(0, 0, 1))
        assert blobs.retries == 0


def test_postgres_down_is_unavailable_and_resumes_by_itself(pg_cluster, store):
    key = store.create("alice", GEOMETRY, TIER, session_id="s1")
    lease = store.acquire(key)
    store.append(lease, records(0, 0, 2))
    pg_cluster.stop("immediate")
    try:
        with pytest.raises(IndexUnavailable) as down:
            store.append(lease, records(0, 1, 2))
        assert down.value.retry_after > 0 and "PostgreSQL" in str(down.value)
        with pytest.raises(IndexUnavailable):
            store.read_records(key)
    finally:
        pg_cluster.start()
    # the same append again (a client retrying after 503): appended once
    assert store.append(lease, records(0, 1, 2)).start == 2
    assert store.read_records(key)[1] == records(0, 0, 2) + records(0, 1, 2)


class AnswerLostIndex(SharedIndex):
    """The real index, whose next commit's answer is lost after PostgreSQL committed it (as when
    the connection drops between COMMIT and its reply)."""

    lose_next = False

    def commit(self, *args, **kwargs):
        done = super().commit(*args, **kwargs)
        if self.lose_next:
            self.lose_next = False
            raise IndexUnavailable("the answer of the commit was lost", retry_after=0.1)
        return done


def test_a_commit_whose_answer_was_lost_is_appended_once(index_url, blobs_url, s3_server):
    index = AnswerLostIndex(index_url)
    with SharedStore(index, BlobStore(blobs_url, endpoint_url=s3_server.endpoint)) as store:
        key = store.create("alice", GEOMETRY, TIER, session_id="s1")
        lease = store.acquire(key)
        store.append(lease, records(0, 0, 2))
        index.lose_next = True
        with pytest.raises(IndexUnavailable):
            store.append(lease, records(0, 1, 3))
        assert store.n_records(key) == 5  # it was committed, the caller was not told
        ack = store.append(lease, records(0, 1, 3))  # the client retries the same rows
        assert (ack.start, ack.end) == (2, 5) and store.n_records(key) == 5
        # lost again, then other rows: the doubt is settled first, the new rows go after
        index.lose_next = True
        with pytest.raises(IndexUnavailable):
            store.append(lease, records(0, 2, 1))
        ack = store.append(lease, records(0, 3, 2))
        assert (ack.start, ack.end) == (6, 8)
        assert store.read_records(key)[1] == records(0, 0, 2) + records(0, 1, 3) + records(0, 2, 1) + records(0, 3, 2)
        assert len(store.segments(key)) == 4


def test_a_commit_cut_before_it_finished_is_committed_by_the_retry(index_url, blobs_url, s3_server):
    # a real lost connection: the writer's backend is terminated while its commit waits for a lock
    with SharedStore(SharedIndex(index_url), BlobStore(blobs_url, endpoint_url=s3_server.endpoint)) as store:
        key = store.create("alice", GEOMETRY, TIER, session_id="s1")
        lease = store.acquire(key)
        prepared = store.prepare(lease, records(0, 0, 2))
        writer_pid = store.index.run("pid", lambda conn: conn.info.backend_pid)
        with psycopg.connect(index_url, autocommit=True) as other:
            with other.transaction():
                other.execute("SELECT 1 FROM kv_leases WHERE key = %s FOR UPDATE", (key,))  # the commit will wait
                failed: list[BaseException] = []

                def commit():
                    try:
                        store.commit(lease, prepared)
                    except BaseException as exc:
                        failed.append(exc)

                thread = threading.Thread(target=commit)
                thread.start()
                while not other.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'", (writer_pid,)
                ).fetchone():
                    pass
                other.execute("SELECT pg_terminate_backend(%s)", (writer_pid,))
                thread.join(timeout=30)
        assert len(failed) == 1 and isinstance(failed[0], IndexUnavailable)
        assert store.n_records(key) == 0 and lease.in_doubt is not None
        ack = store.append(lease, records(0, 0, 2))  # the retry commits the same upload
        assert (ack.start, ack.end, ack.object) == (0, 2, prepared.object)
        assert store.read_records(key)[1] == records(0, 0, 2)
