"""``kvstore sessions …`` on a shared store (``--index``, ``--blobs``, or their environment
variables): the commands an operator runs on a data folder, run as processes against a real
PostgreSQL and a real S3 server, with the same answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvstore.formats import coli_kv
from shared.rows import GEOMETRY, TIER, rec_bytes, records


def kvstore(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_session_commands_on_a_shared_store(tmp_path, child_env):
    flags = ["--index", child_env["KVSTORE_INDEX_URL"], "--blobs", child_env["KVSTORE_BLOBS_URL"]]
    env = {k: v for k, v in child_env.items() if k not in ("KVSTORE_INDEX_URL", "KVSTORE_BLOBS_URL")}

    def ok(*args: str, flagged: bool = True) -> dict:
        done = kvstore("sessions", *args, *(flags if flagged else []), "--json", env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    words = ",".join(str(w) for w in GEOMETRY.words())
    ok("create", "--owner", "alice", "--id", "chat", "--model-name", "m", "--model-revision", "1",
       "--geometry", words, "--tier", TIER.name)  # fmt: skip
    rows = tmp_path / "rows.bin"
    rows.write_bytes(records(1, 0, 6) + records(1, 1, 4))
    appended = ok("append", "chat", str(rows))
    assert appended["appended"] == 10 and appended["session"]["n_records"] == 10
    assert [s["id"] for s in ok("list")] == ["chat"]
    assert ok("park", "chat")["state"] == "parked"
    assert ok("verify", "chat")["ok"]
    out = tmp_path / "out.coli_kv"
    assert ok("resume", "chat", str(out))["reused_tokens"] == 10
    assert out.read_bytes()[coli_kv.HEADER_BYTES :] == rows.read_bytes()
    migrated = ok("migrate", "chat", "--tier", "int4")
    assert migrated["tier"]["name"] == "int4" and migrated["n_records"] == 10
    assert ok("repair", "chat", "--dry-run")["actions"] == []
    # the environment names the store as well as the flags do
    shown = kvstore("sessions", "show", "chat", "--json", env=child_env, cwd=tmp_path)
    assert shown.returncode == 0 and json.loads(shown.stdout)["tier"]["name"] == "int4", shown.stderr
    tokens = np.frombuffer(out.read_bytes()[coli_kv.HEADER_BYTES :], coli_kv.record_dtype(GEOMETRY, TIER))["token"]
    found = ok("lookup", "--like-session", "chat", "--tokens", ",".join(map(str, tokens)))
    assert found["match"] is None  # ten tokens: less than one 64-token block
    refused = kvstore("sessions", "show", "nothing", *flags, env=env, cwd=tmp_path)
    assert refused.returncode == 2 and "nothing" in refused.stderr
    assert not (tmp_path / "data").exists()  # no local folder was made for the shared store
    assert os.path.getsize(out) == coli_kv.HEADER_BYTES + 10 * rec_bytes()
