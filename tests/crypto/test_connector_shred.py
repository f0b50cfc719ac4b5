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


def test_in_service_mode_a_shred_ends_the_hot_tiers_hits_at_the_next_request(tmp_path):
    """A connector talking to an encrypted ``kvstore serve``: after ``kvstore crypto shred`` (run
    against the server's folder while it serves), the server refuses the owner's rows and the
    connector's next lookup drops them from its hot tier; its loads fail, none served from memory."""
    import subprocess
    import sys

    from kvstore.connectors.store_client import ServiceClient
    from kvstore.crypto.kek import write_kek_file
    from served import ServeProcess

    data, kek = tmp_path / "data", tmp_path / "kek.hex"
    write_kek_file(kek)
    server = ServeProcess(
        data, "--encrypt", "--kek-file", str(kek), env={"KVSTORE_API_KEYS": "key-alice-0123456789:alice"}
    )
    server.start()
    try:
        hot = HotTier(1 << 24, pinned=False)
        alice = PrefixCache(ServiceClient(server.url, "key-alice-0123456789"), None, FINGERPRINT, min_tokens=1, hot=hot)
        tokens, rows = rows_of(3)
        session_id = alice.save(tokens, rows)
        assert session_id is not None and np.array_equal(alice.load(session_id, 0, 40), rows)
        assert alice.stats.hot_hits == 1 and len(hot) == 1
        shred = [sys.executable, "-m", "kvstore.cli", "crypto", "shred", "alice", "--data", str(data)]
        subprocess.run([*shred, "--kek-file", str(kek)], check=True, capture_output=True, timeout=60)
        assert alice.lookup(tokens) is None
        assert len(hot) == 0 and hot.nbytes == 0
        with pytest.raises(LoadFailed):
            alice.load(session_id, 0, 40)
        assert alice.stats.hot_hits == 1
    finally:
        server.stop_cleanly()
