"""``GET /metrics`` through ``prometheus_client``, scraped from real servers after real requests.

The store's figures (lookups, restores, appends, lock waits, evictions, bytes per tier) are checked
against what the requests did; the page names no owner or session; each app has its own registry;
and the Grafana dashboard in docs/ asks only for metrics a server exports.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvstore import tiers
from kvstore.api.main import create_app
from kvstore.locks import FileLock
from layering import imports, part_of_file
from store.support import MODEL, Rows

ROOT = Path(__file__).resolve().parents[2]
RAW = "application/octet-stream"
GEOMETRY_JSON = {"n_layers": 2, "kv_lora": 32, "qk_rope": 8, "index_hd": 4, "nic": 1, "vocab": 1000}
# label names a sample may carry: none of them can hold an owner, a session id or a key
SAFE_LABELS = {"outcome", "error", "source", "phase", "action", "tier", "state", "le"}
SAFE_LABELS |= {"implementation", "major", "minor", "patchlevel", "version"}  # python_info


def scrape(client: httpx.Client) -> dict[str, float]:
    """The page as ``{'name{a="x",b="y"}': value}`` (labels sorted), parsed by prometheus_client."""
    page = client.get("/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain"), page.text
    out = {}
    for family in text_string_to_metric_families(page.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def create(client: httpx.Client, sid: str, tier: str = "fp8") -> None:
    answer = client.post("/sessions", json={"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON, "tier": tier})
    assert answer.status_code == 201, answer.text


def append(client: httpx.Client, sid: str, payload: bytes) -> httpx.Response:
    return client.post(f"/sessions/{sid}/append", content=payload, headers={"Content-Type": RAW})


def eventually(check, what: str, timeout: float = 30.0):
    """Poll ``check()`` until it returns something true (the server finishes a stream after the last byte)."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_lookups_restores_appends_and_tiers_are_counted_from_real_requests(server, alice, bob):
    rows = Rows(3)
    tokens = rows.rng.integers(0, 1000, 200).astype(np.int32)
    create(alice, "secret-chat-7")
    fp8_records = rows.encode(tiers.FP8, rows.make(200, tokens))
    assert append(alice, "secret-chat-7", fp8_records).status_code == 200
    create(alice, "other-9", tier="int4")
    assert append(alice, "other-9", rows.encode(tiers.INT4, rows.make(70))).status_code == 200
    assert append(alice, "other-9", rows.encode(tiers.INT4, rows.make(10))).status_code == 200
    assert append(alice, "other-9", b"\x00" * 3).status_code == 422  # refused (not whole records): not an append
    before = scrape(alice)

    query = {"model": MODEL, "geometry": GEOMETRY_JSON, "tier": "fp8"}
    hits = [tokens[:150].tolist(), tokens.tolist() + [1, 2]]
    misses = [
        rows.rng.integers(0, 1000, 100).tolist(),  # shares nothing
        tokens[:40].tolist(),  # shorter than one 64-token block
    ]
    for asked in hits + misses:
        assert alice.post("/lookup", json={**query, "tokens": asked}).status_code == 200
    # bob asks for alice's prefix: ids are per owner, so his lookup is a miss
    assert bob.post("/lookup", json={**query, "tokens": tokens.tolist()}).json()["match"] is None
    assert alice.post("/lookup", json={**query, "tokens": [-1]}).status_code == 422  # refused: no lookup

    downloaded = alice.get("/sessions/secret-chat-7/resume")
    assert downloaded.status_code == 200 and downloaded.content == fp8_records
    after = eventually(
        lambda: (page := scrape(alice))["kvstore_restore_bytes_count"] == 1 and page, "the restore is counted"
    )

    assert after["kvstore_lookups_total"] - before["kvstore_lookups_total"] == 5
    assert after["kvstore_lookup_hits_total"] == 2 and after["kvstore_lookup_misses_total"] == 3
    assert after["kvstore_lookup_hits_total"] + after["kvstore_lookup_misses_total"] == after["kvstore_lookups_total"]

    # one restore of the whole session: its bytes in the sum and in the right buckets
    assert after["kvstore_restore_bytes_sum"] == len(fp8_records)
    assert after['kvstore_restore_bytes_bucket{le="65536.0"}'] == 1  # 23 KB
    assert after["kvstore_restore_seconds_count"] == 1 and after["kvstore_restore_seconds_sum"] > 0
    assert after['kvstore_restore_seconds_bucket{le="+Inf"}'] == 1

    # three acknowledged appends; the refused one is not an append
    assert after["kvstore_append_seconds_count"] == 3 and after["kvstore_append_seconds_sum"] > 0
    assert after['kvstore_append_seconds_bucket{le="+Inf"}'] == 3

    sessions = {s["id"]: s for s in alice.get("/sessions").json()["sessions"]}
    assert after['kvstore_store_tier_bytes{tier="fp8"}'] == sessions["secret-chat-7"]["size_bytes"]
    assert after['kvstore_store_tier_bytes{tier="int4"}'] == sessions["other-9"]["size_bytes"]
    assert after['kvstore_store_tier_sessions{tier="fp8"}'] == 1 == after['kvstore_store_tier_sessions{tier="int4"}']
    assert after["kvstore_store_used_bytes"] == sum(s["size_bytes"] for s in sessions.values())
    assert after["process_resident_memory_bytes"] > 0 and after["process_cpu_seconds_total"] > 0

    # no credentials needed, and nothing on the page names who uses the service or what they store
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        text = anonymous.get("/metrics").text
    for secret in ("alice", "bob", "secret-chat-7", "other-9", "tiny-mla"):
        assert secret not in text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) <= SAFE_LABELS, sample


