"""``kvstore store push | pull`` on a real PostgreSQL cluster and a real S3 server: byte-identical
round trips (``kvstore verify`` and the journal bytes), metadata kept, idempotence, incremental
copies, refusals (conflicts, damage, a held lease) with nothing changed."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import psycopg
import pytest

from kvstore.cli import main
from kvstore.store import SessionStore
from kvstore.store.archive import stream_archive
from kvstore.store.shared import BlobStore, SharedIndex, SharedStore
from shared.rows import GEOMETRY, TIER, records

MODEL = {"name": "tiny-mla", "revision": "r1", "weights_hash": "w0"}
BAR = re.compile(rb"push: +\d+%\|")  # tqdm's "push:  40%|####  | 2.6M/6.5M [...]"


@pytest.fixture
def env(monkeypatch, index_url, blobs_url, s3_server, aws_env):
    """The shared store as an operator names it: environment variables only."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("KVSTORE_INDEX_URL", index_url)
    monkeypatch.setenv("KVSTORE_BLOBS_URL", blobs_url)
    return {"index": index_url, "blobs": blobs_url}


@pytest.fixture
def shared(env):
    with SharedStore(SharedIndex(env["index"]), BlobStore(env["blobs"])) as opened:
        yield opened


def run(capsys, *argv: str) -> tuple[int, dict | str]:
    code = main([*argv])
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in argv else out


def build_store(folder: Path) -> SessionStore:
    """Sessions of every shape push and pull must carry: two owners, several turns (one left
    incomplete), a fork, a parked session, an empty one, tags."""
    store = SessionStore(folder)
    store.create("alice", GEOMETRY, TIER, MODEL, session_id="chat-1", tags=["team:a", "prod"])
    store.append_records("chat-1", records(0, 0, 5), owner="alice")
    store.append_records("chat-1", records(0, 1, 3), owner="alice", complete_turn=False)
    store.append_records("chat-1", records(0, 2, 4), owner="alice")
    store.append_records("chat-1", records(0, 3, 2), owner="alice", complete_turn=False)
    store.fork("chat-1", at=8, new_id="chat-1b", owner="alice")
    store.append_records("chat-1b", records(1, 0, 6), owner="alice")
    store.create("bob", GEOMETRY, TIER, MODEL, session_id="chat-1")  # same id, another owner
    store.append_records("chat-1", records(2, 0, 7), owner="bob")
    store.create("bob", GEOMETRY, TIER, MODEL, session_id="parked")
    store.append_records("parked", records(3, 0, 9), owner="bob")
    store.park("parked", owner="bob")
    store.create("carol", GEOMETRY, TIER, MODEL, session_id="empty")
    return store


def session_bytes(store: SessionStore, session_id: str, owner: str) -> bytes:
    info = store.get(session_id, owner=owner)
    if info.state == "parked":
        return b"".join(stream_archive(store.archive_path(session_id, owner=owner)))
    return store.journal_path(session_id, owner=owner).read_bytes()


def snapshot(store: SessionStore) -> dict[tuple[str, str], tuple[dict, bytes]]:
    return {(info.id, info.owner): (info.to_dict(), session_bytes(store, info.id, info.owner)) for info in store.list()}


def shared_state(index_url: str, shared: SharedStore) -> tuple:
    """Everything a copy could change on the shared side: rows, leases, the token sequence, objects."""
    with psycopg.connect(index_url) as conn:
        sessions = conn.execute(
            "SELECT key, n_records, watermark, record, created_ns, updated_ns, last_used_ns FROM kv_sessions ORDER BY key"
        ).fetchall()
        segments = conn.execute("SELECT key, first_record, object, complete FROM kv_segments ORDER BY 1, 2").fetchall()
        leases = conn.execute("SELECT key, token, expires_at FROM kv_leases ORDER BY key").fetchall()
        sequence = conn.execute("SELECT last_value FROM kv_fencing").fetchone()
    return sessions, segments, leases, sequence, sorted(info.name for info in shared.blobs.list("seg"))


def test_push_then_pull_is_byte_identical_and_keeps_metadata(tmp_path, env, shared, capsys):
    source = tmp_path / "a"
    with build_store(source) as store:
        before = snapshot(store)
    code, report = run(capsys, "store", "push", "--data", str(source), "--json")
    assert code == 0, report
    assert report["counts"] == {"created": 5, "extended": 0, "updated": 0, "unchanged": 0, "refused": 0}
    # every session's image in the shared store is its embedded file, byte for byte
    for (sid, owner), (_, image) in before.items():
        assert shared.file_bytes(f"{sid}~{owner}") == image
    # each turn is one segment, with its completeness
    assert [(s.first_record, s.end, s.complete) for s in shared.segments("chat-1~alice")] == [
        (0, 5, True),
        (5, 8, False),
        (8, 12, True),
        (12, 14, False),
    ]
    target = tmp_path / "b"
    code, report = run(capsys, "store", "pull", "--data", str(target), "--json")
    assert code == 0, report
    assert report["counts"]["created"] == 5
    with SessionStore(target) as pulled:
        after = snapshot(pulled)
        assert pulled.get("parked", owner="bob").state == "parked"
        assert pulled.get("chat-1b", owner="alice").parent == "chat-1"
    assert after == before  # records (ids, owners, fingerprints, tiers, tags, times, lineage) and bytes
    for sid, owner in before:
        code, out = run(capsys, "verify", sid, "--owner", owner, "--data", str(target))
        assert code == 0 and ": ok" in out


