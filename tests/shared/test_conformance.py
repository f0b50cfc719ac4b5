"""The store conformance suite (``tests/conformance/store.py``) on the shared backend: a real
PostgreSQL cluster for the index and moto's standalone S3 server for the segments.

``TestSharedStore`` runs every test of the suite against :class:`SharedSessionStore`, the store a
``kvstore serve --index --blobs`` replica answers its routes from (opened by ``kvstore.store.open``
with the two URLs); what the backend lacks (its class's ``capabilities``) is skipped by the suite,
which checks instead that each lacked operation raises ``NotOnSharedStore``. One cluster and one S3 server serve every test (session fixtures of
``tests/shared/conftest.py``); each test gets a fresh database and a fresh bucket.

The hooks look at the stored bytes behind the store's back: the ``.coli_kv`` image is the header
the index keeps followed by the committed segment objects exactly as S3 holds them, and a flipped
byte is written into a segment object in S3. The replica's local segment cache is off here
(``cache_bytes=0``): a sound cached copy would rightly be served instead of the flipped object, and
the cache has its own tests (``test_cache.py``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import zstandard

import kvstore.store
from conformance.store import StoreConformance
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.keys import IndexKeys
from kvstore.store.shared.index import Segment
from kvstore.store.shared.sessions import SharedSessionStore
from kvstore.store.values import storage_key
from served import ServeProcess, wait_job
from shared.rows import GEOMETRY, TIER, fingerprint_fields, rec_bytes, records


def unpacked(segment: Segment, body: bytes) -> bytes:
    """A segment object's records: a parked one's object is their zstd frame."""
    return zstandard.ZstdDecompressor().decompress(body) if segment.codec == "zstd" else body


def flip_object_byte(store: SharedSessionStore, key: str, record_bytes: int, offset: int) -> None:
    """Flip the low bit of byte ``offset`` of the session's image, in the segment object holding it."""
    record = (offset - HEADER_BYTES) // record_bytes
    segment = next(s for s in store.shared.segments(key) if s.first_record <= record < s.end)
    assert segment.codec == "raw", "flip a byte of an active session's object"
    at = offset - HEADER_BYTES - segment.first_record * record_bytes
    body = bytearray(store.shared.blobs.get(segment.object, 0, segment.nbytes))
    body[at] ^= 0x01
    # a plain overwrite (BlobStore.put never replaces an object): the damage comes from outside
    blobs = store.shared.blobs
    blobs.client.put_object(Bucket=blobs.bucket, Key=segment.object, Body=bytes(body))


class TestSharedStore(StoreConformance):
    backend = SharedSessionStore  # lacks journal_files: a session is segment objects; hashes every read

    @pytest.fixture(autouse=True)
    def _servers(self, index_url, blobs_url, s3_server, monkeypatch):
        # set up before the suite's ``store`` fixture (autouse fixtures of a scope come first)
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)  # as an operator names the server
        self.index_url, self.blobs_url = index_url, blobs_url

    # the suite types its store as the embedded one: the hooks take and give this backend's
    def make_store(self, path, **limits) -> Any:
        return kvstore.store.open(path, index_url=self.index_url, blobs_url=self.blobs_url, cache_bytes=0, **limits)

    def _keys(self, store: Any, session_id: str, owner: str | None) -> list[str]:
        if owner is not None:
            key = storage_key(session_id, owner)
            return [key] if key in {row["key"] for row in store.index.sessions(owner)} else []
        return store.index.keys_of_id(session_id)

    def stored_image(self, store: Any, session_id, owner=None):
        keys = self._keys(store, session_id, owner)
        assert len(keys) <= 1, f"more than one session {session_id!r}: {keys}"
        if not keys:
            return None
        row = store.index.session(keys[0])
        header = bytearray(row["header"])
        header[32:36] = int(row["n_records"]).to_bytes(4, "little")  # nrec, as file_bytes writes it
        # the objects as S3 holds them, unchecked: a flipped byte must show (a parked one's decompressed)
        objects = [
            unpacked(s, store.shared.blobs.get(s.object, 0, s.object_bytes)) for s in store.shared.segments(keys[0])
        ]
        return bytes(header) + b"".join(objects)

    def flip_stored_byte(self, store: Any, session_id, offset):
        (key,) = self._keys(store, session_id, None)
        flip_object_byte(store, key, store.get(session_id).record_bytes, offset)

    def held_bytes(self, store: Any):
        # every session's header (kept in the index) plus the objects its segment rows list, as S3 sizes them
        blobs = store.shared.blobs
        return sum(
            HEADER_BYTES + sum(blobs.size_of(s.object) or 0 for s in store.shared.segments(row["key"]))
            for row in store.index.sessions()
        )


