"""The connectors' hot tier (kvstore.connectors.hot_tier) in front of a real store: hits equal the
disk load bit for bit, the byte budget holds (least recently used out first; an entry larger than
the budget is not kept), another fingerprint or owner never hits another's entry, a quarantine or a
failed save drops the entry, and threads loading one prefix never see torn rows. No vLLM."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvstore import tiers
from kvstore.connectors.hot_tier import HotTier
from kvstore.connectors.prefix_cache import CacheConfig, LoadFailed, PrefixCache, RowsDamaged, model_fingerprint
from kvstore.errors import ConfigError
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, read_header
from kvstore.store import SessionStore

GEOMETRY = Geometry(2, 512, 64, 0, 0, 1000)
RNG = np.random.default_rng(11)
PROMPT = RNG.integers(0, 1000, size=200).astype(np.int32)
ROWS = RNG.standard_normal((2, 200, 576)).astype(np.float32)
ENTRY = ROWS.nbytes  # one prompt's rows in the tier (2 x 200 x 576 f32: 921,600 bytes)


def fingerprint(tier=tiers.F32, weights="sampled-blake2b:one"):
    return model_fingerprint(
        name="tiny",
        revision="main",
        geometry=GEOMETRY,
        tier=tier,
        attention_variant="vllm-mla:float32",
        weights_hash=weights,
    )


def prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=200).astype(np.int32)


@pytest.fixture
def store(tmp_path):
    with SessionStore(tmp_path / "kv") as opened:
        yield opened


def alter(store, session_id: str, owner: str, record: int) -> None:
    """Change one latent value of ``record`` (layer 0) in the session's journal."""
    path = store.journal_path(session_id, owner=owner)
    header, _ = read_header(path)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + record * header.rec_bytes + 4)
        value = np.frombuffer(f.read(4), dtype="<f4")[0]
        f.seek(HEADER_BYTES + record * header.rec_bytes + 4)
        f.write(np.float32(value + 0.5).tobytes())


@pytest.mark.parametrize("tier", [tiers.F32, tiers.BF16, tiers.FP8, tiers.INT4], ids=lambda t: t.name)
def test_a_hot_hit_is_bit_for_bit_the_disk_load(store, tier):
    disk = PrefixCache(store, "team-a", fingerprint(tier))  # no hot tier: every load reads the store
    hot = PrefixCache(store, "team-a", fingerprint(tier), hot=HotTier(4 * ENTRY))
    rows = ROWS.copy()
    rows[1, 7, 3] = np.nan  # stored as the journal stores it (0): the tier must hold that, not the NaN
    session = hot.save(PROMPT, rows)
    assert session is not None
    for start, stop in [(0, 200), (16, 144), (0, 64)]:
        from_disk = disk.load(session, start, stop)
        from_memory = hot.load(session, start, stop)  # the save's entry
        assert from_memory.tobytes() == from_disk.tobytes()
        assert from_memory.flags.writeable and from_memory.flags.c_contiguous  # the caller's copy
    assert (hot.stats.hot_hits, hot.stats.hot_misses, hot.stats.loads) == (3, 0, 3)
    # an entry made by a load (not a save) is the same bytes too
    loader = PrefixCache(store, "team-a", fingerprint(tier), hot=HotTier(4 * ENTRY))
    first = loader.load(session, 16, 144)
    again = loader.load(session, 0, 200)
    assert first.tobytes() == disk.load(session, 16, 144).tobytes()
    assert again.tobytes() == disk.load(session, 0, 200).tobytes()
    kept = ENTRY // 2 if tier is tiers.BF16 else ENTRY  # bf16 rows are kept as stored: 2 bytes a value
    assert (loader.stats.hot_misses, loader.stats.hot_hits, loader.stats.hot_bytes) == (1, 1, kept)
    # a hit's rows are the caller's: writing them leaves the entry as it was
    again[:] = 0
    assert loader.load(session, 0, 200).tobytes() == disk.load(session, 0, 200).tobytes()


