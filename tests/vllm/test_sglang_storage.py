"""kvstore as SGLang's HiCache storage (kvstore.connectors.sglang) on a real store, through the
interface SGLang calls: set/get/exists, the batch forms, the ``interface_v1`` forms over a host page
pool; tiers, missing pages, another model's pages refused and counted, damaged pages never handed
back, owners apart, and service mode against a real ``kvstore serve``.

SGLang's own base class and factory drive the same backend in test_sglang_interface.py (SGLang's
package in vLLM's venv)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore import tiers
from kvstore.connectors.page_cache import PageCache
from kvstore.connectors.sglang import KVStoreHiCacheStorage, PageFormat
from kvstore.errors import ConfigError
from kvstore.formats.coli_kv import HEADER_BYTES, read_header
from served import ServeProcess

_spec = importlib.util.spec_from_file_location("kvstore_sglang_host", Path(__file__).parent / "sglang_host.py")
assert _spec is not None and _spec.loader is not None
_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_host)
HostPages = _host.HostPages

LAYERS, PAGE, WIDTH = 2, 16, 576
KEYS = [f"{i:064x}" for i in range(1, 9)]  # SGLang's page hashes are hex strings
KEY_A = "sglang-test-key-alice-0123456789ab"
KEY_B = "sglang-test-key-bob-0123456789abcd"


@dataclass
class StorageConfig:
    """The fields of SGLang's ``HiCacheStorageConfig`` the backend reads."""

    extra_config: dict[str, Any] = field(default_factory=dict)
    model_name: str | None = "tiny-mla"
    is_mla_model: bool = True
    tp_rank: int = 0


def pages(n: int, seed: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
    """n flat pages of random rows (layer-major, as the layer_first pool hands them over)."""
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.standard_normal(LAYERS * PAGE * WIDTH).astype(np.float32)).to(dtype) for _ in range(n)]


def backend(extra: dict[str, Any], *, dtype=torch.float32, layout="layer_first", **config) -> KVStoreHiCacheStorage:
    storage = KVStoreHiCacheStorage(
        StorageConfig(extra_config={"weights_hash": "sampled-blake2b:one", **extra}, **config)
    )
    storage.register_mem_pool_host(HostPages(layer_num=LAYERS, page_size=PAGE, dtype=dtype, layout=layout))
    return storage


def target(dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(LAYERS * PAGE * WIDTH, dtype=dtype)


@pytest.fixture
def store(tmp_path) -> str:
    return str(tmp_path / "kv")


def test_pages_round_trip_exactly_and_every_page_looked_up_is_a_hit_or_a_miss(store, tmp_path):
    storage = backend({"store": store, "stats_dir": str(tmp_path / "stats")})
    values = pages(4)
    assert storage.batch_exists(KEYS[:4]) == 0 and not storage.exists(KEYS[0])
    assert storage.set(KEYS[0], values[0]) and storage.batch_set(KEYS[1:4], values[1:4])
    assert storage.set(KEYS[0], values[0])  # stored before: still a success, stored once
    assert storage.exists(KEYS[2]) and storage.batch_exists(KEYS[:6]) == 4
    out = target()
    assert storage.get(KEYS[1], out) is out and torch.equal(out, values[1])
    got = storage.batch_get(KEYS[:4], [target() for _ in range(4)])
    assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values))
    fresh = storage.get(KEYS[3])  # no target: a new page tensor
    assert fresh is not None and torch.equal(fresh, values[3])
    fresh.zero_()  # the caller's own page: the hot tier's entry it came from is untouched
    again = storage.get(KEYS[3])
    assert again is not None and torch.equal(again, values[3])
    stats = storage.counters()
    # lookups: 1 (miss at the first of 4) + 1 + 1 + 5 (4 hits, then the 5th misses)
    assert (stats["lookups"], stats["hits"], stats["misses"], stats["refused"]) == (8, 5, 3, 0)
    assert stats["lookups"] == stats["hits"] + stats["misses"]
    assert (stats["saves"], stats["saved_tokens"], stats["loads"], stats["loaded_tokens"]) == (4, 64, 7, 112)
    assert len(list((tmp_path / "stats").glob("sglang-*-tp0.json"))) == 1