# ------------------------------------------------------------------ the same reports over HTTP
def test_a_replica_serves_verify_inspect_and_maintenance(tmp_path, child_env, index_url, monkeypatch):
    """The verify, inspect, repair, park and migrate routes of a ``kvstore serve --index --blobs``
    replica answer from the store above, as the embedded service's do."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", child_env["AWS_ENDPOINT_URL"])  # for the store that damages an object
    with IndexKeys(index_url) as keys:
        key = keys.create("alice")[1]
    server = ServeProcess(tmp_path / "r1", "--cache-size", "0", env=child_env).start()
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
            created = http.post(
                "/sessions",
                json={
                    "id": "chat",
                    **fingerprint_fields(),
                },
            )
            assert created.status_code == 201, created.text
            for seq, n in enumerate((3, 4, 5)):
                appended = http.post(
                    "/sessions/chat/append",
                    content=records(1, seq, n),
                    headers={"Content-Type": "application/octet-stream"},
                )
                assert appended.status_code == 200, appended.text
            verified = http.get("/sessions/chat/verify")
            assert verified.status_code == 200, verified.text
            assert verified.json() == {
                "session_id": "chat",
                "ok": True,
                "n_records": 12,
                "turns_checked": 3,
                "first_bad": None,
                "good_records": 12,
            }
            inspected = http.get("/sessions/chat/file/inspect")
            assert inspected.status_code == 200, inspected.text
            report = inspected.json()
            assert report["header"]["nrec"] == 12 and report["loadable_records"] == 12 and report["problems"] == []
            assert report["turns"] == 3 and report["file"] == {"objects": 3, "bytes": HEADER_BYTES + 12 * rec_bytes()}
            with SharedSessionStore(
                child_env["KVSTORE_INDEX_URL"],
                child_env["KVSTORE_BLOBS_URL"],
                data_dir=tmp_path / "local",
                cache_bytes=0,
            ) as store:
                flip_object_byte(store, storage_key("chat", "alice"), rec_bytes(), HEADER_BYTES + 8 * rec_bytes() + 9)
            damaged = http.get("/sessions/chat/verify").json()
            assert (damaged["ok"], damaged["first_bad"], damaged["good_records"]) == (
                False,
                {"turn": 2, "start": 7, "end": 12},
                7,
            )
            for path in ("/sessions/nothing/verify", "/sessions/nothing/file/inspect"):
                assert http.get(path).status_code == 404
            # the maintenance routes answer as on the embedded store: repair drops the damaged turn,
            # park and migrate run as jobs, and a resume unparks
            dry = http.post("/sessions/chat/file/repair", params={"dry_run": "true"}).json()
            assert (dry["dry_run"], dry["kept_records"], dry["dropped_records"]) == (True, 7, 5)
            repaired = http.post("/sessions/chat/file/repair").json()
            assert repaired["kept_records"] == 7 and http.get("/sessions/chat/verify").json()["ok"]
            assert "repaired" in http.get("/sessions/chat").json()["problem"]
            parked = wait_job(http, http.post("/sessions/chat/park").json(), expect="done")
            assert parked["result"]["state"] == "parked" and http.get("/sessions/chat").json()["state"] == "parked"
            migrated = http.post("/sessions/chat/file/migrate", json={"tier": "int4"})
            assert migrated.status_code == 202, migrated.text
            done = wait_job(http, migrated.json(), expect="done")["result"]
            assert done["tier"]["name"] == "int4" and done["state"] == "active" and done["n_records"] == 7
            assert http.get("/sessions/chat/verify").json()["ok"]
            http.post("/sessions/chat/park")
    finally:
        server.stop_cleanly()


def test_verify_reports_progress_as_each_segment_is_checked(tmp_path, index_url, blobs_url, s3_server, monkeypatch):
    """``verify`` on the shared store calls ``progress(bytes_hashed, bytes_total)`` as each segment
    (turn) is re-hashed, in order, ending at the session's record bytes — also for a parked session,
    whose objects are compressed frames."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    with SharedSessionStore(index_url, blobs_url, data_dir=None, cache_bytes=0) as store:
        store.create("alice", GEOMETRY, TIER, {"name": "m", "revision": "1"}, session_id="chat")
        for seq, n in enumerate((3, 5, 2, 7)):
            store.append_records("chat", records(1, seq, n))
        total = 17 * rec_bytes()
        for parked in (False, True):
            if parked:
                store.park("chat")
            seen: list[tuple[int, int]] = []
            assert store.verify("chat", progress=lambda done, whole, seen=seen: seen.append((done, whole))).ok
            assert [done for done, _ in seen] == [3 * rec_bytes(), 8 * rec_bytes(), 10 * rec_bytes(), total]
            assert {whole for _, whole in seen} == {total}