def test_a_bf16_tiers_rows_are_kept_and_handed_out_as_stored(store):
    """A bf16 tier's rows are kept at 2 bytes a value (its bit patterns, u16) and handed to a caller
    that places them itself as they are (``native``): from the tier, from the store, with and
    without a hot tier, always the bf16 of what ``load`` widens to f32."""
    bf16_rows = torch.from_numpy(ROWS).bfloat16()
    patterns = bf16_rows.view(torch.int16).numpy().view(np.uint16)
    disk = PrefixCache(store, "team-a", fingerprint(tiers.BF16))  # no hot tier
    session = disk.save(PROMPT, bf16_rows.float().numpy())
    assert session is not None and disk.native_dtype == np.uint16
    assert np.array_equal(disk.load(session, 0, 200), bf16_rows.float().numpy())  # exact: f32 by default
    assert np.array_equal(disk.load(session, 16, 144, native=True), patterns[:, 16:144])
    loader = PrefixCache(store, "team-a", fingerprint(tiers.BF16), hot=HotTier(4 * ENTRY))
    made = loader.load(session, 16, 144, view=True, native=True)  # a miss, kept as stored
    hit = loader.load(session, 0, 200, view=True, native=True)
    assert made.dtype == hit.dtype == np.uint16 and np.shares_memory(made, hit) and not hit.flags.writeable
    assert np.array_equal(hit, patterns) and loader.stats.hot_bytes == patterns.nbytes == ENTRY // 2
    widened = loader.load(session, 0, 200, view=True)  # a caller wanting f32 gets its own, exact
    assert (
        widened.dtype == np.float32 and widened.flags.writeable and np.array_equal(widened, bf16_rows.float().numpy())
    )
    # f32 tiers are unchanged by native: their rows are f32 already
    assert PrefixCache(store, "team-a", fingerprint(tiers.F32)).native_dtype == np.float32


@pytest.mark.parametrize("tier", [tiers.F32, tiers.BF16, tiers.FP8], ids=lambda t: t.name)
def test_a_store_load_taken_as_a_view_is_read_only_and_a_copy_is_the_callers(store, tier):
    """With no hot tier, ``load(view=True)`` of a value tier hands out the rows where they lie in
    the records read (nothing decoded): the same bytes as a copy, refused a write; a load without
    ``view`` is the caller's own array (writable, in row order), and writing it changes no later
    load."""
    disk = PrefixCache(store, "team-a", fingerprint(tier))
    session = disk.save(PROMPT, ROWS)
    assert session is not None
    for native in (False, True):
        copy = disk.load(session, 16, 144, native=native)
        view = disk.load(session, 16, 144, view=True, native=native)
        assert view.dtype == copy.dtype and view.tobytes() == copy.tobytes()
        assert copy.flags.writeable and copy.flags.c_contiguous and not np.shares_memory(copy, view)
        if tier is tiers.F32 or (tier is tiers.BF16 and native):  # else decoded: the caller's anyway
            assert not view.flags.writeable
            with pytest.raises(ValueError):
                view[0, 0, 0] = 0
        copy[:] = 0
        assert disk.load(session, 16, 144, view=True, native=native).tobytes() == view.tobytes()


@pytest.mark.parametrize("tier", [tiers.F32, tiers.FP8], ids=lambda t: t.name)
def test_a_reader_may_take_a_hit_as_a_read_only_view_of_the_entry(store, tier):
    """``load(view=True)`` (the vLLM worker's: it only places the rows) hands a hit out with no
    copy — a read-only view of the tier's entry, the same bytes — and so does the load that made
    the entry; a write through it is refused, so the entry cannot change under later hits."""
    disk = PrefixCache(store, "team-a", fingerprint(tier))
    session = disk.save(PROMPT, ROWS)
    assert session is not None
    loader = PrefixCache(store, "team-a", fingerprint(tier), hot=HotTier(4 * ENTRY))
    made = loader.load(session, 16, 144, view=True)  # a miss: read, checked, kept, handed out as a view
    hit = loader.load(session, 0, 200, view=True)
    assert made.tobytes() == disk.load(session, 16, 144).tobytes()
    assert hit.tobytes() == disk.load(session, 0, 200).tobytes()
    assert np.shares_memory(made, hit)  # both views of the one entry: nothing copied
    assert not hit.flags.writeable
    with pytest.raises(ValueError):
        hit[0, 0, 0] = 1.0
    assert (loader.stats.hot_misses, loader.stats.hot_hits) == (1, 1)
    copy = loader.load(session, 0, 200)  # without view: the caller's own array, as before
    assert copy.flags.writeable and not np.shares_memory(copy, hit)


def test_a_hit_reads_no_journal(store):
    cache = PrefixCache(store, "team-a", fingerprint(), hot=HotTier(2 * ENTRY))
    session = cache.save(PROMPT, ROWS)
    assert session is not None
    store.journal_path(session, owner="team-a").unlink()  # the disk copy gone: memory still answers
    assert cache.load(session, 0, 200).tobytes() == ROWS.tobytes()
    assert cache.stats.hot_hits == 1 and cache.stats.load_errors == 0