def test_pages_set_or_got_before_come_from_the_hot_tier_bit_for_bit(store):
    values = pages(3, seed=4, dtype=torch.bfloat16)
    writer = backend({"store": store}, dtype=torch.bfloat16)
    assert writer.batch_set(KEYS[:3], values)
    # no tier set: a bf16 cache's pages are stored as bf16 (v4), 2 bytes a value, not widened to f32
    journals = sorted(Path(store, "journals").glob("*.coli_kv"))
    assert len(journals) == 3 and writer.cache.fingerprint.tier is tiers.BF16
    for path in journals:
        header, size = read_header(path)
        assert header.tier is tiers.BF16 and size == HEADER_BYTES + PAGE * (4 + LAYERS * WIDTH * 2)
    reader = backend({"store": store}, dtype=torch.bfloat16)  # another process would start empty too
    first = reader.batch_get(KEYS[:3], [target(torch.bfloat16) for _ in range(3)])  # from the store
    again = reader.batch_get(KEYS[:3], [target(torch.bfloat16) for _ in range(3)])  # from memory
    own = writer.batch_get(KEYS[:3], [target(torch.bfloat16) for _ in range(3)])  # the pages it set
    for got in (first, again, own):
        assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True))
    stats, mine = reader.counters(), writer.counters()
    # the bf16 tier's pages are kept as stored: 2 bytes a value, half of what f32 rows took
    assert (stats["hot_misses"], stats["hot_hits"], stats["hot_bytes"]) == (3, 3, 3 * LAYERS * PAGE * WIDTH * 2)
    assert (mine["hot_misses"], mine["hot_hits"]) == (0, 3)
    assert backend({"store": store, "hot_bytes": 0}, dtype=torch.bfloat16).cache.hot is None


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["f32-cache", "bf16-cache", "fp8-cache"]
)
def test_the_host_pools_pages_go_through_interface_v1_in_either_layout(store, layout, dtype):
    storage = KVStoreHiCacheStorage(StorageConfig(extra_config={"store": store, "interface_v1": 1}))
    pool = HostPages(layer_num=LAYERS, page_size=PAGE, pages=8, dtype=dtype, layout=layout)
    storage.register_mem_pool_host(pool)
    rng = np.random.default_rng(3)
    pool.kv_buffer.copy_(torch.from_numpy(rng.standard_normal(pool.kv_buffer.shape).astype(np.float32)).to(dtype))
    written = [pool.rows(i * PAGE).clone() for i in range(3)]
    assert storage.batch_set_v1(KEYS[:3], torch.arange(0, 3 * PAGE)) == [True] * 3
    # the stored rows are the pool's rows token by token, in either layout
    stored = storage.cache.load_page(KEYS[1])
    np.testing.assert_array_equal(stored, written[1].to(torch.float32).numpy())
    pool.kv_buffer.zero_()
    into = torch.arange(4 * PAGE, 7 * PAGE)  # other slots of the pool
    assert storage.batch_get_v1(KEYS[:3], into) == [True] * 3
    for i in range(3):  # a bf16 or fp8 page comes back bit for bit (compared as bytes: fp8 has no ==)
        back = pool.rows((4 + i) * PAGE).contiguous().view(torch.uint8)
        assert torch.equal(back, written[i].contiguous().view(torch.uint8))


@pytest.mark.parametrize(("tier", "bound"), [("fp8", 0.08), ("int4", 0.2)])
def test_quantized_tiers_come_back_within_their_error(store, tier, bound):
    storage = backend({"store": store, "tier": tier})
    (value,) = pages(1, seed=5)
    assert storage.set(KEYS[0], value)
    back = storage.get(KEYS[0], target())
    assert back is not None
    error = torch.linalg.norm(back - value) / torch.linalg.norm(value)
    assert 0 < float(error) < bound


def test_missing_pages_are_none_and_stop_the_prefix(store):
    storage = backend({"store": store})
    values = pages(3, seed=1)
    storage.batch_set([KEYS[0], KEYS[2]], [values[0], values[2]])
    assert storage.batch_exists(KEYS[:3]) == 1  # KEYS[1] is missing: KEYS[2] is not usable
    out = target()
    assert storage.get(KEYS[1], out) is None and not out.any()
    got = storage.batch_get(KEYS[:3], [target() for _ in range(3)])
    assert got[1] is None and got[0] is not None and got[2] is not None
    assert storage.counters()["load_errors"] == 2


