"""The shared store encrypted at rest (kvstore.store.shared.keys; docs/SECURITY.md, "The shared store").

``TestEncryptedSharedStore`` runs the whole store conformance suite on a shared store opened with a
KEK (no test copied: only the hooks that look behind the store's back differ — the stored image is
the sealed objects' plaintext, decrypted without checking the tag where a test damaged one, and a
flipped byte is flipped in an object's ciphertext). The tests after it are the encryption's own:
no plaintext in the bucket or the replica's cache, tamper and swap refused, shred seen at once by a
second replica, KEK and data-key rotation, and the refusals that keep plaintext and encrypted apart.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

import kvstore.store
import shared.test_conformance as plain
import shared.test_expiry as plain_expiry
from crypto.support import KEK
from kvstore.crypto import LocalKEK
from kvstore.crypto.seal import NONCE_BYTES, OBJECT_MAGIC, SALT_BYTES
from kvstore.errors import BudgetExceeded, KeyShredded, KeyUnavailable, SealBroken
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.keys import IndexKeys
from kvstore.store.shared.index import Segment
from kvstore.store.shared.keys import PURPOSE
from kvstore.store.shared.sessions import SharedSessionStore
from served import ServeProcess
from shared.rows import GEOMETRY, TIER, fingerprint_fields, records

HEAD = len(OBJECT_MAGIC) + SALT_BYTES + NONCE_BYTES  # a sealed object's bytes before its ciphertext

# the suite's tests that assert a plaintext object's exact size (a sealed object adds 76 bytes), as
# tests/crypto/test_encrypted_store.py skips them on the embedded store; the hard limit with sealed
# sizes is test_the_hard_limit_counts_sealed_bytes below
SIZE_EXACT = {
    "test_park_round_trip_is_byte_exact",
    "test_truncate_mid_turn_rehashes_the_cut_turn",
    "test_hard_limit_refuses_and_writes_nothing",
    "test_hard_limit_holds_under_concurrent_threads",
    "test_budget_evicts_the_least_recently_used_first",
    "test_budget_parks_least_recently_used_then_deletes_parked",
}


def kvstore_cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def unauthenticated(store: SharedSessionStore, key: str, segment: Segment, body: bytes) -> bytes:
    """What a sealed object decrypts to *without* checking its tag (GCM's keystream is AES-CTR from
    counter 2): a test's view of a damaged object, which the store never reads this way."""
    assert store.keyring is not None and segment.key_version is not None
    data_key = store.keyring.key(key.rsplit("~", 1)[-1], segment.key_version).secret
    salt, nonce = body[len(OBJECT_MAGIC) : len(OBJECT_MAGIC) + SALT_BYTES], body[len(OBJECT_MAGIC) + SALT_BYTES : HEAD]
    subkey = HKDF(hashes.SHA256(), 32, salt, b"kvstore v1 " + PURPOSE).derive(data_key)
    ctr = Cipher(algorithms.AES(subkey), modes.CTR(nonce + b"\0\0\0\2")).decryptor()
    return ctr.update(body[HEAD:-16]) + ctr.finalize()


def overwrite(store: SharedSessionStore, name: str, body: bytes) -> None:
    """Replace an object in the bucket behind the store's back (BlobStore.put never replaces one)."""
    blobs = store.shared.blobs
    blobs.client.put_object(Bucket=blobs.bucket, Key=name, Body=body)


