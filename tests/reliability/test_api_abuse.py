"""Hostile HTTP input against a real uvicorn server: nothing gets a 5xx, nothing changes data.

- schemathesis generates requests (schema-valid and schema-violating) for every operation of the
  service's own OpenAPI schema, authenticated as alice, also aimed at a session that exists; the
  responses must not be 5xx and must match the schema (status codes, content types, bodies,
  headers), and schema-violating requests must be refused;
- every route, with every way of presenting no key, a forged key or a malformed header: 401;
- every session route called by bob on alice's session: the same 404 as for an id that does not
  exist, and alice's session unchanged;
- traversal-looking ids on every session route and in bodies: refused, no file outside the
  store's folders, no lock file for an invalid id;
- oversized (chunked, no Content-Length), malformed and truncated bodies, odd queries, a client
  that leaves mid-upload: 4xx (or nothing), the session unchanged, the next append completes.

Routes are read from the schema, so a new route is covered (or fails loudly for want of a body).
"""

from __future__ import annotations

import base64
import dataclasses
import socket
from pathlib import Path

import pytest
import schemathesis
import schemathesis.checks as st_checks
from hypothesis import HealthCheck, given, settings

from kvstore.formats import coli_kv
from reliability.service import ALICE_KEY, Service
from reliability.store_checks import turn_bytes
from reliability.store_workload import MODEL, TIER_NAMES
from reliability.workload import GEOMETRY
from served import wait_job

RAW = "application/octet-stream"
ARROW = "application/vnd.apache.arrow.stream"
JSON = "application/json"
GEOMETRY_JSON = dataclasses.asdict(GEOMETRY)
RECORD_BYTES = coli_kv.record_bytes(GEOMETRY, TIER_NAMES["v2"])
MAX_BODY = 64 << 10

#: A plausible request for each session route (path under /sessions/{id}, method): what bob sends.
SESSION_CALLS = {
    ("", "get"): {},
    ("", "patch"): {"json": {"tags": ["taken"]}},
    ("", "delete"): {},
    ("/append", "post"): {"content": turn_bytes(1, 0), "headers": {"Content-Type": RAW}},
    ("/resume", "get"): {},
    ("/truncate", "post"): {"json": {"n_records": 0}},
    ("/fork", "post"): {"json": {"id": "bob-copy"}},
    ("/verify", "get"): {},
    ("/park", "post"): {},
    ("/unpark", "post"): {},
    ("/file/inspect", "get"): {},
    ("/file/repair", "post"): {},
    ("/file/migrate", "post"): {"json": {"tier": "f32"}},
    ("/generate", "post"): {"json": {"tokens": [1, 2, 3], "max_new_tokens": 1}},
}
#: The one 5xx the service gives by design: the engine routes of a server started without a model
#: answer 503 EngineNotLoaded (with how to start one). Every other 5xx is a failure.
NO_ENGINE = (503, "EngineNotLoaded")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    running = Service(tmp_path_factory.mktemp("abuse") / "data", "--max-body", str(MAX_BODY)).start()
    yield running
    output = running.stop()
    assert "Traceback" not in output, output


@pytest.fixture(scope="module")
def openapi(service):
    with service.client(None) as anonymous:
        return anonymous.get("/openapi.json").json()


def routes(openapi: dict) -> list[tuple[str, str]]:
    return [(path, method) for path, operations in openapi["paths"].items() for method in operations]