def test_another_models_pages_are_refused_and_counted(store):
    first = backend({"store": store})
    first.batch_set(KEYS[:2], pages(2))
    other = backend({"store": store, "weights_hash": "sampled-blake2b:two"})
    assert other.batch_exists(KEYS[:2]) == 0 and not other.exists(KEYS[1])
    stats = other.counters()
    assert (stats["lookups"], stats["misses"], stats["refused"], stats["hits"]) == (2, 2, 2, 0)
    out = target()
    assert other.get(KEYS[0], out) is None and not out.any()
    # asked for the first model's page id directly, the store refuses it by fingerprint
    with pytest.raises(Exception, match="another model or cache tier"):
        other.cache.load(first.cache.page_id(KEYS[0]), 0, PAGE)
    # another tier of the same model is another fingerprint too
    assert backend({"store": store, "tier": "fp8"}).batch_exists(KEYS[:2]) == 0


def test_damaged_pages_are_never_handed_back(store):
    # no hot tier: the process that wrote the pages would serve them from its memory (the bytes it
    # wrote; tests/vllm/test_hot_tier.py); the check of what is on disk is what is tested here
    storage = backend({"store": store, "hot_bytes": 0})
    storage.batch_set(KEYS[:2], pages(2, seed=9))
    client = storage.cache.client
    path = client.store.journal_path(storage.cache.page_id(KEYS[0]), owner="sglang")  # type: ignore[attr-defined]
    header, _ = read_header(path)
    with open(path, "r+b") as f:  # record 5, layer 0, latent value 3: plausible, wrong
        f.seek(HEADER_BYTES + 5 * header.rec_bytes + 4 + 3 * 4)
        value = np.frombuffer(f.read(4), dtype="<f4")[0]
        f.seek(HEADER_BYTES + 5 * header.rec_bytes + 4 + 3 * 4)
        f.write(np.float32(value + 0.25).tobytes())
    out = target()
    assert storage.get(KEYS[0], out) is None and not out.any()
    assert storage.get(KEYS[1], target()) is not None  # the other page is fine
    assert storage.counters()["load_errors"] == 1


def test_a_damaged_page_is_replaced_by_the_next_set(store):
    storage = backend({"store": store, "hot_bytes": 0})  # the disk's copy is checked (see above)
    values = pages(2, seed=10)
    storage.batch_set(KEYS[:2], values)
    client = storage.cache.client
    path = client.store.journal_path(storage.cache.page_id(KEYS[0]), owner="sglang")  # type: ignore[attr-defined]
    header, _ = read_header(path)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 7 * header.rec_bytes + 4)
        f.write(np.float32(321.0).tobytes())
    assert storage.get(KEYS[0], target()) is None
    # quarantined: SGLang sees the page missing, computes it and stores it anew
    assert storage.batch_exists(KEYS[:2]) == 0
    assert storage.batch_set(KEYS[:1], values[:1])
    assert storage.batch_exists(KEYS[:2]) == 2
    got = storage.get(KEYS[0], target())
    assert got is not None and torch.equal(got, values[0])
    counters = storage.counters()
    assert (counters["quarantined"], counters["load_errors"], counters["saves"]) == (1, 1, 3)


def test_another_owner_never_sees_the_pages(store):
    backend({"store": store, "owner": "team-a"}).batch_set(KEYS[:2], pages(2))
    other = backend({"store": store, "owner": "team-b"})
    assert other.batch_exists(KEYS[:2]) == 0 and other.get(KEYS[0], target()) is None
    assert other.counters()["refused"] == 0