class TestEncryptedSharedStore(plain.TestSharedStore):
    @pytest.fixture(autouse=True)
    def _sizes(self, request):
        if request.node.originalname in SIZE_EXACT:
            pytest.skip("asserts a plaintext object's exact size (a sealed one adds 76 bytes)")

    def make_store(self, path, **limits) -> Any:
        return kvstore.store.open(
            path, index_url=self.index_url, blobs_url=self.blobs_url, cache_bytes=0, kek=KEK, **limits
        )

    def stored_image(self, store: Any, session_id, owner=None):
        keys = self._keys(store, session_id, owner)
        assert len(keys) <= 1, f"more than one session {session_id!r}: {keys}"
        if not keys:
            return None
        row = store.index.session(keys[0])
        header = bytearray(row["header"])
        header[32:36] = int(row["n_records"]).to_bytes(4, "little")
        parts = []
        for segment in store.shared.segments(keys[0]):
            body = store.shared.blobs.get(segment.object, 0, segment.object_bytes)
            try:
                opened = store.shared.sealer.open(keys[0], segment, body)
            except SealBroken:
                opened = unauthenticated(store, keys[0], segment, body)
            parts.append(plain.unpacked(segment, opened))
        return bytes(header) + b"".join(parts)

    def flip_stored_byte(self, store: Any, session_id, offset):
        (key,) = self._keys(store, session_id, None)
        record_bytes = store.get(session_id).record_bytes
        record = (offset - HEADER_BYTES) // record_bytes
        segment = next(s for s in store.shared.segments(key) if s.first_record <= record < s.end)
        assert segment.codec == "raw" and segment.key_version is not None
        body = bytearray(store.shared.blobs.get(segment.object, 0, segment.object_bytes))
        body[HEAD + offset - HEADER_BYTES - segment.first_record * record_bytes] ^= (
            0x01  # GCM: the same bit of the plaintext
        )
        overwrite(store, segment.object, bytes(body))


class TestEncryptedSharedExpiry(plain_expiry.TestSharedExpiry):
    """The expiry conformance suite on an encrypted shared store (expired sessions swept as a delete
    removes them: rows, then objects)."""

    def make_store(self, path) -> Any:
        return kvstore.store.open(path, index_url=self.index_url, blobs_url=self.blobs_url, cache_bytes=0, kek=KEK)