def make_session(service: Service, sid: str, owner: str = "alice", turns: int = 2) -> bytes:
    """A session with ``turns`` complete turns; returns its rows."""
    with service.client(owner) as client:
        response = client.post("/sessions", json={"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON, "tags": ["t"]})
        assert response.status_code == 201, response.text
        for turn in range(turns):
            response = client.post(
                f"/sessions/{sid}/append", content=turn_bytes(len(sid), turn), headers={"Content-Type": RAW}
            )
            assert response.status_code == 200, response.text
        return client.get(f"/sessions/{sid}/resume").content


def state_of(service: Service, sid: str, owner: str = "alice") -> tuple:
    """What must not change: the session's record and its rows."""
    with service.client(owner) as client:
        info = client.get(f"/sessions/{sid}").json()
        rows = client.get(f"/sessions/{sid}/resume").content
        assert client.get(f"/sessions/{sid}/verify").json()["ok"] is True
    return info["n_records"], info["watermark"], info["tags"], info["state"], info["tier"], rows


def error_of(body: dict) -> tuple[str | None, str | None]:
    """(error, reason) of an error answer: the service's ``{"error", "reason"}``, or on the
    OpenAI-compatible routes OpenAI's ``{"error": {"message", "type", "param", "code"}}``, whose
    code is the error's class in snake case (``engine_not_loaded``)."""
    error = body.get("error")
    if isinstance(error, dict) and set(body) == {"error"}:
        code = error.get("code") or ""
        return "".join(part.title() for part in code.split("_")), error.get("message")
    return error, body.get("reason")


def assert_error(response, *statuses: int) -> dict:
    """A JSON error with one of ``statuses`` (or the engine-less 503, which any route may give
    before it reads its arguments)."""
    body = response.json()
    error, reason = error_of(body)
    assert error and reason, body
    engine_less = (response.status_code, error) == NO_ENGINE
    assert response.status_code in statuses or engine_less, (response.status_code, response.text)
    return body


def no_server_error(ctx, response, case):
    """schemathesis check: no 5xx, except the engine-less 503 EngineNotLoaded."""
    if response.status_code >= 500:
        try:
            error = error_of(response.json())[0]
        except (ValueError, AttributeError):
            error = None
        if (response.status_code, error) != NO_ENGINE:
            raise AssertionError(f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:500]}")


def store_files(data: Path) -> set[str]:
    """Every file of the store outside the index and the lock folder."""
    return {
        str(p.relative_to(data))
        for p in data.rglob("*")
        if p.is_file() and p.parts[len(data.parts)] not in ("index", "locks")
    }


# ---------------------------------------------------------------------------- schemathesis
def invalid_body_or_path_refused(ctx, response, case):
    """schemathesis' negative_data_rejection, for requests whose body or path was made invalid.

    A query value or a header is text on the wire: a "wrong type" there (a number for a string
    parameter) often arrives as a perfectly valid string, and the Authorization header is ours;
    so mutations confined to those are not expected to be refused.
    """
    if any(case.meta.is_negative_at(location) for location in ("body", "path")):
        return st_checks.negative_data_rejection(ctx, response, case)
    return None


FUZZ_CHECKS = [
    no_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
    st_checks.response_headers_conformance,
    invalid_body_or_path_refused,
]


SHARDS = 4  # the operations are split over four tests (each stays well under the per-test timeout)


@pytest.mark.parametrize("shard", range(SHARDS))
def test_schemathesis_against_the_services_own_schema(service, openapi, trials, figures, shard):
    bob_rows = make_session(service, f"bobs-{shard}", owner="bob")
    bob_before = state_of(service, f"bobs-{shard}", owner="bob")
    schema = schemathesis.openapi.from_dict(openapi)
    auth = {"Authorization": f"Bearer {ALICE_KEY}"}
    examples = trials(6, 150)
    tried: dict[str, int] = {}

    def ensure_target() -> None:
        with service.client() as client:
            if client.get("/sessions/fuzz").status_code == 404:
                make_session(service, "fuzz")

    def fuzz(strategy, target: dict | None, label: str) -> None:
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        )
        @given(case=strategy)
        def call(case):
            if target:
                ensure_target()
            response = case.call(base_url=service.url, headers=auth)
            tried[label] = tried.get(label, 0) + 1
            case.validate_response(response, checks=FUZZ_CHECKS)

        call()

    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations[shard::SHARDS]:
        targets = [None] + ([{"session_id": "fuzz"}] if "{session_id}" in operation.path else [])
        has_input = bool(operation.path_parameters or operation.query or operation.body or operation.headers)
        modes = [schemathesis.GenerationMode.POSITIVE] + ([schemathesis.GenerationMode.NEGATIVE] if has_input else [])
        for target in targets:
            for mode in modes:
                strategy = operation.as_strategy(generation_mode=mode, path_parameters=target)
                label = (
                    f"{operation.method.upper()} {operation.path} {mode.value}{' (existing session)' if target else ''}"
                )
                fuzz(strategy, target, label)
    total = sum(tried.values())
    assert len(operations) == len(routes(openapi)) and total >= len(tried) >= len(operations[shard::SHARDS])
    # Fuzzing as alice never reached bob's session.
    assert state_of(service, f"bobs-{shard}", owner="bob") == bob_before and bob_before[-1] == bob_rows
    figures.add("api_abuse", "schemathesis", inputs=total, operations_modes=len(tried), server_errors=0)


