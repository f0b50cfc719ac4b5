"""The session index out of space: LMDB's map full, or the disk under it full, at every index write.

``test_store_faults.py`` makes the journal's system calls fail; LMDB writes its pages itself (C,
below ``os``), so its failures are reached two ways:

- **the map full, page by page** (portable): the template's index is filled to its last byte in a
  map sized exactly to it, and the store opens with ``k`` more pages, k = 0, 1, 2, ... until the call
  fits: each k refuses a later index transaction of the call (its first one; or one after the
  journal, the archive or a rewritten journal is already on disk). After each refusal:

  - the error is ``IndexFull`` (507, naming ``map_size``); nothing untyped escapes;
  - the store as it stands holds the state before the call, or after it for a call whose commit
    came before the refused transaction; never half (a migrate puts the previous journal back);
  - a full index still opens, lists and serves every session (a read needs no index write);
  - reopened with a larger map, the same call again and a new turn complete, and index and files
    agree exactly.

- **the disk full** (where a tmpfs can be mounted in a private mount namespace: root and
  ``unshare``): ``index/`` on a 128 KiB tmpfs. LMDB reports a disk that ran out as EIO; the store
  says ``IndexFull`` naming the disk, and the service answers 507 with the usual body and stays up.
  ``KVSTORE_LONG=1`` fills eleven more disks, 96 to 512 KiB, so it runs out at other pages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import lmdb
import pytest

from kvstore import tiers
from kvstore.api.errors import http_status
from kvstore.errors import IndexFull, KVStoreError
from kvstore.formats import coli_kv
from kvstore.migrations import index as schema
from kvstore.store import SessionStore
from reliability.conftest import LONG
from reliability.service import Service
from reliability.store_checks import check_served, snapshot, visible
from reliability.store_workload import GEOMETRY, perform
from reliability.test_store_faults import CALLS, build_template, next_call
from reliability.workload import turn_rows

ROOMY_MAP = 1 << 26
MOST_PAGES = 64  # no call needs more new pages than this; reaching it means the map never filled
DISK_CHILD = Path(__file__).with_name("index_disk_child.py")
TMPFS_SIZE = "128k"  # the disk under index/ in the disk-full tests (LMDB's lock file takes ~40 KiB of it)
# KVSTORE_LONG=1: the store's disk-full test on disks of these sizes too (KiB), so the disk runs out
# at other pages of the index, under other transactions
LONG_TMPFS_KIB = (96, 112, 144, 160, 192, 224, 256, 320, 384, 448, 512)


def fill_index(data: Path) -> tuple[int, int]:
    """Fill the index of the store in ``data`` to the last byte of a map exactly its size.

    Returns (map size, page size). The filler sits in the meta database under keys nothing reads;
    the freelist is used up too (a write transaction frees the pages it copies, the next reuses
    them), so the first page any later transaction needs is one past the map.
    """
    env = lmdb.open(str(data / "index"), max_dbs=schema.MAX_DBS, map_size=1)  # LMDB widens it to the data
    try:
        meta = env.open_db(schema.DB_META)
        n = 0
        for size in (1 << 16, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 16, 1):
            while True:
                try:
                    with env.begin(write=True) as txn:
                        txn.put(b"test-filler-%d" % n, bytes(size), db=meta)
                except lmdb.MapFullError:
                    break
                n += 1
        return env.info()["map_size"], env.stat()["psize"]
    finally:
        env.close()


def reads_still_work(store: SessionStore, sessions: dict) -> None:
    """List, get and resume every session of a store whose index is full."""
    assert sorted(info.id for info in store.list()) == sorted(sessions)
    for sid, session in sessions.items():
        assert store.get(sid).n_records == session.n_records
        if session.state == "active":
            served = store.resume(sid).records.record_bytes()
            assert served == session.body[: session.watermark * session.record_bytes], sid


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("index-faults") / "template"
    return root, build_template(root)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_index_full_at_every_index_write_of_a_call(tmp_path, figures, template, name):
    root, before = template
    kind, args = CALLS[name](before)
    after = before.apply(kind, args)
    subject = args[1] if kind == "fork" else args[0]
    refused = committed_then_reported = 0
    for extra_pages in range(MOST_PAGES):
        data = tmp_path / f"pages-{extra_pages}"
        shutil.copytree(root, data)
        full, page = fill_index(data)
        raised = None
        with SessionStore(data, map_size=full + extra_pages * page) as store:
            assert store.reconcile_actions == []  # a full index opens: there was nothing to write
            try:
                perform(store, before, kind, args)
            except KVStoreError as exc:
                raised = exc
            now = visible(store)
            where = f"{name} with {extra_pages} pages to spare"
            if raised is not None:
                assert isinstance(raised, IndexFull), f"{where}: {raised!r}"
                assert http_status(raised) == 507 and "map_size" in raised.reason, raised.reason
                assert now in (before.sessions, after.sessions), f"{where} left a half-done state"
                refused += 1
                committed_then_reported += int(now == after.sessions)
            else:
                assert now == after.sessions, where
            reads_still_work(store, now)
        with SessionStore(data, map_size=ROOMY_MAP) as store:
            model = after
            if now == before.sessions:
                model = perform(store, before, kind, args)  # the same call again, with room
            model = next_call(store, model, subject)
        with SessionStore(data, map_size=ROOMY_MAP) as store:
            assert snapshot(store) == model.sessions
            check_served(store, model.sessions)
        shutil.rmtree(data)
        if raised is None:
            break
    else:
        pytest.fail(f"{name} never fitted in {MOST_PAGES} spare pages")
    assert refused >= 1, f"{name} fitted in a full index"
    figures.add(
        "index_faults",
        f"map_full_{name}",
        faults_injected=refused,
        typed_errors=refused,
        committed_then_reported=committed_then_reported,
        data_lost=0,
    )


# ---------------------------------------------------------------------------- the disk full (tmpfs)
def _tmpfs_in_a_namespace(folder: Path) -> bool:
    if shutil.which("unshare") is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    try:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$1"', "sh", str(folder)],
            capture_output=True,
            timeout=30,
        )
    finally:
        folder.rmdir()  # the mount lived in the probe's namespace only: the folder is empty again
    return probe.returncode == 0


def _in_namespace(index: Path, *command: str, size: str = TMPFS_SIZE) -> list[str]:
    """``command`` run in a private mount namespace with a tmpfs of ``size`` (128 KiB) on ``index``."""
    script = f'mount -t tmpfs -o size={size},mode=0700 tmpfs "$1" && shift && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh", str(index), *command]


needs_tmpfs = pytest.mark.skipif(
    not _tmpfs_in_a_namespace(Path(os.environ.get("TMPDIR", "/tmp")) / f"kvstore-tmpfs-probe-{os.getpid()}"),
    reason="needs root and unshare to mount a small tmpfs in a private mount namespace",
)


@needs_tmpfs
def test_the_disk_under_the_index_full(tmp_path, figures):
    """The store on an index whose disk fills: the checks run in the child (see index_disk_child.py)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    sizes = [TMPFS_SIZE] + ([f"{kib}k" for kib in LONG_TMPFS_KIB] if LONG else [])
    for size in sizes:
        data = tmp_path / f"data-{size}"
        (data / "index").mkdir(parents=True)
        done = subprocess.run(
            _in_namespace(data / "index", sys.executable, str(DISK_CHILD), str(data), size=size),
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert done.returncode == 0, f"a {size} disk: " + done.stdout + done.stderr
        counts = json.loads(done.stdout.splitlines()[-1])
        assert counts["refused"] >= 1 and counts["acknowledged"] > 0, (size, counts)
        figures.add(
            "index_faults",
            "disk_full_store",
            faults_injected=counts["refused"],
            typed_errors=counts["refused"],
            acknowledged_appends=counts["acknowledged"],
            disks_filled=1,
            data_lost=0,
        )


class NamespacedService(Service):
    """``kvstore serve`` with its data folder's ``index/`` on a 128 KiB tmpfs of its own."""

    def __init__(self, data: Path, *extra: str):
        super().__init__(data, *extra)
        self.launcher = tuple(_in_namespace(data / "index"))


def append_until_refused(client: httpx.Client, sid: str, first_step: int, limit: int = 5000) -> tuple[int, dict]:
    """Append fp8 turns until the service refuses one; returns (turns acknowledged, the refusal's body)."""
    for step in range(first_step, first_step + limit):
        body = _turn_bytes(step)
        answer = client.post(
            f"/sessions/{sid}/append", content=body, headers={"Content-Type": "application/octet-stream"}
        )
        if answer.status_code != 200:
            assert answer.status_code == 507, answer.text
            return step - first_step, answer.json()
    raise AssertionError(f"the index never filled in {limit} appends")


TURN_PARTS = 12  # workload turns per appended turn: ~250 tokens, a few prefix blocks each in the index


def _turn_bytes(step: int) -> bytes:
    """The fp8 records of appended turn ``step``."""
    parts = range(step * TURN_PARTS, (step + 1) * TURN_PARTS)
    return b"".join(coli_kv.encode_records(GEOMETRY, tiers.FP8, *turn_rows(7, part)).tobytes() for part in parts)


def _turn_tokens(step: int) -> int:
    return sum(turn_rows(7, part)[0].shape[0] for part in range(step * TURN_PARTS, (step + 1) * TURN_PARTS))


def _create(client: httpx.Client, sid: str) -> None:
    g = GEOMETRY
    answer = client.post(
        "/sessions",
        json={
            "id": sid,
            "model": {"name": "index-full", "revision": "r1"},
            "geometry": {
                "n_layers": g.n_layers,
                "kv_lora": g.kv_lora,
                "qk_rope": g.qk_rope,
                "index_hd": g.index_hd,
                "nic": g.nic,
                "vocab": g.vocab,
            },
            "tier": "fp8",
        },
    )
    assert answer.status_code == 201, answer.text


def check_service_after_refusal(service: Service, client: httpx.Client, acknowledged: int, refusal: dict) -> None:
    """507 with the usual body; the same connection, health, reads and the download still work."""
    assert refusal["error"] == "IndexFull" and set(refusal) == {"error", "reason"}, refusal
    assert client.get("/health").status_code == 200
    session = client.get("/sessions/s")
    assert session.status_code == 200 and session.json()["n_records"] == sum(map(_turn_tokens, range(acknowledged)))
    rows = client.get("/sessions/s/resume")
    assert rows.status_code == 200 and rows.content == b"".join(_turn_bytes(step) for step in range(acknowledged))
    again = client.post(
        "/sessions/s/append", content=_turn_bytes(acknowledged), headers={"Content-Type": "application/octet-stream"}
    )
    assert again.status_code in (200, 507), again.text
    assert service.running()


def test_the_service_answers_507_when_the_index_map_fills_and_stays_up(tmp_path, figures):
    data = tmp_path / "data"
    service = Service(data, "--index-size", "96K").start()
    try:
        with service.client("alice") as client:
            _create(client, "s")
            acknowledged, refusal = append_until_refused(client, "s", 0)
            assert "map_size" in refusal["reason"] and "--index-size" in refusal["reason"]
            check_service_after_refusal(service, client, acknowledged, refusal)
    finally:
        output = service.stop()
    assert "Traceback" not in output, output
    with SessionStore(data, map_size=ROOMY_MAP) as store:  # a larger map: the refused turn goes in
        store.append_records("s", _turn_bytes(10_000), complete_turn=True, owner="alice")
        assert store.get("s", owner="alice").n_records > 0
    figures.add("index_faults", "map_full_service", faults_injected=1, typed_errors=1, http_5xx_other_than_507=0)


@needs_tmpfs
def test_the_service_answers_507_when_the_disk_under_the_index_fills_and_stays_up(tmp_path, figures):
    data = tmp_path / "data"
    (data / "index").mkdir(parents=True)
    service = NamespacedService(data).start()
    try:
        with service.client("alice") as client:
            _create(client, "s")
            acknowledged, refusal = append_until_refused(client, "s", 0)
            assert "disk" in refusal["reason"], refusal
            check_service_after_refusal(service, client, acknowledged, refusal)
    finally:
        output = service.stop()
    assert "Traceback" not in output, output
    figures.add("index_faults", "disk_full_service", faults_injected=1, typed_errors=1, http_5xx_other_than_507=0)
