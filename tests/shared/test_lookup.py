"""Prefix lookup on replicas of the shared store: the chain hashes of each session's 64-token blocks
are written to PostgreSQL by the commits that move its watermark (appends, a turn ended by an empty
append, forks, truncates), and ``POST /lookup`` answers what the embedded store answers for the
same sessions and queries."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

from kvstore.formats import coli_kv
from served import ServeProcess
from shared.rows import GEOMETRY, TIER, fingerprint_fields
from shared.test_replicas import api_key, client, create, replicas  # noqa: F401  (fixtures)

RAW = "application/octet-stream"
BASE = np.arange(1000, 1400, dtype=np.int32)  # a prompt many sessions start with
OTHER = np.arange(50_000, 50_400, dtype=np.int32)


def rows(tokens: np.ndarray) -> bytes:
    rng = np.random.default_rng(int(tokens[0]) if tokens.size else 0)
    n = tokens.shape[0]
    L = rng.standard_normal((GEOMETRY.n_layers, n, GEOMETRY.kv_lora), dtype=np.float32)
    R = rng.standard_normal((GEOMETRY.n_layers, n, GEOMETRY.qk_rope), dtype=np.float32)
    return coli_kv.encode_records(GEOMETRY, TIER, tokens, L, R).tobytes()


def turn(http: httpx.Client, session_id: str, tokens: np.ndarray, complete: bool = True) -> None:
    answer = http.post(
        f"/sessions/{session_id}/append",
        content=rows(tokens),
        params={"complete_turn": str(complete).lower()},
        headers={"Content-Type": RAW},
    )
    assert answer.status_code == 200, answer.text


def lookup(http: httpx.Client, tokens, model: str = "m") -> tuple[int, Any]:
    answer = http.post(
        "/lookup",
        json={
            **fingerprint_fields(model),
            "tokens": [int(t) for t in tokens],
        },
    )
    return answer.status_code, answer.json()


def scenario(first: httpx.Client, second: httpx.Client) -> list[Any]:
    """Sessions written through ``first``, looked up through ``second``; every answer."""
    out: list[Any] = []
    queries = [
        BASE[:250],  # deeper than every session
        BASE[:150],
        BASE[:63],  # less than one block: no match
        BASE[:64],
        np.concatenate([BASE[:64], OTHER[:100]]),
        np.concatenate([BASE[:140], OTHER[:10]]),
        OTHER[:200],
        np.zeros(0, np.int32),
    ]

    def ask() -> None:
        out.extend(lookup(second, q) for q in queries)
        out.append(lookup(second, BASE[:250], model="other"))  # another fingerprint never matches

    create(first, "a")
    turn(first, "a", BASE[:70])  # block 0
    turn(first, "a", BASE[70:120], complete=False)  # watermark stays 70
    ask()
    turn(first, "a", BASE[120:200])  # watermark 200: blocks 1 and 2
    ask()
    assert first.post("/sessions/a/fork", json={"id": "b", "at": 150}).status_code == 201  # blocks 0, 1
    create(first, "c")
    turn(first, "c", np.concatenate([BASE[:64], OTHER[:100]]))
    create(first, "e")
    turn(first, "e", np.concatenate([BASE[:140], OTHER[:5]]), complete=False)
    ask()
    turn(first, "e", np.zeros(0, np.int32))  # an empty append ends the turn: watermark 145, blocks 0, 1
    ask()
    assert first.post("/sessions/a/truncate", json={"n_records": 100}).status_code == 200  # block 0 only
    ask()
    assert first.delete("/sessions/b").status_code == 204
    ask()
    return out


def test_lookup_answers_as_the_embedded_store(replicas, api_key, tmp_path):  # noqa: F811
    a, b = replicas("r1"), replicas("r2")
    with client(a, api_key) as to_a, client(b, api_key) as to_b:
        shared = scenario(to_a, to_b)
        incomplete = to_b.post("/lookup", json={"tokens": [1]})  # validated as on the embedded store
        assert incomplete.status_code == 422
    embedded = ServeProcess(tmp_path / "embedded", env={"KVSTORE_API_KEYS": f"{api_key}:alice"}).start()
    try:
        with client(embedded, api_key) as local:
            alone = scenario(local, local)
    finally:
        embedded.stop_cleanly()
    assert shared == alone
    matches = [(body["match"] or {}).get("matched_tokens") for status, body in shared if status == 200]
    assert matches[:9] == [70, 70, None, 64, 64, 70, None, None, None]  # before block 1 was written
    assert matches[9:11] == [200, 150]
    assert max(m or 0 for m in matches) == 200 and matches.count(None) >= 5