# ---------------------------------------------------------------------------- keys
def bad_credentials() -> list[dict[str, str]]:
    return [
        {},
        {"Authorization": "Bearer forged-key-0000000000000000"},
        {"X-API-Key": "forged-key-0000000000000000"},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic " + base64.b64encode(f"alice:{ALICE_KEY}".encode()).decode()},
        {"Authorization": f"Token {ALICE_KEY}"},
        {"Api-Key": ALICE_KEY},  # the right key under a header the service does not read
        {"Authorization": f"Bearer {ALICE_KEY[:-1]}"},  # a prefix of a real key
        {"Authorization": f"Bearer {ALICE_KEY}0"},
        {"Authorization": f"Bearer {ALICE_KEY.upper()}"},
        {"X-API-Key": ""},
        {"Authorization": "Bearer " + "k" * 8000},
    ]


#: Served without a key by design: the liveness probe and the Prometheus page (process totals only).
PUBLIC_ROUTES = {("/health", "get"), ("/metrics", "get")}


def fill(path: str, sid: str, job: str = "0" * 32) -> str:
    return path.replace("{session_id}", sid).replace("{job_id}", job)


def test_every_route_refuses_missing_forged_and_malformed_keys(service, openapi, figures):
    make_session(service, "keys-target")
    before = state_of(service, "keys-target")
    public = {(p, m) for p, m in routes(openapi) if "security" not in openapi["paths"][p][m]}
    assert public == PUBLIC_ROUTES, f"routes served without a key changed: {public ^ PUBLIC_ROUTES}"
    with service.client(None) as anonymous:  # the public pages name no session and no owner
        for path, method in sorted(public):
            page = anonymous.request(method.upper(), path).text
            assert "keys-target" not in page and "alice" not in page
    tried = 0
    for path, method in routes(openapi):
        if (path, method) in public:
            continue
        for headers in bad_credentials():
            with service.client(None, **headers) as client:
                response = client.request(
                    method.upper(), fill(path, "keys-target"), json={} if method in ("post", "patch") else None
                )
            assert response.status_code == 401, (
                method,
                path,
                headers.keys(),
                response.status_code,
                response.text[:300],
            )
            assert_error(response, 401)
            assert response.headers["www-authenticate"] == "Bearer"
            tried += 1
    assert state_of(service, "keys-target") == before
    figures.add("api_abuse", "missing_forged_malformed_keys", inputs=tried, server_errors=0, accepted=0)


# ---------------------------------------------------------------------------- another owner's ids
def test_another_owners_session_is_missing_on_every_route(service, openapi, figures):
    make_session(service, "alices")
    with service.client() as alice:
        job = wait_job(alice, alice.post("/sessions/alices/park").json(), expect="done")["id"]
        wait_job(alice, alice.post("/sessions/alices/unpark").json(), expect="done")
    before = state_of(service, "alices")
    session_routes = [(p, m) for p, m in routes(openapi) if p.startswith("/sessions/{session_id}")]
    covered = {(p[len("/sessions/{session_id}") :], m) for p, m in session_routes}
    assert covered == set(SESSION_CALLS), f"routes without a plausible request here: {covered ^ set(SESSION_CALLS)}"
    tried = 0
    with service.client("bob") as bob:
        for suffix, method in sorted(SESSION_CALLS):
            kwargs = SESSION_CALLS[(suffix, method)]
            hidden = bob.request(method.upper(), f"/sessions/alices{suffix}", **kwargs)
            missing = bob.request(method.upper(), f"/sessions/nobody-has-this{suffix}", **kwargs)
            body = assert_error(hidden, 404)
            assert body["error"] in ("SessionNotFound", NO_ENGINE[1]) and body["error"] == missing.json()["error"]
            assert hidden.status_code == missing.status_code
            assert body["reason"].replace("alices", "X") == missing.json()["reason"].replace("nobody-has-this", "X")
            tried += 2
        assert (
            bob.post("/lookup", json={"model": MODEL, "geometry": GEOMETRY_JSON, "tokens": list(range(200))}).json()[
                "match"
            ]
            is None
        )
        assert job not in {j["id"] for j in bob.get("/jobs").json()}
        assert_error(bob.get(f"/jobs/{job}"), 404)
        assert "alices" not in {s["id"] for s in bob.get("/sessions").json()["sessions"]}
        tried += 3
    assert state_of(service, "alices") == before
    assert not list((service.data / "journals").glob("bob-copy~*"))
    figures.add("api_abuse", "another_owners_ids", inputs=tried, leaked=0, changed=0)


