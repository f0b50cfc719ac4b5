"""``kvstore sessions create --ttl``, ``sessions ttl``, ``sessions owner-ttl`` and ``sessions
expire`` on a data folder: what they set, what they print, what they refuse (exit 2)."""

from __future__ import annotations

import json

import pytest

from kvstore.cli import main
from kvstore.errors import InvalidRequest
from kvstore.store import SessionStore
from kvstore.store.values import parse_ttl, storage_key

HOUR = 3600.0
GEOMETRY = "2,32,8,4,1,1000"


def run_json(capsys, *argv):
    code = main([str(a) for a in argv] + ["--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if code == 0 else out


def test_ttl_commands_on_a_data_folder(tmp_path, capsys):
    data = tmp_path / "data"
    model = ["--model-name", "m", "--model-revision", "1", "--geometry", GEOMETRY]
    code, info = run_json(capsys, "sessions", "create", "--data", data, "--id", "chat", *model, "--ttl", "2h")
    assert code == 0 and info["ttl_s"] == 2 * HOUR and info["expires_at"] == pytest.approx(info["last_used"] + 2 * HOUR)
    code, info = run_json(capsys, "sessions", "ttl", "--data", data, "chat", "30m")
    assert code == 0 and info["ttl_s"] == 1800
    code, info = run_json(capsys, "sessions", "ttl", "--data", data, "chat", "none")
    assert code == 0 and info["ttl_s"] is None and info["expires_at"] is None
    code, found = run_json(capsys, "sessions", "owner-ttl", "--data", data, "default", "1d")
    assert code == 0 and found == {"owner": "default", "ttl_s": 86400.0, "sessions": 1}
    code, found = run_json(capsys, "sessions", "owner-ttl", "--data", data, "default")
    assert code == 0 and found == {"owner": "default", "ttl_s": 86400.0}
    code, swept = run_json(capsys, "sessions", "expire", "--data", data)
    assert code == 0 and swept == []
    with SessionStore(data) as store:  # a day and more passes for "chat"
        key = storage_key("chat", "default")
        with store.index.write() as txn:
            moved = store.index.get(txn, key)["last_used_ns"] - int(2 * 86400 * 1e9)
            store.index.update(txn, key, last_used_ns=moved, last_used=moved / 1e9)
    assert main(["sessions", "show", "--data", str(data), "chat"]) == 2  # expired: missing
    capsys.readouterr()
    code, swept = run_json(capsys, "sessions", "expire", "--data", data, "--limit", "1")
    assert code == 0 and [(e["session_id"], e["owner"]) for e in swept] == [("chat", "default")]
    assert not (data / "journals" / "chat~default.coli_kv").exists()
    for bad in (
        ["sessions", "ttl", "--data", data, "chat", "0"],
        ["sessions", "owner-ttl", "--data", data, "x", "soon"],
    ):
        assert main([str(a) for a in bad]) == 2
    capsys.readouterr()


def test_ttl_spellings():
    assert [parse_ttl(t) for t in ("90", "90s", "1.5m", "12h", "30d", "2w", "none", " NONE ")] == [
        90.0, 90.0, 90.0, 43200.0, 2592000.0, 1209600.0, None, None,
    ]  # fmt: skip
    for bad in ("", "-1", "1y", "h", "0", "1e3", "inf"):
        with pytest.raises(InvalidRequest):
            parse_ttl(bad)
