"""NaN and infinity in uploaded rows over HTTP: every tier answers the same way, and says so.

Before: an f32 (v1) session refused them (422) while fp8 and TurboQuant sessions stored them as
zeros without a word. Now every tier stores them by its rule and the append answer counts them
(``sanitized``); ``kvstore serve --reject-nonfinite`` refuses them in every tier instead.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from kvstore import tiers
from kvstore.formats import coli_kv
from store.support import GEOMETRY, MODEL, Rows

RAW = {"Content-Type": "application/octet-stream"}
ARROW = {"Content-Type": "application/vnd.apache.arrow.stream"}
GEOMETRY_JSON = dataclasses.asdict(GEOMETRY)


def arrow_body(tokens, L, R, I) -> bytes:
    columns = {
        "token": pa.array(tokens, pa.int32()),
        "L": pa.FixedSizeListArray.from_arrays(pa.array(L.transpose(1, 0, 2).reshape(-1)), L.shape[0] * L.shape[2]),
        "R": pa.FixedSizeListArray.from_arrays(pa.array(R.transpose(1, 0, 2).reshape(-1)), R.shape[0] * R.shape[2]),
        "I": pa.FixedSizeListArray.from_arrays(pa.array(I.transpose(1, 0, 2).reshape(-1)), I.shape[0] * I.shape[2]),
    }
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def poisoned(seed: int):
    tokens, L, R, I = Rows(seed).make(3)
    L[0, 1, 4], R[1, 2, 0], I[0, 2, 1] = np.nan, -np.inf, np.inf
    return tokens, L, R, I


def create(client, sid: str, tier: str) -> None:
    body = {"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON, "tier": tier}
    assert client.post("/sessions", json=body).status_code == 201


@pytest.mark.parametrize("tier", ["f32", "fp8", "int4", "polar3"])
def test_every_tier_stores_nonfinite_rows_by_its_rule_and_counts_them(alice, tier):
    create(alice, "chat", tier)
    answer = alice.post("/sessions/chat/append", content=arrow_body(*poisoned(1)), headers=ARROW)
    assert answer.status_code == 200, answer.text
    zeroed = {1: 0, 2: 1, 3: 2}[tiers.get(tier).version]  # fp8: the -inf row; int4/polar: the NaN row too
    assert answer.json()["sanitized"] == {"values": 3, "rows_zeroed": zeroed}
    assert answer.json()["appended"] == 3
    stored = coli_kv.parse(alice.get("/sessions/chat/resume", params={"format": "coli_kv"}).content)
    L, R, I = stored.dequantize()
    assert np.isfinite(L).all() and np.isfinite(R).all() and np.isfinite(I).all() and I[0, 2, 1] == 0
    clean = alice.post("/sessions/chat/append", content=arrow_body(*Rows(2).make(2)), headers=ARROW)
    assert clean.json()["sanitized"] == {"values": 0, "rows_zeroed": 0}


def test_raw_f32_records_with_nan_are_counted_not_refused(alice):
    create(alice, "raw", "f32")
    records = coli_kv.encode_records(GEOMETRY, tiers.F32, *Rows(3).make(2))
    records["layers"]["Lc"][1, 1, 7] = np.nan
    answer = alice.post("/sessions/raw/append", content=records.tobytes(), headers=RAW)
    assert answer.status_code == 200, answer.text
    assert answer.json()["sanitized"] == {"values": 1, "rows_zeroed": 0}
    served = np.frombuffer(alice.get("/sessions/raw/resume").content, dtype=records.dtype)
    assert served["layers"]["Lc"][1, 1, 7] == 0 and np.isfinite(served["layers"]["Lc"]).all()


def test_reject_nonfinite_refuses_them_in_every_tier_and_changes_nothing(make_server, keys):
    server = make_server("--reject-nonfinite")
    with server.client(keys["alice"]) as alice:
        for tier in ("f32", "fp8", "int4"):
            create(alice, tier, tier)
            assert alice.post(
                f"/sessions/{tier}/append", content=arrow_body(*Rows(4).make(2)), headers=ARROW
            ).is_success
            before = alice.get(f"/sessions/{tier}/resume").content
            refused = alice.post(f"/sessions/{tier}/append", content=arrow_body(*poisoned(5)), headers=ARROW)
            assert refused.status_code == 422 and refused.json()["error"] == "NonFiniteValues"
            assert (
                "3 non-finite values (NaN or infinity), the first at record 1, L layer 0, element 4"
                in (refused.json()["reason"])
            )
            assert alice.get(f"/sessions/{tier}").json()["n_records"] == 2
            assert alice.get(f"/sessions/{tier}/resume").content == before
        records = coli_kv.encode_records(GEOMETRY, tiers.F32, *Rows(3).make(1))
        records["index"][0, 0, 0] = np.inf
        refused = alice.post("/sessions/f32/append", content=records.tobytes(), headers=RAW)
        assert refused.status_code == 422 and "first at record 0, I layer 0, element 0" in refused.json()["reason"]
