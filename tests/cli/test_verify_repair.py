"""``kvstore verify --repair`` (and ``kvstore sessions verify --repair``): reconcile a data folder on
demand and say what was done; stale sidecars are cleaned, never reported as damage."""

from __future__ import annotations

import json
import os

from kvstore.cli import main
from kvstore.store import SessionStore
from store.support import Rows, new_session


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def a_store_with_stale_sidecars(data) -> tuple[str, str]:
    """``chat`` (two turns) beside the lock files of a session that is gone; a linked journal lock."""
    with SessionStore(data) as store:
        new_session(store)
        rows = Rows(11)
        store.append("chat", *rows.make(4))
        store.append("chat", *rows.make(3))
        key = store.journal_path("chat").name[: -len(".coli_kv")]
    ghost = key.replace("chat", "gone", 1)
    (data / "locks" / f"{ghost}.write").write_bytes(b"")
    (data / "journals" / f"{ghost}.coli_kv.lock").write_bytes(b"")
    sidecar = data / "journals" / f"{key}.coli_kv.lock"
    if os.path.lexists(sidecar):
        os.unlink(sidecar)
    os.symlink(data.parent / "outside.lock", sidecar)
    return key, ghost


def test_verify_repair_cleans_the_folder_and_says_what_it_did(tmp_path, capsys):
    data = tmp_path / "data"
    key, ghost = a_store_with_stale_sidecars(data)
    code, out, err = run(capsys, "verify", "--repair", "--data", data)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert all(line.startswith("repaired: ") for line in lines) and len(lines) == 3, out
    assert any(f"lock files of {ghost!r}" in line for line in lines)
    assert any(f"journals/{ghost}.coli_kv.lock" in line for line in lines)
    assert any(f"journals/{key}.coli_kv.lock: a symbolic link" in line for line in lines)
    assert not os.path.lexists(tmp_path / "outside.lock")
    assert run(capsys, "verify", "--repair", "--data", data)[:2] == (0, "nothing to repair\n")


def test_sessions_verify_repair_then_verifies_the_session(tmp_path, capsys):
    data = tmp_path / "data"
    key, ghost = a_store_with_stale_sidecars(data)
    code, out, _ = run(capsys, "sessions", "verify", "chat", "--repair", "--data", data, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["n_records"] == 7
    assert len(report["repaired"]) == 3
    code, out, _ = run(capsys, "sessions", "verify", "chat", "--data", data)
    assert (code, out) == (0, "chat: ok (2 turns, 7 records)\n")


def test_verify_without_an_id_needs_repair(tmp_path, capsys):
    code, out, err = run(capsys, "verify", "--data", tmp_path / "data")
    assert code == 2 and out == ""
    assert "give the id of the session to verify, or --repair" in err