# ------------------------------------------------------------------ the encryption's own tests
@pytest.fixture
def urls(index_url, blobs_url, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.delenv("KVSTORE_KEK", raising=False)
    monkeypatch.delenv("KVSTORE_KEK_FILE", raising=False)
    monkeypatch.delenv("KVSTORE_ENCRYPT", raising=False)
    return {"index_url": index_url, "blobs_url": blobs_url}


def _open(urls, folder=None, **options) -> SharedSessionStore:
    store = kvstore.store.open(folder, **urls, **options)
    assert isinstance(store, SharedSessionStore)
    return store


def _session(store: SharedSessionStore, session_id: str, owner: str, n: int = 6, seed: int = 1) -> bytes:
    store.create(owner, GEOMETRY, TIER, {"name": "m", "revision": "1"}, session_id=session_id)
    rows = records(seed, 0, n)
    store.append_records(session_id, rows, owner=owner)
    return rows


def test_objects_and_the_replica_cache_hold_no_plaintext(urls, tmp_path):
    with _open(urls, tmp_path / "replica", kek=KEK, cache_bytes=1 << 20) as store:
        rows = _session(store, "chat", "alice", n=8)
        assert bytes(store.shared.read_records("chat~alice")[1]) == rows
        store.shared.reads.flush()
        segments = store.shared.segments("chat~alice")
        assert segments and all(s.key_version == 1 and s.stored_bytes == s.nbytes + HEAD + 16 for s in segments)
        for segment in segments:
            body = store.shared.blobs.get(segment.object, 0, segment.object_bytes)
            assert body.startswith(OBJECT_MAGIC) and rows[:64] not in body
        copies = [p for p in (tmp_path / "replica" / "segments").rglob("*") if p.is_file()]
        assert copies, "the read kept a copy in the cache"
        for copy in copies:
            held = copy.read_bytes()
            assert held.startswith(OBJECT_MAGIC) and rows[:64] not in held
        # a second read is served from the cached ciphertext, opened again
        hits = store.shared.cache.counts().hits if store.shared.cache else 0
        assert bytes(store.shared.read_records("chat~alice")[1]) == rows
        assert store.shared.cache is not None and store.shared.cache.counts().hits > hits


def test_a_changed_byte_or_a_swapped_object_is_refused_never_served(urls):
    with _open(urls, kek=KEK) as store:
        _session(store, "a", "alice", seed=1)
        _session(store, "b", "alice", seed=2)
        _session(store, "c", "bob", seed=3)
        (sa,), (sb,), (sc,) = (store.shared.segments(k) for k in ("a~alice", "b~alice", "c~bob"))
        body_b = store.shared.blobs.get(sb.object, 0, sb.object_bytes)
        body_c = store.shared.blobs.get(sc.object, 0, sc.object_bytes)
        # another session's object of the same owner, at the same position: its name is bound
        overwrite(store, sa.object, body_b)
        with pytest.raises(SealBroken):
            store.shared.read_records("a~alice")
        # another owner's object
        overwrite(store, sa.object, body_c)
        with pytest.raises(SealBroken):
            store.shared.read_records("a~alice")
        # one flipped bit in the ciphertext, the tag, the salt
        for at in (HEAD + 5, len(body_b) - 1, len(OBJECT_MAGIC) + 3):
            damaged = bytearray(body_b)
            damaged[at] ^= 0x01
            overwrite(store, sb.object, bytes(damaged))
            with pytest.raises(SealBroken):
                store.shared.read_records("b~alice")
        assert not store.verify("b", owner="alice").ok
        # the row moved to another position: the first record is bound
        with pytest.raises(SealBroken):
            store.shared.reads._plain("c~bob", Segment(1, sc.n_records, sc.object, sc.nbytes, sc.digest, sc.token,
                                                        stored_bytes=sc.stored_bytes, key_version=1), body_c)  # fmt: skip


def test_shred_stops_every_replica_at_once_and_nothing_recovers_the_rows(urls, tmp_path):
    first = _open(urls, tmp_path / "r1", kek=KEK, cache_bytes=1 << 20)
    second = _open(urls, tmp_path / "r2", kek=KEK, cache_bytes=1 << 20)
    try:
        rows = _session(first, "chat", "alice", n=8)
        _session(first, "keep", "bob", n=4, seed=9)
        first.fork("chat", owner="alice", new_id="fork")
        for replica in (first, second):  # both hold alice's key in memory and a cached copy
            assert bytes(replica.shared.read_records("chat~alice")[1]) == rows
            replica.shared.reads.flush()
        objects = {
            s.object: first.shared.blobs.get(s.object, 0, s.object_bytes) for s in first.shared.segments("chat~alice")
        }
        assert first.shred_owner("alice") == 1
        for replica in (second, first):  # the other replica first: it learns of the shred from the index
            for key in ("chat~alice", "fork~alice"):
                with pytest.raises(KeyShredded):
                    replica.shared.read_records(key)
            with pytest.raises(KeyShredded):
                replica.resume("chat", owner="alice")
            assert ("alice", 1) not in replica.keyring._cache  # the unwrapped key left memory
            assert bytes(replica.shared.read_records("keep~bob")[1])  # another owner is untouched
        # the objects and the cached copies are still there, untouched, and useless
        for name, body in objects.items():
            assert first.shared.blobs.get(name, 0, len(body)) == body
        with pytest.raises(KeyShredded):
            first.keyring.key("alice", 1)
        # a new session of the owner gets a new key version, never a destroyed one's number
        _session(second, "again", "alice", n=2)
        assert {s.key_version for s in second.shared.segments("again~alice")} == {2}
    finally:
        first.close()
        second.close()


def test_rotate_kek_rewraps_without_rewriting_and_data_key_rotation_applies_to_new_writes(urls, tmp_path):
    new_kek = LocalKEK(bytes(range(100, 132)), "the new KEK")
    with _open(urls, kek=KEK) as store:
        rows = _session(store, "chat", "alice")
        (before,) = store.shared.segments("chat~alice")
        body = store.shared.blobs.get(before.object, 0, before.object_bytes)
        assert store.keyring is not None and store.keyring.rewrap(new_kek) == 1
    with pytest.raises(KeyUnavailable):
        _open(urls, kek=KEK)  # the old KEK no longer opens the store
    with _open(urls, kek=new_kek) as store:
        assert store.shared.blobs.get(before.object, 0, before.object_bytes) == body  # no object rewritten
        assert bytes(store.shared.read_records("chat~alice")[1]) == rows
        report = store.rotate_data_key("alice", rewrite=False)  # new writes only
        assert report["version"] == 2 and report["in_use"] == [1] and report["retired"] == []
        more = records(5, 1, 3)
        store.append_records("chat", more, owner="alice")
        assert [s.key_version for s in store.shared.segments("chat~alice")] == [1, 2]
        assert bytes(store.shared.read_records("chat~alice")[1]) == rows + more
        store.fork("chat", owner="alice", new_id="fork", at=4)
        store.park("chat", owner="alice")
        report = store.rotate_data_key("alice")  # every object rewritten under v3, v1 and v2 destroyed
        assert report["version"] == 3 and sorted(report["resealed"]) == ["chat", "fork"] and report["skipped"] == []
        assert report["retired"] == [1, 2] and store.keyring.versions("alice") == [3]
        for key in ("chat~alice", "fork~alice"):
            assert {s.key_version for s in store.shared.segments(key)} == {3}
        assert store.get("chat", owner="alice").state == "parked"
        assert bytes(store.shared.read_records("chat~alice")[1]) == rows + more
        assert bytes(store.shared.read_records("fork~alice")[1]) == rows[: 4 * len(rows) // 6]


def test_a_replica_still_holding_the_old_kek_makes_no_key_under_it(urls):
    new_kek = LocalKEK(bytes(range(100, 132)), "the new KEK")
    with _open(urls, kek=KEK) as old, _open(urls, kek=KEK) as rotating:
        rows = _session(old, "chat", "alice")
        assert rotating.keyring is not None and rotating.keyring.rewrap(new_kek) == 1
        assert bytes(old.shared.read_records("chat~alice")[1]) == rows  # the keys it holds stay valid
        with pytest.raises(KeyUnavailable):  # a new owner's key would be wrapped by the old KEK
            _session(old, "chat", "bob")
        with pytest.raises(KeyUnavailable):
            old.rotate_data_key("alice")
    with _open(urls, kek=new_kek) as store:
        assert store.get("chat", owner="bob").n_records == 0  # the refused append left nothing
        _session(store, "later", "bob")
        assert bytes(store.shared.read_records("chat~alice")[1]) == rows


def test_plaintext_and_encrypted_are_never_mixed(urls, monkeypatch):
    with _open(urls, kek=KEK) as store:
        _session(store, "chat", "alice")
    with pytest.raises(KeyUnavailable):
        _open(urls)  # created encrypted: no KEK in the settings
    monkeypatch.setenv("KVSTORE_KEK", bytes(range(32)).hex())
    with _open(urls) as store:  # the replica's own settings name the KEK
        assert store.encrypted and store.get("chat", owner="alice").n_records == 6
    monkeypatch.delenv("KVSTORE_KEK")
    other = LocalKEK(bytes(range(1, 33)), "another KEK")
    with pytest.raises(KeyUnavailable):
        _open(urls, kek=other)


def test_a_plaintext_store_with_sessions_refuses_a_kek(index_url, s3_server, bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    urls = {"index_url": index_url, "blobs_url": f"s3://{bucket}/plain"}
    with _open(urls) as store:
        _session(store, "chat", "alice")
        assert not store.encrypted
    with pytest.raises(KeyUnavailable):
        _open(urls, kek=KEK)
    with _open(urls) as store:  # still plaintext, still served
        assert store.get("chat", owner="alice").n_records == 6


def test_the_hard_limit_counts_sealed_bytes(urls):
    with _open(urls, kek=KEK) as store:
        rows = _session(store, "chat", "alice", n=4)
        (segment,) = store.shared.segments("chat~alice")
        used = store.usage()["used_bytes"]
        assert used == HEADER_BYTES + len(rows) + HEAD + 16 == HEADER_BYTES + segment.stored_bytes
    with _open(urls, kek=KEK, hard_limit_bytes=used + len(rows) + HEAD + 15) as store:
        with pytest.raises(BudgetExceeded):  # one byte short of a sealed segment of 4 records
            store.append_records("chat", records(1, 1, 4), owner="alice")
        assert store.usage()["used_bytes"] == used and store.get("chat", owner="alice").n_records == 4


def test_a_shred_through_the_cli_stops_two_served_replicas_and_every_way_to_the_rows(
    tmp_path, child_env, index_url, monkeypatch
):
    """Two ``kvstore serve --index --blobs`` replicas, each with the KEK from its own environment
    and a segment cache; ``kvstore crypto shred`` run against the index: no route of either replica,
    no command and no direct read of the objects (or of a replica's cached copies) recovers a row,
    and another owner is served as before."""
    env = {**child_env, "KVSTORE_KEK": bytes(range(32)).hex()}  # the tests' KEK (crypto.support.KEK)
    monkeypatch.setenv("AWS_ENDPOINT_URL", child_env["AWS_ENDPOINT_URL"])  # for the direct reads below
    flags = ["--index", env["KVSTORE_INDEX_URL"], "--blobs", env["KVSTORE_BLOBS_URL"]]
    with IndexKeys(index_url) as keys:
        alice, bob = keys.create("alice")[1], keys.create("bob")[1]
    replicas = [ServeProcess(tmp_path / f"r{i}", "--cache-size", "1M", "--encrypt", env=env).start() for i in (1, 2)]
    try:
        clients = [
            {who: httpx.Client(base_url=r.url, headers={"Authorization": f"Bearer {k}"}, timeout=60) for who, k in
             (("alice", alice), ("bob", bob))}
            for r in replicas
        ]  # fmt: skip
        first, second = clients
        for who in ("alice", "bob"):
            assert first[who].post("/sessions", json={"id": "chat", **fingerprint_fields()}).status_code == 201
            appended = first[who].post(
                "/sessions/chat/append", content=records(7, 0, 5), headers={"Content-Type": "application/octet-stream"}
            )
            assert appended.status_code == 200, appended.text
        assert first["alice"].post("/sessions/chat/fork", json={"id": "fork"}).status_code == 201
        for replica in (first, second):  # each replica unwraps alice's key and caches her objects
            got = replica["alice"].get("/sessions/chat/resume")
            assert got.status_code == 200 and got.content.endswith(records(7, 0, 5))
        shred = kvstore_cli("crypto", "shred", "alice", *flags, "--json", env=env, cwd=tmp_path)
        assert shred.returncode == 0, shred.stderr
        assert json.loads(shred.stdout)["versions_destroyed"] == 1
        for replica in (second, first):
            for sid in ("chat", "fork"):
                refused = replica["alice"].get(f"/sessions/{sid}/resume")
                assert refused.status_code == 409 and records(7, 0, 5)[:32] not in refused.content, refused.text
            verify = replica["alice"].get("/sessions/chat/verify")
            assert verify.status_code == 409 or not verify.json()["ok"]
            # a fork shares the objects (no byte is read to make it): it is as unreadable
            forked = replica["alice"].post("/sessions/chat/fork", json={})
            if forked.status_code == 201:
                assert replica["alice"].get(f"/sessions/{forked.json()['id']}/resume").status_code == 409
            kept = replica["bob"].get("/sessions/chat/resume")
            assert kept.status_code == 200 and kept.content.endswith(records(7, 0, 5))
        out = tmp_path / "out.coli_kv"
        resumed = kvstore_cli("sessions", "resume", "chat", str(out), "--owner", "alice", *flags, env=env, cwd=tmp_path)
        assert resumed.returncode == 2 and not out.exists(), resumed.stderr
        # the bucket and both caches still hold every object, untouched and unreadable
        with SharedSessionStore(env["KVSTORE_INDEX_URL"], env["KVSTORE_BLOBS_URL"], data_dir=None, kek=KEK) as store:
            for sid in ("chat", "fork"):
                with pytest.raises(KeyShredded):
                    store.shared.read_records(f"{sid}~alice")
            for segment in store.shared.segments("chat~alice"):
                assert store.shared.blobs.get(segment.object, 0, segment.object_bytes).startswith(OBJECT_MAGIC)
        for replica in replicas:
            for copy in (p for p in (replica.data / "segments").rglob("*") if p.is_file()):
                assert copy.read_bytes().startswith(OBJECT_MAGIC) and records(7, 0, 5)[:32] not in copy.read_bytes()
        for replica in clients:
            for client in replica.values():
                client.close()
    finally:
        for replica in replicas:
            replica.stop_cleanly()


def test_a_replica_opened_plaintext_before_the_store_became_encrypted_cannot_write_plaintext(urls):
    with _open(urls) as early:  # an empty store: plaintext until a replica brings a KEK
        assert not early.encrypted
        with _open(urls, kek=KEK) as late:
            assert late.encrypted
            _session(late, "chat", "alice")
        early.create("bob", GEOMETRY, TIER, {"name": "m", "revision": "1"}, session_id="plain")
        with pytest.raises(KeyUnavailable):  # the index's trigger refuses its plaintext segment
            early.append_records("plain", records(3, 0, 2), owner="bob")
        assert early.get("plain", owner="bob").n_records == 0
        # its plaintext upload was taken back: the bucket holds the sealed objects only
        sealed = {s.object for s in early.shared.segments("chat~alice")}
        assert {info.name for info in early.shared.blobs.list("seg")} == sealed


def test_schema_10_upgrades_an_index_of_schema_9_with_plaintext_and_parked_segments(urls):
    """An index of schema 9 holding a plaintext session with a parked (zstd) segment and a plain one
    upgrades to 10 in place: the new codec check accepts its rows, they keep serving, and the store
    stays plaintext (and still refuses a KEK: it holds sessions)."""
    import psycopg

    from kvstore.formats import coli_kv
    from kvstore.store.shared import schema

    with _open(urls) as store:
        rows = _session(store, "chat", "alice", n=6)  # random rows: parking leaves them raw
        zeros = np.zeros((GEOMETRY.n_layers, 64, GEOMETRY.kv_lora), np.float32)
        more = coli_kv.encode_records(
            GEOMETRY, TIER, np.arange(64, dtype=np.int32), zeros, zeros[..., : GEOMETRY.qk_rope]
        ).tobytes()
        store.append_records("chat", more, owner="alice")
        store.park("chat", owner="alice")  # the second segment compresses: a zstd object
        codecs = sorted(s.codec for s in store.shared.segments("chat~alice"))
    with psycopg.connect(urls["index_url"], autocommit=True) as conn:  # back to what schema 9 made
        with conn.transaction():
            for statement in (
                "DROP TRIGGER kv_segments_sealed ON kv_segments",
                "DROP FUNCTION kv_refuse_plaintext_segment()",
                "DROP TABLE kv_data_keys",
                "DROP TABLE kv_key_owners",
                "DELETE FROM kv_meta WHERE name = 'keys_epoch'",
                "ALTER TABLE kv_segments DROP CONSTRAINT kv_segments_codec",
                "ALTER TABLE kv_segments DROP COLUMN key_version",
                *schema.STEPS[5][2:],  # schema 5's codec check
                "UPDATE kv_meta SET value = '9' WHERE name = 'schema_version'",
            ):
                conn.execute(statement)  # type: ignore[arg-type]
    with _open(urls) as store:  # the upgrade runs on this replica's first connection
        assert store.index.version() == schema.CURRENT_VERSION == 10 and not store.encrypted
        assert sorted(s.codec for s in store.shared.segments("chat~alice")) == codecs == ["raw", "zstd"]
        assert all(s.key_version is None for s in store.shared.segments("chat~alice"))
        assert bytes(store.shared.read_records("chat~alice")[1]) == rows + more
        store.append_records("chat", records(2, 1, 1), owner="alice")  # plaintext segments still go in
    with pytest.raises(KeyUnavailable):
        _open(urls, kek=KEK)


def test_push_then_pull_through_an_encrypted_shared_store_is_byte_identical(tmp_path, monkeypatch, capsys, urls):
    """``kvstore store push|pull`` with the KEK in the settings: every object pushed is sealed, and
    the sessions pulled back are the embedded files byte for byte (records, metadata, a fork, a
    parked session)."""
    import shared.test_transfer as transfer

    monkeypatch.setenv("KVSTORE_INDEX_URL", urls["index_url"])
    monkeypatch.setenv("KVSTORE_BLOBS_URL", urls["blobs_url"])
    with _open(urls, kek=KEK) as store:  # the shared store exists, created encrypted
        assert store.encrypted
    source, target = tmp_path / "a", tmp_path / "b"
    with transfer.build_store(source) as local:
        before = transfer.snapshot(local)
    refused = transfer.main(["store", "push", "--data", str(source)])
    assert refused == 2 and "encrypted at rest" in capsys.readouterr().err  # no KEK in the settings
    monkeypatch.setenv("KVSTORE_KEK", bytes(range(32)).hex())
    code, report = transfer.run(capsys, "store", "push", "--data", str(source), "--json")
    assert code == 0 and report["counts"]["created"] == 5, report
    with _open(urls, kek=KEK) as store:
        rows = store.index.sessions()
        segments = [s for row in rows for s in store.shared.segments(row["key"])]
        assert segments and all(s.key_version == 1 for s in segments)
        for row in rows:  # the image a replica serves is the embedded file
            sid, owner = row["key"].split("~")
            assert store.shared.file_bytes(row["key"]) == before[(sid, owner)][1]
    code, report = transfer.run(capsys, "store", "pull", "--data", str(target), "--json")
    assert code == 0 and report["counts"]["created"] == 5, report
    with transfer.SessionStore(target) as pulled:
        assert transfer.snapshot(pulled) == before


def test_the_crypto_commands_on_a_shared_store(tmp_path, child_env, monkeypatch):
    """``kvstore crypto status|rotate-key|rotate-kek`` with ``--index``/``--blobs`` (and the KEK in
    the environment, then a new KEK file): what each reports, and the store opening only with the
    new KEK afterwards."""
    env = {**child_env, "KVSTORE_KEK": bytes(range(32)).hex()}
    flags = ["--index", env["KVSTORE_INDEX_URL"], "--blobs", env["KVSTORE_BLOBS_URL"], "--json"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", child_env["AWS_ENDPOINT_URL"])
    with SharedSessionStore(env["KVSTORE_INDEX_URL"], env["KVSTORE_BLOBS_URL"], data_dir=None, kek=KEK) as store:
        _session(store, "chat", "alice")
        _session(store, "other", "bob")

    def ok(*args: str, environment: dict[str, str] = env) -> dict:
        done = kvstore_cli("crypto", *args, *flags, env=environment, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    status = ok("status")
    assert status["owners"]["alice"] == {"versions": [1], "current": 1, "files_by_version": {"1": 1}}
    assert set(status["owners"]) == {"alice", "bob"} and status["shredded"] == {}
    rotated = ok("rotate-key", "alice")
    assert (rotated["version"], rotated["resealed"], rotated["retired"]) == (2, ["chat"], [1])
    new_kek = tmp_path / "new.kek"
    assert kvstore_cli("crypto", "init-kek", str(new_kek), env=env, cwd=tmp_path).returncode == 0
    assert ok("rotate-kek", "--new-kek-file", str(new_kek))["rewrapped"] == 2
    refused = kvstore_cli("crypto", "status", *flags, env=env, cwd=tmp_path)  # the old KEK no longer opens it
    assert refused.returncode == 2 and "another key-encryption key" in refused.stderr
    after = ok("status", "--kek-file", str(new_kek))
    assert after["owners"]["alice"]["versions"] == [2] and after["kek_id"] == LocalKEK.from_file(new_kek).key_id
    with SharedSessionStore(
        env["KVSTORE_INDEX_URL"], env["KVSTORE_BLOBS_URL"], data_dir=None, kek=LocalKEK.from_file(new_kek)
    ) as store:
        assert bytes(store.shared.read_records("chat~alice")[1]) == records(1, 0, 6)
