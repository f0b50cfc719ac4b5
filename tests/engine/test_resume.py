"""Resume: journaled rows restored into a cache continue the conversation exactly.

A turn is prefilled and generated; its rows are exported and written as a ``.coli_kv`` file; a
new process loads the model and the file and runs the next turn. Its tokens must equal the run
that never stopped, and it must prefill only the new tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.engine import Engine, StoredRows, load_model, make_cache
from kvstore.engine.errors import CodecMismatch, GeometryMismatch
from kvstore.formats import coli_kv, fp8

WORKER = Path(__file__).with_name("resume_worker.py")
ALL_TIERS = ("f32", "bf16", "fp8", "q8", "int4", "polar4")


def _turns(vocab: int, seed: int = 5) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(2, vocab, 40).tolist(), rng.integers(2, vocab, 9).tolist()


@pytest.mark.parametrize("tier", ["f32", "fp8", "bf16"])
def test_resume_in_a_new_process_equals_the_uninterrupted_run(hf_models, tmp_path, tier):
    _, folder = hf_models["tiny-yarn"]
    engine = Engine.from_folder(folder, tier=tier)
    first_turn, second_turn = _turns(engine.config.vocab_size)
    first = engine.generate(first_turn, max_new_tokens=16, stop_tokens=())
    rows = engine.export_rows()
    assert rows.version == {"f32": 1, "fp8": 2, "bf16": 4}[tier]  # a bf16 cache journals its own rows (v4)
    assert rows.n == len(first_turn) + 16 - 1  # the last generated token has no row yet
    journal = tmp_path / f"session.{tier}.coli_kv"
    journal.write_bytes(rows.encode_file(engine.config.coli_geometry()))
    if tier == "bf16":  # half the bytes of the same rows as f32, and not a value changed
        g = engine.config.coli_geometry()
        wide = StoredRows(rows.tokens, 1, *rows.dequantize(g.kv_lora, g.qk_rope)).encode_file(g)
        assert journal.read_bytes()[:8] == b"COLIKV4\0"
        assert len(wide) - journal.stat().st_size == rows.n * g.n_layers * (g.kv_lora + g.qk_rope) * 2
        assert np.array_equal(coli_kv.parse(wide).dequantize()[0], coli_kv.load(journal).dequantize()[0])

    context = first_turn + first.tokens + second_turn
    uninterrupted = engine.generate(context, max_new_tokens=32, stop_tokens=())

    proc = subprocess.run(
        [sys.executable, str(WORKER), str(folder), str(journal), tier, json.dumps(context), "32"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert resumed["restored"] == rows.n
    assert resumed["tokens"] == uninterrupted.tokens
    # only the new turn (and the last generated token of the previous one) is prefilled
    assert resumed["prefilled"] == len(second_turn) + 1
    assert resumed["reused"] == len(first_turn) + 16 - 1
    assert (uninterrupted.prefilled_tokens, uninterrupted.reused_tokens) == (resumed["prefilled"], resumed["reused"])


@pytest.mark.parametrize("tier", ALL_TIERS)
def test_restored_cache_continues_identically_in_every_tier(hf_models, tier):
    _, folder = hf_models["tiny"]
    model = load_model(folder)
    live = Engine(model, tier=tier)
    first_turn, second_turn = _turns(model.config.vocab_size, seed=6)
    first = live.generate(first_turn, max_new_tokens=8, stop_tokens=())
    rows = live.export_rows()
    restored = Engine(model, tier=tier)
    restored.restore(rows)
    # the restored cache holds the very same stored rows
    again = restored.export_rows()
    np.testing.assert_array_equal(again.tokens, rows.tokens)
    np.testing.assert_array_equal(again.lc, rows.lc)
    np.testing.assert_array_equal(again.rc, rows.rc)
    context = first_turn + first.tokens + second_turn
    expected = live.generate(context, max_new_tokens=12, stop_tokens=())
    got = restored.generate(context, max_new_tokens=12, stop_tokens=())
    assert got.tokens == expected.tokens
    assert got.reused_tokens == rows.n


def test_v1_rows_restore_into_fp8_quantized_in_memory(hf_models):
    """A v1 journal resumed under the fp8 tier: the rows are quantized exactly as the v2 encoder would."""
    _, folder = hf_models["tiny"]
    model = load_model(folder)
    f32 = Engine(model, tier="f32")
    f32.prefill(_turns(model.config.vocab_size, seed=7)[0])
    rows = f32.export_rows()
    cache = make_cache("fp8", model.config)
    cache.restore(rows)
    got = cache.export_rows()
    assert got.version == 2
    codes, scales = fp8.quantize_rows(rows.lc)
    np.testing.assert_array_equal(got.lc, codes)
    np.testing.assert_array_equal(got.lc_scales, scales)
    codes, scales = fp8.quantize_rows(rows.rc)
    np.testing.assert_array_equal(got.rc, codes)
    np.testing.assert_array_equal(got.rc_scales, scales)


def _snapshot(cache):
    rows = cache.export_rows()
    return rows.tokens.copy(), rows.lc.copy(), rows.rc.copy()


def test_restore_is_all_or_nothing(hf_models):
    _, folder = hf_models["tiny"]
    model = load_model(folder)
    engine = Engine(model, tier="int4")
    engine.prefill(_turns(model.config.vocab_size, seed=8)[0])
    before = _snapshot(engine.cache)
    good = engine.export_rows()

    wrong_layers = StoredRows(
        good.tokens,
        good.version,
        good.lc[:-1],
        good.rc[:-1],
        good.lc_scales[:-1],
        good.rc_scales[:-1],
        good.codec,
        good.bits,
    )
    with pytest.raises(GeometryMismatch):
        engine.cache.restore(wrong_layers)
    wrong_tokens = StoredRows(
        good.tokens[:-1], good.version, good.lc, good.rc, good.lc_scales, good.rc_scales, good.codec, good.bits
    )
    with pytest.raises(GeometryMismatch):
        engine.cache.restore(wrong_tokens)
    # v2 rows into a 4-bit tier would be quantized twice: refused unless asked for
    fp8_engine = Engine(model, tier="fp8")
    fp8_engine.prefill(good.tokens.tolist())
    with pytest.raises(CodecMismatch):
        engine.cache.restore(fp8_engine.export_rows())
    for got, want in zip(_snapshot(engine.cache), before):
        np.testing.assert_array_equal(got, want)
    # asked for explicitly, the lossy conversion goes through
    engine.cache.restore(fp8_engine.export_rows(), allow_requantize=True)
    assert engine.cache.length == good.n


def test_restore_file_refuses_a_file_of_another_model(hf_models, tmp_path):
    _, folder = hf_models["tiny"]
    engine = Engine.from_folder(folder)
    engine.prefill([3, 4, 5, 6])
    rows = engine.export_rows()
    g = engine.config.coli_geometry()
    other = coli_kv.Geometry(g.n_layers, g.kv_lora, g.qk_rope, 0, 0, g.vocab + 1)
    path = tmp_path / "other.coli_kv"
    path.write_bytes(rows.encode_file(other))
    fresh = Engine.from_folder(folder)
    with pytest.raises(GeometryMismatch, match="vocab"):
        fresh.restore_file(path)
    assert fresh.cache.length == 0


def _small_golden(vectors: Path, version: str):
    return coli_kv.load(vectors / f"small.{version}.coli_kv")


@pytest.mark.parametrize(
    "version,tier",
    [("v1", "f32"), ("v2", "fp8"), ("v3c1b4", "int4"), ("v3c0b4", "polar4"), ("v3c0b2", "polar2")],
)
def test_golden_files_round_trip_through_the_cache_byte_for_byte(vectors, version, tier):
    """Stored rows go into their tier without a round trip and come back out as the same bytes;
    decoded on the cache's device they are the rows the golden ``expect`` file holds."""
    records = _small_golden(vectors, version)
    cache = make_cache(tier, records.geometry)
    cache.restore_records(records, expect=records.geometry)
    exported = cache.export_rows()
    assert exported.record_array(records.geometry).tobytes() == records.record_bytes()
    expect = np.fromfile(vectors / f"small.{version}.expect.f32", dtype="<f4")
    g = records.geometry
    n_l = g.n_layers * records.n * g.kv_lora
    want_l = expect[:n_l].reshape(g.n_layers, records.n, g.kv_lora)
    want_r = expect[n_l:].reshape(g.n_layers, records.n, g.qk_rope)
    _, got_l, got_r = cache.export_f32()
    if version.startswith("v3c0"):
        # PolarQuant decodes through cos/sin: within 1e-5 of each row's norm (tests/vectors/README.md)
        for got, want in ((got_l, want_l), (got_r, want_r)):
            err = np.linalg.norm(got - want, axis=-1)
            assert (err <= 1e-5 * np.maximum(np.linalg.norm(want, axis=-1), 1e-30)).all()
    else:
        np.testing.assert_array_equal(got_l, want_l)
        np.testing.assert_array_equal(got_r, want_r)


def test_restore_then_attend_on_the_restored_rows(vectors):
    """Decode attention over restored fp8 rows uses the stored codes (compared with f32 rows)."""
    records = _small_golden(vectors, "v2")
    g = records.geometry
    fp8_cache = make_cache("fp8", g)
    fp8_cache.restore_records(records)
    f32_cache = make_cache("f32", g)
    f32_cache.restore(StoredRows(records.tokens, 1, *records.dequantize()[:2]))
    gen = torch.Generator().manual_seed(0)
    q_lat = torch.randn(1, 2, g.kv_lora, generator=gen)
    q_rope = torch.randn(1, 2, g.qk_rope, generator=gen)
    args = (torch.zeros(1, dtype=torch.int32), torch.full((1,), records.n, dtype=torch.int32), 0.1)
    for layer in range(g.n_layers):
        got = fp8_cache.attend(layer, q_lat, q_rope, *args, n_rows=records.n)
        want = f32_cache.attend(layer, q_lat, q_rope, *args, n_rows=records.n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
