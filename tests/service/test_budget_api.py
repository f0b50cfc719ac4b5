"""One disk budget for the whole store, through the API, with generate and append calls at once.

- **Hard limit** (``--hard-limit``): four clients — two generating turns, two appending raw rows —
  write concurrently until each is refused. The store never exceeds the limit, every refusal is
  ``507 BudgetExceeded`` with the reason and wrote nothing (each session holds exactly the records
  of its acknowledged calls, and its turn hashes verify), and the engine does not trust a cache
  whose turn was refused: the next turn restores from the journal.
- **Soft budget** (``--budget``): least recently used active sessions are parked, then the least
  recently used parked ones deleted, until the store fits; the session just written is kept. A
  parked session resumes through ``generate`` with its rows reused (it is unparked).
"""

from __future__ import annotations

import threading

import numpy as np

from kvstore import tiers
from kvstore.formats.coli_kv import Geometry, encode_records
from service.support import metrics

TURN = {"tokens": [5, 6, 7, 8], "max_new_tokens": 4, "stop": []}  # 8 records a turn
RECORD_BYTES = 4 + 4 * (64 + 32) * 4  # f32 (v1) records of the tiny model
TURN_BYTES = 8 * RECORD_BYTES


def _rows(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    geometry = Geometry(4, 64, 32, 0, 0, 512)
    return encode_records(
        geometry, tiers.F32, rng.integers(0, 512, 8), rng.standard_normal((4, 8, 64)), rng.standard_normal((4, 8, 32))
    ).tobytes()


def _journal_bytes(data) -> int:
    return sum(p.stat().st_size for p in (data / "journals").glob("*.coli_kv")) + sum(
        p.stat().st_size for p in (data / "archive").glob("*.zst")
    )


def test_the_hard_limit_holds_under_concurrent_generate_and_append_calls(make_server, model_dir):
    limit = 250_000
    server = make_server("--model", str(model_dir), "--hard-limit", str(limit), log_level="warning")
    acknowledged: dict[str, int] = {"g1": 0, "g2": 0, "a1": 0, "a2": 0}
    refusals: list[tuple[str, int, dict]] = []
    with server.client() as alice:
        engine = alice.get("/engine").json()
        for sid in ("a1", "a2"):
            body = {"id": sid, "model": engine["model"], "geometry": engine["geometry"], "tier": "f32"}
            assert alice.post("/sessions", json=body).status_code == 201
        for sid in ("g1", "g2"):  # a first turn each before the race (appends are much faster than turns)
            first = alice.post(f"/sessions/{sid}/generate", json={**TURN, "create": True})
            assert first.status_code == 200, first.text
            acknowledged[sid] += first.json()["appended"]

    def generate(sid: str) -> None:
        with server.client() as client:
            for _ in range(40):
                answer = client.post(f"/sessions/{sid}/generate", json=TURN)
                if answer.status_code != 200:
                    refusals.append((sid, answer.status_code, answer.json()))
                    return
                acknowledged[sid] += answer.json()["appended"]

    def append(sid: str) -> None:
        with server.client() as client:
            for call in range(40):
                answer = client.post(
                    f"/sessions/{sid}/append", content=_rows(call), headers={"Content-Type": "application/octet-stream"}
                )
                if answer.status_code != 200:
                    refusals.append((sid, answer.status_code, answer.json()))
                    return
                acknowledged[sid] += answer.json()["appended"]

    workers = [threading.Thread(target=generate, args=(s,)) for s in ("g1", "g2")]
    workers += [threading.Thread(target=append, args=(s,)) for s in ("a1", "a2")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    assert sorted(sid for sid, _, _ in refusals) == ["a1", "a2", "g1", "g2"]  # everyone ran into the limit
    for sid, status, body in refusals:
        assert status == 507 and body["error"] == "BudgetExceeded", (sid, body)
        assert f"over its hard limit of {limit}" in body["reason"] and "nothing was written" in body["reason"]
    assert _journal_bytes(server.data) <= limit
    with server.client() as alice:
        counted = metrics(alice)
        assert (
            counted["kvstore_store_used_bytes"]
            == _journal_bytes(server.data)
            <= counted["kvstore_store_hard_limit_bytes"]
            == limit
        )
        assert counted['kvstore_generate_errors_total{error="BudgetExceeded"}'] == 2
        for sid, records in acknowledged.items():
            info = alice.get(f"/sessions/{sid}").json()
            assert info["n_records"] == info["watermark"] == records > 0, sid
            assert alice.get(f"/sessions/{sid}/verify").json()["ok"], sid
        # the refused turn's rows are in the cache but not in the journal: the next turn restores
        for sid in ("a1", "a2"):
            assert alice.delete(f"/sessions/{sid}").status_code == 204
        resumed = alice.post("/sessions/g1/generate", json=TURN)
        assert resumed.status_code == 200, resumed.text
        assert (resumed.json()["source"], resumed.json()["reused_tokens"]) == ("journal", acknowledged["g1"])


def test_the_soft_budget_parks_then_deletes_least_recently_used_and_a_parked_session_resumes(make_server, model_dir):
    session_bytes = 40 + TURN_BYTES
    budget = int(3.2 * session_bytes)  # three journals do not fit; parking saves only what zstd saves on f32 rows
    # a pool that keeps one idle session resident: a turn on an evicted session restores it from the store
    server = make_server("--model", str(model_dir), "--budget", str(budget), "--pool-size", "0", log_level="warning")
    order = ["s1", "s2", "s3", "s4"]
    with server.client() as alice:
        for sid in order:
            assert alice.post(f"/sessions/{sid}/generate", json={**TURN, "create": True}).status_code == 200
        listed = {s["id"]: s for s in alice.get("/sessions").json()["sessions"]}
        states = [listed[sid]["state"] if sid in listed else "deleted" for sid in order]
        assert states[-1] == "active"  # the session just written is never evicted for itself
        rank = {"deleted": 0, "parked": 1, "active": 2}
        assert [rank[s] for s in states] == sorted(rank[s] for s in states), states  # evicted in LRU order
        assert states[0] != "active" and "parked" in states, states
        assert metrics(alice)["kvstore_store_used_bytes"] <= budget
        parked = next(sid for sid, state in zip(order, states) if state == "parked")
        resumed = alice.post(f"/sessions/{parked}/generate", json={"tokens": [9], "max_new_tokens": 2, "stop": []})
        assert resumed.status_code == 200, resumed.text
        assert (resumed.json()["source"], resumed.json()["reused_tokens"], resumed.json()["prefilled_tokens"]) == (
            "journal",
            8,
            1,
        )
        for sid, state in zip(order, states):
            if state == "deleted":
                assert alice.post(f"/sessions/{sid}/generate", json={"tokens": [9]}).status_code == 404
