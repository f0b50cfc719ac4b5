"""Progress bars of the long commands, seen through a real terminal (a pty) and through pipes.

On a terminal's stderr each command draws a tqdm bar (percentage, bytes/s, ETA); piped, or with
``--json``, nothing is drawn and stdout is the same bytes either way. Jobs of the API report their
progress as a fraction and bytes (a real server, a real job).
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.store import SessionStore
from served import ServeProcess, wait_job

N_RECORDS = 20_000  # 6.8 MB of f32 records: long enough for a bar to draw its size and rate
MODEL = {"name": "tiny-mla", "revision": "r1"}
KEY = "progress-key-0123456789abcdef"
# a bar: "<label>:  40%|####      | 2.60M/6.49M [00:00<00:00, 31.2MB/s]"
BAR = re.compile(rb"(\d+%\|[^|]*\| *[\d.]+[kMG]?/[\d.]+[kMG]? \[[\d:]+<[\d:?]+, *[\d.?]+[kMG]?B/s\])")


def run(argv: list[str], cwd: Path, *, tty: bool) -> tuple[int, bytes, bytes]:
    """``python -m kvstore.cli ARGV``: stdout through a pipe; stderr on a pty (``tty``) or a pipe."""
    command = [sys.executable, "-m", "kvstore.cli", *argv]
    if not tty:
        done = subprocess.run(command, cwd=cwd, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
        return done.returncode, done.stdout, done.stderr
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    out_path = cwd / f".stdout-{os.getpid()}"
    with open(out_path, "wb") as out:
        child = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=slave, stdin=subprocess.DEVNULL)
    seen = bytearray()
    try:
        # The slave stays open here until the child is gone and everything it drew is read: once
        # no process holds it, Linux may answer EIO to a read of the master before its buffer is drained.
        deadline = time.monotonic() + 300
        while True:
            if select.select([master], [], [], 0.2)[0]:
                seen += os.read(master, 65536)
            elif child.poll() is not None:
                break
            elif time.monotonic() > deadline:
                child.kill()
                raise AssertionError(f"{argv} did not finish in 300 s")
    finally:
        os.close(slave)
        os.close(master)
        code = child.wait(timeout=300)
    stdout = out_path.read_bytes()
    out_path.unlink()
    return code, stdout, bytes(seen)


def _rows(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, n).astype(np.int32)
    L = rng.standard_normal((2, n, 32)).astype(np.float32)
    R = rng.standard_normal((2, n, 8)).astype(np.float32)
    index = rng.standard_normal((1, n, 4)).astype(np.float32)
    return tokens, L, R, index


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A big f32 file, a copy of it with a torn tail (something to repair), and a data folder with
    one big session ``big`` of owner ``default``."""
    folder = tmp_path_factory.mktemp("progress")
    tokens, L, R, index = _rows(N_RECORDS)
    coli_kv.write(folder / "big.coli_kv", tokens, L, R, index, vocab=1000, version=1)
    (folder / "torn.orig").write_bytes((folder / "big.coli_kv").read_bytes() + b"\x01" * 100)
    with SessionStore(folder / "data") as store:
        header = coli_kv.read_header(folder / "big.coli_kv")[0]
        store.create("default", header.geometry, tiers.FP8, MODEL, session_id="big")
        for start in range(0, N_RECORDS, 5000):
            part = slice(start, start + 5000)
            store.append("big", tokens[part], L[:, part], R[:, part], index[:, part], owner="default")
    return folder


def _commands(workdir: Path) -> dict[str, list[str]]:
    data = ["--data", str(workdir / "data")]
    return {
        "migrate": ["migrate", "big.coli_kv", "out-int4.coli_kv", "--tier", "int4", "--force"],
        "export": ["export", "big.coli_kv", "out.npz", "--force"],
        "repair": ["repair", "torn.coli_kv", "--no-backup"],  # a fresh torn copy each run
        "verify": ["verify", "big", *data],
        "sessions repair": ["sessions", "repair", "big", "--dry-run", *data],
        "sessions migrate": ["sessions", "migrate", "big", "--tier", "int4", *data],  # fp8 -> int4 once
    }


# the volatile fields of a report (durations): masked before comparing two runs
_TIMES = re.compile(rb'^(seconds|mb_per_s) .*$|"(seconds|mb_per_s)": [^,\n]*', re.MULTILINE)


