"""A running service whose data folder someone plants symbolic links (and other non-files) in.

A link (out of the folder, or a loop), a folder or a FIFO is put where each of a session's files belongs — its two lock
files, its journal's lock sidecar, its journal, a parked session's archive — while ``kvstore serve``
runs, and every session route is called: no answer is a 5xx (a refusal is a typed JSON error), no
job fails untyped, nothing is created or written outside the data folder, and the other sessions
never notice. Once the link is gone the session works again as before; a link left where a lock
file belongs is removed by the next start (it locks nothing), never counted as damage.

The race (``test_links_swapped_in_and_out_while_clients_write``): a link or FIFO is swapped in
atomically where one of a session's files belongs and swapped out again, round after round, while
clients append to and download that session and another: whatever instant the swap lands at (after
a path was checked, while a lock is held, mid-append), no answer is a 5xx, nothing is created
outside, every acknowledged turn is there once, in order, and the session is never marked damaged.
``KVSTORE_LONG=1`` runs 200 rounds instead of 8.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvstore import tiers
from kvstore.formats import coli_kv
from reliability.service import Service
from reliability.workload import GEOMETRY, turn_rows
from served import wait_job

RAW = {"Content-Type": "application/octet-stream"}
KINDS = ("out", "loop", "folder", "fifo")
PLACES = ("write_lock", "read_lock", "journal_lock", "journal", "archive")


def turn(step: int) -> bytes:
    return coli_kv.encode_records(GEOMETRY, tiers.FP8, *turn_rows(5, step)).tobytes()


def create(client: httpx.Client, sid: str) -> None:
    g = GEOMETRY
    geometry = {k: getattr(g, k) for k in ("n_layers", "kv_lora", "qk_rope", "index_hd", "nic", "vocab")}
    body = {"id": sid, "model": {"name": "hostile-dir", "revision": "r1"}, "geometry": geometry, "tier": "fp8"}
    answer = client.post("/sessions", json=body)
    assert answer.status_code == 201, answer.text


def file_of(data: Path, place: str, sid: str) -> Path:
    """Where ``place`` of session ``sid`` is, whatever the store names its files by (id or key)."""
    folder, suffix = {
        "write_lock": ("locks", ".write"),
        "read_lock": ("locks", ".read"),
        "journal_lock": ("journals", ".coli_kv.lock"),
        "journal": ("journals", ".coli_kv"),
        "archive": ("archive", ".coli_kv.zst"),
    }[place]
    folder_of_file = data / ("archive" if place == "archive" else "journals")
    names = [p.name.split(".", 1)[0] for p in folder_of_file.iterdir() if p.name.endswith((".coli_kv", ".coli_kv.zst"))]
    key = next(name for name in names if name == sid or name.startswith(f"{sid}~"))
    return data / folder / f"{key}{suffix}"


def plant(target: Path, kind: str, outside: Path) -> None:
    """Something that is not a regular file where ``target`` belongs."""
    if kind == "out":
        os.symlink(outside, target)
    elif kind == "loop":
        os.symlink(target.name, target)
    elif kind == "folder":
        os.mkdir(target)
    else:
        os.mkfifo(target)  # opening it for reading would wait for a writer forever


def every_route(client: httpx.Client, sid: str, step: int) -> list[httpx.Response]:
    """One call of each session route on ``sid`` (jobs waited for, their outcome as a response)."""
    answers = [
        client.get(f"/sessions/{sid}"),
        client.get(f"/sessions/{sid}/resume"),
        client.get(f"/sessions/{sid}/verify"),
        client.post(f"/sessions/{sid}/append", content=turn(step), headers=RAW),
        client.post(f"/sessions/{sid}/truncate", json={"n_records": 1}),
        client.post(f"/sessions/{sid}/fork", json={"id": f"{sid}-fork-{step}"}),
        client.get(f"/sessions/{sid}/file/inspect"),
    ]
    for kind in ("park", "unpark"):
        started = client.post(f"/sessions/{sid}/{kind}")
        answers.append(started)
        if started.status_code == 202:
            job = wait_job(client, started.json())
            if job["state"] == "failed":
                assert job["error"]["error"] != "InternalError", job
    return answers


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    data = tmp_path_factory.mktemp("hostile-data-dir") / "data"
    running = Service(data).start()
    with running.client("alice") as client:
        create(client, "bystander")
    yield running
    output = running.stop()
    assert "Traceback" not in output, output


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("kind", KINDS)
def test_links_planted_in_a_running_services_folder(service, tmp_path, figures, place, kind):
    data, outside, victim = service.data, tmp_path / "outside", f"victim-{place}-{kind}".replace("_", "-")
    requests = 0
    with service.client("alice") as client:
        create(client, victim)
        for step in range(3):
            assert client.post(f"/sessions/{victim}/append", content=turn(step), headers=RAW).status_code == 200
        if place == "archive":
            assert wait_job(client, client.post(f"/sessions/{victim}/park").json())["state"] == "done"
        target = file_of(data, place, victim)
        kept = tmp_path / "kept"
        if os.path.lexists(target):
            os.replace(target, kept)
        plant(target, kind, outside)
        for step, answer in enumerate(every_route(client, victim, 10)):
            requests += 1
            assert answer.status_code < 500, (place, kind, step, answer.status_code, answer.text)
            if answer.status_code >= 400:
                assert set(answer.json()) == {"error", "reason"}, answer.text
        assert not os.path.lexists(outside), f"{place}: something was created outside the data folder"
        bystander = client.post("/sessions/bystander/append", content=turn(20), headers=RAW)
        assert bystander.status_code == 200, bystander.text
        os.rmdir(target) if kind == "folder" else os.unlink(target)
        if kept.exists():
            os.replace(kept, target)
        state = client.get(f"/sessions/{victim}").json()
        assert state["state"] in ("active", "parked"), state
        assert client.post(f"/sessions/{victim}/append", content=turn(30), headers=RAW).status_code == 200
    assert service.running()
    figures.add("hostile_data_dir", f"{place}_{kind}", hostile_inputs=requests, http_5xx=0, escaped_paths=0)


def test_links_left_where_locks_belong_are_gone_after_a_restart(tmp_path, figures):
    data, outside = tmp_path / "data", tmp_path / "outside"
    places = ("write_lock", "read_lock", "journal_lock")
    service = Service(data).start()
    try:
        with service.client("alice") as client:
            for place in places:
                create(client, place.replace("_", "-"))
                answer = client.post(f"/sessions/{place.replace('_', '-')}/append", content=turn(0), headers=RAW)
                assert answer.status_code == 200
    finally:
        service.stop()
    targets = [file_of(data, place, place.replace("_", "-")) for place in places]
    for target in targets:
        if os.path.lexists(target):
            os.unlink(target)
        os.symlink(outside, target)
    service = Service(data).start()
    try:
        with service.client("alice") as client:
            for place in places:
                sid = place.replace("_", "-")
                state = client.get(f"/sessions/{sid}").json()
                assert (state["state"], state["problem"]) == ("active", None), state
                assert client.post(f"/sessions/{sid}/append", content=turn(1), headers=RAW).status_code == 200
                assert client.get(f"/sessions/{sid}/verify").json()["ok"]
    finally:
        output = service.stop()
    assert not any(os.path.islink(target) for target in targets) and not os.path.lexists(outside)
    assert output.count("symbolic link where a lock file belongs") == len(places), output
    figures.add("hostile_data_dir", "restart_removes_lock_links", hostile_inputs=len(places), http_5xx=0)


RACE_PLACES = ("write_lock", "read_lock", "journal_lock", "journal")
RACE_KINDS = ("out", "loop", "fifo")
RACE_ERRORS = {"PathRefused", "JournalLocked"}  # the refusals a swapped-in file may cause


class RaceClient(threading.Thread):
    """One client of the race: counts its requests; keeps the typed refusals and anything else (bad)."""

    def __init__(self, service, sid: str):
        super().__init__(daemon=True)
        self.service, self.sid = service, sid
        self.requests = 0
        self.refusals: dict[str, int] = {}
        self.bad: list[str] = []
        self.stop = threading.Event()

    def answered(self, answer: httpx.Response) -> bool:
        """Count ``answer``; True when it is a 2xx, else check it is a typed refusal a swap may cause."""
        self.requests += 1
        if answer.status_code < 300:
            return True
        body = answer.json() if answer.headers.get("content-type", "").startswith("application/json") else {}
        if answer.status_code >= 500 or set(body) != {"error", "reason"} or body["error"] not in RACE_ERRORS:
            self.bad.append(f"{answer.status_code} {answer.text}")
        else:
            self.refusals[body["error"]] = self.refusals.get(body["error"], 0) + 1
        return False

    def run(self) -> None:
        with self.service.client("alice") as client:
            while not self.stop.is_set():
                self.once(client)  # each subclass's one round of requests


class Appender(RaceClient):
    """Appends turns to ``sid``; records each acknowledged step."""

    def __init__(self, service, sid: str, first_step: int):
        super().__init__(service, sid)
        self.step = first_step
        self.acknowledged: list[int] = []

    def once(self, client: httpx.Client) -> None:
        if self.answered(client.post(f"/sessions/{self.sid}/append", content=turn(self.step), headers=RAW)):
            self.acknowledged.append(self.step)
        self.step += 1


class Downloader(RaceClient):
    """Downloads ``sid``; keeps every body served."""

    def __init__(self, service, sid: str):
        super().__init__(service, sid)
        self.bodies: list[bytes] = []

    def once(self, client: httpx.Client) -> None:
        answer = client.get(f"/sessions/{self.sid}/resume")
        if self.answered(answer):
            self.bodies.append(answer.content)


class Checker(RaceClient):
    """Verifies, inspects and forks ``sid``: a verify that answers must find it sound."""

    def __init__(self, service, sid: str):
        super().__init__(service, sid)
        self.forks: list[str] = []

    def once(self, client: httpx.Client) -> None:
        verified = client.get(f"/sessions/{self.sid}/verify")
        if self.answered(verified) and not verified.json()["ok"]:
            self.bad.append(f"verify found the session unsound: {verified.text}")
        self.answered(client.get(f"/sessions/{self.sid}/file/inspect"))
        fork_id = f"{self.sid}-fork-{self.requests}"
        if self.answered(client.post(f"/sessions/{self.sid}/fork", json={"id": fork_id})):
            self.forks.append(fork_id)


def swap_in(target: Path, kind: str, outside: Path, spare: Path) -> None:
    """Replace ``target`` in one rename by a link (out of the folder, or a loop) or a FIFO; the real
    file stays reachable at ``spare`` (a hard link), so its name is never missing."""
    staged = spare.with_name("staged")
    if kind == "out":
        os.symlink(outside, staged)
    elif kind == "loop":
        os.symlink(target.name, staged)
    else:
        os.mkfifo(staged)
    if os.path.lexists(target):
        os.link(target, spare, follow_symlinks=False)
    os.replace(staged, target)


def swap_out(target: Path, spare: Path) -> None:
    """Put the real file back in one rename (or drop the planted entry where there was none)."""
    if os.path.lexists(spare):
        os.replace(spare, target)
    else:
        os.unlink(target)


def whole_turn_prefix(body: bytes, steps: list[int]) -> bool:
    expected = b""
    for step in steps:
        if body == expected:
            return True
        expected += turn(step)
    return body == expected


def test_links_swapped_in_and_out_while_clients_write(service, tmp_path, figures, trials):
    rounds = trials(8, 200)
    rng = random.Random(2024)
    data, outside = service.data, tmp_path / "outside"
    with service.client("alice") as client:
        create(client, "racer")
        create(client, "racer-bystander")
    writers = [Appender(service, "racer", 1000), Appender(service, "racer-bystander", 5000)]
    reader, checker = Downloader(service, "racer"), Checker(service, "racer")
    clients = (*writers, reader, checker)
    for thread in clients:
        thread.start()
    try:
        for n in range(rounds):
            place, kind = rng.choice(RACE_PLACES), rng.choice(RACE_KINDS)
            target, spare = file_of(data, place, "racer"), tmp_path / f"spare-{n}"
            time.sleep(rng.uniform(0, 0.01))
            swap_in(target, kind, outside, spare)
            time.sleep(rng.uniform(0, 0.03))
            swap_out(target, spare)
            assert not os.path.lexists(outside), f"round {n} ({place}, {kind}): something was created outside"
            time.sleep(rng.uniform(0, 0.01))
    finally:
        for thread in clients:
            thread.stop.set()
        for thread in clients:
            thread.join(timeout=120)
    racer, bystander = writers
    assert [t for t in clients if t.is_alive()] == [], "a client hung"
    assert [t.bad for t in clients] == [[]] * len(clients), [t.bad for t in clients]
    assert bystander.refusals == {}, bystander.refusals  # the other session never noticed
    with service.client("alice") as client:
        for appender in writers:
            state = client.get(f"/sessions/{appender.sid}").json()
            assert (state["state"], state["problem"]) == ("active", None), state
            served = client.get(f"/sessions/{appender.sid}/resume").content
            assert served == b"".join(turn(step) for step in appender.acknowledged), appender.sid
            assert client.post(f"/sessions/{appender.sid}/append", content=turn(1), headers=RAW).status_code == 200
    assert all(whole_turn_prefix(body, racer.acknowledged) for body in reader.bodies)
    with service.client("alice") as client:
        for fork_id in checker.forks:  # each a whole-turn prefix of the racer, sound
            served = client.get(f"/sessions/{fork_id}/resume").content
            assert whole_turn_prefix(served, racer.acknowledged), fork_id
            assert client.get(f"/sessions/{fork_id}/verify").json()["ok"], fork_id
    assert service.running()
    refused = sum(sum(t.refusals.values()) for t in clients)
    figures.add(
        "hostile_data_dir",
        "swapped_in_and_out_while_writing",
        hostile_inputs=rounds,
        requests=sum(t.requests for t in clients),
        acknowledged_appends=len(racer.acknowledged) + len(bystander.acknowledged),
        downloads=len(reader.bodies),
        forks=len(checker.forks),
        refused_typed=refused,
        http_5xx=0,
        escaped_paths=0,
        lost=0,
    )
