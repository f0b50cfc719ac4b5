"""API keys in the shared index: ``kvstore keys create|list|revoke --index postgresql://...`` on a real
PostgreSQL cluster, read back by every replica (``kvstore.keys.IndexKeys``) and checked by the same
``Keyring`` as the file backend's keys."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from kvstore.cli import main
from kvstore.errors import IndexUnavailable, InvalidRequest
from kvstore.keys import IndexKeys, KeyFile, Keyring
from shared.servers import free_port


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_keys_created_by_the_cli_are_accepted_by_every_replica(index_url, tmp_path, capsys):
    data = tmp_path / "data"
    code, out, err = run(capsys, "keys", "create", "--owner", "alice", "--index", index_url, "--json")
    assert code == 0, err
    alice = json.loads(out)
    code, out, err = run(capsys, "keys", "create", "--owner", "bob", "--expires", "30d", "--index", index_url)
    assert code == 0 and f"--index {index_url}" in out, out
    bob_key = next(line.strip() for line in out.splitlines() if line.strip().startswith("kvs_"))
    assert not (data / "keys.json").exists()  # the data folder is not where these keys live
    # two replicas, each with its own connection: the same keys, checked the same way as a keys.json
    with IndexKeys(index_url) as one, IndexKeys(index_url) as two:
        assert one.records() == two.records()
        ring = Keyring(two.records())
        assert ring.match(alice["key"]).id == alice["id"]
        assert ring.match(bob_key).owner == "bob"
        assert ring.match(alice["key"][:-1] + ("A" if alice["key"][-1] != "A" else "B")) is None
        stored = {record.id: record for record in one.records()}[alice["id"]]
        assert stored.entry()["hint"] == alice["key"][-4:] and stored.salt is not None and len(stored.digest) == 32
    # what PostgreSQL holds is never the key: salt and digest only
    with psycopg.connect(index_url) as conn:
        rows = conn.execute("SELECT id, owner, salt, digest, hint FROM kv_keys ORDER BY position").fetchall()
    assert [(row[0], row[1]) for row in rows][0] == (alice["id"], "alice")
    assert all(alice["key"].encode() not in bytes(row[3]) for row in rows)
    code, out, err = run(capsys, "keys", "list", "--index", index_url, "--json")
    listed = json.loads(out)
    assert code == 0 and [row["owner"] for row in listed] == ["alice", "bob"]
    assert set(listed[0]) == {"id", "owner", "state", "created", "expires", "revoked", "hint"}
    assert listed[1]["expires"] is not None and listed[1]["state"] == "active"
    code, out, _ = run(capsys, "keys", "list", "--index", index_url, "--owner", "bob", "--json")
    assert [row["owner"] for row in json.loads(out)] == ["bob"]


def test_revoke_in_the_index_and_the_environment_variable(index_url, monkeypatch, capsys):
    monkeypatch.setenv("KVSTORE_INDEX_URL", index_url)
    code, out, _ = run(capsys, "keys", "create", "--owner", "carol", "--json")
    carol = json.loads(out)
    code, out, _ = run(capsys, "keys", "revoke", carol["id"], "--json")
    assert code == 0 and json.loads(out)["state"] == "revoked"
    revoked_at = json.loads(out)["revoked"]
    code, out, _ = run(capsys, "keys", "revoke", carol["id"])
    assert code == 0 and "already revoked" in out and revoked_at in out  # the first time stays
    with IndexKeys(index_url) as keys:
        (record,) = keys.records()
        assert record.state() == "revoked" and Keyring([record]).match(carol["key"]) == record
        with pytest.raises(InvalidRequest, match="no API key has id"):
            keys.revoke("k_000000000000")
    code, _, err = run(capsys, "keys", "revoke", "k_000000000000")
    assert code == 2 and "no API key has id" in err


def test_index_keys_match_the_file_backend(index_url, tmp_path):
    """The same interface and the same records: a key made in either is a KeyRecord of one shape."""
    now = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    with IndexKeys(index_url) as keys:
        made, key = keys.create("dave", expires=now + timedelta(days=1), now=now)
        assert keys.records() == (made,)
        assert made.state(now) == "active" and made.state(now + timedelta(days=2)) == "expired"
    on_file, _ = KeyFile(tmp_path).create("dave", expires=now + timedelta(days=1), now=now)
    assert set(made.entry()) == set(on_file.entry()) and made.created == on_file.created


def test_an_unreachable_index_is_one_line_and_exit_2(capsys):
    url = f"postgresql://kvstore@127.0.0.1:{free_port()}/nowhere"  # nothing listens there
    with IndexKeys(url) as keys:  # opens without the server (a replica started in an outage waits for it)
        with pytest.raises(IndexUnavailable):
            keys.records()
    code, _, err = run(capsys, "keys", "list", "--index", url)
    assert code == 2 and "unavailable" in err and len(err.strip().splitlines()) == 1