# ---------------------------------------------------------------------------- traversal-looking ids
BAD_PATH_IDS = [
    "%2e%2e",
    "%2E%2E%2F%2E%2E%2Fkeys.json",
    "%2e",
    "..%2f..%2findex%2fdata.mdb",
    "%2Fetc%2Fpasswd",
    "~root",
    "chat%00",
    "chat%0A",
    "chat%20",
    "%C3%A9t%C3%A9",
    "x" * 65,
    "-lead",
    "_lead",
    "chat.coli_kv",
    "a%5Cb",
    "%5C..%5C..",
    "lost%2Bfound",
    "*",
    "%24%28id%29",
]
VALID_BUT_SUSPICIOUS = ["index", "locks", "keys", "journals", "archive", "lost-found", "CON", "nul"]


def test_traversal_looking_ids_on_every_route(service, openapi, figures):
    make_session(service, "trav")
    before_files = store_files(service.data)
    before = state_of(service, "trav")
    tried = 0
    with service.client() as alice:
        for suffix, method in sorted(SESSION_CALLS):
            kwargs = SESSION_CALLS[(suffix, method)]
            for bad in BAD_PATH_IDS:
                response = alice.request(method.upper(), f"/sessions/{bad}{suffix}", **kwargs)
                body = assert_error(response, 400, 404, 405)
                if response.status_code == 400:
                    assert body["error"] == "InvalidSessionId", body
                tried += 1
        for bad in ["..", "../x", "a/b", "/etc/passwd", "x\x00y", "é", " chat", "chat\n", "x" * 65, "", "-x"]:
            create = alice.post("/sessions", json={"id": bad, "model": MODEL, "geometry": GEOMETRY_JSON})
            assert assert_error(create, 400, 422)["error"] in ("InvalidSessionId", "InvalidRequest")
            fork = alice.post("/sessions/trav/fork", json={"id": bad})
            assert assert_error(fork, 400, 422)["error"] in ("InvalidSessionId", "InvalidRequest")
            tried += 2
    assert store_files(service.data) == before_files, "a refused id left a file"
    locks = {p.name.rsplit(".", 1)[0] for p in (service.data / "locks").iterdir()}  # <id>~<owner>.write
    assert all(name.replace("-", "").replace("_", "").replace("~", "").isalnum() for name in locks), locks
    assert state_of(service, "trav") == before
    # Ids that only look like the store's own folders are ordinary sessions, kept in journals/.
    for sid in VALID_BUT_SUSPICIOUS:
        rows = make_session(service, sid, turns=1)
        assert (service.data / "journals" / f"{sid}~alice.coli_kv").read_bytes()[coli_kv.HEADER_BYTES :] == rows
        tried += 1
    # the store's own entries are as they were (no keys.json: the keys come from KVSTORE_API_KEYS)
    assert (service.data / "index").is_dir() and not (service.data / "keys.json").exists()
    figures.add("api_abuse", "traversal_looking_ids", inputs=tried, escaped=0, server_errors=0)


# ---------------------------------------------------------------------------- bodies and queries
def raw_request(service: Service, head: bytes, body: bytes) -> None:
    """Send a request head and part of its body, then leave."""
    host, port = service.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)


