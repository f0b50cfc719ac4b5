"""API keys as the service checks them: salted records found by id, older files still read, the same
work whatever the key, and expired or revoked keys refused like unknown ones — from the next request
on, on a real server."""

from __future__ import annotations

import hmac
import json
import os
import stat
from datetime import timedelta

import pytest

from kvstore import keys as store_keys
from kvstore.api.keys import KeyTable, key_digest
from kvstore.errors import ConfigError
from kvstore.keys import KeyFile, parse_document, utc_now
from served import ServeProcess

ENV = "env-key-0123456789abcdef:alice,second-key-0123456789ab:carol"
LEGACY_KEY = "file-key-0123456789abcdef"  # an entry written before key ids: its SHA-256 only
HAND_KEY = "hand-written-key-0123456789"  # an entry written by hand: the key in clear


def legacy_file(folder):
    folder.mkdir(exist_ok=True)
    (folder / "keys.json").write_text(
        json.dumps(
            {
                "keys": [
                    {"owner": "bob", "sha256": key_digest(LEGACY_KEY)},
                    {"owner": "dave", "key": HAND_KEY},
                ]
            }
        )
    )


def rewrite(path, change):
    """Edit keys.json as an operator's tool would: read, change the document, replace the file."""
    document = json.loads(path.read_text())
    change(document)
    temp = path.with_name("edited.json")
    temp.write_text(json.dumps(document))
    os.replace(temp, path)


