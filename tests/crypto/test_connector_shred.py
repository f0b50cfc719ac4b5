"""A crypto shred reaches the connectors' hot tier: rows of an owner whose data keys were destroyed
(``Keyring.shred``, what ``kvstore crypto shred`` runs, from another keyring instance as another
process would) are never served from host memory again and are dropped from it at the connector's
next lookup or load; another owner's entries stay. Real encrypted store, no vLLM."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore.store
from crypto.support import KEK
from kvstore import tiers
from kvstore.connectors.hot_tier import HotTier
from kvstore.connectors.prefix_cache import LoadFailed, PrefixCache, model_fingerprint
from kvstore.crypto.keyring import Keyring
from kvstore.formats.coli_kv import Geometry

GEOMETRY = Geometry(2, 64, 16, 0, 0, 1000)
FINGERPRINT = model_fingerprint(
    name="tiny", revision="main", geometry=GEOMETRY, tier=tiers.F32, attention_variant="vllm-mla:float32"
)


def rows_of(seed: int, n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1000, n).astype(np.int32), rng.standard_normal((2, n, 80)).astype(np.float32)


@pytest.fixture
def store(tmp_path):
    with kvstore.store.open(tmp_path / "data", kek=KEK) as opened:
        yield opened


@pytest.mark.parametrize("after", ["lookup", "load"])
def test_a_shred_drops_the_owners_rows_from_the_hot_tier_and_no_load_serves_them(store, tmp_path, after):
    hot = HotTier(1 << 24, pinned=False)
    alice = PrefixCache(store, "alice", FINGERPRINT, min_tokens=1, hot=hot)
    bob = PrefixCache(store, "bob", FINGERPRINT, min_tokens=1, hot=hot)
    (a_tokens, a_rows), (b_tokens, b_rows) = rows_of(1), rows_of(2)
    a_id, b_id = alice.save(a_tokens, a_rows), bob.save(b_tokens, b_rows)
    assert a_id is not None and b_id is not None
    assert np.array_equal(alice.load(a_id, 0, 40), a_rows) and alice.stats.hot_hits == 1
    held = hot.nbytes

    Keyring(tmp_path / "data", KEK).shred("alice")  # another instance: as `kvstore crypto shred` in another process

    if after == "lookup":
        assert alice.lookup(a_tokens) is None  # the lookup checks first, then the store refuses
        assert hot.nbytes == held // 2  # alice's entry gone before any load
    with pytest.raises(LoadFailed, match="shredded"):
        alice.load(a_id, 0, 40)
    assert hot.nbytes == held // 2 and len(hot) == 1
    assert alice.stats.hot_hits == 1  # never served from memory after the shred
    assert np.array_equal(bob.load(b_id, 0, 40), b_rows) and bob.stats.hot_hits == 1  # bob untouched


@pytest.fixture
def encrypted_server(tmp_path):
    from kvstore.crypto.kek import write_kek_file
    from served import ServeProcess

    data, kek = tmp_path / "data", tmp_path / "kek.hex"
    write_kek_file(kek)
    server = ServeProcess(
        data, "--encrypt", "--kek-file", str(kek), env={"KVSTORE_API_KEYS": "key-alice-0123456789:alice"}
    )
    server.start()
    try:
        yield server, data, kek
    finally:
        server.stop_cleanly()


def shred_alice(data, kek) -> None:
    """``kvstore crypto shred alice`` in another process, against the serving store's folder."""
    import subprocess
    import sys

    shred = [sys.executable, "-m", "kvstore.cli", "crypto", "shred", "alice", "--data", str(data)]
    subprocess.run([*shred, "--kek-file", str(kek)], check=True, capture_output=True, timeout=60)


def test_in_service_mode_a_shred_ends_the_hot_tiers_hits_at_the_next_lookup(encrypted_server):
    """A vLLM-style connector talking to an encrypted ``kvstore serve``: after ``kvstore crypto
    shred`` (run against the server's folder while it serves), the lookup's answer says so and the
    connector drops the owner's rows from its hot tier; its loads fail, none served from memory."""
    from kvstore.connectors.store_client import ServiceClient

    server, data, kek = encrypted_server
    hot = HotTier(1 << 24, pinned=False)
    alice = PrefixCache(ServiceClient(server.url, "key-alice-0123456789"), None, FINGERPRINT, min_tokens=1, hot=hot)
    tokens, rows = rows_of(3)
    session_id = alice.save(tokens, rows)
    assert session_id is not None and np.array_equal(alice.load(session_id, 0, 40), rows)
    assert alice.stats.hot_hits == 1 and len(hot) == 1
    shred_alice(data, kek)
    assert alice.lookup(tokens) is None
    assert len(hot) == 0 and hot.nbytes == 0
    with pytest.raises(LoadFailed):
        alice.load(session_id, 0, 40)
    assert alice.stats.hot_hits == 1


def test_in_service_mode_pages_leave_the_hot_tier_once_the_shred_mark_is_asked_again(encrypted_server, monkeypatch):
    """An SGLang-style page cache never looks up by tokens: its hits from memory ask the service
    (``GET /console/me``) once the mark is :data:`SHRED_CHECK_S` old — here at once — so a shredded
    owner's pages are dropped at the next load, never served."""
    from kvstore.connectors import store_client
    from kvstore.connectors.page_cache import PageCache

    server, data, kek = encrypted_server
    hot = HotTier(1 << 24, pinned=False)
    pages = PageCache(
        store_client.ServiceClient(server.url, "key-alice-0123456789"), None, FINGERPRINT, page_size=40, hot=hot
    )
    _, rows = rows_of(4)
    assert pages.save_page("p0", rows) and pages.count_present(["p0"]) == 1
    assert np.array_equal(pages.load_page("p0"), rows) and pages.stats.hot_hits == 1
    shred_alice(data, kek)
    monkeypatch.setattr(store_client, "SHRED_CHECK_S", 0.0)  # the mark is old at once: no waiting in a test
    with pytest.raises(LoadFailed):
        pages.load_page("p0")
    assert pages.stats.hot_hits == 1 and len(hot) == 0
