"""The engine-independent part of the connectors (kvstore.connectors.prefix_cache) on a real store:
lookups counted as hits or misses, rows round-tripping per tier, refusals by fingerprint and by
verification, and the configuration's typed errors. vLLM itself is exercised in test_connector.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvstore import tiers
from kvstore.connectors.prefix_cache import (
    ROWS_DIGEST_TAG,
    CacheConfig,
    LoadFailed,
    PrefixCache,
    RowsDamaged,
    model_fingerprint,
    open_store,
    recorded_digest,
    rows_digest,
    sampled_weights_hash,
)
from kvstore.errors import ConfigError
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, read_header
from kvstore.formats.floats import bf16_decode
from kvstore.store import SessionStore

GEOMETRY = Geometry(2, 512, 64, 0, 0, 1000)
RNG = np.random.default_rng(7)
PROMPT = RNG.integers(0, 1000, size=200).astype(np.int32)
ROWS = RNG.standard_normal((2, 200, 576)).astype(np.float32)


def fingerprint(tier=tiers.F32, weights="sampled-blake2b:one"):
    return model_fingerprint(
        name="tiny",
        revision="main",
        geometry=GEOMETRY,
        tier=tier,
        attention_variant="vllm-mla:float32",
        weights_hash=weights,
    )


@pytest.fixture
def store(tmp_path):
    with SessionStore(tmp_path / "kv") as opened:
        yield opened


def test_saved_rows_load_back_exactly_and_every_lookup_is_a_hit_or_a_miss(store, tmp_path):
    cache = PrefixCache(store, "team-a", fingerprint(), stats_path=tmp_path / "stats.json")
    assert cache.lookup(PROMPT) is None
    session = cache.save(PROMPT, ROWS)
    assert session is not None and cache.save(PROMPT, ROWS) is None  # the same prompt is stored once
    other = np.concatenate([PROMPT[:150], (PROMPT[150:] + 1) % 1000])
    found = cache.lookup(other)
    assert found is not None and found.session_id == session and found.tokens == 150
    np.testing.assert_array_equal(cache.load(session, 16, 144), ROWS[:, 16:144])
    assert cache.lookup(PROMPT[:40]) is None  # shorter than min_tokens: a miss, not an error
    stats = cache.stats
    assert (stats.lookups, stats.hits, stats.misses, stats.refused) == (3, 1, 2, 0)
    assert stats.lookups == stats.hits + stats.misses
    assert (stats.loads, stats.loaded_tokens, stats.saves, stats.saved_tokens) == (1, 128, 1, 200)
    assert json.loads((tmp_path / "stats.json").read_text())["hits"] == 1


def test_another_owner_never_finds_the_rows(store):
    PrefixCache(store, "team-a", fingerprint()).save(PROMPT, ROWS)
    other = PrefixCache(store, "team-b", fingerprint())
    assert other.lookup(PROMPT) is None
    assert (other.stats.misses, other.stats.refused) == (1, 0)


@pytest.mark.parametrize(
    "changed",
    [fingerprint(weights="sampled-blake2b:two"), fingerprint(tier=tiers.FP8)],
    ids=["other-weights", "other-tier"],
)
def test_rows_of_another_fingerprint_are_refused_and_counted(store, changed):
    stored = PrefixCache(store, "team-a", fingerprint())
    session = stored.save(PROMPT, ROWS)
    asking = PrefixCache(store, "team-a", changed)
    assert asking.lookup(PROMPT) is None
    assert (asking.stats.lookups, asking.stats.misses, asking.stats.refused) == (1, 1, 1)
    with pytest.raises(LoadFailed, match="another model or cache tier"):
        asking.load(session, 0, 64)  # even asked directly, the store refuses it
    assert asking.stats.load_errors == 1


def alter(store, session_id: str, owner: str, record: int) -> None:
    """Change one latent value of ``record`` (layer 0) in the session's journal: plausible, wrong."""
    path = store.journal_path(session_id, owner=owner)
    header, _ = read_header(path)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + record * header.rec_bytes + 4)
        value = np.frombuffer(f.read(4), dtype="<f4")[0]
        f.seek(HEADER_BYTES + record * header.rec_bytes + 4)
        f.write(np.float32(value + 0.5).tobytes())


