"""``POST /sessions/{id}/generate`` on a real ``kvstore serve --model`` (uvicorn on 127.0.0.1, httpx).

Reuse is reported and checked: after a restart (a new server process) the next turn restores the
session from its journal and prefills only the new turn — in the body, the ``X-KV-*`` headers, the
server's log and the ``/metrics`` counters. A naive server that re-prefills the whole conversation
reports ``prefilled_tokens`` = everything and fails every one of those checks.
"""

from __future__ import annotations

import re
import time

import httpx
import numpy as np

from kvstore import tiers
from kvstore.engine.generate import Engine
from kvstore.engine.weights import load_model
from service.support import OTHER_KEY, metrics, sse_events

TURN = {"max_new_tokens": 4, "stop": []}


def _generate(client: httpx.Client, session_id: str, **body) -> dict:
    response = client.post(f"/sessions/{session_id}/generate", json={**TURN, **body})
    assert response.status_code == 200, response.text
    result = response.json()
    assert response.headers["X-KV-Reused-Tokens"] == str(result["reused_tokens"])
    assert response.headers["X-KV-Prefilled-Tokens"] == str(result["prefilled_tokens"])
    assert response.headers["X-KV-Source"] == result["source"]
    return result


def test_a_conversation_resumed_after_a_restart_prefills_only_the_new_turn(make_server, model_dir):
    first_server = make_server("--model", str(model_dir))  # f32
    with first_server.client() as alice:
        first = _generate(alice, "chat", text="Hello", create=True)
        assert first["created"] and (first["source"], first["reused_tokens"], first["prefilled_tokens"]) == (
            "new",
            0,
            5,
        )
        assert first["session"]["model"]["weights_hash"].startswith("blake2b:")
        assert first["session"]["tier"]["name"] == "f32"
        stored = first["session"]["n_records"]
        assert stored == 5 + 4

        streamed = alice.post(
            "/sessions/chat/generate", json={**TURN, "tokens": [40, 41, 42]}, headers={"Accept": "text/event-stream"}
        )
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        assert (streamed.headers["X-KV-Reused-Tokens"], streamed.headers["X-KV-Prefilled-Tokens"]) == (str(stored), "3")
        events = sse_events(streamed)
        names = [name for name, _ in events]
        assert names[:4] == ["token"] * 4 and names[4:] in (["done"], ["text", "done"])
        done = events[-1][1]
        assert [data["token"] for name, data in events if name == "token"] == done["tokens"]
        assert "".join(data["text"] for _, data in events[:-1]) == done["text"]
        assert (done["source"], done["reused_tokens"], done["prefilled_tokens"]) == ("live", stored, 3)
        assert done["session"]["tier"]["name"] == "f32"
        stored = done["session"]["n_records"]
        history = alice.get("/sessions/chat/resume", params={"format": "coli_kv"}).content
    first_server.stop()

    second_server = make_server("--model", str(model_dir), "--tier", "fp8")  # a new process, another tier
    with second_server.client() as alice:
        before = metrics(alice)
        resumed = _generate(alice, "chat", tokens=[50, 51])
        assert (resumed["source"], resumed["reused_tokens"], resumed["prefilled_tokens"]) == ("journal", stored, 2)
        assert (
            resumed["restored_tokens"] == stored
            and resumed["upgraded"] == f"{tiers.F32.describe()} -> {tiers.FP8.describe()}"
        )
        assert resumed["session"]["tier"]["version"] == 2 and resumed["session"]["tier"]["name"] == "fp8"
        after = metrics(alice)
        assert after["kvstore_reused_tokens_total"] - before["kvstore_reused_tokens_total"] == stored
        assert after["kvstore_prefilled_tokens_total"] - before["kvstore_prefilled_tokens_total"] == 2
        assert (
            after['kvstore_restores_total{source="journal"}'] == 1 and after["kvstore_restored_tokens_total"] == stored
        )

        again = _generate(alice, "chat", tokens=[60])
        n = resumed["session"]["n_records"]
        assert (again["source"], again["reused_tokens"], again["prefilled_tokens"]) == ("live", n, 1)
        assert metrics(alice)['kvstore_restores_total{source="live"}'] == 1
    log = second_server.stop()
    assert f"turn session=chat source=journal reused={stored} prefilled=2 generated=4" in log
    assert f"turn session=chat source=live reused={n} prefilled=1 generated=4" in log

    # the turn after the restart continued the conversation the first server journaled (f32 rows, exact):
    # its tokens are the ones an uninterrupted fp8 engine produces from the whole history
    from kvstore.formats import coli_kv

    tokens = np.frombuffer(
        history[coli_kv.HEADER_BYTES :],
        dtype=coli_kv.record_dtype(coli_kv.parse_header(history[: coli_kv.HEADER_BYTES]).geometry, coli_kv.tiers.F32),
    )["token"].tolist()
    uninterrupted = Engine(load_model(model_dir), tier="fp8").generate(
        tokens + [50, 51], max_new_tokens=4, stop_tokens=()
    )
    assert resumed["tokens"] == uninterrupted.tokens


