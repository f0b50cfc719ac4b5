"""Saves off the serving step (kvstore.connectors.save_writer) on a real store: what is handed over is
stored, a full queue skips the save and counts it, never waits; a request is reported finished only
once its save is durable, failed or given up; closing writes what is queued. No vLLM: the vLLM
connector's use of it runs in test_connector.py."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from kvstore import tiers
from kvstore.connectors.prefix_cache import CacheConfig, PrefixCache, model_fingerprint
from kvstore.connectors.save_writer import WRITER_NICE, SaveWriter
from kvstore.errors import ConfigError
from kvstore.formats.coli_kv import Geometry
from kvstore.store import SessionStore

GEOMETRY = Geometry(2, 512, 64, 0, 0, 1000)
RNG = np.random.default_rng(11)
PROMPTS = [RNG.integers(0, 1000, size=100).astype(np.int32) for _ in range(4)]
ROWS = [RNG.standard_normal((2, 100, 576)).astype(np.float32) for _ in range(4)]
FINGERPRINT = model_fingerprint(
    name="tiny",
    revision="main",
    geometry=GEOMETRY,
    tier=tiers.F32,
    attention_variant="vllm-mla:float32",
    weights_hash="sampled-blake2b:one",
)


class HeldCache(PrefixCache):
    """A prefix cache over a real store whose saves wait for ``release`` (the disk being slow)."""

    def __init__(self, store):
        super().__init__(store, "team-a", FINGERPRINT)
        self.release = threading.Event()
        self.started = threading.Event()

    def save(self, tokens, rows):
        self.started.set()
        self.release.wait(timeout=30)
        return super().save(tokens, rows)


@pytest.fixture
def store(tmp_path):
    with SessionStore(tmp_path / "kv") as opened:
        yield opened


def stored_rows(store, cache: PrefixCache, prompt: np.ndarray) -> np.ndarray:
    records = store.resume(cache.session_id_for(prompt), owner="team-a").records
    L, R, _ = records.dequantize()
    return np.concatenate([L, R], axis=-1)


def test_a_request_is_reported_only_once_its_save_is_durable(store):
    cache = HeldCache(store)
    writer = SaveWriter(cache, capacity=4)
    try:
        assert writer.submit(PROMPTS[0], ROWS[0], report="req-0")
        assert cache.started.wait(timeout=30)
        # the save is being written: the request's blocks must stay held
        assert writer.finished() == set() and cache.stats.save_pending == 1
        cache.release.set()
        writer.flush()
        assert writer.finished() == {"req-0"} and writer.finished() == set()
        assert stored_rows(store, cache, PROMPTS[0]).tobytes() == ROWS[0].tobytes()
        stats = cache.stats
        assert (stats.saves, stats.save_pending, stats.save_skipped, stats.finished_done) == (1, 0, 0, 1)
    finally:
        cache.release.set()
        writer.close()


def test_a_full_queue_skips_the_save_counts_it_and_gives_the_request_up(store):
    cache = HeldCache(store)
    writer = SaveWriter(cache, capacity=1)
    try:
        assert writer.submit(PROMPTS[0], ROWS[0], report="req-0")
        assert cache.started.wait(timeout=30)  # being written: the queue is empty again
        assert writer.submit(PROMPTS[1], ROWS[1])  # waits in the queue
        # full: skipped at once (never waited for), its request settled as given up
        assert not writer.submit(PROMPTS[2], ROWS[2], report="req-2")
        assert writer.finished() == {"req-2"}
        assert (cache.stats.save_skipped, cache.stats.save_pending) == (1, 2)
        cache.release.set()
        writer.flush()
        assert writer.finished() == {"req-0"}
        assert cache.stats.saves == 2 and cache.lookup(PROMPTS[2]) is None  # the skipped one: a future miss
        assert stored_rows(store, cache, PROMPTS[1]).tobytes() == ROWS[1].tobytes()
    finally:
        cache.release.set()
        writer.close()


def test_a_failed_save_is_counted_and_its_request_still_reported(store):
    cache = PrefixCache(store, "team-a", FINGERPRINT)
    writer = SaveWriter(cache, capacity=2)
    try:
        assert writer.submit(PROMPTS[0], ROWS[0][:, :, :100], report="req-0")  # rows of the wrong shape
        writer.flush()
        assert writer.finished() == {"req-0"}
        assert (cache.stats.save_errors, cache.stats.saves, cache.stats.save_pending) == (1, 0, 0)
    finally:
        writer.close()


def test_closing_writes_what_is_queued_then_skips_new_saves(store):
    cache = PrefixCache(store, "team-a", FINGERPRINT)
    writer = SaveWriter(cache, capacity=4)
    for prompt, rows in zip(PROMPTS[:3], ROWS[:3]):
        assert writer.submit(prompt, rows)
    writer.close(timeout=60)
    assert cache.stats.saves == 3
    for prompt, rows in zip(PROMPTS[:3], ROWS[:3]):
        assert stored_rows(store, cache, prompt).tobytes() == rows.tobytes()
    assert not writer.submit(PROMPTS[3], ROWS[3], report="late")
    assert writer.finished() == {"late"} and cache.stats.save_skipped == 1


def test_the_queue_size_is_configured_and_checked():
    assert CacheConfig.from_extra({"store": "/srv/kv"}).save_queue == 4
    assert CacheConfig.from_extra({"store": "/srv/kv", "save_queue": 0}).save_queue == 0
    for bad in (-1, True, "4"):
        with pytest.raises(ConfigError, match="'save_queue' must be 0 or a positive integer"):
            CacheConfig.from_extra({"store": "/srv/kv", "save_queue": bad})
    with pytest.raises(ValueError, match="room for 1 save or more"):
        SaveWriter(PrefixCache.__new__(PrefixCache), capacity=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_writer_runs_below_the_engines_priority(tmp_path):
    """The writer's thread takes contended cores after the engine's step threads (its nice value
    is raised above the process's), so its encodes and fsyncs never slow the step on a small host."""
    with SessionStore(tmp_path / "kv") as store:
        cache = HeldCache(store)
        writer = SaveWriter(cache, 2)
        try:
            assert writer.submit(PROMPTS[0], ROWS[0])
            assert cache.started.wait(timeout=30)  # the thread is running (and has set its priority)
            mine = os.getpriority(os.PRIO_PROCESS, 0)
            thread_id = writer._thread.native_id
            assert thread_id is not None and os.getpriority(os.PRIO_PROCESS, thread_id) == min(19, mine + WRITER_NICE)
            assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's unchanged
        finally:
            cache.release.set()
            writer.close(timeout=30)
