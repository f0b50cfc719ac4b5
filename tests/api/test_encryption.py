"""A service over a store encrypted at rest (``kvstore serve --encrypt --kek-file``), end to end on
a real server: the files a user downloads are the plaintext store's byte for byte, and after
``kvstore crypto shred`` no route, command or file read recovers a row of that owner."""

from __future__ import annotations

import shutil
import time

import pytest

from kvstore import tiers
from kvstore.cli import main
from kvstore.crypto import Keyring, LocalKEK
from kvstore.errors import EncryptedJournal, KeyShredded
from kvstore.formats import coli_kv
from kvstore.sealed import SealedImage, Sealing
from store.support import Rows

RAW = "application/octet-stream"
GEOMETRY_JSON = {"n_layers": 2, "kv_lora": 32, "qk_rope": 8, "index_hd": 4, "nic": 1, "vocab": 1000}
MODEL = {"name": "tiny-mla", "revision": "r1"}


def create(client, sid):
    response = client.post("/sessions", json={"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON, "tier": "fp8"})
    assert response.status_code == 201, response.text


def append(client, sid, payload):
    response = client.post(f"/sessions/{sid}/append", content=payload, headers={"Content-Type": RAW})
    assert response.status_code == 200, response.text


@pytest.fixture
def kek_file(tmp_path):
    path = tmp_path / "kek"
    assert main(["crypto", "init-kek", str(path)]) == 0
    return path


def test_downloads_are_the_plaintext_stores_byte_for_byte(make_server, tmp_path, kek_file, keys):
    plain = make_server(data=tmp_path / "plain")
    sealed = make_server("--encrypt", "--kek-file", str(kek_file), data=tmp_path / "sealed")
    rows = Rows(5)
    turns = [rows.encode(tiers.FP8, rows.make(n)) for n in (6, 9, 3)]
    got = {}
    for name, server in (("plain", plain), ("sealed", sealed)):
        with server.client(keys["alice"]) as alice:
            create(alice, "chat")
            for turn in turns:
                append(alice, "chat", turn)
            got[name] = [
                alice.get("/sessions/chat/resume", params={"format": form}).content
                for form in ("coli_kv", "raw", "arrow")
            ]
        server.stop()
        out = tmp_path / f"{name}.coli_kv"
        extra = ["--kek-file", str(kek_file)] if name == "sealed" else []
        assert main(["sessions", "resume", "chat", str(out), "--data", str(tmp_path / name), *extra]) == 0
        got[name].append(out.read_bytes())
    assert got["sealed"] == got["plain"]
    assert coli_kv.parse(got["sealed"][0]).record_bytes() == b"".join(turns)
    journal = (tmp_path / "sealed" / "journals" / "chat~alice.coli_kv").read_bytes()
    assert journal[:8] == b"COLIKVE\0" and turns[0][:64] not in journal


def test_a_store_created_encrypted_refuses_to_open_without_its_key(make_server, tmp_path, kek_file):
    server = make_server("--encrypt", "--kek-file", str(kek_file), data=tmp_path / "sealed")
    server.stop()
    assert main(["sessions", "list", "--data", str(tmp_path / "sealed")]) == 2
    other = tmp_path / "other-kek"
    assert main(["crypto", "init-kek", str(other)]) == 0
    assert main(["sessions", "list", "--data", str(tmp_path / "sealed"), "--kek-file", str(other)]) == 2
    assert main(["sessions", "list", "--data", str(tmp_path / "sealed"), "--kek-file", str(kek_file)]) == 0


def test_after_a_shred_no_route_command_or_file_read_recovers_a_row(make_server, tmp_path, kek_file, keys, capsys):
    data = tmp_path / "sealed"
    server = make_server("--encrypt", "--kek-file", str(kek_file), data=data)
    rows = Rows(6)
    secret = rows.encode(tiers.FP8, rows.make(8))
    with server.client(keys["alice"]) as alice, server.client(keys["bob"]) as bob:
        create(alice, "chat")
        append(alice, "chat", secret)
        create(alice, "parked")
        append(alice, "parked", secret)
        assert alice.post("/sessions/parked/park").status_code == 202
        create(bob, "chat")
        append(bob, "chat", secret)
        assert alice.get("/sessions/chat/resume").content == secret
        backup = tmp_path / "backup"
        shutil.copytree(data / "journals", backup)  # a backup taken before the shred

        assert main(["crypto", "shred", "alice", "--data", str(data), "--kek-file", str(kek_file)]) == 0
        time.sleep(1.0)  # the server's keyring watcher checks twice a second
        for path in ("/sessions/chat/resume", "/sessions/parked/resume"):
            response = alice.get(path)
            assert response.status_code >= 400 and secret not in response.content, (path, response.status_code)
        assert alice.get("/sessions/chat/verify").json()["ok"] is False  # nothing re-hashes: no key
        assert alice.get("/sessions/chat/resume", params={"format": "coli_kv"}).status_code >= 400
        assert bob.get("/sessions/chat/resume").content == secret  # another owner is untouched
    server.stop()
    out = tmp_path / "out.coli_kv"
    assert (
        main(
            [
                "sessions",
                "resume",
                "chat",
                str(out),
                "--owner",
                "alice",
                "--data",
                str(data),
                "--kek-file",
                str(kek_file),
            ]
        )
        != 0
    )
    assert not out.exists() or secret not in out.read_bytes()
    capsys.readouterr()
    ring = Keyring(data, LocalKEK.from_file(kek_file))
    for journal in [data / "journals" / "chat~alice.coli_kv", backup / "chat~alice.coli_kv"]:
        raw = journal.read_bytes()
        assert secret[:32] not in raw
        with pytest.raises(EncryptedJournal):
            coli_kv.load(journal)
        with open(journal, "rb") as f, pytest.raises(KeyShredded):
            SealedImage(f.fileno(), Sealing.for_key(ring, "chat~alice"), journal.name).read_range(0, 8)


def test_a_shred_drops_the_owners_resident_rows_from_a_running_servers_pool(tmp_path):
    """What the service's lifespan wires (``api.main._watch_keyring``): a real engine pool holding
    two owners' rows; a shred by another process drops the shredded owner's within the watcher's
    period, and only theirs."""
    import types

    import kvstore.store
    from kvstore.api.main import _watch_keyring
    from kvstore.engine.cache import CacheGeometry, LatentCache
    from kvstore.engine.pool import Resident, ResidentPool
    from store.support import GEOMETRY, new_session

    kek = LocalKEK(bytes(range(32)))
    with kvstore.store.open(tmp_path / "data", kek=kek) as store:
        new_session(store, "chat", owner="alice")
        new_session(store, "chat", owner="bob")
        pool = ResidentPool(1 << 30, 1 << 30)
        for key in ("chat~alice", "chat~bob"):
            pool.put(Resident(key, LatentCache(tiers.FP8, CacheGeometry.of(GEOMETRY), "cpu"), (), 0))
        watcher = _watch_keyring(store, types.SimpleNamespace(pool=pool))
        assert watcher is not None
        try:
            Keyring(tmp_path / "data", kek).shred("alice")  # another process's shred
            deadline = time.monotonic() + 5
            while pool.get("chat~alice") is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.get("chat~alice") is None and pool.get("chat~bob") is not None
        finally:
            watcher.stop()


def test_serve_refuses_an_encrypted_store_without_its_key_before_it_starts(tmp_path, kek_file, monkeypatch, capsys):
    for name in ("KVSTORE_KEK", "KVSTORE_KEK_FILE", "KVSTORE_ENCRYPT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["serve", "--data", str(tmp_path / "new"), "--encrypt"]) == 2
    assert "--kek-file" in capsys.readouterr().err and not (tmp_path / "new" / "keyring.json").exists()
    with kvstore_store_open(tmp_path / "made", LocalKEK.from_file(kek_file)):
        pass
    assert main(["serve", "--data", str(tmp_path / "made")]) == 2  # created encrypted: always opened so
    assert "encrypted at rest" in capsys.readouterr().err
    # a shared store asked encrypted without a key: refused before anything is reached (no server here)
    shared = ["--index", "postgresql://127.0.0.1:9/none", "--blobs", str(tmp_path / "blobs")]
    assert main(["serve", "--data", str(tmp_path / "replica"), *shared, "--encrypt", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--kek-file" in err and "did not start" not in err  # the reason, not a failed start-up


def kvstore_store_open(data, kek):
    import kvstore.store

    return kvstore.store.open(data, kek=kek)
