"""The HTTP API end to end: a real uvicorn server on 127.0.0.1, driven with httpx."""

from __future__ import annotations

import json
import os
import stat
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pytest

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry
from served import wait_job
from store.support import GEOMETRY, MODEL, Rows

RAW = "application/octet-stream"
ARROW = "application/vnd.apache.arrow.stream"
GEOMETRY_JSON = {"n_layers": 2, "kv_lora": 32, "qk_rope": 8, "index_hd": 4, "nic": 1, "vocab": 1000}


def create(client, sid="chat", tier=None, **extra):
    body = {"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON, **extra}
    if tier is not None:
        body["tier"] = tier
    response = client.post("/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def append_raw(client, sid, payload, complete_turn=True):
    return client.post(
        f"/sessions/{sid}/append",
        params={"complete_turn": str(complete_turn).lower()},
        content=payload,
        headers={"Content-Type": RAW},
    )


def arrow_body(tokens, L, R, I, *, l_width=None):
    """The documented upload schema, built independently of the server's code."""
    n = tokens.shape[0]
    columns = {
        "token": pa.array(tokens, pa.int32()),
        "L": pa.FixedSizeListArray.from_arrays(
            pa.array(L.transpose(1, 0, 2).reshape(-1)), l_width or L.shape[0] * L.shape[2]
        ),
        "R": pa.FixedSizeListArray.from_arrays(pa.array(R.transpose(1, 0, 2).reshape(-1)), R.shape[0] * R.shape[2]),
    }
    if I is not None:
        columns["I"] = pa.FixedSizeListArray.from_arrays(
            pa.array(I.transpose(1, 0, 2).reshape(-1)), I.shape[0] * I.shape[2]
        )
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(1, n // 2))
    return sink.getvalue().to_pybytes()


def assert_error(response, status, error):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] == error and isinstance(body["reason"], str) and body["reason"], body
    return body


# ------------------------------------------------------------------ service basics and auth
def test_health_docs_and_openapi_need_no_key(server):
    with server.client(None) as anonymous:
        assert anonymous.get("/health").json()["status"] == "ok"
        assert anonymous.get("/docs").status_code == 200
        schema = anonymous.get("/openapi.json").json()
    assert "/sessions/{session_id}/append" in schema["paths"]
    assert "HTTPValidationError" not in json.dumps(schema)


def test_missing_and_forged_keys_are_refused(server, alice):
    create(alice)
    with server.client(None) as anonymous:
        response = anonymous.get("/sessions/chat")
        assert_error(response, 401, "Unauthorized")
        assert response.headers["www-authenticate"] == "Bearer"
    with server.client("forged-key-0000000000000000") as forged:
        assert_error(forged.get("/sessions/chat"), 401, "Unauthorized")
        assert_error(forged.post("/sessions", json={}), 401, "Unauthorized")
    with server.client("alice-key-0123456789abcdef", bearer=False) as by_header:
        assert by_header.get("/sessions/chat").status_code == 200


def test_owner_isolation(alice, bob, keys):
    create(alice, "secret")
    append_raw(alice, "secret", Rows(1).encode(tiers.FP8, Rows(1).make(3)))
    missing = bob.get("/sessions/never-existed")
    hidden = bob.get("/sessions/secret")
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json()["error"] == missing.json()["error"] == "SessionNotFound"
    assert hidden.json()["reason"].replace("secret", "X") == missing.json()["reason"].replace("never-existed", "X")
    for call in (
        lambda: bob.get("/sessions/secret/resume"),
        lambda: append_raw(bob, "secret", b""),
        lambda: bob.post("/sessions/secret/truncate", json={"n_records": 0}),
        lambda: bob.post("/sessions/secret/fork", json={}),
        lambda: bob.post("/sessions/secret/park"),
        lambda: bob.get("/sessions/secret/verify"),
        lambda: bob.get("/sessions/secret/file/inspect"),
        lambda: bob.delete("/sessions/secret"),
    ):
        assert_error(call(), 404, "SessionNotFound")
    assert bob.get("/sessions").json() == {"sessions": [], "next_cursor": None}
    job = alice.post("/sessions/secret/park").json()
    assert_error(bob.get(f"/jobs/{job['id']}"), 404, "JobNotFound")
    wait_job(alice, job)
    assert [s["id"] for s in alice.get("/sessions").json()["sessions"]] == ["secret"]
    # Ids are per owner: bob may have a "secret" of his own (created, never told alice's exists),
    # and each owner's calls reach only their own.
    mine = create(bob, "secret", tier="int4")
    assert (mine["owner"], mine["n_records"], mine["tier"]["name"]) == ("bob", 0, "int4")
    assert append_raw(bob, "secret", Rows(2).encode(tiers.INT4, Rows(2).make(2))).json()["session"]["n_records"] == 2
    assert bob.post("/sessions/secret/fork", json={"id": "copy"}).status_code == 201
    assert bob.delete("/sessions/secret").status_code == 204
    theirs = alice.get("/sessions/secret").json()
    assert (theirs["owner"], theirs["n_records"], theirs["tier"]["name"]) == ("alice", 3, "fp8")
    assert [s["id"] for s in alice.get("/sessions").json()["sessions"]] == ["secret"]
    assert [s["id"] for s in bob.get("/sessions").json()["sessions"]] == ["copy"]
    assert alice.get("/sessions/copy").status_code == 404


@pytest.mark.parametrize("bad", ["a.b", "...", "-x", "x" * 65, "%00", "caf%C3%A9", "a%20b", ".hidden"])
def test_bad_and_traversal_ids_are_refused(server, alice, bad):
    response = alice.get(f"/sessions/{bad}")
    assert_error(response, 400, "InvalidSessionId")
    assert_error(
        alice.post(f"/sessions/{bad}/append", content=b"", headers={"Content-Type": RAW}), 400, "InvalidSessionId"
    )
    assert_error(
        alice.post("/sessions", json={"id": unquote(bad), "model": MODEL, "geometry": GEOMETRY_JSON}),
        400,
        "InvalidSessionId",
    )


def test_slashes_never_reach_the_store(server, alice):
    # Dot segments are resolved by the client, encoded slashes make a path no route matches:
    # either way the request never names a file.
    for path in (
        "/sessions/..",
        "/sessions/%2E%2E/resume",
        "/sessions/..%2F..%2Fkeys.json",
        "/sessions/a%2Fb/resume",
        "/sessions/%2Fetc%2Fpasswd",
    ):
        response = alice.get(path)
        if response.url.path == "/":  # "/sessions/.." resolved by the client: the console's page
            assert response.headers["content-type"].startswith("text/html")
            continue
        assert response.status_code in (400, 404) and set(response.json()) == {"error", "reason"}
    assert sorted(p.name for p in (server.data / "journals").iterdir()) == []


# ------------------------------------------------------------------ rows in and out
@pytest.mark.parametrize("tier", ["fp8", "int4", "f32"])
def test_append_raw_and_arrow_then_resume_in_every_form(alice, tier):
    info = create(alice, tier=tier)
    t = tiers.get(tier)
    assert info["tier"] == {
        "name": tier,
        "version": t.version,
        "codec": t.codec_name,
        "bits": t.bits,
        "description": t.describe(),
    }
    rows = Rows(3)
    first, second, partial = rows.make(7), rows.make(5), rows.make(4)
    response = append_raw(alice, "chat", rows.encode(t, first))
    assert response.status_code == 200, response.text
    assert response.json()["turn"] == [0, 7] and response.json()["session"]["watermark"] == 7
    response = alice.post("/sessions/chat/append", content=arrow_body(*second), headers={"Content-Type": ARROW})
    assert response.status_code == 200, response.text
    assert append_raw(alice, "chat", rows.encode(t, partial), complete_turn=False).json()["session"]["n_records"] == 16
    expected = rows.encode(t, first, second)
    raw = alice.get("/sessions/chat/resume")
    assert raw.status_code == 200 and raw.content == expected
    assert raw.headers["x-kv-reused-tokens"] == "12" and raw.headers["x-kv-record-bytes"] == str(info["record_bytes"])
    assert raw.headers["x-kv-geometry"] == "2,32,8,4,1,1000" and raw.headers["x-kv-tier-name"] == tier
    assert "deprecation" not in raw.headers and "warning" not in raw.headers
    file = alice.get("/sessions/chat/resume", params={"format": "coli_kv"})
    loaded = coli_kv.parse(file.content, expect=GEOMETRY, tier=t)
    assert loaded.n == 12 and loaded.record_bytes() == expected
    table = pa.ipc.open_stream(alice.get("/sessions/chat/resume", headers={"Accept": ARROW}).content).read_all()
    assert table.column_names == ["token", "L", "R", "I"] and table.num_rows == 12
    assert table.schema.metadata[b"kvstore.geometry"] == b"2,32,8,4,1,1000"
    L, R, I = coli_kv.parse(coli_kv.Header(GEOMETRY, t, 12).to_bytes() + expected).dequantize()
    np.testing.assert_array_equal(
        table.column("L").combine_chunks().flatten().to_numpy().reshape(12, 2, 32), L.transpose(1, 0, 2)
    )
    np.testing.assert_array_equal(
        table.column("I").combine_chunks().flatten().to_numpy().reshape(12, 1, 4), I.transpose(1, 0, 2)
    )
    assert table.column("token").to_pylist() == first[0].tolist() + second[0].tolist()


def test_malformed_bodies_change_nothing(alice):
    create(alice)
    rows = Rows(4)
    good = coli_kv.encode_records(GEOMETRY, tiers.FP8, *rows.make(3))
    assert append_raw(alice, "chat", good.tobytes()).status_code == 200
    bad_scale = good.copy()
    bad_scale["layers"]["Rs"][0, 1] = -1.0
    assert_error(append_raw(alice, "chat", good.tobytes()[:-3]), 422, "FormatError")
    assert_error(append_raw(alice, "chat", bad_scale.tobytes()), 422, "FormatError")
    assert_error(
        alice.post("/sessions/chat/append", content=b"\x00" * 64, headers={"Content-Type": ARROW}),
        400,
        "InvalidRequest",
    )
    assert_error(
        alice.post("/sessions/chat/append", content=good.tobytes(), headers={"Content-Type": "text/plain"}),
        415,
        "UnsupportedMediaType",
    )
    assert_error(alice.post("/sessions/chat/append", content=good.tobytes()), 415, "UnsupportedMediaType")
    assert_error(
        alice.post("/sessions", content=b"{not json", headers={"Content-Type": "application/json"}),
        422,
        "InvalidRequest",
    )
    assert_error(
        alice.post("/sessions", json={"id": "x", "model": MODEL, "geometry": {**GEOMETRY_JSON, "n_layers": 10**30}}),
        422,
        "InvalidRequest",
    )
    assert_error(
        alice.post("/sessions", json={"id": "x", "model": MODEL, "geometry": {**GEOMETRY_JSON, "nic": 0}}),
        422,
        "BadHeader",
    )
    assert_error(
        alice.post(
            "/sessions",
            json={
                "id": "x",
                "model": MODEL,
                "geometry": GEOMETRY_JSON,
                "tier": {"version": 3, "codec": "int4", "bits": 3},
            },
        ),
        422,
        "UnknownTier",
    )
    assert_error(
        alice.post("/sessions", json={"id": "x", "model": MODEL, "geometry": GEOMETRY_JSON, "tier": "int3"}),
        422,
        "UnknownTier",
    )
    assert_error(alice.post("/sessions/chat/truncate", json={"n_records": 9}), 400, "InvalidRequest")
    assert_error(alice.post("/sessions/chat/fork", json={"at": 4}), 400, "InvalidRequest")
    assert_error(
        alice.post("/lookup", json={"model": MODEL, "geometry": GEOMETRY_JSON, "tokens": [-1]}), 422, "InvalidRequest"
    )
    assert_error(alice.get("/sessions", params={"state": "lost"}), 422, "InvalidRequest")
    info = alice.get("/sessions/chat").json()
    assert (info["n_records"], info["watermark"]) == (3, 3)
    assert alice.get("/sessions/chat/resume").content == good.tobytes()


def test_geometry_and_fingerprint_mismatches(alice):
    create(alice)
    other = Rows(5, Geometry(3, 32, 8, 4, 1, 1000)).make(2)
    assert_error(
        alice.post("/sessions/chat/append", content=arrow_body(*other), headers={"Content-Type": ARROW}),
        409,
        "GeometryMismatch",
    )
    wrong_width = coli_kv.encode_records(
        Geometry(2, 64, 8, 4, 1, 1000), tiers.FP8, *Rows(5, Geometry(2, 64, 8, 4, 1, 1000)).make(3)
    )
    assert_error(append_raw(alice, "chat", wrong_width.tobytes()), 422, "FormatError")
    append_raw(alice, "chat", Rows(6).encode(tiers.FP8, Rows(6).make(2)))
    body = assert_error(
        alice.get("/sessions/chat/resume", params={"geometry": "2,32,8,4,1,999"}), 409, "FingerprintMismatch"
    )
    assert "geometry.vocab" in body["reason"]
    body = assert_error(
        alice.get("/sessions/chat/resume", params={"weights_hash": "other"}), 409, "FingerprintMismatch"
    )
    assert "model.weights_hash" in body["reason"]
    ok = alice.get("/sessions/chat/resume", params={"weights_hash": "other", "override": "model.weights_hash"})
    assert ok.status_code == 200 and ok.headers["x-kv-reused-tokens"] == "2"
    body = assert_error(alice.get("/sessions/chat/resume", params={"override": "bogus"}), 400, "InvalidRequest")
    assert "cannot override ['bogus']" in body["reason"]  # refused, not ignored, with no fingerprint stated
    assert_error(alice.get("/sessions/chat/resume", params={"tier": "int4"}), 409, "FingerprintMismatch")
    assert (
        alice.get(
            "/sessions/chat/resume", params={"tier": "fp8", "model_name": MODEL["name"], "geometry": "2,32,8,4,1,1000"}
        ).status_code
        == 200
    )


def test_oversized_bodies_are_refused_before_reading(make_server, keys):
    server = make_server("--max-body", "4K")
    with server.client(keys["alice"]) as alice:
        create(alice)
        big = Rows(7).encode(tiers.FP8, Rows(7).make(40))  # 40 * 116 bytes > 4 KiB
        assert_error(append_raw(alice, "chat", big), 413, "BodyTooLarge")

        def chunks():
            for start in range(0, len(big), 1000):
                yield big[start : start + 1000]

        streamed = alice.post("/sessions/chat/append", content=chunks(), headers={"Content-Type": RAW})
        assert_error(streamed, 413, "BodyTooLarge")
        assert_error(
            alice.post("/lookup", json={"model": MODEL, "geometry": GEOMETRY_JSON, "tokens": [1] * 5000}),
            413,
            "BodyTooLarge",
        )
        assert alice.get("/sessions/chat").json()["n_records"] == 0
        assert append_raw(alice, "chat", big[: 30 * 116]).status_code == 200


# ------------------------------------------------------------------ the other operations
def test_truncate_fork_verify_lookup_and_tags(alice):
    create(alice, tags=["a"])
    rows = Rows(8)
    tokens = rows.rng.integers(0, 1000, 200).astype(np.int32)
    append_raw(alice, "chat", rows.encode(tiers.FP8, rows.make(150, tokens[:150])))
    append_raw(alice, "chat", rows.encode(tiers.FP8, rows.make(50, tokens[150:])))
    query = {"model": MODEL, "geometry": GEOMETRY_JSON, "tier": "fp8", "tokens": tokens[:180].tolist() + [5, 5]}
    match = alice.post("/lookup", json=query).json()["match"]
    assert match["session_id"] == "chat" and match["matched_tokens"] == 180
    fork = alice.post("/sessions/chat/fork", json={"at": 160, "id": "branch", "tags": ["b"]})
    assert fork.status_code == 201 and fork.json()["parent"] == "chat" and fork.json()["n_records"] == 160
    assert alice.get("/sessions/branch/resume").content == alice.get("/sessions/chat/resume").content[: 160 * 116]
    truncated = alice.post("/sessions/chat/truncate", json={"n_records": 100}).json()
    assert (truncated["n_records"], truncated["watermark"]) == (100, 100)
    assert alice.get("/sessions/chat/verify").json()["ok"] is True
    assert alice.post("/lookup", json=query).json()["match"]["session_id"] == "branch"
    assert alice.patch("/sessions/chat", json={"tags": ["x", "y"]}).json()["tags"] == ["x", "y"]
    assert [s["id"] for s in alice.get("/sessions", params={"tag": ["x"]}).json()["sessions"]] == ["chat"]
    assert alice.delete("/sessions/branch").status_code == 204
    assert_error(alice.get("/sessions/branch"), 404, "SessionNotFound")


def test_park_unpark_and_migrate_run_as_jobs(alice):
    create(alice)
    rows = Rows(9)
    payload = rows.encode(tiers.FP8, rows.make(600))
    append_raw(alice, "chat", payload)
    journal_before = alice.get("/sessions/chat/resume", params={"format": "coli_kv"}).content
    response = alice.post("/sessions/chat/park")
    assert response.status_code == 202
    job = wait_job(alice, response.json())
    assert job["state"] == "done" and job["result"]["state"] == "parked" and job["done"] == job["total"] > 0
    assert alice.get("/sessions/chat").json()["state"] == "parked"
    job = wait_job(alice, alice.post("/sessions/chat/unpark").json())
    assert job["state"] == "done" and job["result"]["state"] == "active"
    assert alice.get("/sessions/chat/resume", params={"format": "coli_kv"}).content == journal_before
    job = wait_job(alice, alice.post("/sessions/chat/file/migrate", json={"tier": "int4"}).json())
    assert job["state"] == "done" and job["done"] == job["total"] == 600
    assert job["result"]["tier"]["name"] == "int4" and job["result"]["tier"]["version"] == 3
    resumed = alice.get("/sessions/chat/resume")
    assert resumed.headers["x-kv-tier-name"] == "int4" and resumed.headers["x-kv-tier"] == "v3:int4:4"
    inspect = alice.get("/sessions/chat/file/inspect").json()
    assert inspect["header"]["version"] == 3 and inspect["problems"] == []
    assert [j["kind"] for j in alice.get("/jobs").json()] == ["park", "unpark", "migrate"]


def test_verify_and_repair_over_http(server, alice):
    create(alice)
    rows = Rows(10)
    append_raw(alice, "chat", rows.encode(tiers.FP8, rows.make(4)))
    append_raw(alice, "chat", rows.encode(tiers.FP8, rows.make(4)))
    path = server.data / "journals" / "chat~alice.coli_kv"  # ids are per owner: <id>~<owner>
    with open(path, "r+b") as f:  # a silent bit flip in record 5's codes
        f.seek(HEADER_BYTES + 5 * 116 + 10)
        byte = f.read(1)[0]
        f.seek(HEADER_BYTES + 5 * 116 + 10)
        f.write(bytes([byte ^ 4]))
    report = alice.get("/sessions/chat/verify").json()
    assert report["ok"] is False and report["first_bad"] == {"turn": 1, "start": 4, "end": 8}
    resumed = alice.get("/sessions/chat/resume", params={"verify": "true"})
    assert resumed.headers["x-kv-reused-tokens"] == "4" and resumed.headers["x-kv-damaged-from"] == "4"
    assert len(resumed.content) == 4 * 116
    dry = alice.post("/sessions/chat/file/repair", params={"dry_run": "true"}).json()
    assert dry["kept_records"] == 4 and alice.get("/sessions/chat").json()["n_records"] == 8
    assert alice.post("/sessions/chat/file/repair").json()["dropped_records"] == 4
    assert alice.get("/sessions/chat/verify").json()["ok"] is True


# ------------------------------------------------------------------ restarts and keys
@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_server_restart_mid_conversation_resumes_exactly(make_server, keys, stop):
    rows = Rows(11)
    turns = [rows.make(n) for n in (30, 12, 7)]
    tail = rows.make(5)
    first = make_server()
    with first.client(keys["alice"]) as client:
        create(client, "talk")
        for turn in turns:
            assert append_raw(client, "talk", rows.encode(tiers.FP8, turn)).status_code == 200
        assert append_raw(client, "talk", rows.encode(tiers.FP8, tail), complete_turn=False).status_code == 200
        before = client.get("/sessions/talk/resume").content
    first.stop() if stop == "sigterm" else first.kill()
    second = make_server()
    with second.client(keys["alice"]) as client:
        resumed = client.get("/sessions/talk/resume", params={"verify": "true"})
        assert resumed.content == before == rows.encode(tiers.FP8, *turns)
        assert resumed.headers["x-kv-reused-tokens"] == "49" and resumed.headers["x-kv-verified"] == "true"
        info = client.get("/sessions/talk").json()
        assert (info["n_records"], info["watermark"]) == (54, 49)
        more = rows.make(3)
        assert append_raw(client, "talk", rows.encode(tiers.FP8, more)).json()["session"]["watermark"] == 57
        assert client.get("/sessions/talk/resume").content == rows.encode(tiers.FP8, *turns, tail, more)


def test_first_start_creates_keys_json_and_prints_the_key_once(make_server, tmp_path):
    data = tmp_path / "fresh"
    server = make_server(data=data, env_keys=None)
    server.stop()
    printed = [line.split()[-1] for line in server.output.splitlines() if line.strip().startswith("kvs_")]
    assert len(printed) == 1
    key = printed[0]
    keys_file = data / "keys.json"
    assert stat.S_IMODE(os.stat(keys_file).st_mode) == 0o600 and key not in keys_file.read_text()
    again = make_server(data=data, env_keys=None)
    assert "kvs_" not in again.output
    with again.client(key) as client:
        created = client.post("/sessions", json={"id": "mine", "model": MODEL, "geometry": GEOMETRY_JSON})
        assert created.status_code == 201 and created.json()["owner"] == "default"
    with again.client("kvs_" + "x" * 43) as forged:
        assert_error(forged.get("/sessions"), 401, "Unauthorized")


def test_a_client_that_leaves_mid_download_releases_the_session(alice):
    create(alice)
    rows = Rows(12)
    payload = rows.encode(tiers.FP8, rows.make(150_000))  # ~17 MB: far more than the socket buffers hold
    assert append_raw(alice, "chat", payload).status_code == 200
    with alice.stream("GET", "/sessions/chat/resume") as response:
        first = next(response.iter_raw())
        assert first == payload[: len(first)]
    # truncate needs the reader gone (it shrinks the journal); a leaked reader would make it 409
    truncated = alice.post("/sessions/chat/truncate", json={"n_records": 10})
    assert truncated.status_code == 200 and truncated.json()["n_records"] == 10


def test_keys_json_edits_apply_without_a_restart(server, keys):
    path = server.data / "keys.json"  # none yet: the server's keys come from KVSTORE_API_KEYS
    document = json.loads(path.read_text()) if path.exists() else {"keys": []}
    document["keys"].append({"owner": "carol", "key": "carol-key-0123456789abcdef"})
    path.write_text(json.dumps(document))
    with server.client("carol-key-0123456789abcdef") as carol:
        assert carol.get("/sessions").status_code == 200
        path.write_text("{ half written")  # a broken edit keeps the keys read last time
        assert carol.get("/sessions").status_code == 200
