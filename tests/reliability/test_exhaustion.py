"""One request must not take the server down (issue 15, items 1-4), against a real ``kvstore serve``.

- a compressed Arrow upload is bounded by what it *decodes* to: a 1 GB zstd bomb of ~30 KB is
  refused (413, naming the limit) before anything is decompressed, the server's memory peak barely
  moves, the session is unchanged and the next honest upload goes in; so is one of more record
  batches than the service reads;
- JSON bodies are bounded on every route while they are read (413 naming the route's limit), parsed and
  validated off the event loop: ``/health`` stays fast while 8 clients send oversized bodies, or
  bodies just under the limit;
- requests for ids that do not exist leave no lock files (the last reader out removes one); the job
  queue is capped (429 with ``Retry-After``), per owner and service-wide;
- requests waiting for a busy session hold no worker thread: beyond ``--session-waiters`` they get
  429 at once, before their body is read, other sessions are served meanwhile, the waiters go
  through when the lock is free, and a wait longer than ``--lock-timeout`` (one setting) answers 409;
- every one of these limits is a `kvstore serve` flag, in its --help and in docs/API.md.

The latency bounds here are generous (CI machines are small and shared); ``bench/exhaustion_bench.py``
measures the figures RELIABILITY.md gives.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pytest
from fastapi.exceptions import RequestValidationError

from kvstore import tiers
from kvstore.api import arrow
from kvstore.api.errors import BodyTooLarge
from kvstore.api.jobs import DEFAULT_MAX_PENDING, DEFAULT_MAX_PENDING_PER_OWNER
from kvstore.api.json_body import (
    BIG_BODY_BYTES,
    BIG_BODY_VALUES,
    StrictJSONRoute,
    _parse_and_validate,
    unyielding_values,
)
from kvstore.api.main import create_app
from kvstore.api.schemas import JSON_BODY_BYTES, TOKENS_BODY_BYTES
from kvstore.api.settings import DEFAULT_SESSION_WAITERS, Settings
from kvstore.cli.serve import LIMITS
from kvstore.journal import KVFile, writer_lock
from kvstore.locks import DEFAULT_LOCK_TIMEOUT_S, FileLock, waits_capped
from kvstore.store import SessionStore
from kvstore.store.values import storage_key
from reliability.conftest import LONG
from reliability.exhaustion import (
    Prober,
    arrow_bomb,
    arrow_rows,
    chunked,
    json_load,
    lookup_body,
    lying_arrow_upload,
    oversized_lookup,
    peak_rss_growth,
    session_lock_held,
)
from reliability.service import KEYS, Service
from reliability.store_workload import MODEL
from reliability.workload import GEOMETRY

ARROW = "application/vnd.apache.arrow.stream"
RAW = "application/octet-stream"
GEOMETRY_JSON = dataclasses.asdict(GEOMETRY)
MiB = 1 << 20


def start(tmp_path, *extra: str) -> Service:
    return Service(tmp_path / "data", *extra).start()


def stop(service: Service) -> None:
    output = service.stop()
    assert "Traceback" not in output, output


def create(client: httpx.Client, sid: str) -> None:
    response = client.post("/sessions", json={"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON})
    assert response.status_code == 201, response.text


def store_files(data) -> set[str]:
    return {f"{folder}/{p.name}" for folder in ("locks", "journals", "archive") for p in (data / folder).iterdir()}


# ---------------------------------------------------------------------------------- item 1
def test_a_compressed_arrow_bomb_is_refused_before_it_is_decoded(tmp_path, figures):
    limit = 4 * MiB
    service = start(tmp_path, "--max-body", "4M")
    bomb = arrow_bomb(GEOMETRY, 1 << 30)  # ~1 GB of rows in ~30 KB
    liar = lying_arrow_upload(GEOMETRY, 1 << 30)  # 3 honest rows, one buffer "decodes" to 1 GB
    assert len(bomb) < 64 * 1024 and len(liar) < 64 * 1024
    growths = []
    try:
        with service.client() as alice:
            create(alice, "bombed")
            honest = alice.post(
                "/sessions/bombed/append", content=arrow_rows(GEOMETRY, 5), headers={"Content-Type": ARROW}
            )
            assert honest.status_code == 200, honest.text
            before = alice.get("/sessions/bombed").json()
            for body in [bomb, liar] * (10 if LONG else 2):
                answers: list[httpx.Response] = []

                def send(body: bytes = body, answers: list = answers) -> None:
                    answers.append(alice.post("/sessions/bombed/append", content=body, headers={"Content-Type": ARROW}))

                growths.append(peak_rss_growth(service.process.pid, send))
                response = answers[0]
                assert response.status_code == 413, response.text
                assert response.json()["error"] == "BodyTooLarge"
                assert str(limit) in response.json()["reason"], response.json()["reason"]
            after = alice.get("/sessions/bombed").json()
            assert (after["n_records"], after["watermark"], after["size_bytes"]) == (
                before["n_records"],
                before["watermark"],
                before["size_bytes"],
            )
            again = alice.post(
                "/sessions/bombed/append", content=arrow_rows(GEOMETRY, 7, seed=1), headers={"Content-Type": ARROW}
            )
            assert again.status_code == 200, again.text
            assert again.json()["session"]["n_records"] == 12
    finally:
        stop(service)
    assert max(growths) <= 64 * MiB, [g // MiB for g in growths]
    figures.add("exhaustion", "arrow_bombs", inputs=len(growths), accepted=0, changed=0)


def _batches(geometry, sizes: list[int]) -> bytes:
    """An uncompressed upload of one record batch per entry of ``sizes`` (rows each)."""
    schema = arrow.schema_for(geometry)
    widths = [w for _, w in arrow._layout(schema, geometry)]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for rows in sizes:
            columns = [pa.array(np.zeros(rows, np.int32))]
            columns += [
                pa.FixedSizeListArray.from_arrays(pa.array(np.ones(rows * w, np.float32)), w) for w in widths[1:]
            ]
            writer.write_batch(pa.record_batch(columns, schema=schema))
    return sink.getvalue().to_pybytes()


def test_an_upload_of_very_many_record_batches_is_refused_before_they_are_read():
    # 100,000 empty batches (34 MiB) took 300 MiB and 6 s to read: each batch is objects, whatever its rows
    records, _ = arrow.records_from_stream(
        _batches(GEOMETRY, [1] * arrow.MAX_BATCHES), GEOMETRY, tiers.F32, max_decoded_bytes=64 * MiB
    )
    assert records["token"].shape == (arrow.MAX_BATCHES,) and records["layers"]["Lc"].shape[0] == arrow.MAX_BATCHES
    with pytest.raises(BodyTooLarge, match=f"more than {arrow.MAX_BATCHES} record batches"):
        arrow.records_from_stream(
            _batches(GEOMETRY, [0] * (arrow.MAX_BATCHES + 1)), GEOMETRY, tiers.F32, max_decoded_bytes=64 * MiB
        )


# ---------------------------------------------------------------------------------- item 2
def test_json_bodies_are_bounded_per_route_while_read(tmp_path):
    service = start(tmp_path)
    try:
        with service.client() as alice, service.client(owner=None) as anonymous:
            create(alice, "limits")
            # by Content-Length, before reading
            response = alice.post(
                "/lookup", content=b"[" + b" " * TOKENS_BODY_BYTES, headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 413, response.text
            assert f"POST /lookup accepts at most {TOKENS_BODY_BYTES}" in response.json()["reason"]
            # chunked: refused once the limit is passed
            response = alice.post(
                "/lookup", content=oversized_lookup(3 * TOKENS_BODY_BYTES), headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 413, response.text
            for path in (
                "/sessions",
                "/sessions/limits/truncate",
                "/sessions/limits/fork",
                "/sessions/limits/file/migrate",
            ):
                response = alice.post(
                    path,
                    content=b'{"tags": [' + b'"x",' * (JSON_BODY_BYTES // 4) + b'"x"]}',
                    headers={"Content-Type": "application/json"},
                )
                assert response.status_code == 413, (path, response.text)
                assert str(JSON_BODY_BYTES) in response.json()["reason"]
            # just under the limit: parsed and answered
            n = (TOKENS_BODY_BYTES - 400) // 7
            response = alice.post(
                "/lookup", content=lookup_body(n, GEOMETRY_JSON, MODEL), headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 200, response.text
            # without a key, nothing of the body is read or parsed: 401, not 413 nor 422
            response = anonymous.post(
                "/lookup", content=b"{not json" * 1000, headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 401, response.text
            # the body is still checked like before (strict, typed)
            response = alice.post("/sessions/limits/truncate", json={"n_records": "0"})
            assert response.status_code == 422, response.text
    finally:
        stop(service)


def test_a_smaller_max_body_bounds_json_routes_too(tmp_path):
    service = start(tmp_path, "--max-body", "10K")
    try:
        with service.client() as alice:
            response = alice.post(
                "/sessions", json={"id": "x", "model": MODEL, "geometry": GEOMETRY_JSON, "tags": ["t" * 60] * 200}
            )
            assert response.status_code == 413, response.text
            assert "10240" in response.json()["reason"]
    finally:
        stop(service)


def _json_body_routes(data) -> dict[tuple[str, str], Any]:
    """{(method, path): the body's field} for every route of the app that reads a JSON body."""
    app = create_app(Settings(data_dir=data, api_keys_env="k" * 16 + ":alice"))
    found = {}
    for included in app.routes:
        for route in getattr(getattr(included, "original_router", None), "routes", [included]):
            params = getattr(getattr(route, "dependant", None), "body_params", [])
            if params:
                assert isinstance(route, StrictJSONRoute), route.path  # bounded and parsed off the loop
                (method,) = route.methods
                found[method, route.path] = params[0]
    return found


def _reason(response, path: str) -> str:
    """The reason of an error answer: OpenAI's error object on the OpenAI-compatible routes."""
    body = response.json()
    return body["error"]["message"] if path.startswith("/v1/") else body["reason"]


def test_every_json_route_refuses_a_body_over_its_limit_while_reading(tmp_path):
    routes = _json_body_routes(tmp_path / "routes")
    assert {path for _, path in routes} >= {"/sessions", "/lookup", "/sessions/{session_id}/generate"}
    service = start(tmp_path)
    try:
        with service.client() as alice:
            create(alice, "s")
            for (method, path), field in routes.items():
                limit = field.field_info.annotation.max_body_bytes
                url = path.replace("{session_id}", "s")
                accepts = f"{method} {path} accepts at most {limit}"
                # declared: refused before a byte of the body is read
                response = alice.request(
                    method, url, content=b" " * (limit + 1), headers={"Content-Type": "application/json"}
                )
                assert response.status_code == 413 and accepts in _reason(response, path), (path, response.text)
                # chunked (no length): refused as soon as the limit is passed
                response = alice.request(
                    method,
                    url,
                    content=chunked(limit + 64 * 1024, b" " * 4096),
                    headers={"Content-Type": "application/json"},
                )
                assert response.status_code == 413 and f"most {method} {path} accepts" in _reason(response, path), (
                    path,
                    response.text,
                )
            assert alice.get("/sessions/s").json()["n_records"] == 0
    finally:
        stop(service)


def _built_in_c(value: Any) -> int:
    """Arrays, objects, strings (keys too) and null/true/false in a parsed JSON value: what json's C
    parser builds without calling back into Python (NaN and Infinity count 2 and 4, by design)."""
    if isinstance(value, list):
        return 1 + sum(_built_in_c(item) for item in value)
    if isinstance(value, dict):
        return 1 + sum(1 + _built_in_c(item) for item in value.values())
    if isinstance(value, float) and not math.isfinite(value):
        return 2 if math.isnan(value) else 4
    return int(isinstance(value, str) or value is None or isinstance(value, bool))


def test_the_count_of_values_a_body_parses_to_in_c_is_exact():
    rng = random.Random(15)
    letters = ['"', "\\", "[", "]", "{", "}", "a", " ", "\u00e9", "\n"]

    def text() -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(0, 12)))

    def value(depth: int = 0) -> Any:
        roll = rng.random()
        if depth > 4 or roll < 0.3:
            return rng.choice([1, 2.5, None, True, False, math.nan, -math.inf, text()])
        if roll < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {text(): value(depth + 1) for _ in range(rng.randint(0, 4))}

    for _ in range(2000):
        document = value()
        body = json.dumps(document, ensure_ascii=rng.random() < 0.5).encode()
        assert unyielding_values(body) == _built_in_c(document), body
    # runs of backslashes and quotes across the 1 MiB steps the count is made in
    for shift in range(-6, 7):
        for run in range(5):
            for document in (
                {"text": "x" * ((1 << 20) - 20 + shift) + "\\" * run + '"[{' + "\\" * run + '" ]', "t": [[1], {}]},
                {"a": "y" * ((1 << 20) - 12 + shift) + "\\" * run + '"[', "b": [{}]},
            ):
                assert unyielding_values(json.dumps(document).encode()) == _built_in_c(document), (shift, run)


