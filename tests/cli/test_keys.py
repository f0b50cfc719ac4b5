"""``kvstore keys create|list|revoke`` against a data folder, with a real server reading the same
folder; and ``kvstore serve``'s first key, printed only once the server listens."""

from __future__ import annotations

import json
import os
import re
import selectors
import socket
import stat
import subprocess
import sys
import time

import httpx
import pytest

from kvstore.cli import build_parser, main
from served import ServeProcess

KEY_LINE = re.compile(r"^\s+(kvs_\S+)$", re.MULTILINE)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def create(capsys, data, owner, *extra):
    code, out, err = run(capsys, "keys", "create", "--owner", owner, "--data", data, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def status(server, key):
    return httpx.get(server.url + "/sessions", headers={"Authorization": f"Bearer {key}"}, timeout=60).status_code


def clean_env():
    return {k: v for k, v in os.environ.items() if k != "KVSTORE_API_KEYS"}


def read_until(process, pattern: re.Pattern, timeout: float = 60.0) -> tuple[re.Match, str]:
    """Read a running child's stdout until ``pattern`` matches what it printed; (match, text so far)."""
    fd = process.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (found := pattern.search(seen.decode(errors="replace"))) is None:
            left = deadline - time.monotonic()
            assert left > 0, f"{pattern.pattern!r} not printed: {seen.decode(errors='replace')}"
            if selector.select(left):
                chunk = os.read(fd, 65536)
                assert chunk, f"the server exited: {seen.decode(errors='replace')}"
                seen += chunk
    return found, seen.decode()


# ---------------------------------------------------------------------------- create, list, revoke
def test_a_created_key_works_on_a_running_server_and_a_revoked_one_stops_at_the_next_request(tmp_path, capsys):
    data = tmp_path / "data"
    server = ServeProcess(data).start()  # no keys.json yet: the server makes the first one
    try:
        alice = create(capsys, data, "alice")
        bob = create(capsys, data, "bob", "--expires", "30d")
        assert status(server, alice["key"]) == status(server, bob["key"]) == 200  # no restart
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {alice['key']}"}) as client:
            made = client.post(
                "/sessions",
                json={
                    "id": "chat",
                    "model": {"name": "tiny-mla", "revision": "r1"},
                    "geometry": {"n_layers": 2, "kv_lora": 32, "qk_rope": 8, "index_hd": 4, "nic": 1, "vocab": 1000},
                },
            )
            assert made.status_code == 201 and made.json()["owner"] == "alice", made.text
        code, out, err = run(capsys, "keys", "revoke", alice["id"], "--data", data)
        assert code == 0 and f"Revoked API key {alice['id']} of owner 'alice'" in out, err
        assert status(server, alice["key"]) == 401  # the very next request
        assert status(server, bob["key"]) == 200
    finally:
        server.stop_cleanly()
    assert re.fullmatch(r"k_[0-9a-f]{12}", alice["id"]) and alice["key"].startswith(f"kvs_{alice['id']}_")
    assert alice["hint"] == alice["key"][-4:] and alice["expires"] is None and bob["expires"] is not None


def test_list_shows_every_field_but_never_a_key_a_digest_or_a_salt(tmp_path, capsys):
    data = tmp_path / "data"
    made = [create(capsys, data, owner) for owner in ("alice", "bob", "alice")]
    run(capsys, "keys", "revoke", made[2]["id"], "--data", data)
    stored = json.loads((data / "keys.json").read_text())["keys"]
    secrets = [m["key"] for m in made] + [e[name] for e in stored for name in ("salt", "hmac_sha256")]
    secrets += [m["key"][len(f"kvs_{m['id']}_") :] for m in made]  # the secret part alone

    code, text, _ = run(capsys, "keys", "list", "--data", data)
    assert code == 0 and len(text.splitlines()) == 4  # a header and one line each
    code, listed, _ = run(capsys, "keys", "list", "--data", data, "--json")
    assert code == 0
    for shown in (text, listed):
        assert not any(secret in shown for secret in secrets)
    records = json.loads(listed)
    assert [set(r) for r in records] == [{"id", "owner", "state", "created", "expires", "revoked", "hint"}] * 3
    assert [(r["id"], r["owner"], r["state"]) for r in records] == [
        (made[0]["id"], "alice", "active"),
        (made[1]["id"], "bob", "active"),
        (made[2]["id"], "alice", "revoked"),
    ]
    code, only_bob, _ = run(capsys, "keys", "list", "--data", data, "--owner", "bob", "--json")
    assert code == 0 and [r["id"] for r in json.loads(only_bob)] == [made[1]["id"]]
    code, none, _ = run(capsys, "keys", "list", "--data", tmp_path / "empty")
    assert code == 0 and "no API keys" in none and not (tmp_path / "empty").exists()


def test_the_file_holds_no_key_and_is_private(tmp_path, capsys):
    data = tmp_path / "data"
    made = create(capsys, data, "alice")
    path = data / "keys.json"
    assert made["key"] not in path.read_text() and made["key"].split("_", 3)[3] not in path.read_text()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
    assert [p.name for p in data.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_two_processes_creating_keys_at_once_lose_none(tmp_path):
    data = tmp_path / "data"
    script = (
        "import sys\n"
        "from kvstore.cli import main\n"
        "for _ in range(8):\n"
        "    assert main(['keys', 'create', '--owner', sys.argv[1], '--data', sys.argv[2], '--json']) == 0\n"
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", script, owner, str(data)], stdout=subprocess.PIPE, text=True)
        for owner in ("alice", "bob", "carol")
    ]
    printed = [writer.communicate(timeout=120)[0] for writer in writers]
    assert [writer.returncode for writer in writers] == [0, 0, 0]
    ids = [json.loads(block)["id"] for out in printed for block in re.findall(r"\{.*?\n\}", out, re.DOTALL)]
    stored = [e["id"] for e in json.loads((data / "keys.json").read_text())["keys"]]
    assert len(ids) == 24 and sorted(stored) == sorted(ids)


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["keys", "revoke", "k_000000000000"], "no API key has id 'k_000000000000'"),
        (["keys", "revoke", "alice"], "no API key has id 'alice'"),
        (["keys", "create", "--owner", "al ice"], "invalid owner 'al ice'"),
        (["keys", "create", "--owner", ""], "invalid owner ''"),
        (["keys", "list", "--owner", "../x"], "invalid owner '../x'"),
        (["keys", "create", "--owner", "alice", "--expires", "soon"], "--expires 'soon': give a span (12h, 30d, 2w)"),
        (["keys", "create", "--owner", "alice", "--expires", "0d"], "a key must live longer than 0 days"),
        (["keys", "create", "--owner", "alice", "--expires", "2001-01-01"], "is not in the future"),
        (["keys", "create"], "keys create: the following arguments are required: --owner"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, reason):
    data = tmp_path / "data"
    create(capsys, data, "alice")
    before = (data / "keys.json").read_bytes()
    code, out, err = run(capsys, *argv, "--data", data)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith("kvstore: error: "), err
    assert reason in err
    assert (data / "keys.json").read_bytes() == before


def test_a_broken_keys_file_is_named_not_rewritten(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "keys.json").write_text("{ half written")
    code, _, err = run(capsys, "keys", "create", "--owner", "alice", "--data", data)
    assert code == 2 and "keys.json is not readable JSON" in err
    assert (data / "keys.json").read_text() == "{ half written"


def test_every_keys_option_has_a_help_line():
    parser = build_parser()
    keys = next(a for a in parser._actions if hasattr(a, "choices") and a.choices and "keys" in a.choices)
    commands = next(a for a in keys.choices["keys"]._actions if hasattr(a, "choices") and a.choices)
    assert set(commands.choices) == {"create", "list", "revoke"}
    for name, command in commands.choices.items():
        for action in command._actions:
            assert action.help and action.help.strip(), (name, action.dest)


# ---------------------------------------------------------------------------- serve's first key
def test_serve_prints_the_first_key_once_it_listens_and_the_key_works(tmp_path):
    data = tmp_path / "fresh"
    server = ServeProcess(data, log_level="info").start()
    try:
        found, before = read_until(server.process, KEY_LINE)
        key = found[1]
        assert "Application startup complete" in before[: found.start()]  # printed after uvicorn started
        assert "API key for owner 'default'" in before and status(server, key) == 200
    finally:
        server.stop_cleanly()
    printed = KEY_LINE.findall(before + server.output)
    assert printed == [key] and key not in (data / "keys.json").read_text()
    assert f"kvstore: serving {server.url} with the data folder {data} (Ctrl-C stops it)" in before
    again = ServeProcess(data).start()
    try:
        assert status(again, key) == 200
    finally:
        again.stop_cleanly()
    assert "kvs_" not in again.output
    # a later start says where the keys are and how whoever lost theirs gets another
    assert (
        f"kvstore: API keys: 1 key in {data}/keys.json (each shown once, when made; lost one? "
        f"`kvstore keys create --owner NAME --data {data}` makes another)"
    ) in again.output.splitlines()


def test_serve_with_keys_in_the_environment_makes_no_keys_file_and_prints_no_key(tmp_path):
    data = tmp_path / "data"
    key = "demo-key-0123456789abcdef"
    server = ServeProcess(data, env={"KVSTORE_API_KEYS": f"{key}:alice"}, log_level="info").start()
    try:
        found, before = read_until(server.process, re.compile(r"^kvstore: API keys: .*$", re.MULTILINE))
        assert found.group(0) == "kvstore: API keys: 1 key from KVSTORE_API_KEYS"
        assert status(server, key) == 200
    finally:
        server.stop_cleanly()
    assert not (data / "keys.json").exists()
    assert "kvs_" not in before + server.output and "default" not in before + server.output
    # a keys.json made later (kvstore keys create) is read beside the variable's keys, and counted
    made = subprocess.run(
        [sys.executable, "-m", "kvstore", "keys", "create", "--owner", "bob", "--data", str(data), "--json"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    again = ServeProcess(data, env={"KVSTORE_API_KEYS": f"{key}:alice"}).start()
    try:
        assert status(again, key) == 200 and status(again, json.loads(made.stdout)["key"]) == 200
    finally:
        again.stop_cleanly()
    assert f"kvstore: API keys: 1 key from KVSTORE_API_KEYS and 1 key in {data}/keys.json" in again.output


def test_serve_on_a_taken_port_exits_2_and_makes_no_key(tmp_path):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    data = tmp_path / "data"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "serve", "--data", str(data), "--port", str(port)],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=120,
        )
    finally:
        taken.close()
    assert done.returncode == 2, done.stderr
    # bound before anything else: one line naming the address and what to do, nothing written
    assert done.stdout == "" and done.stderr == (
        f"kvstore: error: cannot listen on 127.0.0.1:{port}: the port is in use (another `kvstore serve`, such "
        f"as `make run`, may hold it); stop that one, or give another port with --port\n"
    )
    assert not data.exists()