def test_altered_rows_fail_verification_and_are_never_served(store):
    cache = PrefixCache(store, "team-a", fingerprint())
    session = cache.save(PROMPT, ROWS)
    alter(store, session, "team-a", 50)
    assert cache.lookup(PROMPT) is not None  # the tokens are intact: the index still finds it
    with pytest.raises(RowsDamaged, match="do not match their XXH3-128"):
        cache.load(session, 0, 192)
    with pytest.raises(LoadFailed):
        cache.load("vllm-missing", 0, 16)
    assert cache.stats.load_errors == 2 and cache.stats.loaded_tokens == 0
    assert cache.stats.quarantined == 1  # the damaged session; a missing one is not quarantined


def test_a_prefix_that_fails_verification_is_replaced_by_the_next_save(store):
    cache = PrefixCache(store, "team-a", fingerprint())
    session = cache.save(PROMPT, ROWS)
    alter(store, session, "team-a", 120)
    with pytest.raises(RowsDamaged):
        cache.load(session, 0, 192)
    # quarantined: the next request of the prompt misses (nothing offered that would fail again)...
    assert cache.lookup(PROMPT) is None
    # ...and its save stores the rows anew instead of being skipped as "stored already"
    assert cache.save(PROMPT, ROWS) == session
    found = cache.lookup(PROMPT)
    assert found is not None and found.session_id == session
    loaded = cache.load(session, 0, 192)
    assert loaded.tobytes() == ROWS[:, :192].tobytes()  # bit-exact
    stats = cache.stats
    assert (stats.quarantined, stats.saves, stats.load_errors, stats.loads) == (1, 2, 1, 1)


def test_a_save_records_the_rows_xxh3_and_a_load_checks_it(store):
    cache = PrefixCache(store, "team-a", fingerprint())
    session = cache.save(PROMPT, ROWS)
    info = store.get(session, owner="team-a")
    (tag,) = [t for t in info.tags if t.startswith(ROWS_DIGEST_TAG)]
    records = store.resume(session, owner="team-a").records.records
    assert tag == ROWS_DIGEST_TAG + rows_digest(records) and len(tag) <= 64  # of the very bytes stored
    assert cache.load(session, 0, 200).tobytes() == ROWS.tobytes()
    # the digest is what the load checks: a wrong one refuses rows the store's turn hashes would pass
    store.set_tags(session, [ROWS_DIGEST_TAG + "0" * 32], owner="team-a")
    assert store.verify(session, owner="team-a").ok
    with pytest.raises(RowsDamaged, match="XXH3-128"):
        cache.load(session, 0, 64)
    assert cache.stats.quarantined == 1


def test_a_session_saved_without_the_digest_is_verified_by_the_turn_hashes(store):
    cache = PrefixCache(store, "team-a", fingerprint())
    # as a connector before the digest existed saved it: no tag
    session = cache.session_id_for(PROMPT)
    store.create("team-a", GEOMETRY, tiers.F32, fingerprint().model, session_id=session)
    store.append(session, PROMPT, ROWS[..., :512], ROWS[..., 512:], owner="team-a")
    assert not store.get(session, owner="team-a").tags
    assert cache.load(session, 0, 200).tobytes() == ROWS.tobytes()
    alter(store, session, "team-a", 199)
    with pytest.raises(RowsDamaged, match="serves 0 rows"):
        cache.load(session, 0, 200)
    # a future version's digest is not taken for this one's: the turn hashes decide
    assert recorded_digest([ROWS_DIGEST_TAG.replace("v1", "v2") + "0" * 32, "team:x"]) is None


@pytest.mark.parametrize(("tier", "bound"), [(tiers.FP8, 0.08), (tiers.INT4, 0.2)])
def test_quantized_tiers_dequantize_on_load(store, tier, bound):
    cache = PrefixCache(store, "team-a", fingerprint(tier=tier))
    session = cache.save(PROMPT, ROWS)
    assert session is not None
    rows = cache.load(session, 0, 200)
    assert rows.dtype == np.float32 and rows.shape == ROWS.shape
    error = np.linalg.norm(rows - ROWS) / np.linalg.norm(ROWS)
    assert 0 < error < bound