def test_refusals_are_clear_and_change_nothing(make_server, model_dir):
    # a pool that keeps one idle session resident: a turn on another session restores it from its journal
    server = make_server("--model", str(model_dir), "--tier", "fp8", "--pool-size", "0")
    with server.client() as alice, server.client(OTHER_KEY) as bob:
        engine = alice.get("/engine").json()
        assert engine["cache_tier"] == "fp8" and engine["journal_tier"] == tiers.FP8.describe()
        ours = _generate(alice, "ours", tokens=[5, 6, 7], create=True)

        missing = alice.post("/sessions/nobody/generate", json={"tokens": [5]})
        assert missing.status_code == 404 and "create" in missing.json()["reason"]
        assert bob.post("/sessions/ours/generate", json={"tokens": [5]}).status_code == 404  # another owner's
        both = alice.post("/sessions/ours/generate", json={"tokens": [5], "text": "x"})
        assert both.status_code == 400 and "either" in both.json()["reason"]
        assert alice.post("/sessions/ours/generate", json={"tokens": [999]}).status_code == 422  # vocab is 512
        assert alice.post("/sessions/..%2Fescape/generate", json={"tokens": [5]}).status_code in (400, 404)
        assert (
            alice.post("/sessions/ours/generate", json={"tokens": [5], "override": ["geometry.vocab"]}).status_code
            == 400
        )

        # a session of other weights: refused before the stream starts (plain JSON), naming the field
        model = {**engine["model"], "weights_hash": "blake2b:" + "0" * 64}
        created = alice.post(
            "/sessions", json={"id": "theirs", "model": model, "geometry": engine["geometry"], "tier": "fp8"}
        )
        assert created.status_code == 201
        rows = alice.get("/sessions/ours/resume").content
        assert (
            alice.post(
                "/sessions/theirs/append", content=rows, headers={"Content-Type": "application/octet-stream"}
            ).status_code
            == 200
        )
        refused = alice.post("/sessions/theirs/generate", json={"tokens": [8], "stream": True})
        assert refused.status_code == 409 and refused.headers["content-type"].startswith("application/json")
        assert (
            refused.json()["error"] == "FingerprintMismatch"
            and "model.weights_hash: session 'blake2b:000" in refused.json()["reason"]
        )
        overridden = _generate(alice, "theirs", tokens=[8], override=["model.weights_hash"])
        assert (overridden["source"], overridden["reused_tokens"], overridden["prefilled_tokens"]) == (
            "journal",
            ours["session"]["n_records"],
            1,
        )

        # a journal cut behind the store's back: the restore fails with the reason, nothing changes
        journal = server.data / "journals" / "ours~alice.coli_kv"  # <id>~<owner>
        size = journal.stat().st_size
        with open(journal, "r+b") as f:
            f.truncate(size - 100)
        session_before = alice.get("/sessions/ours").json()
        cut = alice.post("/sessions/ours/generate", json={"tokens": [9]})
        assert (
            cut.status_code == 409
            and cut.json()["error"] == "IntegrityError"
            and "ended at record" in cut.json()["reason"]
        )
        assert alice.get("/sessions/ours").json()["n_records"] == session_before["n_records"]
        still = _generate(
            alice, "theirs", tokens=[10], override=["model.weights_hash"]
        )  # the live cache was not touched
        assert still["source"] == "live"

        counted = metrics(alice)
        assert counted['kvstore_generate_errors_total{error="FingerprintMismatch"}'] == 1  # the override is per call
        assert counted['kvstore_generate_errors_total{error="IntegrityError"}'] == 1

        # a client that leaves mid-stream stops the turn; what was generated is journaled
        before = alice.get("/sessions/theirs").json()["n_records"]
        with alice.stream(
            "POST",
            "/sessions/theirs/generate",
            json={
                "tokens": [11],
                "max_new_tokens": 4096,
                "stop": [],
                "stream": True,
                "override": ["model.weights_hash"],
            },
        ) as live:
            seen = 0
            for line in live.iter_lines():
                seen += line.startswith("event: token")
                if seen == 3:
                    break
        for _ in range(600):
            settled = metrics(alice)
            if settled["kvstore_turns_cancelled_total"] == 1:
                break
            time.sleep(0.05)  # the turn ends on the server after the client left
        assert settled["kvstore_turns_cancelled_total"] == 1
        after = alice.get("/sessions/theirs").json()
        assert before + 1 + 3 <= after["n_records"] < before + 1 + 5000 and after["watermark"] == after["n_records"]
        assert alice.get("/sessions/theirs/verify").json()["ok"]


