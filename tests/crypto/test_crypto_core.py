"""The crypto core: sealing byte objects, the KEK provider and the keyring (real files, real fsync)."""

from __future__ import annotations

import base64
import json
import os

import pytest

from kvstore.crypto import Keyring, LocalKEK, open_object, seal_object
from kvstore.crypto.kek import provider_from_settings, write_kek_file
from kvstore.crypto.keyring import open_keyring
from kvstore.errors import KeyShredded, KeyUnavailable, SealBroken

KEY = bytes(range(32))


def test_an_object_round_trips_and_any_change_is_refused():
    sealed = seal_object(KEY, b"rows of a conversation", b"alice\0chat\0v1")
    assert open_object(KEY, sealed, b"alice\0chat\0v1") == b"rows of a conversation"
    assert b"rows" not in sealed
    for at in range(len(sealed)):  # every byte: magic, salt, nonce, ciphertext, tag
        damaged = bytearray(sealed)
        damaged[at] ^= 0x01
        with pytest.raises(SealBroken):
            open_object(KEY, bytes(damaged), b"alice\0chat\0v1")
    with pytest.raises(SealBroken):
        open_object(KEY, sealed, b"bob\0chat\0v1")  # moved to another owner's name
    with pytest.raises(SealBroken):
        open_object(bytes(32), sealed, b"alice\0chat\0v1")  # another key
    assert seal_object(KEY, b"x", b"") != seal_object(KEY, b"x", b"")  # a fresh salt and nonce each time


def test_a_kek_is_read_from_a_file_or_the_environment_and_never_shown(tmp_path, monkeypatch):
    path = tmp_path / "kek"
    written = write_kek_file(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert provider_from_settings(path).key_id == written.key_id
    secret = bytes.fromhex(path.read_text().strip())
    monkeypatch.delenv("KVSTORE_KEK_FILE", raising=False)
    monkeypatch.setenv("KVSTORE_KEK", base64.b64encode(secret).decode())
    from_env = provider_from_settings()
    assert from_env.key_id == written.key_id
    assert secret.hex() not in repr(from_env) and secret.hex() not in from_env.key_id
    monkeypatch.setenv("KVSTORE_KEK", "too short")
    with pytest.raises(KeyUnavailable, match="256-bit"):
        provider_from_settings()
    monkeypatch.delenv("KVSTORE_KEK")
    with pytest.raises(KeyUnavailable, match="--kek-file"):
        provider_from_settings()


def test_the_keyring_keeps_wrapped_keys_only_and_reopens(tmp_path):
    kek = LocalKEK(KEY)
    ring = Keyring(tmp_path, kek, create=True)
    alice = ring.current("alice")
    assert ring.current("alice") == alice and ring.current("bob").secret != alice.secret
    text = (tmp_path / "keyring.json").read_bytes()
    assert (
        alice.secret not in text
        and base64.b64encode(alice.secret) not in text
        and alice.secret.hex().encode() not in text
    )
    assert "secret" not in repr(alice) and alice.secret.hex() not in repr(alice)
    again = Keyring(tmp_path, LocalKEK(KEY))
    assert again.key("alice", alice.version).secret == alice.secret
    with pytest.raises(KeyUnavailable, match="another key-encryption key"):
        Keyring(tmp_path, LocalKEK(bytes(32)))
    # a wrapped key moved to another owner does not unwrap (bound to owner and version)
    doc = json.loads(text)
    doc["owners"]["bob"]["keys"] = doc["owners"]["alice"]["keys"]
    (tmp_path / "keyring.json").write_text(json.dumps(doc))
    with pytest.raises(KeyUnavailable):
        Keyring(tmp_path, LocalKEK(KEY)).key("bob", 1)


def test_shred_destroys_one_owners_keys_durably_and_a_running_holder_notices(tmp_path):
    kek = LocalKEK(KEY)
    server = Keyring(tmp_path, kek, create=True)  # a running process holding unwrapped keys
    alice, bob = server.current("alice"), server.current("bob")
    server.key("alice", alice.version)
    dropped = []
    server.on_change.append(dropped.append)
    assert Keyring(tmp_path, kek).shred("alice") == 1  # another process (kvstore crypto shred)
    with pytest.raises(KeyShredded, match="shredded"):
        server.key("alice", alice.version)
    assert dropped == [{"alice"}] and ("alice", alice.version) not in server._cache
    assert server.key("bob", bob.version).secret == bob.secret
    with pytest.raises(KeyShredded):
        Keyring(tmp_path, kek).key("alice", alice.version)  # after a restart too
    fresh = server.current("alice")  # a new key for new sessions, never the destroyed version
    assert fresh.version > alice.version and fresh.secret != alice.secret


def test_rotation_adds_a_version_and_retires_old_ones(tmp_path):
    ring = Keyring(tmp_path, LocalKEK(KEY), create=True)
    first = ring.current("alice")
    second = ring.rotate("alice")
    assert ring.current("alice").version == second != first.version
    assert ring.key("alice", first.version).secret == first.secret  # still opens old files
    with pytest.raises(KeyUnavailable):
        ring.retire("alice", second)  # never the current one
    ring.retire("alice", first.version)
    with pytest.raises(KeyShredded):
        ring.key("alice", first.version)


def test_kek_rotation_rewraps_without_changing_data_keys(tmp_path):
    old, new = LocalKEK(KEY), LocalKEK(os.urandom(32))
    ring = Keyring(tmp_path, old, create=True)
    keys = [ring.current(o) for o in ("alice", "bob")]
    before = (tmp_path / "keyring.json").read_text()
    assert Keyring(tmp_path, old).rewrap(new) == 2
    assert (tmp_path / "keyring.json").read_text() != before
    with pytest.raises(KeyUnavailable):
        Keyring(tmp_path, old)
    reopened = Keyring(tmp_path, new)
    assert [reopened.key(k.owner, k.version).secret for k in keys] == [k.secret for k in keys]


def test_stores_are_never_mixed(tmp_path):
    assert open_keyring(tmp_path, None) is None  # plaintext
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "data.mdb").write_bytes(b"")
    with pytest.raises(KeyUnavailable, match="created without encryption"):
        open_keyring(tmp_path, LocalKEK(KEY))
    other = tmp_path / "enc"
    other.mkdir()
    assert open_keyring(other, LocalKEK(KEY)) is not None
    with pytest.raises(KeyUnavailable, match="encrypted at rest"):
        open_keyring(other, None)