def test_rows_of_the_wrong_shape_are_refused(store):
    with pytest.raises(ValueError, match=r"rows must be \[2, 200, 576\]"):
        PrefixCache(store, "team-a", fingerprint()).save(PROMPT, ROWS[:, :, :512])


def test_one_store_per_folder_and_process(tmp_path):
    first = open_store(str(tmp_path / "kv"))
    try:
        assert open_store(str(tmp_path / "kv" / ".." / "kv")) is first
    finally:
        first.close()


def test_the_configuration_is_checked_with_typed_errors():
    config = CacheConfig.from_extra({"store": "/srv/kv", "tier": "fp8", "owner": "team-a"})
    assert (config.tier, config.owner, config.verify, config.min_tokens) == (tiers.FP8, "team-a", True, 64)
    for extra, reason in [
        ({}, "needs either 'store'"),
        ({"store": "/srv/kv", "url": "http://127.0.0.1:1"}, "needs either 'store'"),
        ({"url": "http://127.0.0.1:1", "api_key_env": "KVSTORE_TEST_NO_SUCH_VARIABLE"}, "needs 'api_key'"),
        ({"url": "http://127.0.0.1:1", "api_key": "k" * 24, "owner": "a"}, "the API key decides the owner"),
        ({"store": "/srv/kv", "api_key": "k" * 24}, "is for service mode"),
        ({"url": 7}, "'url' must be a non-empty string"),
        ({"store": "/srv/kv", "tier": "f33"}, "unknown tier"),
        ({"store": "/srv/kv", "tier": "q8"}, "not stored in files"),
        ({"store": "/srv/kv", "owner": "a b"}, "invalid owner"),
        ({"store": "/srv/kv", "min_tokens": 0}, "positive integer"),
        ({"store": "/srv/kv", "verify": "yes"}, "true or false"),
        ({"store": "/srv/kv", "shared_storage_path": "/tmp"}, "unknown kvstore connector settings"),
    ]:
        with pytest.raises(ConfigError, match=reason):
            CacheConfig.from_extra(extra)


def test_the_default_tier_is_the_exact_one_of_the_cache_dtype():
    """No ``tier``: a bfloat16 cache is stored as bf16 (v4, half the bytes of f32, exact), any
    other dtype as f32; a tier that is set wins."""
    default = CacheConfig.from_extra({"store": "/srv/kv"})
    assert default.tier is None
    assert default.tier_for("bfloat16") is tiers.BF16 and default.tier_for("torch.bfloat16") is tiers.BF16
    for dtype in ("float32", "float16", "fp8_e4m3"):
        assert default.tier_for(dtype) is tiers.F32
    assert CacheConfig.from_extra({"store": "/srv/kv", "tier": "f32"}).tier_for("bfloat16") is tiers.F32


def test_the_sampled_weights_hash_tells_checkpoints_apart(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for folder, fill in ((one, 1), (two, 2)):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(bytes([fill]) * 3_000_000)
    assert sampled_weights_hash(one) != sampled_weights_hash(two)
    assert sampled_weights_hash(one) == sampled_weights_hash(one)
    assert sampled_weights_hash(tmp_path / "no-such-folder") is None


def test_a_bf16_caches_bits_save_the_same_records_as_its_widened_rows(tmp_path):
    # what a CUDA worker hands its writer for the bf16 tier: the cache's own bits, never widened
    bits = torch.from_numpy(ROWS).bfloat16().view(torch.int16).numpy().view(np.uint16).copy()
    bits[1, 7, :2] = [0x7F80, 0x7FC1]  # inf, a NaN: stored as 0 either way
    saved = {}
    for name, rows in (("bits", bits), ("f32", bf16_decode(bits))):
        with SessionStore(tmp_path / name) as opened:
            cache = PrefixCache(opened, "team-a", fingerprint(tiers.BF16))
            session = cache.save(PROMPT, rows)
            assert session is not None
            with opened.reader(session, owner="team-a") as reader:
                saved[name] = reader.load().record_bytes()
            assert cache.load(session, 0, 200)[1, 7, :2].tolist() == [0.0, 0.0]
    assert saved["bits"] == saved["f32"]
    with SessionStore(tmp_path / "f32-tier") as opened, pytest.raises(ValueError, match="bf16 tier only"):
        PrefixCache(opened, "team-a", fingerprint(tiers.F32)).save(PROMPT, bits)