def test_rows_handed_over_are_kept_read_only_and_others_are_copied():
    """``put(owned=True)`` keeps the caller's fresh array as it is, read-only (a save hands its
    decoded rows over: no second copy of a page); without it the tier holds a copy of its own, so a
    caller writing into its rows afterwards changes nothing the tier serves."""
    tier = HotTier(4 * ENTRY)
    mine = np.ones((2, 8, 4), dtype=np.float32)
    tier.put(("o", "k", "copied"), mine)
    mine[:] = 7.0
    assert (tier.get(("o", "k", "copied")) == 1.0).all()
    handed = np.full((2, 8, 4), 3.0, dtype=np.float32)
    tier.put(("o", "k", "owned"), handed, owned=True)
    assert tier.get(("o", "k", "owned")) is handed and not handed.flags.writeable
    with pytest.raises(ValueError):
        handed[0, 0, 0] = 0.0  # read-only: a stray write fails instead of changing what hits serve
    # not in row order (a value tier's rows as they lie in the records): copied into row order even
    # if handed over — a hit places rows in order about twice as fast
    strided = np.ones((8, 2, 4), dtype=np.float32).transpose(1, 0, 2)  # [layers, n, width] of records
    tier.put(("o", "k", "strided"), strided, owned=True)
    kept = tier.get(("o", "k", "strided"))
    assert kept is not strided and kept.flags.c_contiguous and strided.flags.writeable


def test_the_budget_holds_and_the_least_recently_used_goes_first(store):
    tier = HotTier(2 * ENTRY + 100)  # room for two prompts' rows
    cache = PrefixCache(store, "team-a", fingerprint(), hot=tier)
    a, b, c = (cache.save(prompt(seed), ROWS) for seed in (1, 2, 3))
    assert a and b and c
    assert tier.nbytes <= tier.budget and len(tier) == 2  # c's save pushed a (the oldest) out
    assert cache.stats.hot_evictions == 1 and cache.stats.hot_bytes == 2 * ENTRY
    cache.load(b, 0, 64)  # b is now the most recently used: the next entry pushes c out, not b
    assert cache.stats.hot_hits == 1
    cache.load(a, 0, 64)  # a miss (read from disk, kept again)
    assert cache.stats.hot_misses == 1 and cache.stats.hot_evictions == 2
    assert tier.nbytes <= tier.budget
    hits = cache.stats.hot_hits
    cache.load(b, 0, 64)
    cache.load(a, 0, 64)
    assert cache.stats.hot_hits == hits + 2
    cache.load(c, 0, 64)
    assert cache.stats.hot_misses == 2  # c was the one evicted


def test_an_entry_larger_than_the_budget_is_not_kept(store):
    tier = HotTier(ENTRY - 1)
    cache = PrefixCache(store, "team-a", fingerprint(), hot=tier)
    session = cache.save(PROMPT, ROWS)
    assert session is not None and len(tier) == 0 and tier.nbytes == 0
    assert cache.load(session, 0, 200).tobytes() == ROWS.tobytes()  # from disk, still right
    assert (cache.stats.hot_misses, cache.stats.hot_hits, cache.stats.hot_bytes) == (1, 0, 0)
    assert len(tier) == 0


def test_another_fingerprint_or_owner_never_hits_anothers_entry(store):
    shared = HotTier(8 * ENTRY)  # one tier behind caches of two models and two owners
    mine = PrefixCache(store, "team-a", fingerprint(), hot=shared)
    session = mine.save(PROMPT, ROWS)
    assert session is not None and len(shared) == 1
    other_model = PrefixCache(store, "team-a", fingerprint(weights="sampled-blake2b:two"), hot=shared)
    other_owner = PrefixCache(store, "team-b", fingerprint(), hot=shared)
    for other in (other_model, other_owner):
        with pytest.raises(LoadFailed):  # the store refuses (another fingerprint) or has no such session
            other.load(session, 0, 64)
        assert (other.stats.hot_hits, other.stats.hot_misses, other.stats.load_errors) == (0, 1, 1)
    assert mine.load(session, 0, 64).tobytes() == ROWS[:, :64].tobytes() and mine.stats.hot_hits == 1