def test_lock_waits_and_timeouts_are_counted(make_server, tmp_path):
    data = tmp_path / "data"
    server = make_server("--lock-timeout", "3", data=data)
    rows = Rows(4)
    with server.client() as alice:
        create(alice, "busy")
        payload = rows.encode(tiers.FP8, rows.make(4))
        # another process holds the session's write lock: the append waits, then gives up (409)
        holder = FileLock(data / "locks" / "busy~alice.write").acquire()
        try:
            refused = append(alice, "busy", payload)
        finally:
            holder.release()
        assert refused.status_code == 409 and refused.json()["error"] == "JournalLocked"
        assert refused.headers["retry-after"] == "1"  # busy now: a client knows when to come back
        counted = scrape(alice)
        assert (counted["kvstore_lock_waits_total"], counted["kvstore_lock_timeouts_total"]) == (1, 1)

        # held again; released once the server shows the append waiting: it then goes through
        holder = FileLock(data / "locks" / "busy~alice.write").acquire()
        answers: list[httpx.Response] = []
        with server.client() as other:
            worker = threading.Thread(target=lambda: answers.append(append(other, "busy", payload)))
            worker.start()
            try:
                eventually(lambda: scrape(alice)["kvstore_lock_waits_total"] == 2, "the second append waits")
            finally:
                holder.release()
                worker.join(60)
        assert answers[0].status_code == 200, answers[0].text
        counted = scrape(alice)
        assert (counted["kvstore_lock_waits_total"], counted["kvstore_lock_timeouts_total"]) == (2, 1)
        assert counted["kvstore_append_seconds_count"] == 1