def test_a_second_push_or_pull_changes_nothing(tmp_path, env, shared, capsys):
    source, target = tmp_path / "a", tmp_path / "b"
    build_store(source).close()
    assert run(capsys, "store", "push", "--data", str(source))[0] == 0
    assert run(capsys, "store", "pull", "--data", str(target))[0] == 0
    state = shared_state(env["index"], shared)
    with SessionStore(target) as pulled:
        local = snapshot(pulled)
    code, report = run(capsys, "store", "push", "--data", str(source), "--json")
    assert code == 0 and report["counts"]["unchanged"] == 5 and report["copied_bytes"] == 0
    code, report = run(capsys, "store", "push", "--data", str(target), "--json")  # the pulled copy: the same
    assert code == 0 and report["counts"]["unchanged"] == 5
    assert shared_state(env["index"], shared) == state  # no lease taken, no token drawn, no object written
    code, report = run(capsys, "store", "pull", "--data", str(target), "--json")
    assert code == 0 and report["counts"]["unchanged"] == 5
    with SessionStore(target) as pulled:
        assert snapshot(pulled) == local


def test_later_turns_and_metadata_are_copied_incrementally(tmp_path, env, shared, capsys):
    source, target = tmp_path / "a", tmp_path / "b"
    build_store(source).close()
    run(capsys, "store", "push", "--data", str(source))
    run(capsys, "store", "pull", "--data", str(target))
    objects = {info.name for info in shared.blobs.list("seg")}
    with SessionStore(source) as store:
        store.append_records("chat-1", b"", owner="alice")  # completes the last turn, no rows
        store.append_records("chat-1b", records(1, 1, 2), owner="alice")
        store.set_tags("chat-1", ["prod"], owner="bob")
    code, report = run(capsys, "store", "push", "--data", str(source), "--json")
    actions = {(s["id"], s["owner"]): s["action"] for s in report["sessions"]}
    assert code == 0 and actions == {
        ("chat-1", "alice"): "updated",
        ("chat-1b", "alice"): "extended",
        ("chat-1", "bob"): "updated",
        ("parked", "bob"): "unchanged",
        ("empty", "carol"): "unchanged",
    }
    assert report["copied_bytes"] == len(records(1, 1, 2))
    assert len({info.name for info in shared.blobs.list("seg")} - objects) == 1  # only the new turn
    assert shared.segments("chat-1~alice")[-1].complete
    code, report = run(capsys, "store", "pull", "--data", str(target), "--json")
    assert code == 0 and report["counts"] == {"created": 0, "extended": 1, "updated": 2, "unchanged": 2, "refused": 0}
    with SessionStore(source) as store, SessionStore(target) as pulled:
        assert snapshot(pulled) == snapshot(store)


def test_a_different_session_under_the_same_id_is_refused(tmp_path, env, shared, capsys):
    source = tmp_path / "a"
    build_store(source).close()
    key = shared.create("alice", GEOMETRY, TIER, MODEL, session_id="chat-1")
    lease = shared.acquire(key)
    shared.append(lease, records(9, 0, 5))  # 5 records, but other bytes than alice's first turn
    shared.release(lease)
    code, report = run(capsys, "store", "push", "--data", str(source), "--json")
    refused = [s for s in report["sessions"] if s["action"] == "refused"]
    assert code == 2 and [(s["id"], s["owner"]) for s in refused] == [("chat-1", "alice")]
    assert "differs" in refused[0]["reason"] and not refused[0]["damaged"]
    assert report["counts"]["created"] == 4  # the others went on
    assert shared.read_records(key)[1] == records(9, 0, 5)  # the conflicting session is as it was
    # and the other way: the local session is left as it is
    target = tmp_path / "b"
    with SessionStore(target) as store:
        store.create("alice", GEOMETRY, TIER, MODEL, session_id="chat-1")
        store.append_records("chat-1", records(8, 0, 5), owner="alice")
        local = snapshot(store)
    code, report = run(capsys, "store", "pull", "--data", str(target), "--json")
    assert code == 2 and report["counts"]["refused"] == 1
    with SessionStore(target) as store:
        assert snapshot(store)[("chat-1", "alice")] == local[("chat-1", "alice")]


