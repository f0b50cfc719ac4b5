"""The engine's side of decode attention: each cache selects its function through the one registry
of ``kvstore.gpu`` and attends the rows it holds (the backends themselves pass the attention
conformance suite, tests/conformance/attention.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore import tiers
from kvstore.engine import CacheGeometry, make_cache
from kvstore.engine.errors import TierUnsupported
from kvstore.gpu import registry

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


def _filled(tier, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lc, rc = torch.randn(N, K, generator=gen) * 2, torch.randn(N, R, generator=gen) * 2
    cache = make_cache(tier, CacheGeometry(1, K, R))
    cache.prepare(0, N)
    cache.write(0, 0, lc, rc)
    cache.commit(0, np.arange(N))
    return cache, lc, rc


@pytest.mark.parametrize("tier", tiers.names())
def test_every_tier_attends_the_rows_it_holds(tier):
    """The selected function (the torch backend on the CPU) over the cache's fields equals a float64
    softmax over the rows the cache decodes them to; and quantized tiers really are quantized."""
    cache, lc, rc = _filled(tier)
    assert cache.decode_choice.backend == "torch" and cache.decode_choice.tier is cache.tier
    q_lat, q_rope = _queries(2)
    got = cache.attend(0, q_lat, q_rope, SEQ_START, SEQ_LEN, SCALE, n_rows=N)
    held_l, held_r = cache.read(0, N)
    # the TQ tiers attend in the rotated domain: equal up to rounding
    torch.testing.assert_close(
        got, _reference(q_lat, q_rope, held_l, held_r, SEQ_START, SEQ_LEN, SCALE), rtol=1e-4, atol=1e-4
    )
    assert torch.equal(got[3], torch.zeros(H, K))
    exact = _reference(q_lat, q_rope, lc, rc, SEQ_START, SEQ_LEN, SCALE)
    assert torch.allclose(got, exact, rtol=1e-5, atol=1e-5) == (not cache.tier.lossy)


def test_cache_attend_goes_through_the_selected_function():
    from kvstore.gpu import codecs

    calls = []
    cache, _, _ = _filled("fp8", 6)
    real = cache.decode_choice.function

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    cache.decode_choice = registry.Selection(spy, "spy", tiers.FP8)
    q_lat, q_rope = _queries(7)
    starts, lens = torch.zeros(1, dtype=torch.int32), torch.full((1,), N, dtype=torch.int32)
    got = cache.attend(0, q_lat[:1], q_rope[:1], starts, lens, SCALE, n_rows=N)
    assert len(calls) == 1
    batch = calls[0][2]
    assert batch.tier is tiers.FP8 and not batch.checked  # the cache's own operands: trusted, checked never
    lc_codes, lc_scales, rc_codes, rc_scales = batch.lc_codes, batch.lc_scales, batch.rc_codes, batch.rc_scales
    assert lc_codes.dtype == torch.uint8 and lc_codes.shape == (N, K) and lc_scales.shape == (N,)
    assert rc_codes.shape == (N, R) and rc_scales.dtype == torch.float32
    assert (batch.kv_lora, batch.qk_rope, batch.n_rows, batch.batch_size) == (K, R, N, 1)
    rows = codecs.fp8_dequantize_rows(lc_codes, lc_scales), codecs.fp8_dequantize_rows(rc_codes, rc_scales)
    torch.testing.assert_close(got, _reference(q_lat[:1], q_rope[:1], *rows, starts, lens, SCALE), rtol=1e-5, atol=1e-5)


def test_selection_honours_prefer_and_explains_a_refusal():
    cache = make_cache("int4", CacheGeometry(1, K, R), prefer_backend="torch")
    assert cache.decode_choice.backend == "torch" and list(cache.decode_choice.rejected) == []
    # the backend's one entry point, whatever the tier (the tier and its bits travel in the batch)
    assert cache.decode_choice.function == registry.instance("torch", "cpu").decode
    polar = make_cache("polar3", CacheGeometry(1, K, R))
    assert polar.decode_choice.function == cache.decode_choice.function and polar.decode_choice.tier.bits == 3
    with pytest.raises(TierUnsupported, match="no decode backend for tier fp8 on meta: cuda: runs on"):
        make_cache("fp8", CacheGeometry(1, K, R), "meta")