# ---------------------------------------------------------------------------- the check itself
def test_every_key_costs_the_same_comparisons_whatever_it_is(tmp_path, monkeypatch):
    legacy_file(tmp_path)
    record, salted_key = KeyFile(tmp_path).create("erin")
    table = KeyTable(tmp_path, ENV)
    compared = []
    real = hmac.compare_digest

    def counting(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(store_keys.hmac, "compare_digest", counting)
    presented = {
        "env-key-0123456789abcdef": "alice",  # the first plain digest
        "second-key-0123456789ab": "carol",
        LEGACY_KEY: "bob",
        HAND_KEY: "dave",  # the last plain digest
        salted_key: "erin",  # found by its id
        salted_key[:-1] + ("A" if salted_key[-1] != "A" else "B"): None,  # a known id, a wrong secret
        f"kvs_k_{'0' * 12}_{'x' * 43}": None,  # a well-formed key with an id nobody has
        "env-key-0123456789abcdeX": None,  # one character off a plain key
        "env-key-0123456789abcde": None,  # a prefix of a real key
        "x" * 8192: None,
    }
    for key, owner in presented.items():
        compared.clear()
        assert table.owner_for(key) == owner, key
        # 4 plain digests, every one compared with this key's SHA-256, then exactly one salted comparison
        plain = [a for a, _ in compared[:4]]
        assert len(compared) == 5 and plain == [store_keys.plain_digest(key)] * 4, key
        assert len(compared[4][0]) == len(compared[4][1]) == 32, key
    assert record.id in salted_key and len(table) == 5


def test_an_older_file_is_read_and_the_first_write_keeps_its_keys_without_any_in_clear(tmp_path):
    legacy_file(tmp_path)
    keys = KeyFile(tmp_path)
    before = {record.owner: record for record in keys.records()}
    assert before["bob"].id == store_keys.derived_id(store_keys.plain_digest(LEGACY_KEY))
    assert before["dave"].hint == HAND_KEY[-4:] and before["bob"].hint is None
    assert KeyTable(tmp_path, None).owner_for(LEGACY_KEY) == "bob"
    assert KeyTable(tmp_path, None).owner_for(HAND_KEY) == "dave"

    keys.create("erin")  # the first write by the key store
    text = (tmp_path / "keys.json").read_text()
    assert HAND_KEY not in text and LEGACY_KEY not in text
    after = {record.owner: record for record in keys.records()}
    assert {owner: after[owner].id for owner in ("bob", "dave")} == {
        owner: before[owner].id for owner in ("bob", "dave")
    }
    table = KeyTable(tmp_path, None)
    assert (table.owner_for(LEGACY_KEY), table.owner_for(HAND_KEY)) == ("bob", "dave")
    keys.revoke(before["dave"].id)  # a key known only by its plain digest is revoked by its derived id
    assert KeyTable(tmp_path, None).owner_for(HAND_KEY) is None
    assert stat.S_IMODE(os.stat(tmp_path / "keys.json").st_mode) == 0o600


def test_expired_and_revoked_keys_are_refused_and_the_table_follows_the_file(tmp_path):
    keys = KeyFile(tmp_path)
    soon, soon_key = keys.create("alice", expires=utc_now() + timedelta(days=1))
    table = KeyTable(tmp_path, None)
    assert table.owner_for(soon_key) == "alice"
    rewrite(keys.path, lambda doc: doc["keys"][0].update(expires="2001-01-01T00:00:00Z"))
    assert table.owner_for(soon_key) is None
    later, later_key = keys.create("alice")
    assert table.owner_for(later_key) == "alice"
    record, changed = keys.revoke(later.id)
    assert changed and record.state() == "revoked" and table.owner_for(later_key) is None
    again, changed = keys.revoke(later.id)
    assert not changed and again.revoked == record.revoked
    assert [r.state() for r in keys.records()] == ["expired", "revoked"] and soon.id != later.id


@pytest.mark.parametrize(
    "entry, complaint",
    [
        ({"owner": "bob"}, "an entry needs"),
        ({"owner": "bob", "key": "short"}, "an entry needs"),
        ({"owner": "no one", "sha256": "0" * 64}, "invalid owner"),
        ({"owner": "bob", "sha256": "0" * 64, "id": "k_000000000000"}, "its id must be"),
        ({"owner": "bob", "salt": "00", "hmac_sha256": "0" * 64}, "'salt' is 32 hex digits"),
        ({"owner": "bob", "salt": "0" * 32, "hmac_sha256": "0" * 64, "id": "key-1"}, "'id' is k_"),
        ({"owner": "bob", "salt": "0" * 32, "hmac_sha256": "0" * 64}, "a salted entry needs its 'id'"),
        ({"owner": "bob", "sha256": "0" * 64, "expires": "next week"}, "ISO 8601"),
    ],
)
def test_a_broken_entry_is_refused_with_what_is_wrong(entry, complaint):
    with pytest.raises(ConfigError, match=complaint):
        parse_document(json.dumps({"keys": [entry]}), "keys.json")


def test_the_same_key_twice_is_refused():
    entry = {"owner": "bob", "sha256": "0" * 64}
    with pytest.raises(ConfigError, match="two entries are key"):
        parse_document(json.dumps({"keys": [entry, {**entry, "owner": "carol"}]}), "keys.json")


# ---------------------------------------------------------------------------- on a real server
def test_a_revoked_or_expired_key_gets_the_401_of_an_unknown_one_at_the_next_request(tmp_path):
    data = tmp_path / "data"
    keys = KeyFile(data)
    kept, kept_key = keys.create("alice")
    revoked, revoked_key = keys.create("alice")
    expiring, expiring_key = keys.create("bob", expires=utc_now() + timedelta(days=30))
    server = ServeProcess(data, log_level="debug").start()
    try:
        import httpx

        def status(key):
            answer = httpx.get(server.url + "/sessions", headers={"Authorization": f"Bearer {key}"}, timeout=60)
            return answer.status_code, answer.json()

        assert status(kept_key)[0] == status(revoked_key)[0] == status(expiring_key)[0] == 200
        unknown = status(f"kvs_k_{'0' * 12}_{'x' * 43}")
        assert unknown[0] == 401
        keys.revoke(revoked.id)
        assert status(revoked_key) == unknown  # same status, same body: nothing tells them apart
        rewrite(keys.path, lambda doc: doc["keys"][2].update(expires="2001-01-01T00:00:00Z"))
        assert status(expiring_key) == unknown
        assert status(kept_key)[0] == 200
    finally:
        server.stop_cleanly()
    assert f"refused API key {revoked.id} of owner 'alice': revoked at" in server.output
    assert f"refused API key {expiring.id} of owner 'bob': expired at 2001-01-01T00:00:00Z" in server.output
    assert revoked_key not in server.output and kept.id not in server.output