def test_a_damaged_session_is_refused_and_never_uploaded(tmp_path, env, shared, capsys):
    source = tmp_path / "a"
    with build_store(source) as store:
        path = store.journal_path("chat-1", owner="bob")
        rec = store.get("chat-1", owner="bob").record_bytes
    image = bytearray(path.read_bytes())
    image[40 + 3 * rec + 10] ^= 0x40  # a silent bit flip in record 3 (the format cannot see it)
    path.write_bytes(bytes(image))
    code, report = run(capsys, "store", "push", "--data", str(source), "--json")
    bad = [s for s in report["sessions"] if s["action"] == "refused"]
    assert code == 1 and [(s["id"], s["owner"], s["damaged"]) for s in bad] == [("chat-1", "bob", True)]
    assert "kvstore verify" in bad[0]["reason"]
    assert shared.n_records("chat-1~bob") == 0  # its only turn is damaged: nothing of it is published
    assert shared.n_records("chat-1~alice") == 14


def test_a_held_lease_refuses_that_session_only(tmp_path, env, shared, capsys):
    source = tmp_path / "a"
    build_store(source).close()
    run(capsys, "store", "push", "--data", str(source))
    with SessionStore(source) as store:
        store.append_records("chat-1b", records(1, 1, 2), owner="alice")
    writer = shared.acquire("chat-1b~alice", "replica-7")
    code, report = run(capsys, "store", "push", "--data", str(source), "--json")
    refused = [s for s in report["sessions"] if s["action"] == "refused"]
    assert code == 2 and len(refused) == 1 and "replica-7" in refused[0]["reason"]
    assert shared.n_records("chat-1b~alice") == 14
    shared.release(writer)
    code, report = run(capsys, "store", "push", "--data", str(source), "--json")
    assert code == 0 and report["counts"]["extended"] == 1 and shared.n_records("chat-1b~alice") == 16


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, env, monkeypatch, capsys):
    code = main(["store", "push", "--data", str(tmp_path / "nothing")])
    assert code == 2 and "no session store there" in capsys.readouterr().err
    monkeypatch.delenv("KVSTORE_INDEX_URL")
    code = main(["store", "pull", "--data", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and "--index postgresql://" in err and len(err.strip().splitlines()) == 1
    code = main(["store", "pull", "--data", str(tmp_path / "b"), "--index", env["index"], "--blobs", "bucket/x"])
    assert code == 2 and "s3://BUCKET/PREFIX" in capsys.readouterr().err
    code = main(["store", "pull", "--data", str(tmp_path / "b"), "--index", "mysql://x"])
    assert code == 2 and "not a PostgreSQL URL" in capsys.readouterr().err


def test_a_terminal_sees_a_progress_bar_and_a_pipe_sees_none(tmp_path, env):
    source = tmp_path / "a"
    with SessionStore(source) as store:
        store.create("alice", GEOMETRY, TIER, MODEL, session_id="long")
        for seq in range(40):
            store.append_records("long", records(0, seq, 200), owner="alice")
    command = [sys.executable, "-m", "kvstore.cli", "store", "push", "--data", str(source)]
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
    drawn = bytearray()
    try:
        # The slave stays open here until the child is gone and everything it drew is read: once
        # no process holds it, Linux may answer EIO to a read of the master before its buffer is drained.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                drawn += os.read(master, 65536)
            elif child.poll() is not None:
                break
    finally:
        os.close(slave)
        os.close(master)
        stdout = child.stdout.read() if child.stdout else b""
        code = child.wait(timeout=120)
    assert code == 0 and BAR.search(bytes(drawn)), bytes(drawn)[-500:]
    assert b"\r" not in stdout and b"created    long (alice): 8000 records" in stdout
    piped = subprocess.run(command, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert piped.returncode == 0 and piped.stderr == b"" and b"unchanged  long (alice)" in piped.stdout


def test_a_session_parked_on_the_shared_store_is_pulled_parked(tmp_path, env, capsys):
    """Parking is the shared store's too (compressed segment objects): a session parked there is
    pulled into a parked local session, its journal's bytes those the shared store serves."""
    from kvstore.store.shared.sessions import SharedSessionStore

    with SharedSessionStore(env["index"], env["blobs"], data_dir=None, cache_bytes=0) as replica:
        replica.create("dana", GEOMETRY, TIER, MODEL, session_id="cold")
        replica.append_records("cold", records(4, 0, 6))
        replica.append_records("cold", records(4, 1, 3))
        assert replica.park("cold").state == "parked"
        image = replica.shared.file_bytes("cold~dana")
    target = tmp_path / "pulled"
    code, report = run(capsys, "store", "pull", "--data", str(target), "--json")
    assert code == 0 and report["counts"]["created"] == 1, report
    with SessionStore(target) as pulled:
        assert pulled.get("cold", owner="dana").state == "parked"
        assert session_bytes(pulled, "cold", "dana") == image