def test_the_configuration_and_the_host_pool_are_checked_with_typed_errors(store):
    with pytest.raises(ConfigError, match="must use MLA"):
        KVStoreHiCacheStorage(StorageConfig(extra_config={"store": store}, is_mla_model=False))
    for extra, reason in [
        ({}, "needs either 'store'"),
        ({"store": store, "min_tokens": 16}, "whole pages"),
        ({"store": store, "save_queue": 2}, "is for the vLLM connector"),
        ({"store": store, "tier": "q8"}, "not stored in files"),
        ({"store": store, "page_bytes": 1}, "unknown kvstore connector settings"),
    ]:
        with pytest.raises(ConfigError, match=reason):
            KVStoreHiCacheStorage(StorageConfig(extra_config=extra))
    storage = KVStoreHiCacheStorage(StorageConfig(extra_config={"store": store}))
    with pytest.raises(ConfigError, match="not registered"):
        storage.exists(KEYS[0])
    wrong = HostPages()
    wrong.kv_cache_dim = 656  # a packed row (e.g. fp8 latent with its scales), not kv_lora + qk_rope
    with pytest.raises(ConfigError, match="packs 656"):
        PageFormat.of_host_pool(wrong)
    with pytest.raises(ConfigError, match="not torch.uint8"):
        PageFormat.of_host_pool(HostPages(dtype=torch.uint8))
    storage.register_mem_pool_host(HostPages(layer_num=LAYERS, page_size=PAGE))
    with pytest.raises(ValueError, match="a page holds 18432 values"):
        storage.set(KEYS[0], torch.zeros(100))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("sglang-served") / "data"
    running = ServeProcess(data, env={"KVSTORE_API_KEYS": f"{KEY_A}:alice,{KEY_B}:bob"}).start()
    yield running
    running.stop_cleanly()


def test_service_mode_round_trips_for_the_keys_owner_only(server):
    alice = backend({"url": server.url, "api_key": KEY_A})
    bob = backend({"url": server.url, "api_key": KEY_B})
    assert alice.cache.owner == "alice" and bob.cache.owner == "bob"
    values = pages(3, seed=4)
    assert alice.batch_set(KEYS[:3], values)
    assert alice.batch_exists(KEYS[:4]) == 3
    got = alice.batch_get(KEYS[:3], [target() for _ in range(3)])
    assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values))
    assert bob.batch_exists(KEYS[:3]) == 0 and bob.get(KEYS[0], target()) is None
    # an int4 backend of the same model: another fingerprint, its refusal counted by the service's data
    int4 = backend({"url": server.url, "api_key": KEY_A, "tier": "int4"})
    assert int4.batch_exists(KEYS[:3]) == 0 and int4.counters()["refused"] == 1
    assert int4.set(KEYS[0], values[0])
    back = int4.get(KEYS[0], target())
    assert back is not None and 0 < float(torch.linalg.norm(back - values[0]) / torch.linalg.norm(values[0])) < 0.2
    alice.close()
    bob.close()


def test_service_mode_damaged_pages_are_refused_and_a_wrong_key_stops_at_start(server):
    with pytest.raises(ConfigError, match="refused the API key"):
        backend({"url": server.url, "api_key": "not-a-key-of-this-server-000000"})
    alice = backend({"url": server.url, "api_key": KEY_A, "hot_bytes": 0})  # the served copy is checked
    (value,) = pages(1, seed=8)
    assert alice.set(KEYS[5], value)
    session_id = alice.cache.page_id(KEYS[5])
    (path,) = (server.data / "journals").glob(f"{session_id}~alice.coli_kv")
    header, _ = read_header(path)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 2 * header.rec_bytes + 4)
        stored = np.frombuffer(f.read(4), dtype="<f4")[0]
        f.seek(HEADER_BYTES + 2 * header.rec_bytes + 4)
        f.write(np.float32(stored + 0.5).tobytes())
    out = target()
    assert alice.get(KEYS[5], out) is None and not out.any()
    assert alice.counters()["load_errors"] == 1
    # the service verified, found the damage; the page was quarantined and a new set replaces it
    assert alice.counters()["quarantined"] == 1 and alice.batch_exists([KEYS[5]]) == 0
    assert alice.set(KEYS[5], value)
    got = alice.get(KEYS[5], target())
    assert got is not None and torch.equal(got, value)
    alice.close()


def test_page_ids_are_salted_with_the_fingerprint(store):
    a = backend({"store": store})
    b = backend({"store": store, "tier": "fp8"})
    assert isinstance(a.cache, PageCache)
    assert a.cache.page_id(KEYS[0]) != b.cache.page_id(KEYS[0])
    assert a.cache.page_id(KEYS[0]).startswith("sglang-") and len(a.cache.page_id(KEYS[0])) <= 64