def test_evictions_and_their_bytes_are_counted(make_server):
    rows = Rows(5)
    server = make_server("--budget", "15000")
    with server.client() as alice:
        create(alice, "old")
        assert append(alice, "old", rows.encode(tiers.FP8, rows.make(100))).status_code == 200
        old_bytes = alice.get("/sessions/old").json()["size_bytes"]
        before = scrape(alice)
        assert before['kvstore_evictions_total{action="parked"}'] == 0
        create(alice, "new")
        # 2 x 11.6 KB of rows over a 15 KB budget: "old" is parked, and its archive still does not fit
        assert append(alice, "new", rows.encode(tiers.FP8, rows.make(100))).status_code == 200
        after = scrape(alice)
        assert alice.get("/sessions/old").status_code == 404
    assert after['kvstore_evictions_total{action="parked"}'] == 1
    assert after['kvstore_evictions_total{action="deleted"}'] == 1
    assert after["kvstore_evicted_bytes_total"] == old_bytes  # the journal, less the archive, plus the archive
    assert after["kvstore_store_budget_bytes"] == 15000
    assert after["kvstore_store_used_bytes"] <= 15000


class ThreadServer:
    """A real uvicorn on 127.0.0.1 in a thread of this process (two apps in one process)."""

    def __init__(self, app):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        eventually(lambda: self.server.started, "the server starts")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.socket.close()
        assert not self.thread.is_alive()


def test_two_apps_in_one_process_have_their_own_metrics(tmp_path, monkeypatch, keys):
    monkeypatch.setenv("KVSTORE_API_KEYS", f"{keys['alice']}:alice")
    headers = {"Authorization": f"Bearer {keys['alice']}"}
    with ThreadServer(create_app(tmp_path / "one")) as one, ThreadServer(create_app(tmp_path / "two")) as two:
        with httpx.Client(base_url=one.url, headers=headers) as first, httpx.Client(base_url=two.url) as second:
            create(first, "a")
            query = {"model": MODEL, "geometry": GEOMETRY_JSON, "tokens": [1, 2, 3]}
            assert first.post("/lookup", json=query).status_code == 200
            assert scrape(first)["kvstore_lookups_total"] == 1
            assert scrape(second)["kvstore_lookups_total"] == 0
            assert scrape(first)['kvstore_store_tier_sessions{tier="fp8"}'] == 1
            assert 'kvstore_store_tier_sessions{tier="fp8"}' not in scrape(second)


def test_the_grafana_dashboard_asks_only_for_exported_metrics(make_server):
    dashboard = json.loads((ROOT / "docs" / "grafana-kvstore.json").read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["panels"]
    server = make_server("--budget", "1G", "--hard-limit", "2G")  # the limits' gauges exist when set
    with server.client() as alice:
        create(alice, "a")
        page = alice.get("/metrics").text
    exported = set()
    for family in text_string_to_metric_families(page):
        exported |= {sample.name for sample in family.samples}
        exported.add(family.name + "_total" if family.type == "counter" else family.name)
        if family.type == "histogram":
            exported |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    wanted = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\b((?:kvstore|process|python)_[a-z_]+)\b", target["expr"]))
            assert names, target["expr"]
            wanted |= names
    assert wanted <= exported, sorted(wanted - exported)
    # every store figure the issue asks for has a panel
    for name in (
        "kvstore_lookup_hits_total",
        "kvstore_lookup_misses_total",
        "kvstore_restore_seconds_bucket",
        "kvstore_restore_bytes_sum",
        "kvstore_append_seconds_bucket",
        "kvstore_lock_waits_total",
        "kvstore_lock_timeouts_total",
        "kvstore_store_tier_bytes",
        "kvstore_evictions_total",
    ):
        assert name in wanted, name


def test_only_the_service_imports_prometheus_client():
    # the store counts in plain numbers (kvstore.store.stats); exporting them is the API's business
    found = [
        edge
        for edge in imports(ROOT)
        if edge.module.split(".")[0] == "prometheus_client" and part_of_file(edge.source) not in ("api", "cli")
    ]
    assert not found, found


@pytest.mark.parametrize("accept", ["application/openmetrics-text; version=1.0.0"])
def test_openmetrics_is_served_when_asked_for(alice, accept):
    page = alice.get("/metrics", headers={"Accept": accept})
    assert page.status_code == 200 and page.headers["content-type"].startswith("application/openmetrics-text")
    assert page.text.endswith("# EOF\n") and "kvstore_lookups_total 0.0" in page.text
