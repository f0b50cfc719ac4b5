"""JSON bodies are parsed strictly: a key given twice in one object is refused, never last-wins."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.routing import APIRoute

from kvstore import tiers
from kvstore.api.errors import DuplicateJSONKey
from kvstore.api.json_body import StrictJSONRoute, loads
from kvstore.api.main import create_app
from store.support import GEOMETRY, MODEL, Rows

JSON = {"Content-Type": "application/json"}
GEOMETRY_JSON = dataclasses.asdict(GEOMETRY)


def create(client, sid: str) -> None:
    response = client.post("/sessions", json={"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON})
    assert response.status_code == 201, response.text


def append_raw(client, sid: str, payload: bytes):
    return client.post(f"/sessions/{sid}/append", content=payload, headers={"Content-Type": "application/octet-stream"})


def test_loads_refuses_a_repeated_key_at_any_depth():
    assert loads(b'{"a": {"b": 1}, "c": [{"d": 2}]}') == {"a": {"b": 1}, "c": [{"d": 2}]}
    for body in (b'{"n": 100, "n": 0}', b'{"a": {"b": 1, "b": 1}}', b'[{"x": 1}, {"y": 1, "y": 2}]'):
        with pytest.raises(DuplicateJSONKey, match="give every key once"):
            loads(body)
    with pytest.raises(json.JSONDecodeError):
        loads(b'{"n": ')


def test_every_route_of_the_app_parses_strictly(tmp_path):
    def walk(routes):  # included routers are wrappers around the router they include
        for route in routes:
            included = getattr(route, "original_router", None)
            yield from walk(included.routes) if included is not None else (route,)

    api_routes = [route for route in walk(create_app(tmp_path / "data").routes) if isinstance(route, APIRoute)]
    assert api_routes and all(isinstance(route, StrictJSONRoute) for route in api_routes), [
        route.path for route in api_routes if not isinstance(route, StrictJSONRoute)
    ]


def json_routes(openapi: dict) -> list[tuple[str, str]]:
    return [
        (path, method)
        for path, operations in openapi["paths"].items()
        for method, operation in operations.items()
        if "application/json" in operation.get("requestBody", {}).get("content", {})
    ]


def test_duplicate_keys_are_refused_on_every_json_route_and_change_nothing(alice):
    create(alice, "chat")
    rows = Rows(1)
    assert append_raw(alice, "chat", rows.encode(tiers.FP8, rows.make(5))).status_code == 200
    before = alice.get("/sessions/chat").json()
    routes = json_routes(alice.get("/openapi.json").json())
    assert {("/sessions/{session_id}/truncate", "post"), ("/sessions", "post"), ("/lookup", "post")} <= set(routes)
    for path, method in routes:
        response = alice.request(
            method.upper(), path.replace("{session_id}", "chat"), content=b'{"x": 1, "x": 2}', headers=JSON
        )
        if path.startswith("/v1/"):  # the OpenAI-compatible routes answer in OpenAI's error object
            error = response.json()["error"]
            assert response.status_code == 400 and error["code"] == "duplicate_json_key", (path, response.text)
            assert "'x' 2 times" in error["message"]
            continue
        assert response.status_code == 422, (path, response.text)
        assert response.json()["error"] == "DuplicateJSONKey" and "'x' 2 times" in response.json()["reason"]
    # The example: last-wins read this as n_records 0 and emptied the session.
    truncate = alice.post("/sessions/chat/truncate", content=b'{"n_records": 100, "n_records": 0}', headers=JSON)
    assert truncate.status_code == 422 and truncate.json()["error"] == "DuplicateJSONKey"
    nested = json.dumps({"id": "other", "model": MODEL, "geometry": GEOMETRY_JSON})
    nested = nested.replace('"name": "tiny-mla"', '"name": "tiny-mla", "name": "other"')
    assert alice.post("/sessions", content=nested.encode(), headers=JSON).status_code == 422
    assert alice.get("/sessions/chat").json() == before
    assert [s["id"] for s in alice.get("/sessions").json()["sessions"]] == ["chat"]
    assert alice.post("/sessions/chat/truncate", json={"n_records": 2}).json()["n_records"] == 2