def test_oversized_malformed_and_abandoned_bodies(service, figures):
    rows = make_session(service, "bodies")
    before = state_of(service, "bodies")
    auth = {"Authorization": f"Bearer {ALICE_KEY}"}

    def chunks(total: int):
        for _ in range(total // 4096):
            yield b"\x00" * 4096

    json_bodies = [
        b"[" * 30000 + b"]" * 30000,  # nesting bomb within the size limit
        b'{"n_records": ' + b"9" * 5000 + b"}",  # an integer past Python's digit limit
        b'{"n_records": "\xff\xfe"}',  # not UTF-8
        b'{"n_records": NaN}',
        b'{"n_records": 1e400}',
        b'{"n_records": -1}',
        b'{"n_records": 2147483648}',
        b'{"n_records": 0',  # truncated
        b"",
        b"null",
        b'{"n_records": 0, "extra": 1}',
    ]
    tried = 0
    with service.client() as alice:
        for body in json_bodies:
            for path in ("/sessions/bodies/truncate", "/sessions/bodies/fork", "/sessions", "/lookup"):
                assert_error(alice.post(path, content=body, headers={"Content-Type": JSON}), 400, 422)
                tried += 1
        assert_error(
            alice.post(
                "/sessions/bodies/truncate", content=b'{"n_records": 0}', headers={"Content-Type": "text/plain"}
            ),
            400,
            415,
            422,
        )
        odd = [
            (
                "POST",
                "/sessions/bodies/append",
                {"content": chunks(MAX_BODY * 2), "headers": {"Content-Type": RAW}},
                (413,),
            ),
            ("POST", "/sessions", {"content": chunks(MAX_BODY * 2), "headers": {"Content-Type": JSON}}, (413,)),
            ("POST", "/sessions/bodies/append", {"content": rows[:-1], "headers": {"Content-Type": RAW}}, (422,)),
            (
                "POST",
                "/sessions/bodies/append",
                {"content": b"\xff" * RECORD_BYTES, "headers": {"Content-Type": RAW}},
                (422,),
            ),
            (
                "POST",
                "/sessions/bodies/append",
                {"content": b"ARROW1" + b"\xff" * 64, "headers": {"Content-Type": ARROW}},
                (400,),
            ),
            (
                "POST",
                "/sessions/bodies/append",
                {"content": rows, "headers": {"Content-Type": "multipart/form-data"}},
                (415,),
            ),
            (
                "POST",
                "/sessions/bodies/append",
                {"content": rows, "headers": {"Content-Type": RAW}, "params": {"complete_turn": "maybe"}},
                (422,),
            ),
            ("GET", "/sessions/bodies/resume", {"params": {"format": "zip"}}, (422,)),
            ("GET", "/sessions/bodies/resume", {"params": {"tier": "v3:int4:" + "9" * 25}}, (400, 422)),
            ("GET", "/sessions/bodies/resume", {"params": {"geometry": ",".join(["1"] * 12)}}, (400,)),
            ("GET", "/sessions/bodies/resume", {"params": {"geometry": "9" * 70}}, (400,)),
            ("GET", "/sessions/bodies/resume", {"params": {"tier": "fp9"}}, (422,)),
            ("GET", "/sessions/bodies/resume", {"params": {"override": "geometry.vocab", "tier": "f32"}}, (400,)),
            ("GET", "/sessions", {"params": [("tag", "x")] * 2000}, (200, 400, 422)),
            ("GET", "/sessions", {"params": {"state": "deleting"}}, (422,)),
        ]
        for method, path, kwargs, statuses in odd:
            response = alice.request(method, path, **kwargs)
            assert response.status_code in statuses, (path, kwargs.get("params"), response.status_code, response.text)
            if response.status_code >= 400:
                assert_error(response, *statuses)
            tried += 1
    # A client that announces a body and leaves after part of it: nothing is written.
    head = (
        f"POST /sessions/bodies/append HTTP/1.1\r\nHost: x\r\nAuthorization: {auth['Authorization']}\r\n"
        f"Content-Type: {RAW}\r\nContent-Length: {len(rows)}\r\n\r\n"
    ).encode()
    for cut in (0, 1, RECORD_BYTES, len(rows) - 1):
        raw_request(service, head, rows[:cut])
        tried += 1
    # A key that is not even text: refused like any unknown key.
    for header in (b"X-API-Key: \xff\xfe\xe9", b"Authorization: Bearer \xff\xfe"):
        host, port = service.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"GET /sessions/bodies HTTP/1.1\r\nHost: x\r\n" + header + b"\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
        tried += 1
    assert state_of(service, "bodies") == before
    with service.client() as alice:  # the next append completes
        response = alice.post("/sessions/bodies/append", content=turn_bytes(9, 9), headers={"Content-Type": RAW})
        assert response.status_code == 200
        assert alice.get("/sessions/bodies/resume").content == rows + turn_bytes(9, 9)
    figures.add("api_abuse", "bodies_queries_abandoned_uploads", inputs=tried, server_errors=0, changed=0)


def test_wrongly_typed_json_is_refused_not_coerced(service, figures):
    """Regression: lax parsing read {"n_records": false} as 0, so a malformed truncate emptied the
    session (found by the long schemathesis run). A value must already have its field's type."""
    rows = make_session(service, "typed")
    before = state_of(service, "typed")
    wrong = [
        ("/sessions/typed/truncate", {"n_records": False}),
        ("/sessions/typed/truncate", {"n_records": "0"}),
        ("/sessions/typed/truncate", {"n_records": 0.0}),
        ("/sessions/typed/fork", {"at": True, "id": "typed-fork"}),
        ("/sessions/typed/fork", {"at": "1", "id": "typed-fork"}),
        ("/sessions", {"id": "typed-2", "model": MODEL, "geometry": {**GEOMETRY_JSON, "n_layers": "2"}}),
        ("/sessions", {"id": "typed-2", "model": MODEL, "geometry": GEOMETRY_JSON, "tier": {"version": True}}),
        ("/sessions", {"id": "typed-2", "model": MODEL, "geometry": GEOMETRY_JSON, "tier": 2}),
        ("/sessions", {"id": "typed-2", "model": MODEL, "geometry": GEOMETRY_JSON, "tier": True}),
        ("/lookup", {"model": MODEL, "geometry": GEOMETRY_JSON, "tokens": [True, False]}),
        ("/sessions/typed/file/migrate", {"to": "v3", "codec": "int4", "bits": 4.0}),
        ("/sessions/typed/file/migrate", {"tier": 4}),
    ]
    with service.client() as alice:
        for path, body in wrong:
            assert_error(alice.post(path, json=body), 422)
        assert (
            alice.get("/sessions/typed-fork").status_code == 404 and alice.get("/sessions/typed-2").status_code == 404
        )
    assert state_of(service, "typed") == before and before[-1] == rows
    figures.add("api_abuse", "wrongly_typed_json", inputs=len(wrong), coerced=0)


def test_a_repeated_single_valued_query_parameter_is_refused(service, figures):
    """Regression (long schemathesis run): ``?model=a&model=b`` was answered for ``b`` alone — the
    other values were dropped without a word. A parameter that takes one value, repeated, is 400;
    one that takes a list (``tag``) still takes several."""
    make_session(service, "repeat")
    repeated = [
        ("/sessions", [("model", "a"), ("model", "b")]),
        ("/sessions", [("state", "active"), ("state", "parked")]),
        ("/sessions/repeat/resume", [("format", "raw"), ("format", "arrow")]),
        ("/sessions/repeat/resume", [("verify", "true"), ("verify", "false")]),
    ]
    with service.client() as alice:
        for path, params in repeated:
            body = assert_error(alice.get(path, params=params), 400)
            assert "given 2 times" in body["reason"], body
        both = alice.get("/sessions", params=[("tag", "t"), ("tag", "u")])
        assert both.status_code == 200 and both.json() == {"sessions": [], "next_cursor": None}
        one = alice.get("/sessions", params=[("tag", "t"), ("model", MODEL["name"])])
        assert "repeat" in {s["id"] for s in one.json()["sessions"]}
    figures.add("api_abuse", "repeated_query_parameters", inputs=len(repeated) + 2, accepted=0)