@pytest.mark.parametrize("name", ["migrate", "export", "repair", "verify", "sessions repair", "sessions migrate"])
def test_a_terminal_gets_a_bar_and_pipes_get_the_same_bytes_without_one(workdir, name):
    argv = _commands(workdir)[name]
    label = name.split()[-1].encode()
    torn = (workdir / "torn.orig").read_bytes()
    (workdir / "torn.coli_kv").write_bytes(torn)
    code, stdout_tty, stderr_tty = run(argv, workdir, tty=True)
    assert code == 0, (stdout_tty, stderr_tty)
    assert re.search(label + rb":\s*\d+%\|", stderr_tty), stderr_tty  # the label, then a percentage
    assert BAR.search(stderr_tty), stderr_tty  # size, bytes/s and the ETA

    (workdir / "torn.coli_kv").write_bytes(torn)
    code, stdout_pipe, stderr_pipe = run(argv, workdir, tty=False)
    assert code == 0
    assert _TIMES.sub(b"", stdout_pipe) == _TIMES.sub(b"", stdout_tty)  # the answer is the same bytes
    assert b"\r" not in stderr_pipe and b"%|" not in stderr_pipe and b"B/s" not in stderr_pipe
    if name == "migrate":  # what migrate always says about the conversion, and nothing more
        assert all(line.startswith("note: ") for line in stderr_pipe.decode().splitlines()), stderr_pipe
    else:
        assert stderr_pipe == b""


@pytest.mark.parametrize("name", ["migrate", "verify", "sessions repair"])
def test_json_on_a_terminal_draws_nothing(workdir, name):
    argv = [*_commands(workdir)[name], "--json"]
    code, stdout_tty, stderr_tty = run(argv, workdir, tty=True)
    assert code == 0 and stderr_tty == b"", stderr_tty
    code, stdout_pipe, stderr_pipe = run(argv, workdir, tty=False)
    assert code == 0 and stderr_pipe == b""
    assert _TIMES.sub(b"", stdout_pipe) == _TIMES.sub(b"", stdout_tty)


def test_a_command_that_fails_or_does_no_work_draws_nothing(workdir):
    for argv in (["migrate", "missing.coli_kv", "x.coli_kv", "--tier", "int4"], ["repair", "torn.orig", "--dry-run"]):
        code, stdout, stderr = run(argv, workdir, tty=True)
        piped = run(argv, workdir, tty=False)
        assert code == piped[0] and stdout == piped[1]
        assert stderr.replace(b"\r\n", b"\n") == piped[2]  # a terminal turns \n into \r\n; nothing else differs
    assert code == 0 and b"would: " in stdout and stderr == b""  # a dry run writes nothing: no bar


def test_jobs_report_a_fraction_and_bytes(tmp_path):
    """Park, unpark and migrate as jobs of a real server: bytes and fraction in GET /jobs/{id}."""
    data = tmp_path / "data"
    tokens, L, R, index = _rows(3000, seed=1)
    with SessionStore(data) as store:
        header = coli_kv.Header(coli_kv.Geometry(2, 32, 8, 4, 1, 1000), tiers.F32, 0)
        store.create("alice", header.geometry, tiers.F32, MODEL, session_id="chat")
        store.append("chat", tokens, L, R, index, owner="alice")
        record_bytes = store.get("chat", owner="alice").record_bytes
    server = ServeProcess(data, env={"KVSTORE_API_KEYS": f"{KEY}:alice"}).start()
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as alice:
            journal_bytes = HEADER_BYTES + 3000 * record_bytes
            for path, body, total in (
                ("/sessions/chat/park", None, journal_bytes),
                ("/sessions/chat/unpark", None, journal_bytes),
                ("/sessions/chat/file/migrate", {"tier": "int4"}, 3000 * record_bytes),
            ):
                started = alice.post(path, json=body) if body is not None else alice.post(path)
                assert started.status_code == 202, started.text
                job = started.json()
                assert 0 <= job["fraction"] <= 1 and 0 <= job["bytes_done"] <= job["bytes_total"], job
                finished = wait_job(alice, job, expect="done")
                assert finished["fraction"] == 1.0, finished
                assert finished["bytes_done"] == finished["bytes_total"] == total, (path, finished)
            listed = alice.get("/jobs").json()
            assert [job["fraction"] for job in listed] == [1.0, 1.0, 1.0]
            schema = alice.get("/openapi.json").json()["components"]["schemas"]["JobOut"]
            assert {"fraction", "bytes_done", "bytes_total"} <= set(schema["required"])
    finally:
        server.stop_cleanly()
