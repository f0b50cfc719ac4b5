"""The vLLM connector's worker side on real tensors in vLLM's MLA paged layout, without vLLM.

What a vLLM user depends on, checked where vLLM is not installed (so on a GPU machine too): rows a
worker saves from its paged caches, layer by layer in a prefill step or all at once when a request
finishes, are the rows it held, whether the cache is on the CPU or on a CUDA device (the same bytes
in the store), and a worker loading them into other blocks of a fresh cache gets them back exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore import tiers
from kvstore.connectors.hot_tier import HotTier
from kvstore.connectors.prefix_cache import PrefixCache, model_fingerprint
from kvstore.connectors.save_writer import SaveWriter
from kvstore.connectors.vllm_worker import LoadSpec, PagedWorker, PinnedStaging, SaveSpec
from kvstore.formats.coli_kv import Geometry
from kvstore.store import SessionStore

GEOMETRY = Geometry(3, 512, 64, 0, 0, 1000)
BLOCK = 16
BLOCKS = 24
N = 200  # tokens: 12 full blocks and a partial one
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def fingerprint(tier):
    return model_fingerprint(
        name="tiny", revision="main", geometry=GEOMETRY, tier=tier, attention_variant="vllm-mla:bf16", weights_hash="w"
    )


def caches(device, dtype, seed):
    """One cache per layer, ``[blocks, block_size, kv_lora + qk_rope]``, filled with random rows."""
    gen = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, BLOCK, 576, generator=gen).to(dtype).to(device)
        for i in range(GEOMETRY.n_layers)
    }


def rows_at(kv, block_ids, n):
    """The rows of token positions [0, n) in ``block_ids``, f32 [n_layers, n, width], on the host."""
    slots = torch.tensor([block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
    return np.stack([c.view(-1, 576)[slots.to(c.device)].float().cpu().numpy() for c in kv.values()])


def worker(store, tier, *, queue, hot=None):
    cache = PrefixCache(store, "team", fingerprint(tier), hot=hot)
    return PagedWorker(cache, GEOMETRY, BLOCK, SaveWriter(cache, queue) if queue else None)


def journal_bytes(store, session_id):
    with store.reader(session_id, owner="team") as reader:
        return reader.load().record_bytes()


@pytest.fixture
def store(tmp_path):
    with SessionStore(tmp_path / "kv") as opened:
        yield opened


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("queue", [0, 4])
def test_rows_saved_layer_by_layer_load_back_exactly_into_other_blocks(store, device, queue):
    tokens = list(range(7, 7 + N))
    blocks = [5, 2, 9, 0, 11, 3, 17, 8, 20, 1, 14, 6, 22]
    kv = caches(device, torch.bfloat16, seed=1)
    saver = worker(store, tiers.BF16, queue=queue)
    saver.register_kv_caches(kv)
    save = SaveSpec("req-1", tokens, blocks)
    for name, layer in kv.items():  # as vLLM calls save_kv_layer during the forward pass
        saver.save_layer([save], name, layer)
    saver.wait_for_save([save], [])
    saver.shutdown()  # the writer finishes what was queued
    assert saver.cache.stats.saves == 1 and saver.cache.stats.save_skipped == 0

    fresh = caches(device, torch.bfloat16, seed=2)
    loader = worker(store, tiers.BF16, queue=0, hot=HotTier(1 << 30))
    loader.register_kv_caches(fresh)
    found = loader.cache.lookup(tokens)
    assert found is not None and found.tokens == N
    others = [12, 4, 23, 15, 10, 7, 13, 16, 18, 19, 21, 2, 0]
    again = [1, 3, 5, 8, 9, 11, 14, 17, 20, 22, 6, 4, 12]  # a second request: the rows from the hot tier
    for req, where in (("req-2", others), ("req-3", again)):
        loader.start_load([LoadSpec(req, found.session_id, 0, N, where)])
        for name in fresh:  # as each layer's attention does before it reads the cache
            loader.wait_for_layer(name)
        assert loader.load_errors() == set()
        assert np.array_equal(rows_at(fresh, where, N), rows_at(kv, blocks, N))
    assert (loader.cache.stats.hot_misses, loader.cache.stats.hot_hits) == (1, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompts_saved_in_one_step_each_store_their_own_rows(store, device, dtype):
    """Three prompts of different lengths end their prefill in one step (blocks of the cache in any
    order, the last partly filled): their rows are gathered into one buffer (one gather a layer)
    and each is stored as its own blocks' rows; a prompt whose load failed this step is left out,
    the others are not."""
    kv = caches(device, dtype, seed=6)
    w = worker(store, tiers.F32, queue=4)
    w.register_kv_caches(kv)
    plans = {"a": (70, [3, 1, 23, 14, 5]), "b": (64, [10, 4, 22, 7]), "c": (81, [8, 6, 12, 0, 9, 2])}
    saves = [
        SaveSpec(req, list(range(100 * i + 3, 100 * i + 3 + n)), blocks)
        for i, (req, (n, blocks)) in enumerate(plans.items())
    ]
    failed = SaveSpec("d", list(range(500, 580)), [19, 21, 11, 13, 15])
    w._load_failed.add("d")
    for name, layer in kv.items():
        w.save_layer([*saves, failed], name, layer)
    w.wait_for_save([*saves, failed], [])
    w.shutdown()
    assert w.cache.stats.saves == 3 and w.cache.stats.save_errors == 0
    for save in saves:
        session_id = w.cache.session_id_for(np.asarray(save.tokens, np.int32))
        loaded = w.cache.load(session_id, 0, len(save.tokens))
        assert np.array_equal(loaded, rows_at(kv, save.block_ids, len(save.tokens)))
    assert w.cache.lookup(failed.tokens) is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_finished_conversation_is_saved_before_it_is_reported_and_equals_its_blocks(store, device):
    tokens = list(range(100, 100 + N))
    blocks = list(range(BLOCKS - 13, BLOCKS))
    kv = caches(device, torch.bfloat16, seed=3)
    w = worker(store, tiers.BF16, queue=2)
    w.register_kv_caches(kv)
    w.wait_for_save([], [SaveSpec("done-1", tokens, blocks)])
    w.writer.flush()
    assert w.get_finished(set()) == {"done-1"}
    loaded = w.cache.load(w.cache.session_id_for(np.asarray(tokens, np.int32)), 0, N)
    assert np.array_equal(loaded, rows_at(kv, blocks, N))
    w.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("tier", [tiers.BF16, tiers.F32, tiers.FP8])
def test_rows_saved_from_cuda_are_the_cpu_paths_bytes(tmp_path, tier):
    tokens = list(range(3, 3 + N))
    blocks = [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 0]
    stored = {}
    for device in ("cpu", "cuda"):
        with SessionStore(tmp_path / device) as store:
            kv = caches(device, torch.bfloat16, seed=4)  # the same rows on both devices
            first = next(iter(kv.values()))  # values no tier stores as given: each stored as 0 alike
            first[1, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
            w = worker(store, tier, queue=2)
            w.register_kv_caches(kv)
            save = SaveSpec("r", tokens, blocks)
            for name, layer in kv.items():
                w.save_layer([save], name, layer)
            w.wait_for_save([save], [])
            w.shutdown()
            stored[device] = journal_bytes(store, w.cache.session_id_for(np.asarray(tokens, np.int32)))
    assert stored["cuda"] == stored["cpu"] and len(stored["cpu"]) > 0


def test_a_prompt_a_layer_did_not_hand_over_is_not_saved(store):
    kv = caches("cpu", torch.float32, seed=5)
    w = worker(store, tiers.F32, queue=0)
    w.register_kv_caches(kv)
    save = SaveSpec("r", list(range(N)), list(range(13)))
    for name, layer in list(kv.items())[:-1]:  # the last layer never arrives
        w.save_layer([save], name, layer)
    w.wait_for_save([save], [])
    assert w.cache.stats.saves == 0 and w.cache.lookup(list(range(N))) is None


def test_a_staging_buffer_returns_to_the_pool_only_when_its_last_reader_is_gone():
    """The saves' staging buffers are the worker's own: lent while their owner lives (a prompt's
    rows still to be copied out by the writer), then reused, never handed to another allocation."""

    class Owner:
        pass

    pool = PinnedStaging(keep=2, pin=False)
    first_owner = Owner()
    first = pool.lend((3, 10, 576), torch.bfloat16, first_owner)
    assert first.shape == (3, 10, 576) and first.dtype == torch.bfloat16
    other = pool.lend((3, 10, 576), torch.bfloat16, Owner())  # its owner already gone: back at once
    assert other.data_ptr() != first.data_ptr()  # the first one is still lent
    again = pool.lend((3, 12, 576), torch.bfloat16, Owner())  # same size class: the returned buffer
    assert again.data_ptr() == other.data_ptr() and (pool.allocated, pool.reused) == (2, 1)
    del first_owner
    reuse = [pool.lend((3, 10, 576), torch.bfloat16, owner) for owner in (Owner(), Owner())]
    assert {t.data_ptr() for t in reuse} <= {first.data_ptr(), other.data_ptr()}
    kept = PinnedStaging(keep=1, pin=False)
    owners = [Owner(), Owner(), Owner()]
    lent = [kept.lend((1, 4), torch.float32, o) for o in owners]
    del owners, lent
    assert sum(len(free) for free in kept._free.values()) == 1  # at most ``keep`` free a class


@pytest.mark.gpu
def test_saving_steps_reuse_their_staging_while_the_hot_tier_pins_every_save(tmp_path):
    """Every save kept in the (pinned) hot tier, a step after each: the steps' staging buffers come
    back from the worker's own pool, not from torch's pinned allocator (where the hot tier's entries
    of the same size took them, and each step allocated pinned memory anew), and the rows stay right."""
    kv = caches("cuda", torch.bfloat16, seed=8)
    blocks = list(range(13))
    with SessionStore(tmp_path / "kv") as store:
        w = worker(store, tiers.BF16, queue=2, hot=HotTier(1 << 30, pinned=True))
        w.register_kv_caches(kv)
        for step in range(8):
            save = SaveSpec(f"r{step}", list(range(step * 50, step * 50 + N)), blocks)  # distinct prompts
            for name, layer in kv.items():
                w.save_layer([save], name, layer)
            w.wait_for_save([save], [])
            w.writer.flush()  # written and kept hot before the next step: the case that allocated each step
        assert w.staging.allocated == 1 and w.staging.reused == 7
        assert w.cache.stats.saves == 8
        last = w.cache.load(w.cache.session_id_for(np.asarray(save.tokens, np.int32)), 0, N)
        assert np.array_equal(last, rows_at(kv, blocks, N))
        w.shutdown()
