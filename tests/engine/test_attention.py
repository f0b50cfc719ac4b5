"""Decode backends: each tier's function against a float64 reference over its dequantized rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.engine import attention, quant
from kvstore.engine.attention import DecodeBackend, select_decode
from kvstore.engine.errors import CacheError, TierUnsupported

H, K, R = 3, 64, 32
N = 50
# three sequences packed in one row buffer, and one query that sees nothing yet
SEQ_START = torch.tensor([0, 20, 31, 7], dtype=torch.int32)
SEQ_LEN = torch.tensor([20, 11, 19, 0], dtype=torch.int32)
SCALE = 0.17


def _reference(q_lat, q_rope, lc, rc, seq_start, seq_len, scale) -> torch.Tensor:
    """softmax(scale * (q_lat . Lc + q_rope . Rc)) @ Lc per query, in float64, one query at a time."""
    out = torch.zeros(q_lat.shape, dtype=torch.float64)
    for b in range(q_lat.shape[0]):
        a, n = int(seq_start[b]), int(seq_len[b])
        if n == 0:
            continue
        rows_l, rows_r = lc[a : a + n].double(), rc[a : a + n].double()
        scores = (q_lat[b].double() @ rows_l.T + q_rope[b].double() @ rows_r.T) * scale
        out[b] = torch.softmax(scores, dim=-1) @ rows_l
    return out.float()


def _queries(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, H, K, generator=gen), torch.randn(4, H, R, generator=gen)


def _rows(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=gen) * 2, torch.randn(N, R, generator=gen) * 2


def test_dense_matches_the_float64_reference():
    q_lat, q_rope = _queries()
    lc, rc = _rows()
    got = attention.mla_decode_dense(q_lat, q_rope, lc, rc, SEQ_START, SEQ_LEN, SCALE)
    torch.testing.assert_close(got, _reference(q_lat, q_rope, lc, rc, SEQ_START, SEQ_LEN, SCALE), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3], torch.zeros(H, K))


@pytest.mark.parametrize("tier", ["fp8", "tq-int4", "tq-polar", "int8"])
def test_quantized_backends_attend_their_dequantized_rows(tier):
    q_lat, q_rope = _queries(2)
    lc, rc = _rows(3)
    if tier == "fp8":
        operands = (*quant.fp8_quantize_rows(lc), *quant.fp8_quantize_rows(rc))
        rows = quant.fp8_dequantize_rows(*operands[:2]), quant.fp8_dequantize_rows(*operands[2:])
        fn = attention.mla_decode_fp8
    elif tier == "tq-int4":
        operands = (*quant.int4_quantize_rows(lc), *quant.int4_quantize_rows(rc))
        rows = quant.int4_dequantize_rows(*operands[:2]), quant.int4_dequantize_rows(*operands[2:])
        fn = attention.mla_decode_int4
    elif tier == "tq-polar":
        operands = (*quant.polar_quantize_rows(lc, 3), *quant.polar_quantize_rows(rc, 3))
        rows = quant.polar_dequantize_rows(*operands[:2], K, 3), quant.polar_dequantize_rows(*operands[2:], R, 3)

        def fn(*args, **kwargs):
            return attention.mla_decode_polar(*args, bits=3, **kwargs)

    else:
        operands = (*quant.q8_quantize_blocks(lc), *quant.q8_quantize_blocks(rc))
        rows = quant.q8_dequantize_blocks(*operands[:2]), quant.q8_dequantize_blocks(*operands[2:])
        fn = attention.mla_decode_q8
    out = torch.full((4, H, K), float("nan"))
    got = fn(q_lat, q_rope, *operands, SEQ_START, SEQ_LEN, SCALE, out=out)
    assert got is out
    # the TQ backends attend in the rotated domain: equal up to rounding
    torch.testing.assert_close(got, _reference(q_lat, q_rope, *rows, SEQ_START, SEQ_LEN, SCALE), rtol=1e-4, atol=1e-4)
    # and the rows really are quantized: not the f32 answer
    assert not torch.allclose(got, _reference(q_lat, q_rope, lc, rc, SEQ_START, SEQ_LEN, SCALE), rtol=1e-6, atol=1e-6)


def test_streaming_over_many_chunks_matches_one_pass(monkeypatch):
    q_lat, q_rope = _queries(4)
    lc, rc = _rows(5)
    whole = attention.mla_decode_dense(q_lat, q_rope, lc, rc, SEQ_START, SEQ_LEN, SCALE)
    monkeypatch.setattr(attention, "_CHUNK_ROWS", 7)  # many chunks, some with no visible row
    chunked = attention.mla_decode_dense(q_lat, q_rope, lc, rc, SEQ_START, SEQ_LEN, SCALE)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_out_is_checked():
    q_lat, q_rope = _queries()
    lc, rc = _rows()
    with pytest.raises(CacheError, match="out must be"):
        attention.mla_decode_dense(q_lat, q_rope, lc, rc, SEQ_START, SEQ_LEN, SCALE, out=torch.empty(4, H, K + 1))


def test_selection_is_data_driven_with_reasons():
    choice = select_decode("fp8", "cpu")
    assert choice.backend == "torch" and choice.function is attention.mla_decode_fp8
    assert select_decode("tq-int4", "cpu").function is attention.mla_decode_int4
    with pytest.raises(TierUnsupported, match="unknown cache tier"):
        select_decode("fp4", "cpu")
    limited = DecodeBackend("fp8-only", frozenset({"cuda"}), {"mla_decode_fp8": attention.mla_decode_fp8})
    reasons = limited.why_not("tq-int4", torch.device("cpu"))
    assert any("not cpu" in r for r in reasons) and any("mla_decode_int4" in r for r in reasons)
    assert limited.why_not("fp8", torch.device("cuda")) == []


def test_cache_attend_goes_through_the_selected_backend():
    from kvstore.engine import CacheGeometry, make_cache

    calls = []
    cache = make_cache("fp8", CacheGeometry(1, K, R))

    def spy(*args, **kwargs):
        calls.append(args)
        return attention.mla_decode_fp8(*args, **kwargs)

    cache.decode_choice = attention.DecodeChoice(spy, "spy")
    lc, rc = _rows(6)
    cache.prepare(0, N)
    cache.write(0, 0, lc, rc)
    cache.commit(0, np.arange(N))
    q_lat, q_rope = _queries(7)
    starts, lens = torch.zeros(1, dtype=torch.int32), torch.full((1,), N, dtype=torch.int32)
    got = cache.attend(0, q_lat[:1], q_rope[:1], starts, lens, SCALE, n_rows=N)
    assert len(calls) == 1
    lc_codes, lc_scales, rc_codes, rc_scales = calls[0][2:6]
    assert lc_codes.dtype == torch.uint8 and lc_codes.shape == (N, K) and lc_scales.shape == (N,)
    assert rc_codes.shape == (N, R) and rc_scales.dtype == torch.float32
    rows = quant.fp8_dequantize_rows(lc_codes, lc_scales), quant.fp8_dequantize_rows(rc_codes, rc_scales)
    torch.testing.assert_close(got, _reference(q_lat[:1], q_rope[:1], *rows, starts, lens, SCALE), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tier,kernel", [("fp8", "mla_decode_fp8"), ("tq-int4", "mla_decode_int4")])
def test_kvstore_gpu_kernels_take_the_cache_operands(tier, kernel):
    """The real kvstore.gpu backend of this device, called through the engine's hook (with
    validate=False bound), agrees with the engine's own implementation on the same cache."""
    from kvstore import gpu
    from kvstore.engine import CacheGeometry, make_cache

    backend = gpu.get_backend(torch.device("cpu"))
    ours = make_cache(tier, CacheGeometry(1, K, R))
    theirs = make_cache(tier, CacheGeometry(1, K, R))
    theirs.decode_choice = attention.DecodeChoice(attention._trusted(getattr(backend, kernel)), backend.name)
    lc, rc = _rows(8)
    for cache in (ours, theirs):
        cache.prepare(0, N)
        cache.write(0, 0, lc, rc)
        cache.commit(0, np.arange(N))
    q_lat, q_rope = _queries(9)
    got = theirs.attend(0, q_lat, q_rope, SEQ_START, SEQ_LEN, SCALE, n_rows=N)
    want = ours.attend(0, q_lat, q_rope, SEQ_START, SEQ_LEN, SCALE, n_rows=N)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
