"""Key rotation without downtime (``kvstore crypto rotate-kek`` and ``rotate-key``), through the
command line on a real encrypted store."""

from __future__ import annotations

import threading

import kvstore.store
from kvstore import tiers
from kvstore.cli import main
from kvstore.crypto import Keyring, LocalKEK
from kvstore.errors import KeyUnavailable
from kvstore.sealed import SEALED_HEADER_BYTES, SealedHeader
from store.support import Rows, new_session


def files(data):
    return {p.name: p.read_bytes() for folder in ("journals", "archive") for p in (data / folder).glob("*.coli_kv*")}


def make_store(tmp_path):
    kek = tmp_path / "kek"
    assert main(["crypto", "init-kek", str(kek)]) == 0
    data = tmp_path / "data"
    rows = Rows(7)
    with kvstore.store.open(data, kek=LocalKEK.from_file(kek)) as store:
        for sid, owner in (("a", "alice"), ("b", "alice"), ("c", "bob")):
            new_session(store, sid, owner=owner)
            store.append(sid, *rows.make(5), owner=owner)
            store.append(sid, *rows.make(4), owner=owner)
        store.park("b", owner="alice")
        served = {sid: store.resume(sid).records.record_bytes() for sid in ("a", "c")}
    return data, kek, served


def test_rotate_kek_rewraps_the_keys_and_rewrites_no_data(tmp_path):
    data, kek, served = make_store(tmp_path)
    before = files(data)
    new = tmp_path / "new-kek"
    assert main(["crypto", "init-kek", str(new)]) == 0
    assert main(["crypto", "rotate-kek", "--data", str(data), "--kek-file", str(kek), "--new-kek-file", str(new)]) == 0
    assert files(data) == before  # not one byte of a journal or archive changed
    try:
        kvstore.store.open(data, kek=LocalKEK.from_file(kek))
        raise AssertionError("the old KEK still opens the store")
    except KeyUnavailable:
        pass
    with kvstore.store.open(data, kek=LocalKEK.from_file(new)) as store:
        assert {sid: store.resume(sid).records.record_bytes() for sid in ("a", "c")} == served


def test_rotate_key_reseals_the_owners_sessions_and_retires_the_old_version(tmp_path, capsys):
    data, kek, served = make_store(tmp_path)
    before = files(data)
    provider = LocalKEK.from_file(kek)
    with kvstore.store.open(data, kek=provider) as store:
        old = store.keyring.current("alice").version
        results = []

        def reader():  # the store keeps serving alice while her sessions are rewritten
            for _ in range(20):
                results.append(store.resume("a").records.record_bytes())

        thread = threading.Thread(target=reader)
        thread.start()
        report = store.rotate_data_key("alice")
        thread.join()
        assert set(results) == {served["a"]}
        assert report["resealed"] == ["a", "b"] and report["skipped"] == [] and report["retired"] == [old]
        assert store.key_versions_in_use("alice") == {report["version"]: 2}
        assert store.resume("a").records.record_bytes() == served["a"]
        assert store.get("b", owner="alice").state == "parked"
        assert store.resume("b", owner="alice").tokens.shape == (9,)
        assert store.get("c").tier == tiers.FP8
    after = files(data)
    assert after["c~bob.coli_kv"] == before["c~bob.coli_kv"]  # another owner's files are untouched
    assert after["a~alice.coli_kv"] != before["a~alice.coli_kv"]
    head = SealedHeader.parse(after["a~alice.coli_kv"][:SEALED_HEADER_BYTES], "a")
    assert head.key_version == report["version"]
    assert Keyring(data, provider).versions("alice") == [report["version"]]
    capsys.readouterr()
    assert main(["crypto", "status", "--data", str(data), "--kek-file", str(kek), "--json"]) == 0
    assert '"alice"' in capsys.readouterr().out
    assert main(["crypto", "rotate-key", "bob", "--data", str(data), "--kek-file", str(kek)]) == 0
