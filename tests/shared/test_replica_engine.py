"""The bundled engine on replicas of a shared store (``kvstore serve --index --blobs --model``).

A conversation's turns land on whichever replica the load balancer picks. Each turn restores the
session from the shared store unless that replica's live cache holds its current state, prefills
only the new tokens, and appends the turn through the lease protocol; the conversation's tokens
and stored rows are exactly those of one embedded server that ran every turn itself.
"""

from __future__ import annotations

import httpx

from kvstore.engine.weights import write_random_model
from service.support import Server, metrics

TURN = {"max_new_tokens": 4, "stop": []}
TURNS = [{"text": "Hello", "create": True}, {"tokens": [40, 41, 42]}, {"tokens": [50, 51]}, {"tokens": [60]}]


def _generate(client: httpx.Client, session_id: str, **body) -> dict:
    response = client.post(f"/sessions/{session_id}/generate", json={**TURN, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _image(client: httpx.Client) -> bytes:
    answer = client.get("/sessions/chat/resume", params={"format": "coli_kv"})
    assert answer.status_code == 200, answer.text
    return answer.content


def test_a_conversation_continues_on_any_replica_without_re_prefill(tmp_path, child_env, hash_cache):
    model = str(write_random_model(tmp_path / "tiny", "tiny", seed=0))
    embedded = Server(tmp_path / "embedded", "--model", model).start()
    try:
        with embedded.client() as alice:
            expected = [_generate(alice, "chat", **turn) for turn in TURNS]
            expected_image = _image(alice)
    finally:
        embedded.stop()

    a = Server(tmp_path / "a", "--model", model, env=child_env).start()
    b = Server(tmp_path / "b", "--model", model, env=child_env).start()
    try:
        got = []
        for server, turn in zip((a, b, a, a), TURNS):
            with server.client() as alice:
                got.append(_generate(alice, "chat", **turn))
        stored = [r["session"]["n_records"] for r in got]
        # B restores what A wrote from the shared store; A's resident rows are stale after B's turn,
        # so A restores again; then they are live
        assert [(r["source"], r["reused_tokens"], r["prefilled_tokens"]) for r in got] == [
            ("new", 0, 5),
            ("shared", stored[0], 3),
            ("shared", stored[1], 2),
            ("live", stored[2], 1),
        ]
        assert [r["tokens"] for r in got] == [r["tokens"] for r in expected]
        assert stored == [r["session"]["n_records"] for r in expected]
        with a.client() as on_a, b.client() as on_b:
            assert _image(on_a) == _image(on_b) == expected_image  # the f32 rows of one uninterrupted run
            assert metrics(on_a)['kvstore_restores_total{source="shared"}'] == 1
            assert metrics(on_b)['kvstore_restores_total{source="shared"}'] == 1
            # the engine's other answers on a replica: its description, and a refused turn changes nothing
            assert on_a.get("/engine").json()["fingerprint"] == on_b.get("/engine").json()["fingerprint"]
            refused = on_b.post("/sessions/chat/generate", json={**TURN, "tokens": [10**9]})
            assert refused.status_code == 422 and refused.json()["error"] == "GenerationError", refused.text
            assert _image(on_b) == expected_image
    finally:
        a.stop()
        b.stop()
