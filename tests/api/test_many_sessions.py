"""Many sessions (issue 42, item 5), over HTTP against a real server: ``GET /sessions`` in pages
(``limit``, ``cursor``, ``next_cursor``), the cap on an owner's sessions (``--max-sessions-per-owner``,
``409 TooManySessions``), and ``/metrics`` and the console's summaries read from the index's counts.
Sessions are made through the store first where a test needs many (a server then opens it)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvstore.store
from kvstore import tiers
from kvstore.api.schemas import DEFAULT_PAGE, MAX_PAGE
from store.support import GEOMETRY, MODEL, Rows, new_session

GEOMETRY_JSON = {
    "n_layers": GEOMETRY.n_layers,
    "kv_lora": GEOMETRY.kv_lora,
    "qk_rope": GEOMETRY.qk_rope,
    "index_hd": GEOMETRY.index_hd,
    "nic": GEOMETRY.nic,
    "vocab": GEOMETRY.vocab,
}
RAW = "application/octet-stream"


def create(client: httpx.Client, sid: str, **extra) -> httpx.Response:
    return client.post("/sessions", json={"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON, **extra})


def page_through(client: httpx.Client, **params) -> tuple[list[str], int]:
    """Every session id the list gives, cursor to cursor, and how many pages it took."""
    ids, cursor, pages = [], None, 0
    while pages < 5000:  # more pages than any test holds sessions: a list that never ends fails
        answer = client.get("/sessions", params={**params, **({"cursor": cursor} if cursor else {})})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert set(body) == {"sessions", "next_cursor"}
        ids += [s["id"] for s in body["sessions"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            return ids, pages
        assert len(body["sessions"]) == params.get("limit", DEFAULT_PAGE)  # only the last page is short
    raise AssertionError(f"the pages never end: {ids[:8]} ...")


def fill(data, owner: str, n: int, *, tag_every: int = 0) -> list[str]:
    ids = [f"s{i:04d}" for i in range(n)]
    with kvstore.store.open(data) as store:
        for i, sid in enumerate(ids):
            tags = ["t"] if tag_every and i % tag_every == 0 else []
            new_session(store, sid, owner=owner, tags=tags)
    return ids


def test_pages_hold_every_session_once_oldest_first_with_filters(make_server, keys, tmp_path):
    data = tmp_path / "data"
    ids = fill(data, "alice", 250, tag_every=3)
    fill(data, "bob", 5)
    server = make_server(data=data)
    with server.client(keys["alice"]) as alice:
        first = alice.get("/sessions").json()
        assert [s["id"] for s in first["sessions"]] == ids[:DEFAULT_PAGE] and first["next_cursor"]
        assert page_through(alice) == (ids, 3)
        assert page_through(alice, limit=7) == (ids, 36)
        assert page_through(alice, limit=250) == (ids, 1)  # exactly one page: next_cursor null at once
        assert page_through(alice, limit=MAX_PAGE) == (ids, 1)
        tagged = [sid for i, sid in enumerate(ids) if i % 3 == 0]
        assert page_through(alice, limit=10, tag="t") == (tagged, 9)
        assert page_through(alice, limit=10, state="parked") == ([], 1)
        assert page_through(alice, limit=40, model=MODEL["name"]) == (ids, 7)
        assert page_through(alice, model="another") == ([], 1)
    with server.client(keys["bob"]) as bob:
        assert page_through(bob, limit=2) == ([f"s{i:04d}" for i in range(5)], 3)


def test_sessions_created_and_deleted_between_pages(server, alice):
    for i in range(10):
        assert create(alice, f"s{i}").status_code == 201
    seen, cursor = [], None
    for step in range(20):
        body = alice.get("/sessions", params={"limit": 3, **({"cursor": cursor} if cursor else {})}).json()
        seen += [s["id"] for s in body["sessions"]]
        cursor = body["next_cursor"]
        if step == 0:
            assert alice.delete("/sessions/s2").status_code == 204  # the page's own last one
            assert alice.delete("/sessions/s3").status_code == 204  # one the next page would hold
            assert create(alice, "a-late").status_code == 201  # sorts first by id, comes last
        if cursor is None:
            break
    assert seen == ["s0", "s1", "s2", "s4", "s5", "s6", "s7", "s8", "s9", "a-late"]


@pytest.mark.parametrize(
    "params, status, error, words",
    [
        ({"limit": MAX_PAGE + 1}, 422, "InvalidRequest", "limit"),
        ({"limit": 0}, 422, "InvalidRequest", "limit"),
        ({"limit": "ten"}, 422, "InvalidRequest", "limit"),
        ({"cursor": "bm90IGEgY3Vyc29y"}, 400, "InvalidCursor", "next_cursor unchanged"),
        ({"cursor": "!!"}, 400, "InvalidCursor", "next_cursor unchanged"),
        ({"cursor": "A" * 401}, 422, "InvalidRequest", "cursor"),
        ([("limit", "2"), ("limit", "3")], 400, "InvalidRequest", "given 2 times"),
    ],
)
def test_bad_paging_is_refused_with_a_typed_error(server, alice, params, status, error, words):
    create(alice, "one")
    answer = alice.get("/sessions", params=params)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"] == error and words in answer.json()["reason"]


def test_the_cap_refuses_the_next_create_per_owner_and_creates_nothing(make_server, keys, tmp_path):
    server = make_server("--max-sessions-per-owner", "3")
    with server.client(keys["alice"]) as alice, server.client(keys["bob"]) as bob:
        for sid in ("a", "b", "c"):
            assert create(alice, sid).status_code == 201
        assert alice.post("/sessions/a/append", content=Rows(1).encode(tiers.FP8, Rows(1).make(2)),
                          headers={"Content-Type": RAW}).status_code == 200  # fmt: skip
        listed = alice.get("/sessions").json()
        for refused in (
            create(alice, "d"),
            create(alice, "e", tags=["x"]),
            alice.post("/sessions/a/fork", json={"id": "f"}),
        ):
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"] == "TooManySessions" and "Retry-After" not in refused.headers
            assert "--max-sessions-per-owner 3" in refused.json()["reason"]
        assert alice.get("/sessions").json() == listed
        assert alice.get("/sessions/d").status_code == 404
        assert not list((tmp_path / "data" / "journals").glob("d~*")) and not list(
            (tmp_path / "data" / "locks").glob("d~*")
        )
        # bob's count is his own
        for sid in ("a", "b", "c"):
            assert create(bob, sid).status_code == 201
        assert create(bob, "d").json()["error"] == "TooManySessions"
        # a delete frees a place at once
        assert alice.delete("/sessions/b").status_code == 204
        assert create(alice, "d").status_code == 201
        assert create(alice, "e").status_code == 409


def metrics(client: httpx.Client) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_metrics_and_console_counts_follow_create_append_park_and_delete(server, alice, bob):
    from served import wait_job

    def expected(client: httpx.Client) -> dict:
        by_state = {state: {"sessions": 0, "bytes": 0} for state in ("active", "parked", "damaged")}
        by_tier: dict = {}
        for s in client.get("/sessions", params={"limit": MAX_PAGE}).json()["sessions"]:
            for table, name in ((by_state, s["state"]), (by_tier, s["tier"]["name"])):
                entry = table.setdefault(name, {"sessions": 0, "bytes": 0})
                entry["sessions"] += 1
                entry["bytes"] += s["size_bytes"]
        return {"state": by_state, "tier": by_tier}

    def check() -> None:
        mine, theirs = expected(alice), expected(bob)
        console = alice.get("/console/store").json()
        assert console["mine"] == mine["state"] and console["mine_by_tier"] == mine["tier"]
        everyone = {
            state: {k: mine["state"][state][k] + theirs["state"][state][k] for k in ("sessions", "bytes")}
            for state in mine["state"]
        }
        assert console["store"] == everyone
        scraped = metrics(alice)
        for state, entry in everyone.items():
            assert scraped[f'kvstore_store_sessions{{state="{state}"}}'] == entry["sessions"], state
        tiers_seen = set(mine["tier"]) | set(theirs["tier"])
        for tier in tiers_seen:
            sessions = sum(d["tier"].get(tier, {"sessions": 0})["sessions"] for d in (mine, theirs))
            nbytes = sum(d["tier"].get(tier, {"bytes": 0})["bytes"] for d in (mine, theirs))
            assert scraped[f'kvstore_store_tier_sessions{{tier="{tier}"}}'] == sessions
            assert scraped[f'kvstore_store_tier_bytes{{tier="{tier}"}}'] == nbytes
        assert not [
            k for k in scraped if k.startswith("kvstore_store_tier_sessions") and k.split('"')[1] not in tiers_seen
        ]

    check()
    assert create(alice, "a").status_code == 201
    assert create(alice, "b", tier="int4").status_code == 201
    assert create(bob, "c").status_code == 201
    check()
    rows = Rows(1)
    assert alice.post("/sessions/a/append", content=rows.encode(tiers.FP8, rows.make(40)),
                      headers={"Content-Type": RAW}).status_code == 200  # fmt: skip
    check()
    wait_job(alice, alice.post("/sessions/a/park").json(), expect="done")
    check()
    assert alice.delete("/sessions/b").status_code == 204 and bob.delete("/sessions/c").status_code == 204
    check()
    assert alice.get("/console/store").json()["mine"]["parked"]["sessions"] == 1


def test_console_activity_drops_a_session_deleted_elsewhere(server, alice):
    assert create(alice, "kept").status_code == 201 and create(alice, "gone").status_code == 201
    for sid in ("kept", "gone"):
        assert alice.get(f"/sessions/{sid}/verify").status_code == 200
    assert set(alice.get("/console/activity").json()["sessions"]) == {"kept", "gone"}
    with kvstore.store.open(server.data) as store:  # another process (the CLI) deletes one
        store.delete("gone", owner="alice")
    assert set(alice.get("/console/activity").json()["sessions"]) == {"kept"}