def test_a_big_json_body_may_be_one_text_but_not_millions_of_small_values(tmp_path):
    fields = _json_body_routes(tmp_path / "routes")
    generate, lookup = fields["POST", "/sessions/{session_id}/generate"], fields["POST", "/lookup"]
    prompt = 'say "[{x}]" and \\ more\n' * ((1 << 20) // 24)  # 1M characters, 175,000 brackets
    body = json.dumps({"text": prompt}).encode()
    assert len(body) > BIG_BODY_BYTES
    assert _parse_and_validate(body, generate).text == prompt
    for item in (b"[],", b"{},", b'"",', b"null,", b"true,", b"NaN,"):
        body = b'{"tokens": [' + item * max(BIG_BODY_VALUES, BIG_BODY_BYTES // len(item)) + b"0]}"
        with pytest.raises(BodyTooLarge, match=f"may hold at most {BIG_BODY_VALUES}"):
            _parse_and_validate(body, lookup)
    # wrong items are one validation error, not one per item (2 million took 45 s with the GIL held)
    for body in (b'{"tokens": [' + b"0.5," * (1 << 20) + b"0]}", b'{"stop": [' + b"null," * 10_000 + b"0]}"):
        with pytest.raises(RequestValidationError) as refused:
            _parse_and_validate(body, generate)
        assert len(refused.value.errors()) == 1, body[:20]


@pytest.mark.parametrize(
    ("kind", "answer"), [("chunked", 413), ("declared", 413), ("lists", 413), ("floats", 422), ("valid", 200)]
)
def test_health_stays_fast_while_8_clients_send_big_json(tmp_path, figures, kind, answer):
    """8 clients send /lookup bodies without pause: 24 MiB chunked (refused at the route's 8 MiB),
    95 MB by Content-Length (refused before reading), just under 8 MiB of empty lists (refused before
    parsing: C-built, they held the GIL for ~2 s each) or of floats (parsed yielding, refused with one
    validation error, not 2 million), or valid ones just under 8 MiB (parsed)."""
    service = start(tmp_path)
    try:
        prober = Prober(service.url + "/health", every=0.01)
        prober.start()
        counts = json_load(service.url, KEYS["alice"], kind, 6.0 if LONG else 3.0, clients=8)
        prober.stop()
    finally:
        stop(service)
    assert set(counts) == {answer}, counts
    assert set(prober.statuses) == {200}
    # Before the fix one such body stalled the event loop for seconds (a 95 MB /lookup: 3.2 s). The
    # figure (p99 <= 100 ms) is measured by bench/exhaustion_bench.py; this bound only has to hold
    # on a busy 2-core runner.
    assert prober.p99() < 1.0, (prober.p99(), prober.worst(), len(prober.latencies))
    figures.add("exhaustion", f"json_{kind}_8_clients", inputs=sum(counts.values()), server_errors=0)


# ---------------------------------------------------------------------------------- item 3
def test_requests_for_missing_ids_leave_no_lock_files(tmp_path, figures):
    service = start(tmp_path)
    rounds = 100 if LONG else 20
    tried = 0
    try:
        with service.client() as alice, service.client("bob") as bob:
            create(alice, "real")
            assert (
                alice.post(
                    "/sessions/real/append", content=arrow_rows(GEOMETRY, 4), headers={"Content-Type": ARROW}
                ).status_code
                == 200
            )
            before = store_files(service.data)
            for i in range(rounds):
                missing = f"missing-{i}"
                calls = [
                    ("POST", f"/sessions/{missing}/append", {"content": b"", "headers": {"Content-Type": RAW}}),
                    ("POST", f"/sessions/{missing}/truncate", {"json": {"n_records": 0}}),
                    ("POST", f"/sessions/{missing}/fork", {"json": {"id": f"copy-{i}"}}),
                    ("DELETE", f"/sessions/{missing}", {}),
                    ("POST", f"/sessions/{missing}/park", {}),
                    ("POST", f"/sessions/{missing}/unpark", {}),
                    ("GET", f"/sessions/{missing}/resume", {}),
                    ("GET", f"/sessions/{missing}/verify", {}),
                    ("POST", f"/sessions/{missing}/file/repair", {}),
                    ("GET", f"/sessions/{missing}/file/inspect", {}),
                    ("POST", f"/sessions/{missing}/file/migrate", {"json": {"tier": "fp8"}}),
                ]
                for method, path, kwargs in calls:
                    assert alice.request(method, path, **kwargs).status_code == 404, path
                    tried += 1
                # another owner's id, every route: the same 404, and no lock file either
                for method, path, kwargs in calls:
                    assert bob.request(method, path.replace(missing, "real"), **kwargs).status_code == 404, path
                    tried += 1
                # a refused create of a new id
                bad = {"id": f"bad-{i}", "model": MODEL, "geometry": {**GEOMETRY_JSON, "vocab": 0}}
                assert alice.post("/sessions", json=bad).status_code in (400, 422)
                tried += 1
            assert store_files(service.data) == before, store_files(service.data) - before
            # a deleted session takes its lock files with it
            create(alice, "gone")
            assert alice.delete("/sessions/gone").status_code == 204
            assert store_files(service.data) == before
    finally:
        stop(service)
    figures.add("exhaustion", "missing_ids_lock_files", inputs=tried, leaked=0)


def test_the_last_reader_of_a_missing_session_removes_its_lock_file(tmp_path):
    """A reader that unlinked a missing session's read lock file while another reader still held it
    could remove the name of a file a create-then-truncate had just locked; the last one out does it."""
    with SessionStore(tmp_path / "store") as store:
        ctx = store._ctx
        key = storage_key("ghost", "alice")
        first, second = ctx.reading(key).acquire(), ctx.reading(key).acquire()
        first.release()
        assert second.path.exists()  # still held: not unlinked under its holder
        second.release()
        assert not second.path.exists()
        writer = ctx.writing(key).acquire()
        writer.release()
        assert not writer.path.exists()
        # a session that exists keeps its lock files
        store.create("alice", GEOMETRY, tiers.F32, MODEL, session_id="kept")
        kept = storage_key("kept", "alice")
        for lock in (ctx.reading(kept), ctx.writing(kept)):
            lock.acquire().release()
            assert lock.path.exists()


def test_the_job_queue_is_capped_per_owner_and_in_all(tmp_path, figures):
    service = start(tmp_path, "--max-jobs", "4", "--max-jobs-per-owner", "3", "--lock-timeout", "30")
    try:
        with service.client() as alice, service.client("bob") as bob:
            create(alice, "parked")
            create(bob, "bobs")
            with session_lock_held(service.data, "parked"):  # alice's jobs wait for it
                accepted = [alice.post("/sessions/parked/park") for _ in range(3)]
                assert [r.status_code for r in accepted] == [202] * 3
                refused = alice.post("/sessions/parked/park")
                assert refused.status_code == 429, refused.text
                assert (
                    refused.json()["error"] == "JobQueueFull" and "--max-jobs-per-owner 3" in refused.json()["reason"]
                )
                assert int(refused.headers["Retry-After"]) >= 1
                assert alice.post("/sessions/parked/file/migrate", json={"tier": "fp8"}).status_code == 429
                with session_lock_held(service.data, "bobs"):
                    assert bob.post("/sessions/bobs/park").status_code == 202  # bob's share: 4 in all
                    full = bob.post("/sessions/bobs/unpark")
                    assert full.status_code == 429 and "--max-jobs 4" in full.json()["reason"], full.text
                    assert "Retry-After" in full.headers
            deadline = time.monotonic() + 60
            while any(j["state"] in ("queued", "running") for j in alice.get("/jobs").json() + bob.get("/jobs").json()):
                assert time.monotonic() < deadline, "the jobs did not finish once the locks were free"
                time.sleep(0.05)
            assert {j["state"] for j in alice.get("/jobs").json()} == {"done"}
            assert alice.post("/sessions/parked/unpark").status_code == 202  # room again
    finally:
        stop(service)
    figures.add("exhaustion", "job_queue_cap", inputs=9, accepted=0)


# ---------------------------------------------------------------------------------- item 4
def test_waiting_for_a_busy_session_does_not_starve_other_sessions(tmp_path, figures):
    waiters = 4
    service = start(tmp_path, "--session-waiters", str(waiters))
    hold_s = 3.0
    try:
        with service.client() as alice:
            create(alice, "busy")
            create(alice, "other")
            rows = arrow_rows(GEOMETRY, 2)
            clients = [service.client() for _ in range(61)]  # made first: making 60 at once takes seconds

            def append(sid: str, client: httpx.Client):
                started = time.perf_counter()
                response = client.post(f"/sessions/{sid}/append", content=rows, headers={"Content-Type": ARROW})
                return response, time.perf_counter() - started

            with session_lock_held(service.data, "busy"):
                held_until = time.monotonic() + hold_s
                pool = ThreadPoolExecutor(60)
                busy = [pool.submit(append, "busy", client) for client in clients[:60]]
                while sum(f.done() for f in busy) < 60 - waiters and time.monotonic() < held_until - 0.5:
                    time.sleep(0.02)
                # the refusals came while the lock was held, not when it was freed
                refused_while_held = sum(f.done() and f.result()[0].status_code == 429 for f in busy)
                # one more, alone, is refused at once
                response, took = append("busy", clients[60])
                assert response.status_code == 429 and took < 0.5, (response.status_code, took)
                # meanwhile, other sessions are served at once
                other_latencies = []
                for _ in range(10):
                    response, took = append("other", clients[60])
                    assert response.status_code == 200, response.text
                    other_latencies.append(took)
                    started = time.perf_counter()
                    assert alice.get("/sessions/other").status_code == 200
                    other_latencies.append(time.perf_counter() - started)
                time.sleep(max(0.0, held_until - time.monotonic()))
            results = [f.result() for f in busy]
            pool.shutdown()
            for client in clients:
                client.close()
            assert max(other_latencies) < 1.0, other_latencies  # before: queued behind 40 blocked threads
            statuses = [r.status_code for r, _ in results]
            assert statuses.count(200) == waiters, statuses  # the waiters went in once the lock was free
            assert statuses.count(429) == refused_while_held == 60 - waiters, (statuses, refused_while_held)
            for response, _ in results:
                if response.status_code == 429:
                    assert response.json()["error"] == "SessionBusy" and response.headers["Retry-After"] == "1"
            info = alice.get("/sessions/busy").json()
            assert info["n_records"] == 2 * waiters
    finally:
        stop(service)
    figures.add("exhaustion", "busy_session_waiters", inputs=60 + 20, server_errors=0)


def test_a_refused_append_is_refused_before_its_body_is_read(tmp_path):
    """Beyond --session-waiters an append is refused on its headers: its body (up to --max-body) is
    never read, so refused requests cost the server no memory."""
    service = start(tmp_path, "--session-waiters", "2", "--lock-timeout", "60")
    rows = arrow_rows(GEOMETRY, 2)
    clients = [service.client() for _ in range(3)]
    pool = ThreadPoolExecutor(3)
    try:
        with service.client() as alice:
            create(alice, "busy")
            with session_lock_held(service.data, "busy"):
                sent = [
                    pool.submit(c.post, "/sessions/busy/append", content=rows, headers={"Content-Type": ARROW})
                    for c in clients
                ]
                deadline = time.monotonic() + 60
                while not any(f.done() for f in sent):  # two wait for the lock, the third is refused
                    assert time.monotonic() < deadline, "no append was refused"
                    time.sleep(0.02)
                # headers declaring 100 MB, and no body: answered without waiting for it
                status = _status_without_body(service.url, "/sessions/busy/append", 100_000_000)
            statuses = sorted(f.result().status_code for f in sent)
        assert status.startswith(b"HTTP/1.1 429"), status
        assert statuses == [200, 200, 429], statuses
    finally:
        pool.shutdown()
        for client in clients:
            client.close()
        stop(service)


def _status_without_body(url: str, path: str, length: int) -> bytes:
    """POST ``path`` with headers declaring ``length`` bytes of Arrow and send none of them: the status
    line the server answers with in 10 s (b"" if it waits for the body instead)."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['alice']}\r\n"
        f"Content-Type: {ARROW}\r\nContent-Length: {length}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode())
        try:
            reply = sock.recv(65536)
        except TimeoutError:
            reply = b""
    return reply.split(b"\r\n", 1)[0]


def test_uploads_held_at_once_are_bounded_service_wide(tmp_path):
    """--max-inflight-bytes (item 7 of issue 42): the bodies of uploads the service holds at once are
    bounded across sessions and owners; one that would pass the budget is refused on its headers —
    503 UploadsBusy with Retry-After, its body never read — and goes in once the others are done."""
    body = arrow_rows(GEOMETRY, 64, compression=None)
    size = len(body)
    service = start(tmp_path, "--max-body", str(size), "--max-inflight-bytes", str(2 * size))
    host, port = service.url.removeprefix("http://").split(":")
    try:
        with service.client() as alice, service.client("bob") as bob:
            for client, sid in ((alice, "a"), (alice, "b"), (alice, "d"), (bob, "c")):
                create(client, sid)
            # two uploads send their headers and half their body, then stall: they hold the budget
            stalled = []
            for sid in ("a", "b"):
                sock = socket.create_connection((host, int(port)), timeout=30)
                head = (
                    f"POST /sessions/{sid}/append HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['alice']}\r\n"
                    f"Content-Type: {ARROW}\r\nContent-Length: {size}\r\n\r\n"
                )
                sock.sendall(head.encode() + body[: size // 2])
                stalled.append(sock)
            deadline = time.monotonic() + 30
            while _metric(alice, "kvstore_upload_bytes_held") < 2 * size:
                assert time.monotonic() < deadline, "the stalled uploads are not counted as held"
                time.sleep(0.02)
            refused = bob.post("/sessions/c/append", content=body, headers={"Content-Type": ARROW})
            assert refused.status_code == 503 and refused.json()["error"] == "UploadsBusy", refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            # headers declaring a body and no byte of it: answered without waiting for it
            assert _status_without_body(service.url, "/sessions/d/append", size).startswith(b"HTTP/1.1 503")
            assert _metric(alice, "kvstore_uploads_refused_total") == 2
            for sock in stalled:  # the stalled ones finish and are acknowledged
                sock.sendall(body[size // 2 :])
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
                sock.close()
            assert _metric(alice, "kvstore_upload_bytes_held") == 0
            answer = bob.post("/sessions/c/append", content=body, headers={"Content-Type": ARROW})
            assert answer.status_code == 200 and answer.json()["appended"] == 64, answer.text
    finally:
        stop(service)


def _metric(client: httpx.Client, name: str) -> float:
    """One unlabelled sample of ``GET /metrics``."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def test_a_wait_longer_than_the_lock_timeout_answers_409(tmp_path):
    service = start(tmp_path, "--lock-timeout", "1")
    try:
        with service.client() as alice:
            create(alice, "held")
            with session_lock_held(service.data, "held"):
                started = time.perf_counter()
                response = alice.post("/sessions/held/truncate", json={"n_records": 0})
                took = time.perf_counter() - started
            assert response.status_code == 409 and response.json()["error"] == "JournalLocked", response.text
            assert 0.9 <= took < 3.0, took
            assert alice.post("/sessions/held/truncate", json={"n_records": 0}).status_code == 200
    finally:
        stop(service)


def test_the_lock_timeout_is_one_setting(tmp_path):
    assert Settings().lock_timeout == DEFAULT_LOCK_TIMEOUT_S
    assert Settings().session_waiters == DEFAULT_SESSION_WAITERS
    assert (Settings().max_jobs, Settings().max_jobs_per_owner) == (DEFAULT_MAX_PENDING, DEFAULT_MAX_PENDING_PER_OWNER)
    with SessionStore(tmp_path / "store") as store:
        assert store.lock_timeout == DEFAULT_LOCK_TIMEOUT_S
    assert FileLock(tmp_path / "x.lock").timeout == DEFAULT_LOCK_TIMEOUT_S
    for function in (KVFile.create, KVFile.open, writer_lock):
        defaults = {
            name: parameter.default
            for name, parameter in __import__("inspect").signature(function).parameters.items()
            if "timeout" in name
        }
        assert set(defaults.values()) == {DEFAULT_LOCK_TIMEOUT_S}, (function, defaults)


def test_every_limit_is_a_documented_setting():
    """The bounds of items 1-4 are flags of `kvstore serve`, in its --help and in docs/API.md "Limits"."""
    shown = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    docs = (Path(__file__).resolve().parents[2] / "docs" / "API.md").read_text()
    limits = docs[docs.index("### Limits") : docs.index("## API keys")]
    for flag in ["--max-body", "--max-inflight-bytes", *(f"--{name.replace('_', '-')}" for name in LIMITS)]:
        assert flag in shown, flag
        assert f"`{flag} " in limits, flag
    for error in (
        "413 BodyTooLarge", "429 SessionBusy", "429 JobQueueFull", "409 JournalLocked", "503 UploadsBusy", "408",
        "Retry-After",
    ):  # fmt: skip
        assert error in limits, error
    assert str(JSON_BODY_BYTES // 1024) in limits and str(TOKENS_BODY_BYTES >> 20) in limits
    assert f"at most {BIG_BODY_VALUES} arrays" in limits and str(arrow.MAX_BATCHES) in limits


def test_a_lookup_waits_for_a_busy_candidate_no_longer_than_the_lock_timeout(tmp_path):
    """The per-candidate wait of a prefix lookup (1 s) is bounded by the one lock timeout too."""
    with SessionStore(tmp_path / "store", lock_timeout=0) as store:
        store.create("alice", GEOMETRY, tiers.F32, MODEL, session_id="long")
        rng = np.random.default_rng(0)
        g, n = GEOMETRY, 128  # two whole prefix blocks
        tokens = np.arange(n, dtype=np.int32) % g.vocab
        rows = [rng.standard_normal(shape, dtype=np.float32) for shape in ((2, n, 64), (2, n, 16), (1, n, 8))]
        store.append("long", tokens, *rows, owner="alice")
        fingerprint = store.get("long", owner="alice").fingerprint
        key = storage_key("long", "alice")
        with FileLock(tmp_path / "store" / "locks" / f"{key}.read", timeout=0):  # a cut or park holds it
            started = time.perf_counter()
            assert store.lookup("alice", fingerprint, tokens) is None  # skipped, not waited for
            # loose: a single try takes microseconds; before, every busy candidate took 1 s
            assert time.perf_counter() - started < 0.8
        assert store.lookup("alice", fingerprint, tokens).matched_tokens == n


def test_a_capped_wait_tries_once(tmp_path):
    path = tmp_path / "s.lock"
    with FileLock(path):
        started = time.perf_counter()
        with waits_capped(0), pytest.raises(Exception) as caught:
            FileLock(path, timeout=30).acquire()
        assert type(caught.value).__name__ == "JournalLocked"
        assert time.perf_counter() - started < 0.5
