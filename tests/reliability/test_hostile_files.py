"""Hostile files: flipped bits, truncations and absurd header words.

Only typed errors come out; nothing hangs; nothing is allocated beyond what the file's size
justifies (a header may claim 2^31 records or 2^30-wide rows, the loader sizes nothing from that).
"""

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import config, tiers
from kvstore.errors import KVStoreError
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Header
from kvstore.journal import KVFile
from reliability.workload import GEOMETRY, expected_records

TIERS = [tiers.F32, tiers.FP8, tiers.INT4, tiers.polar(2)]
#: Fuzzed files per test: 300 in CI, 5000 in the long run (KVSTORE_LONG=1).
EXAMPLES = 5000 if config.LONG.get() else 300
SEEDS = {t: Header(GEOMETRY, t, 5).to_bytes() + expected_records(5, 1, t)[:5].tobytes() for t in TIERS}


def exercise(blob: bytes) -> None:
    """Everything a reader does with a file; only KVStoreError may escape."""
    try:
        records = coli_kv.parse(blob)
    except KVStoreError:
        return
    records.problems.messages()
    L, R, index = records.dequantize()
    assert L.shape == (records.geometry.n_layers, records.n, records.geometry.kv_lora)
    assert np.isfinite(L).all() and np.isfinite(R).all() or records.tier.version == 1
    if records.tier.version != 1:
        records.quantized("L")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(TIERS), st.lists(st.integers(0, 10**6), max_size=12), st.integers(0, 10**6))
def test_bit_flips_and_truncations(figures, tier, flips, cut):
    figures.add("hostile_files", "bit_flips_and_truncations", inputs=1)
    blob = bytearray(SEEDS[tier])
    for position in flips:
        bit = position % (len(blob) * 8)
        blob[bit // 8] ^= 1 << (bit % 8)
    exercise(bytes(blob[: cut % (len(blob) + 1)]))


HEADER_WORDS = st.sampled_from([0, 1, 2, 3, 7, 64, 512, 2048, 2**20, 2**30, 2**31 - 1, -1, -(2**31)])


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.sampled_from(TIERS), st.lists(st.tuples(st.integers(0, 7), HEADER_WORDS), min_size=1, max_size=4))
def test_absurd_header_words_allocate_nothing(figures, tier, edits):
    figures.add("hostile_files", "absurd_header_words", inputs=1)
    blob = bytearray(SEEDS[tier])
    for word, value in edits:
        struct.pack_into("<i", blob, 8 + 4 * word, value)
    tracemalloc.start()
    try:
        exercise(bytes(blob))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Decoded rows are at most ~8x the stored bytes (4-bit codes -> f32) plus fixed overheads.
    assert peak < 64 * len(blob) + (1 << 20), f"peak {peak} bytes for a {len(blob)}-byte file"


def test_huge_claims_are_refused_or_clamped():
    blob = bytearray(SEEDS[tiers.FP8])
    struct.pack_into("<i", blob, 32, 2**31 - 1)  # nrec
    assert coli_kv.parse(bytes(blob)).n == 5
    for word, value in [(1, 2**30), (0, 2**31 - 1), (2, 2**30), (3, 2**30)]:
        bad = bytearray(SEEDS[tiers.FP8])
        struct.pack_into("<i", bad, 8 + 4 * word, value)
        with pytest.raises(KVStoreError):
            coli_kv.parse(bytes(bad))


@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.describe())
def test_words_in_range_whose_record_is_too_large(tier):
    """Regression (long fuzz): every word in range, their product a record of 2 GiB or more —
    numpy cannot build such a record type; it raised an untyped ValueError."""
    for n_layers, kv_lora, index_hd, nic in ((512, 2**20, 8, 1), (4096, 2**20, 2**20, 4096)):
        blob = bytearray(SEEDS[tier])
        struct.pack_into("<4i", blob, 8, n_layers, kv_lora, 16, index_hd)
        struct.pack_into("<i", blob, 24, nic)
        if coli_kv.record_bytes(coli_kv.Geometry(n_layers, kv_lora, 16, index_hd, nic, 1000), tier) < 2**31:
            continue  # fits (a 4-bit tier packs the first shape small enough)
        with pytest.raises(KVStoreError, match="2 GiB"):
            coli_kv.parse(bytes(blob))


@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.describe())
def test_journal_open_on_hostile_headers(tmp_path, figures, tier):
    path = tmp_path / "h.coli_kv"
    for word in range(8):
        for value in (-1, 0, 2**31 - 1):
            blob = bytearray(SEEDS[tier])
            struct.pack_into("<i", blob, 8 + 4 * word, value)
            path.write_bytes(bytes(blob))
            figures.add("hostile_files", "journal_open_hostile_headers", inputs=1)
            try:
                with KVFile.open(path, writable=True, lock_timeout=0.1) as journal:
                    journal.load()
            except KVStoreError:
                pass
