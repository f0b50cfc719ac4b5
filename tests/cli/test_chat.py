"""``kvstore chat`` and ``kvstore verify`` as a user runs them: one process per turn, no server.

Each turn is a new process, so every turn after the first restores the session from its journal
and must prefill only its own tokens — the summary on stderr and ``--json`` say so. ``kvstore
verify`` names the first bad turn after a bit flip (exit 1), and ``chat --verify`` does not serve
it. ``python -m kvstore`` is the ``kvstore`` command.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from kvstore.formats.coli_kv import HEADER_BYTES


def kvstore(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], cwd=cwd, capture_output=True, text=True, timeout=180
    )


def test_chat_turns_in_new_processes_prefill_only_the_new_tokens_and_verify_finds_a_flip(tmp_path, model_dir):
    common = ("--session", "chat-1", "--data", "data", "--tier", "fp8", "--max-new-tokens", "6", "--stop")
    first = kvstore("chat", str(model_dir), "--prompt", "Hello", *common, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "[created session chat-1 for tiny (fp8 (v2, e4m3 codes + f32 scale))]" in first.stderr
    summary = re.search(
        r"\[chat-1: 6 tokens \(length\); prefilled (\d+), reused (\d+) \((\w+)\); (\d+) records", first.stderr
    )
    assert summary and summary.groups() == ("5", "0", "new", "11"), first.stderr

    second = kvstore("chat", str(model_dir), "--ids", "40 41 42", *common, "--json", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    report = json.loads(second.stdout)
    assert (report["source"], report["reused_tokens"], report["prefilled_tokens"], report["restored_tokens"]) == (
        "journal",
        11,
        3,
        11,
    )
    assert report["session"]["n_records"] == 11 + 3 + 6

    journal = tmp_path / "data" / "journals" / "chat-1~default.coli_kv"  # <id>~<owner>
    offset = HEADER_BYTES + 13 * report["session"]["record_bytes"] + 4 + 3  # inside turn 1 (records 11..19)
    with open(journal, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    bad = kvstore("verify", "chat-1", "--data", "data", "--json", cwd=tmp_path)
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["first_bad"] == {"turn": 1, "start": 11, "end": 20}

    third = kvstore("chat", str(model_dir), "--ids", "50", *common, "--verify", cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    assert re.search(
        r"prefilled 1, reused 11 \(journal\); 18 records, fp8 \(v2, e4m3 codes \+ f32 scale\); damage from record 11 was not served; dropped 9 unserved records\]",
        third.stderr,
    ), third.stderr
    healed = kvstore("verify", "chat-1", "--data", "data", cwd=tmp_path)
    assert healed.returncode == 0 and "chat-1: ok (2 turns, 18 records)" in healed.stdout


def _traces(data, session_id: str) -> list[str]:
    """Every file or folder under the data folder whose name mentions the session id."""
    return sorted(str(p.relative_to(data)) for p in data.rglob("*") if session_id in p.name)


def test_a_refused_turn_creates_nothing(tmp_path, model_dir, capsys):
    # Issue 15, item 15: an empty prompt (text, ids, or ids out of the vocabulary) with the default
    # create is refused before the session exists: no session, no journal, no lock file.
    from kvstore.cli import main

    data = tmp_path / "data"
    base = ["chat", str(model_dir), "--session", "ghost", "--data", str(data), "--max-new-tokens", "2"]
    for turn in (["--prompt", ""], ["--ids", ""], ["--ids", "99999"]):
        assert main([*base, *turn]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvstore: error: "), lines
        assert _traces(data, "ghost") == [], turn
        assert main(["sessions", "list", "--data", str(data), "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == []
    assert "the new turn is empty" in kvstore("chat", *base[1:], "--prompt", "", cwd=tmp_path).stderr
    # the same session is created by the first turn that runs
    assert main([*base, "--prompt", "Hi"]) == 0
    assert "[created session ghost" in capsys.readouterr().err
    assert any(name.startswith("journals/") and name.endswith(".coli_kv") for name in _traces(data, "ghost"))


def test_a_turn_that_would_create_a_taken_id_says_the_session_was_already_there(tmp_path, model_dir, capsys):
    # Issue 19: an id an earlier walkthrough used for another model; the mismatch must not read as
    # if the new conversation's own session were wrong.
    from kvstore.cli import main

    data = str(tmp_path / "data")
    created = ["sessions", "create", "--data", data, "--id", "chat-1", "--model-name", "tiny-mla"]
    assert main([*created, "--model-revision", "r1", "--geometry", "2,64,16,0,0,1000", "--tier", "fp8"]) == 0
    capsys.readouterr()
    assert main(["chat", str(model_dir), "--session", "chat-1", "--data", data, "--prompt", "Hi"]) == 2
    reason = capsys.readouterr().err
    assert "model.name: session 'tiny-mla'" in reason  # the mismatch itself, as before
    assert "session 'chat-1' was already there (0 records, model 'tiny-mla'), not created by this turn" in reason
    assert "or start this conversation under a new id" in reason
    # without create, a session of another model is the plain mismatch
    assert main(["chat", str(model_dir), "--session", "chat-1", "--data", data, "--prompt", "Hi", "--no-create"]) == 2
    assert "already there" not in capsys.readouterr().err
