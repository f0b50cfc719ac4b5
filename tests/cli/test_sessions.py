"""``kvstore sessions ...`` and ``kvstore verify`` on a data folder, through the main CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvstore.store
from kvstore import tiers
from kvstore.cli import build_parser, main
from kvstore.errors import InvalidRequest, SessionNotFound
from kvstore.formats import coli_kv


def run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().out


def run_json(capsys, *argv):
    code, out = run(capsys, *argv, "--json")
    assert code == 0, out
    return json.loads(out)


def test_commands_register_on_the_main_parser(tmp_path):
    parser = build_parser()
    args = parser.parse_args(["sessions", "verify", "chat", "--data", "d"])
    assert args.func.__name__ == "cmd_verify" and args.id == "chat"
    top = parser.parse_args(["verify", "chat"])  # the same check at the top level
    assert top.func is args.func and (top.data, top.owner) == ("./data", None)
    args = parser.parse_args(["serve", "--port", "9000"])
    assert (args.host, args.port, args.data) == ("127.0.0.1", 9000, "./data")
    show = parser.parse_args(["sessions", "show", "nope", "--data", str(tmp_path / "d")])
    with pytest.raises(InvalidRequest, match="no session store there"):  # bad input raises; main() maps it to exit 2
        show.func(show)
    kvstore.store.open(tmp_path / "d").close()
    with pytest.raises(SessionNotFound):
        show.func(show)


def test_a_conversation_through_the_cli(tmp_path, capsys, geometry, make_rows):
    data = tmp_path / "data"
    source = tmp_path / "turn.coli_kv"
    first = make_rows(70, seed=1)
    coli_kv.write(source, first[0], first[1], first[2], first[3], vocab=geometry.vocab, version=2)
    created = run_json(
        capsys,
        "sessions",
        "create",
        "--data",
        data,
        "--id",
        "chat",
        "--owner",
        "alice",
        "--model-name",
        "m",
        "--model-revision",
        "r",
        "--like",
        source,
        "--tag",
        "demo",
    )
    assert created["geometry"]["n_layers"] == 2 and created["tier"]["version"] == 2 and created["tags"] == ["demo"]
    appended = run_json(capsys, "sessions", "append", "chat", source, "--data", data)
    assert appended["appended"] == 70 and appended["turn"] == [0, 70]
    npz = tmp_path / "more.npz"
    more = make_rows(6, seed=2)
    np.savez(npz, tokens=more[0], L=more[1], R=more[2], I=more[3])
    assert (
        run_json(capsys, "sessions", "append", "chat", npz, "--data", data, "--partial")["session"]["watermark"] == 70
    )
    out = tmp_path / "resumed.coli_kv"
    report = run_json(capsys, "sessions", "resume", "chat", out, "--data", data, "--verify")
    assert report["reused_tokens"] == 70 and coli_kv.load(out).record_bytes() == coli_kv.load(source).record_bytes()
    exported = tmp_path / "resumed.npz"
    run_json(capsys, "sessions", "resume", "chat", exported, "--data", data)
    with np.load(exported) as arrays:
        assert arrays["L"].shape == (2, 70, 32) and arrays["tokens"].tolist() == first[0].tolist()
    listed = run_json(capsys, "sessions", "list", "--data", data, "--owner", "alice")
    assert [s["id"] for s in listed] == ["chat"]
    assert run_json(capsys, "sessions", "list", "--data", data, "--owner", "bob") == []
    hit = run_json(
        capsys,
        "sessions",
        "lookup",
        "--data",
        data,
        "--like-session",
        "chat",
        "--tokens",
        ",".join(map(str, first[0][:66])),
    )
    assert hit["match"] == {
        "session_id": "chat",
        "matched_tokens": 66,
        "state": "active",
        "n_records": 76,
        "watermark": 70,
    }
    fork = run_json(capsys, "sessions", "fork", "chat", "--data", data, "--at", "64", "--new-id", "branch")
    assert fork["parent"] == "chat" and fork["n_records"] == 64
    assert run_json(capsys, "sessions", "truncate", "chat", "70", "--data", data)["n_records"] == 70
    assert run_json(capsys, "sessions", "park", "chat", "--data", data)["state"] == "parked"
    assert run_json(capsys, "sessions", "verify", "chat", "--data", data)["ok"] is True
    assert run_json(capsys, "sessions", "unpark", "chat", "--data", data)["state"] == "active"
    assert run_json(capsys, "sessions", "show", "chat", "--data", data, "--turns")["turns"] == 1
    assert run_json(capsys, "sessions", "migrate", "chat", "--data", data, "--tier", "int4")["tier"]["version"] == 3
    assert run_json(capsys, "sessions", "inspect", "chat", "--data", data)["header"]["version"] == 3
    assert run_json(capsys, "sessions", "repair", "chat", "--data", data, "--dry-run")["actions"] == []
    code, text = run(capsys, "sessions", "delete", "branch", "--data", data)
    assert code == 0 and "deleted branch" in text


def test_verify_exits_1_on_damage_and_bad_input_exits_2(tmp_path, capsys, geometry, make_rows):
    data = tmp_path / "data"
    raw = tmp_path / "rows.bin"
    raw.write_bytes(coli_kv.encode_records(geometry, tiers.FP8, *make_rows(4, seed=2)).tobytes())
    run_json(
        capsys,
        "sessions",
        "create",
        "--data",
        data,
        "--id",
        "chat",
        "--model-name",
        "m",
        "--model-revision",
        "r",
        "--geometry",
        "2,32,8,4,1,1000",
        "--tier",
        "fp8",
    )
    run_json(capsys, "sessions", "append", "chat", raw, "--data", data)
    journal = data / "journals" / "chat~default.coli_kv"  # <id>~<owner>
    blob = bytearray(journal.read_bytes())
    blob[coli_kv.HEADER_BYTES + 9] ^= 1
    journal.write_bytes(bytes(blob))
    code, out = run(capsys, "sessions", "verify", "chat", "--data", data)
    assert code == 1 and "turn 0 (records 0..4) does not match its hash" in out
    assert main(["sessions", "show", "missing", "--data", str(data)]) == 2
    assert "no session 'missing'" in capsys.readouterr().err
    assert (
        main(
            [
                "sessions",
                "create",
                "--data",
                str(data),
                "--model-name",
                "m",
                "--model-revision",
                "r",
                "--geometry",
                "1,2",
            ]
        )
        == 2
    )
    assert main(["sessions", "append", "chat", str(tmp_path / "absent.bin"), "--data", str(data)]) == 2
    assert main(["sessions", "migrate", "chat", "--data", str(data)]) == 2
    half = tmp_path / "half.bin"
    half.write_bytes(raw.read_bytes()[:-1])
    assert main(["sessions", "append", "chat", str(half), "--data", str(data)]) == 2


def test_append_refuses_a_damaged_file_unless_allowed_and_then_appends_its_rows_sanitized(tmp_path, vectors, capsys):
    # Issue 15, item 13 for `sessions append`: a damaged .coli_kv is refused (exit 1, the damage
    # named, the session unchanged); --allow-damaged appends its whole records as repair would.
    data = tmp_path / "data"
    source = tmp_path / "rows.coli_kv"
    blob = bytearray((vectors / "small.v2.coli_kv").read_bytes())
    header = coli_kv.parse_header(bytes(blob[:40]))
    records = np.frombuffer(blob, coli_kv.record_dtype(header.geometry, header.tier), 7, 40)
    records["layers"]["Ls"][2, 1] = np.nan
    source.write_bytes(bytes(blob))
    create = ["sessions", "create", "--id", "s", "--like", source, "--model-name", "m", "--model-revision", "r"]
    assert run(capsys, *create, "--data", data)[0] == 0
    assert main(["sessions", "append", "s", str(source), "--data", str(data)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvstore: error: {source}: damaged, append refused: record 2 ")
    assert run_json(capsys, "sessions", "show", "s", "--data", data)["n_records"] == 0
    assert main(["sessions", "append", "s", str(source), "--data", str(data), "--allow-damaged"]) == 0
    assert capsys.readouterr().err.startswith(f"kvstore: warning: {source} is damaged (record 2 ")
    out = tmp_path / "back.coli_kv"
    assert run(capsys, "sessions", "resume", "s", out, "--data", data)[0] == 0
    stored = coli_kv.load(out)
    assert stored.n == 7 and not stored.problems.damaged  # the bad row went in inert, as repair writes it


def test_ids_are_per_owner_on_the_command_line(tmp_path, capsys, geometry, make_rows):
    # Two owners may both have "chat". Without --owner a command takes the one session of an id and
    # refuses (exit 2, naming the owners) an id several owners have; --owner picks that owner's.
    data = tmp_path / "data"
    chunks = {"alice": make_rows(70, seed=1), "bob": make_rows(66, seed=2)}
    for owner, rows in chunks.items():
        source = tmp_path / f"{owner}.coli_kv"
        coli_kv.write(source, *rows, vocab=geometry.vocab, version=2)
        create = ["sessions", "create", "--data", data, "--id", "chat", "--owner", owner, "--like", source]
        assert run_json(capsys, *create, "--model-name", "m", "--model-revision", "r")["owner"] == owner
        run_json(capsys, "sessions", "append", "chat", source, "--data", data, "--owner", owner)
    for command in (["show", "chat"], ["truncate", "chat", "1"], ["delete", "chat"], ["park", "chat"]):
        code = main(["sessions", *command, "--data", str(data)])
        assert code == 2 and "2 owners have a session 'chat' (alice, bob); name the owner (--owner)" in (
            capsys.readouterr().err
        ), command
    shown = {o: run_json(capsys, "sessions", "show", "chat", "--data", data, "--owner", o) for o in chunks}
    assert {o: (s["owner"], s["n_records"]) for o, s in shown.items()} == {"alice": ("alice", 70), "bob": ("bob", 66)}
    alices = ",".join(map(str, chunks["alice"][0][:66]))
    lookup = ["sessions", "lookup", "--data", data, "--like-session", "chat", "--tokens", alices]
    assert run_json(capsys, *lookup, "--owner", "alice")["match"]["matched_tokens"] == 66
    assert run_json(capsys, *lookup, "--owner", "bob")["match"] is None  # bob's "chat" holds other tokens
    fork = run_json(capsys, "sessions", "fork", "chat", "--data", data, "--owner", "bob", "--new-id", "branch")
    assert (fork["owner"], fork["parent"], fork["n_records"]) == ("bob", "chat", 66)
    assert run_json(capsys, "sessions", "park", "chat", "--data", data, "--owner", "bob")["state"] == "parked"
    out = tmp_path / "bob.npz"
    run_json(capsys, "sessions", "resume", "chat", out, "--data", data, "--owner", "bob")  # unparks bob's
    with np.load(out) as arrays:
        assert arrays["tokens"].tolist() == chunks["bob"][0].tolist()
    assert main(["sessions", "delete", "chat", "--data", str(data), "--owner", "bob"]) == 0
    capsys.readouterr()
    # one "chat" is left: commands without --owner reach it again
    assert run_json(capsys, "sessions", "show", "chat", "--data", data)["owner"] == "alice"
    assert run_json(capsys, "sessions", "verify", "chat", "--data", data)["ok"] is True
    listed = run_json(capsys, "sessions", "list", "--data", data)
    assert sorted((s["id"], s["owner"]) for s in listed) == [("branch", "bob"), ("chat", "alice")]