def test_without_a_model_generation_answers_503_with_the_reason(make_server):
    server = make_server()
    with server.client() as alice, server.client(None) as anonymous:
        assert anonymous.post("/sessions/x/generate", json={"tokens": [1]}).status_code == 401
        answer = alice.post("/sessions/x/generate", json={"tokens": [1], "create": True})
        assert answer.status_code == 503
        assert answer.json()["error"] == "EngineNotLoaded" and "kvstore serve --model DIR" in answer.json()["reason"]
        assert alice.get("/engine").status_code == 503
        assert alice.get("/sessions").json() == {"sessions": [], "next_cursor": None}  # nothing was created
        page = anonymous.get("/metrics")  # no credentials: process totals only
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
        assert re.search(r"^kvstore_engine_loaded 0\.0$", page.text, re.MULTILINE)


def test_a_refused_generate_with_create_leaves_no_trace(make_server, model_dir):
    # Issue 15, item 15: an empty turn with create (text "", tokens []), streamed or not, is refused
    # before the session exists: no session for anyone, no journal, no lock file.
    server = make_server("--model", str(model_dir))
    with server.client() as alice:
        for body in ({"text": ""}, {"tokens": []}, {"text": "", "stream": True}, {"tokens": [99999]}):
            refused = alice.post("/sessions/ghost/generate", json={**TURN, **body, "create": True})
            assert refused.status_code == 422 and refused.headers["content-type"].startswith("application/json")
            assert refused.json()["error"] in ("GenerationError", "RequestValidationError"), refused.text
            assert alice.get("/sessions/ghost").status_code == 404
            assert [s["id"] for s in alice.get("/sessions").json()["sessions"]] == []
            assert sorted(p.name for p in server.data.rglob("*") if "ghost" in p.name) == [], body
        created = _generate(alice, "ghost", text="Hi", create=True)  # the first turn that runs creates it
        assert created["created"] and created["session"]["n_records"] == 2 + 4