def test_rows_that_fail_verification_are_quarantined_and_never_kept(store):
    writer = PrefixCache(store, "team-a", fingerprint())  # saves without a tier: the entry is the load's
    session = writer.save(PROMPT, ROWS)
    assert session is not None
    tier = HotTier(4 * ENTRY)
    cache = PrefixCache(store, "team-a", fingerprint(), hot=tier)
    alter(store, session, "team-a", 30)
    with pytest.raises(RowsDamaged):
        cache.load(session, 0, 200)
    assert cache.stats.quarantined == 1 and len(tier) == 0 and cache.stats.hot_bytes == 0


def test_a_quarantine_found_by_another_cache_of_the_process_drops_the_shared_entry(store):
    tier = HotTier(4 * ENTRY)
    first = PrefixCache(store, "team-a", fingerprint(), hot=tier)
    session = first.save(PROMPT, ROWS)
    assert session is not None and len(tier) == 1
    second = PrefixCache(store, "team-a", fingerprint(), hot=tier)
    second._quarantine(session, "damaged (found by another request's load)")
    assert len(tier) == 0
    with pytest.raises(LoadFailed):
        first.load(session, 0, 64)  # gone from memory and from the store: a miss, never the old entry
    assert first.stats.hot_misses == 1


def test_a_failed_save_drops_the_entry(store, monkeypatch):
    tier = HotTier(4 * ENTRY)
    cache = PrefixCache(store, "team-a", fingerprint(), hot=tier)
    session = cache.session_id_for(PROMPT)
    tier.put(cache._hot_key(session), ROWS)  # as if an earlier copy of this id were held

    def refuse(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(cache.client, "append_records", refuse)
    assert cache.save(PROMPT, ROWS) is None and cache.stats.save_errors == 1
    assert len(tier) == 0


def test_threads_loading_one_prefix_never_see_torn_rows(store):
    tier = HotTier(3 * ENTRY)  # room for 3 of the 4 prompts: loads evict and re-add entries as they go
    cache = PrefixCache(store, "team-a", fingerprint(), hot=tier)
    prompts = [prompt(seed) for seed in range(4)]
    expected = {}
    for i, tokens in enumerate(prompts):
        rows = np.full((2, 200, 576), float(i), dtype=np.float32) + ROWS
        session = cache.save(tokens, rows)
        assert session is not None
        expected[session] = rows.tobytes()
    sessions = list(expected)
    wrong: list[str] = []
    start = threading.Barrier(6)

    def load(worker: int) -> None:
        start.wait()
        for step in range(40):
            session = sessions[(worker + step) % len(sessions)]
            if cache.load(session, 0, 200).tobytes() != expected[session]:
                wrong.append(session)

    threads = [threading.Thread(target=load, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong
    stats = cache.stats
    assert stats.hot_hits + stats.hot_misses == stats.loads == 240 and stats.load_errors == 0
    assert stats.hot_hits > 0 and stats.hot_evictions > 0 and tier.nbytes <= tier.budget


def test_pinned_entries_when_torch_sees_cuda():
    if not torch.cuda.is_available():
        assert not HotTier(ENTRY).pinned  # plain memory; asking for pinned is a clear error
        with pytest.raises(ValueError, match="needs torch with CUDA"):
            HotTier(ENTRY, pinned=True)
        return
    tier = HotTier(ENTRY)
    assert tier.pinned
    tier.put(("o", "f", "s"), ROWS)
    entry = tier.get(("o", "f", "s"))
    assert entry is not None and entry.tobytes() == ROWS.tobytes() and not entry.flags.writeable


def test_hot_bytes_is_a_setting_with_a_default_and_0_turns_it_off(store):
    assert CacheConfig.from_extra({"store": "/srv/kv"}).hot_bytes == 1 << 30
    assert CacheConfig.from_extra({"store": "/srv/kv", "hot_bytes": 0}).hot_bytes == 0
    for bad in (-1, "1GiB", True, 1.5):
        with pytest.raises(ConfigError, match="'hot_bytes'"):
            CacheConfig.from_extra({"store": "/srv/kv", "hot_bytes": bad})
    off = PrefixCache(store, "team-a", fingerprint(), hot=HotTier(0))
    assert off.hot is None
    session = off.save(PROMPT, ROWS)
    assert session is not None and off.load(session, 0, 64).tobytes() == ROWS[:, :64].tobytes()
    assert (off.stats.hot_hits, off.stats.hot_misses, off.stats.hot_bytes) == (0, 0, 0)
