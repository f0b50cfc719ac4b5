"""Many conversations at once through a real ``kvstore serve --model`` (uvicorn on 127.0.0.1, httpx).

Concurrent clients are each answered what the same turn gets alone; a client that leaves — streamed
or not — frees its turn at the scheduler's next step; an owner past its limit gets 429 with
``Retry-After`` while another owner's turn is answered before the flooding owner's queued turns.
Assertions are on counts and order (the scheduler's gauges in ``/metrics``), never on timings.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from service.support import OTHER_KEY, metrics

TURN = {"max_new_tokens": 6, "stop": []}
LONG = {"max_new_tokens": 4096, "stop": []}


def _turn(client: httpx.Client, session_id: str, tokens, **body) -> dict:
    answer = client.post(f"/sessions/{session_id}/generate", json={**TURN, "tokens": tokens, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _settled(client: httpx.Client, check, tries: int = 600) -> dict:
    """``/metrics`` once ``check(page)`` holds (the server finishes a turn after its client left)."""
    page = metrics(client)
    for _ in range(tries):
        if check(page):
            return page
        time.sleep(0.05)
        page = metrics(client)
    return page


@pytest.mark.parametrize("step_tokens", [0, 64])
def test_eight_concurrent_clients_each_get_what_the_turn_gets_alone(make_server, model_dir, tmp_path, step_tokens):
    """Eight clients, two turns each, on a server decoding eight turns together: each turn gets the
    tokens it gets on a server to itself, with prompts prefilled by forwards or (``--step-tokens``)
    run inside the decode steps."""
    prompts = {f"s{i}": [[5 + i, 7, 11 + i], [40 + i, 2]] for i in range(8)}
    alone = make_server("--model", str(model_dir), data=tmp_path / "alone")
    with alone.client() as client:
        want = {
            sid: [_turn(client, sid, turns[0], create=True)["tokens"], _turn(client, sid, turns[1])["tokens"]]
            for sid, turns in prompts.items()
        }
    alone.stop()
    server = make_server(
        "--model", str(model_dir), "--max-batch", "8", "--step-tokens", str(step_tokens), data=tmp_path / "together"
    )
    got: dict[str, list] = {}
    errors: list[str] = []

    def converse(sid: str) -> None:
        with server.client() as client:
            try:
                first = _turn(client, sid, prompts[sid][0], create=True)
                second = _turn(client, sid, prompts[sid][1])
                assert second["source"] == "live"  # resident between the turns: nothing restored
                got[sid] = [first["tokens"], second["tokens"]]
            except AssertionError as exc:
                errors.append(f"{sid}: {exc}")

    threads = [threading.Thread(target=converse, args=(sid,)) for sid in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and got == want
    with server.client() as client:
        page = metrics(client)
        assert page["kvstore_scheduler_in_flight"] == 0
        assert page['kvstore_restores_total{source="live"}'] == 8
        # turns shared decode steps: fewer steps than the turns' tokens one after another
        assert page["kvstore_scheduler_steps_total"] < 16 * (TURN["max_new_tokens"] + 1)
        assert page['kvstore_scheduler_seconds_total{phase="decode"}'] > 0
        if step_tokens:  # a slot is always free: every prompt rode a decode step, none took a forward
            assert page["kvstore_scheduler_step_prompts_total"] == 16
            assert page["kvstore_scheduler_prefill_forwards_total"] == 0
            assert page['kvstore_scheduler_seconds_total{phase="prefill"}'] == 0
        else:  # every prompt but its last token is prefilled, one chunk each; waiting chunks share forwards
            assert page["kvstore_scheduler_prefill_chunks_total"] == 16
            assert 1 <= page["kvstore_scheduler_prefill_forwards_total"] <= 16
            assert page["kvstore_scheduler_step_prompts_total"] == 0
            assert page['kvstore_scheduler_seconds_total{phase="prefill"}'] > 0


def test_a_client_that_leaves_frees_its_turn_streamed_or_not(make_server, model_dir):
    server = make_server("--model", str(model_dir))
    with server.client() as client:
        _turn(client, "waited", [5, 6, 7], create=True)
        _turn(client, "streamed", [5, 6, 7], create=True)
        before = {sid: client.get(f"/sessions/{sid}").json()["n_records"] for sid in ("waited", "streamed")}
    # not streamed: the client gives up waiting for the answer
    with server.client() as impatient:
        try:
            impatient.post(
                "/sessions/waited/generate", json={"tokens": [8], **LONG}, timeout=httpx.Timeout(120, read=1.0)
            )
            raise AssertionError("a 4096-token turn answered within a second")
        except httpx.ReadTimeout:
            pass
    with server.client() as client:
        page = _settled(client, lambda p: p["kvstore_turns_cancelled_total"] == 1)
        assert page["kvstore_turns_cancelled_total"] == 1 and page["kvstore_scheduler_in_flight"] == 0
        waited = client.get("/sessions/waited").json()
        assert before["waited"] < waited["n_records"] < before["waited"] + 1 + LONG["max_new_tokens"]
    # streamed: the client reads three tokens and leaves
    with server.client() as client:
        with client.stream("POST", "/sessions/streamed/generate", json={"tokens": [8], "stream": True, **LONG}) as live:
            seen = 0
            for line in live.iter_lines():
                seen += line.startswith("event: token")
                if seen == 3:
                    break
    with server.client() as client:
        page = _settled(client, lambda p: p["kvstore_turns_cancelled_total"] == 2)
        assert page["kvstore_turns_cancelled_total"] == 2 and page["kvstore_scheduler_in_flight"] == 0
        streamed = client.get("/sessions/streamed").json()
        # the prompt's token and the tokens the server had handed to the stream before it noticed
        assert before["streamed"] + 1 + 3 <= streamed["n_records"] < before["streamed"] + 1 + LONG["max_new_tokens"]
        assert client.get("/sessions/streamed/verify").json()["ok"]


def test_a_flooding_owner_gets_429_and_another_owner_is_answered_before_its_queued_turns(make_server, model_dir):
    server = make_server(
        "--model", str(model_dir), "--max-batch", "2", "--max-turns-per-owner", "3", "--max-queue", "4"
    )
    with server.client() as alice:
        for i in range(5):
            _turn(alice, f"a{i}", [5, 6, 7 + i], create=True)
    with server.client(OTHER_KEY) as bob:
        _turn(bob, "b", [9, 10], create=True)
    streams: list = []
    counts = [0] * 3
    clients = [server.client() for _ in range(3)]
    try:
        for i, client in enumerate(clients):  # alice's three long turns: two decode, one waits
            response = client.send(
                client.build_request("POST", f"/sessions/a{i}/generate", json={"tokens": [3], "stream": True, **LONG}),
                stream=True,
            )
            assert response.status_code == 200
            streams.append(response)
        lines = [s.iter_lines() for s in streams]
        for i in (0, 1):  # the two in the slots are decoding
            while counts[i] < 1:
                counts[i] += next(lines[i]).startswith("event: token")
        with server.client() as alice:
            refused = alice.post("/sessions/a3/generate", json={"tokens": [3], **TURN})
            assert refused.status_code == 429 and refused.json()["error"] == "ServerBusy"
            assert int(refused.headers["Retry-After"]) >= 1 and "max-turns-per-owner" in refused.json()["reason"]
            page = metrics(alice)
            assert page['kvstore_scheduler_turns{phase="ready"}'] == 1  # alice's third turn waits for a slot
        with server.client(OTHER_KEY) as bob:
            answered = _turn(bob, "b", [11])  # bob has nothing decoding: a slot at the next step
            assert answered["finish_reason"] == "length" and len(answered["tokens"]) == TURN["max_new_tokens"]
        with server.client() as alice:
            page = metrics(alice)
        # answered while alice's queued turn has not had a slot yet
        assert page['kvstore_scheduler_turns{phase="ready"}'] >= 1 and page["kvstore_scheduler_refused_total"] == 1
        assert page["kvstore_scheduler_preempted_total"] >= 1
    finally:
        for response in streams:
            response.close()
        for client in clients:
            client.close()
    with server.client() as alice:
        page = _settled(alice, lambda p: p["kvstore_scheduler_in_flight"] == 0)
        assert page["kvstore_scheduler_in_flight"] == 0 and page["kvstore_turns_cancelled_total"] == 3
