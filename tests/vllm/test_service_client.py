"""Service mode of the connectors' prefix cache, without vLLM: :class:`PrefixCache` over a real
``kvstore serve`` (uvicorn on 127.0.0.1) with two API keys — rows round-trip, owners are isolated,
refusals and damaged rows are load failures, the server's ``/metrics`` counts every lookup.
vLLM processes against a server are in test_connector.py."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from kvstore import tiers
from kvstore.connectors.prefix_cache import CacheConfig, LoadFailed, PrefixCache, model_fingerprint, open_client
from kvstore.connectors.store_client import ServiceClient
from kvstore.errors import ConfigError
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, read_header
from served import ServeProcess

GEOMETRY = Geometry(2, 512, 64, 0, 0, 1000)
RNG = np.random.default_rng(11)
PROMPT = RNG.integers(0, 1000, size=200).astype(np.int32)
ROWS = RNG.standard_normal((2, 200, 576)).astype(np.float32)
KEY_A = "connector-test-key-alice-0123456789"
KEY_B = "connector-test-key-bob-0123456789ab"


def fingerprint(tier=tiers.F32, weights="sampled-blake2b:one"):
    return model_fingerprint(
        name="tiny",
        revision="main",
        geometry=GEOMETRY,
        tier=tier,
        attention_variant="vllm-mla:float32",
        weights_hash=weights,
    )


def lookup_metrics(url: str) -> tuple[int, int, int]:
    """The server's (lookups, hits, misses) from ``GET /metrics``."""
    text = httpx.get(url + "/metrics", timeout=10).text

    def value(name: str) -> int:
        found = re.search(rf"^{name}_total (\S+)$", text, re.MULTILINE)
        assert found is not None, name
        return int(float(found.group(1)))

    return value("kvstore_lookups"), value("kvstore_lookup_hits"), value("kvstore_lookup_misses")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("served") / "data"
    running = ServeProcess(data, env={"KVSTORE_API_KEYS": f"{KEY_A}:alice,{KEY_B}:bob"}).start()
    yield running
    running.stop_cleanly()


def cache(server, key: str, **kwargs) -> PrefixCache:
    return PrefixCache(ServiceClient(server.url, key), None, kwargs.pop("fp", None) or fingerprint(), **kwargs)


def test_rows_saved_through_the_service_load_back_exactly_for_their_owner_only(server):
    before = lookup_metrics(server.url)
    alice, bob = cache(server, KEY_A), cache(server, KEY_B)
    assert alice.owner == "alice" and bob.owner == "bob"
    session_id = alice.save(PROMPT, ROWS)
    assert session_id is not None and alice.save(PROMPT, ROWS) is None  # the same prompt is stored once
    found = alice.lookup(PROMPT)
    assert found is not None and (found.session_id, found.tokens) == (session_id, 200)
    assert np.array_equal(alice.load(session_id, 16, 192), ROWS[:, 16:192])
    assert bob.lookup(PROMPT) is None  # another owner never finds it
    with pytest.raises(LoadFailed, match="SessionNotFound"):
        bob.load(session_id, 0, 192)
    counted = [alice.stats, bob.stats]
    assert [(s.lookups, s.hits, s.misses, s.refused) for s in counted] == [(1, 1, 0, 0), (1, 0, 1, 0)]
    assert bob.stats.load_errors == 1 and alice.stats.loaded_tokens == 176
    # the server counted the same lookups, and hits + misses == lookups there too
    lookups, hits, misses = (after - then for after, then in zip(lookup_metrics(server.url), before))
    assert (lookups, hits, misses) == (2, 1, 1)
    total = lookup_metrics(server.url)
    assert total[0] == total[1] + total[2]


def test_a_quantized_tier_round_trips_within_its_error(server):
    alice = cache(server, KEY_A, fp=fingerprint(tier=tiers.INT4))
    prompt = RNG.integers(0, 1000, size=128).astype(np.int32)
    rows = RNG.standard_normal((2, 128, 576)).astype(np.float32)
    session_id = alice.save(prompt, rows)
    found = alice.lookup(prompt)
    assert found is not None and found.session_id == session_id
    loaded = alice.load(session_id, 0, 128)
    error = np.linalg.norm(loaded - rows) / np.linalg.norm(rows)
    assert 0 < error < 0.2


def test_another_fingerprint_is_refused_and_counted(server):
    alice = cache(server, KEY_A)
    alice.save(PROMPT, ROWS)
    other = cache(server, KEY_A, fp=fingerprint(weights="sampled-blake2b:two"))
    assert other.lookup(PROMPT) is None and other.stats.refused == 1 and other.stats.misses == 1
    # a load of the stored session stating the other fingerprint is refused by the server (409)
    with pytest.raises(LoadFailed, match="FingerprintMismatch|weights_hash"):
        other.load(alice.session_id_for(PROMPT), 0, 192)


def test_rows_changed_on_the_server_are_refused_by_verification(server):
    alice = cache(server, KEY_A)
    prompt = RNG.integers(0, 1000, size=150).astype(np.int32)
    session_id = alice.save(prompt, RNG.standard_normal((2, 150, 576)).astype(np.float32))
    assert session_id is not None
    (path,) = (server.data / "journals").glob(f"{session_id}~alice.coli_kv")
    header, _ = read_header(path)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 20 * header.rec_bytes + 4)
        value = np.frombuffer(f.read(4), dtype="<f4")[0]
        f.seek(HEADER_BYTES + 20 * header.rec_bytes + 4)
        f.write(np.float32(value + 0.5).tobytes())
    # the rows came over HTTP unverified and were checked here, against the digest the save recorded
    with pytest.raises(LoadFailed, match="do not match their XXH3-128"):
        alice.load(session_id, 0, 128)
    assert alice.stats.load_errors == 1 and alice.stats.quarantined == 1


def test_a_wrong_key_stops_the_connector_at_start_and_the_key_may_come_from_the_environment(server, monkeypatch):
    with pytest.raises(ConfigError, match="refused the API key"):
        ServiceClient(server.url, "not-a-key-of-this-server-000000")
    monkeypatch.setenv("KVSTORE_TEST_CONNECTOR_KEY", KEY_B)
    config = CacheConfig.from_extra({"url": server.url, "api_key_env": "KVSTORE_TEST_CONNECTOR_KEY"})
    assert config.api_key == KEY_B and KEY_B not in repr(config)  # a key is never logged
    assert open_client(config).owner == "bob"
