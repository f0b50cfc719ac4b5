"""Key times out of range (issue 42, item 6).

``kvstore keys create --expires 999999w`` (or ``9999-12-31T23:59:59-01:00``, which is past year 9999
in UTC) ended in a Python traceback (``OverflowError``); such an ``expires`` in ``keys.json`` made
every request of every owner answer 500 on a running server, and a restart crashed. Every time a key
carries is checked against 1970-01-01 .. 9999-12-31T23:59:59Z where it is parsed; one entry of
``keys.json`` that cannot be used is logged once and skipped, and the other keys keep working.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from kvstore.cli import main
from kvstore.keys import LATEST, KeyFile, TimeOutOfRange, parse_expires, parse_time, utc_now
from served import ServeProcess

OUT_OF_RANGE = ["9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00", "0001-01-01", "1969-12-31T23:59:59Z"]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def add_entry(path, entry):
    """Add an entry to keys.json as a hand edit would (a new file renamed over the old one)."""
    document = json.loads(path.read_text())
    document["keys"].append(entry)
    temp = path.with_name("edited.json")
    temp.write_text(json.dumps(document))
    os.replace(temp, path)


@pytest.mark.parametrize("expires", ["999999w", "9999-12-31T23:59:59-01:00"])
def test_an_expiry_past_the_range_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, expires):
    data = tmp_path / "data"
    assert run(capsys, "keys", "create", "--owner", "alice", "--data", data)[0] == 0
    before = (data / "keys.json").read_bytes()
    code, out, err = run(capsys, "keys", "create", "--owner", "bob", "--data", data, "--expires", expires)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"kvstore: error: --expires {expires!r}: ") and "9999-12-31T23:59:59Z" in err
    assert (data / "keys.json").read_bytes() == before
    # spans and dates that end in the range are accepted
    for fits in ("999999d", "9999-12-31T23:59:59+01:00"):
        assert run(capsys, "keys", "create", "--owner", "bob", "--data", data, "--expires", fits)[0] == 0


def test_every_parsed_time_is_in_range_or_refused_by_name():
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for text in OUT_OF_RANGE:
        with pytest.raises(TimeOutOfRange):
            parse_time(text)
    assert parse_time("9999-12-31T23:59:59Z") == LATEST
    assert parse_time("9999-12-31T23:59:59+01:00") == LATEST - timedelta(hours=1)
    assert parse_expires("999999d", now) == now + timedelta(days=999999)
    assert parse_expires("9999-12-31", now).year == 9999


def test_a_bad_entry_in_keys_json_is_skipped_and_logged_once_and_kept_by_changes(tmp_path, capsys, caplog):
    data = tmp_path / "data"
    keys = KeyFile(data)
    alice, alice_key = keys.create("alice")
    bob, _ = keys.create("bob", expires=utc_now() + timedelta(days=1))
    bad = {"id": "k_0123456789ab", "owner": "mallory", "salt": "0" * 32, "hmac_sha256": "0" * 64}
    add_entry(keys.path, {**bad, "expires": "9999-12-31T23:59:59-01:00"})
    add_entry(keys.path, {**bad, "id": "k_ba9876543210", "created": "0001-01-01T00:00:00+01:00"})
    reader = KeyFile(data)
    with caplog.at_level(logging.WARNING, logger="kvstore.keys"):
        for _ in range(3):
            assert [r.id for r in reader.records()] == [alice.id, bob.id]
    skipped = [r.getMessage() for r in caplog.records if r.name == "kvstore.keys"]
    assert len(skipped) == 2, skipped  # once each, not once per read
    assert "key entry 2 (id 'k_0123456789ab', owner 'mallory') is skipped, the other keys work" in skipped[0]
    assert "'expires' '9999-12-31T23:59:59-01:00' is out of range" in skipped[0]
    assert "0" * 32 not in " ".join(skipped)  # never a salt or a digest
    # the command line lists the others and warns about each skipped entry
    code, out, err = run(capsys, "keys", "list", "--data", data, "--json")
    assert code == 0 and [row["id"] for row in json.loads(out)] == [alice.id, bob.id]
    assert err.count("kvstore: warning: ") == 2 and "key entry 3 (id 'k_ba9876543210'" in err
    # a change written by kvstore keeps the entries it cannot read, where they were
    assert run(capsys, "keys", "revoke", bob.id, "--data", data)[0] == 0
    assert run(capsys, "keys", "create", "--owner", "carol", "--data", data)[0] == 0
    entries = json.loads(keys.path.read_text())["keys"]
    assert entries[2]["expires"] == "9999-12-31T23:59:59-01:00" and entries[3]["id"] == "k_ba9876543210"
    assert [e["owner"] for e in entries] == ["alice", "bob", "mallory", "mallory", "carol"]
    assert [r.owner for r in KeyFile(data).records()] == ["alice", "bob", "carol"]
    assert alice_key


def test_a_running_server_keeps_serving_every_owner_and_restarts_with_a_bad_entry(tmp_path):
    data = tmp_path / "data"
    keys = KeyFile(data)
    _, alice_key = keys.create("alice")
    _, bob_key = keys.create("bob")

    def status(server, key):
        return httpx.get(server.url + "/sessions", headers={"Authorization": f"Bearer {key}"}, timeout=60).status_code

    server = ServeProcess(data, log_level="info").start()
    try:
        assert status(server, alice_key) == status(server, bob_key) == 200
        add_entry(keys.path, {"id": "k_00000000cafe", "owner": "eve", "salt": "1" * 32, "hmac_sha256": "2" * 64,
                              "expires": "9999-12-31T23:59:59-01:00"})  # fmt: skip
        for _ in range(3):
            assert status(server, alice_key) == status(server, bob_key) == 200
        _, carol_key = keys.create("carol")  # the file changes again: the entry is not logged again
        assert status(server, carol_key) == 200
    finally:
        server.stop_cleanly()
    assert server.output.count("key entry 2 (id 'k_00000000cafe', owner 'eve') is skipped") == 1, server.output
    restarted = ServeProcess(data).start()  # a restart with the entry in the file
    try:
        assert status(restarted, alice_key) == status(restarted, carol_key) == 200
    finally:
        restarted.stop_cleanly()
