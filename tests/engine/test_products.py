"""The decode step's small products as reductions (kvstore.engine.products): the same values as the
batched GEMMs they stand for, up to the order of an f32 sum and one rounding to the output dtype,
and taken only where they pay (a compiled CUDA region of a few tokens). On CUDA the compiled step
that uses them is checked against the eager one in tests/engine/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstore.engine import products
from kvstore.engine.config import preset
from kvstore.engine.model import MLAttention


def _ulps_apart(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest distance in units of the dtype's last place (bf16 values as int16 bit patterns,
    sign-folded so neighbours differ by one)."""
    a, b = (t.contiguous().view(torch.int16).int() for t in (got, want))
    a = torch.where(a < 0, -32768 - a, a)
    b = torch.where(b < 0, -32768 - b, b)
    return int((a - b).abs().max())


@pytest.mark.parametrize("tokens", [1, 3])
def test_head_products_are_the_bmm_of_each_head(tokens):
    gen = torch.Generator().manual_seed(tokens)
    heads, k, n = 16, 128, 512
    x = torch.randn(tokens, heads, k, generator=gen).bfloat16()
    w = (torch.randn(heads, k, n, generator=gen) * 0.05).bfloat16()  # W_UK's layout: [H, K, N]
    want = torch.bmm(x.double().transpose(0, 1), w.double()).transpose(0, 1)
    got = products.head_products(x, w, contract_last=False)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, heads, n)
    # f32 sums round once to bf16 as the GEMM's do: at most one bf16 step from the exact product
    assert _ulps_apart(got, want.bfloat16()) <= 1
    ctx = torch.randn(tokens, heads, n, generator=gen).bfloat16()
    w_uv = (torch.randn(heads, k, n, generator=gen) * 0.05).bfloat16()  # W_UV's layout: [H, N_out, K]
    want = torch.bmm(ctx.double().transpose(0, 1), w_uv.double().transpose(1, 2)).transpose(0, 1)
    got = products.head_products(ctx, w_uv, contract_last=True)
    assert got.shape == (tokens, heads, k)
    assert _ulps_apart(got, want.bfloat16()) <= 1


def test_linear_rows_is_the_routers_f32_product():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2048, generator=gen).bfloat16()
    w = torch.randn(64, 2048, generator=gen) * 0.02
    got = products.linear_rows(x, w)
    assert got.dtype == torch.float32
    want = F.linear(x.double(), w.double())
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_project_rows_is_the_linear_layer_rounded_once(bias):
    """The attention's projections as reductions give ``F.linear``'s bf16 values: f32 sums, the bias
    added in f32, one rounding (at most one bf16 step from the exact product)."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(3, 2048, generator=gen).bfloat16()
    w = (torch.randn(576, 2048, generator=gen) * 0.02).bfloat16()
    b = torch.randn(576, generator=gen).bfloat16() if bias else None
    got = products.project_rows(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (3, 576)
    assert _ulps_apart(got, want.bfloat16()) <= 1


def test_weighted_sum_is_the_bmm_over_each_tokens_experts():
    gen = torch.Generator().manual_seed(11)
    y = torch.randn(5, 8, 2048, generator=gen).bfloat16()
    weights = torch.rand(5, 8, generator=gen).bfloat16()
    got = products.weighted_sum(weights, y)
    want = torch.bmm(weights.double()[:, None, :], y.double())[:, 0]
    assert got.dtype == torch.bfloat16 and got.shape == (5, 2048)
    assert _ulps_apart(got, want.bfloat16()) <= 1


def test_the_reductions_trace_under_torch_compile():
    """The forms a compiled CUDA step takes, compiled here for the CPU: same values as eager."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 4, 32, generator=gen)
    w = torch.randn(4, 32, 64, generator=gen)
    compiled = torch.compile(lambda a, b: products.head_products(a, b, contract_last=False))
    torch.testing.assert_close(compiled(x, w), products.head_products(x, w, contract_last=False))


def test_the_reductions_are_taken_only_by_a_compiled_cuda_step_of_a_few_tokens(monkeypatch):
    monkeypatch.setattr(products, "REDUCED_TOKENS", 4)
    x = torch.zeros(1, 8)
    assert not products.as_reduction(x)  # eager, and on the CPU: the oracle-pinned GEMMs
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not products.as_reduction(x)  # compiling, but for the CPU
    cuda_like = torch.zeros(1, 8, device="meta")
    assert not products.as_reduction(cuda_like)
    monkeypatch.setattr(products, "REDUCED_TOKENS", 0)  # the switch off: nothing takes them
    assert not products.as_reduction(x, any_tokens=True)


def test_the_projections_take_reductions_only_when_switched_on_where_the_others_do(monkeypatch):
    x = torch.zeros(1, 8)
    monkeypatch.setattr(products, "as_reduction", lambda t, any_tokens=False: True)  # a compiled CUDA step
    assert products.REDUCED_PROJECTIONS and products.as_projection_reduction(x)  # on by default
    monkeypatch.setattr(products, "REDUCED_PROJECTIONS", False)
    assert not products.as_projection_reduction(x)
    monkeypatch.setattr(products, "REDUCED_PROJECTIONS", True)
    monkeypatch.setattr(products, "as_reduction", lambda t, any_tokens=False: False)  # eager, or the CPU
    assert not products.as_projection_reduction(x)


def _attention(cfg) -> MLAttention:
    """Layer 0's attention of ``cfg`` with small random weights (seeded)."""
    torch.manual_seed(0)
    attn = MLAttention(cfg, 0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.05)
    return attn


def test_the_projections_as_reductions_give_the_layers_outputs(monkeypatch):
    """The attention's ``project`` and ``latent_output`` with the projections taken as reductions (as
    a compiled CUDA step would, forced here on the CPU) give the GEMMs' values within rounding."""
    cfg = preset("tiny")
    attn = _attention(cfg)
    attn.fuse_x_projections()
    from kvstore.engine.rotary import Rotary

    rotary = Rotary(cfg)
    x = torch.randn(2, cfg.hidden_size)
    positions = torch.tensor([5, 6])
    cos, sin = rotary(positions)
    ctx = torch.randn(2, cfg.num_attention_heads, cfg.kv_lora_rank)
    want = attn.project(x, cos, sin, rotary), attn.latent_output(ctx)
    monkeypatch.setattr(products, "REDUCED_PROJECTIONS", True)
    monkeypatch.setattr(products, "as_reduction", lambda t, any_tokens=False: True)
    got = attn.project(x, cos, sin, rotary), attn.latent_output(ctx)
    for g, w in zip([*got[0], got[1]], [*want[0], want[1]]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_eager_attention_products_are_unchanged_by_the_module():
    """Outside a compiled region the layer's products are the bmm they always were (the
    transformers oracle tests pin that order on the CPU)."""
    cfg = preset("tiny")
    attn = _attention(cfg)
    q_nope = torch.randn(2, cfg.num_attention_heads, cfg.qk_nope_head_dim)
    w_uk, _ = attn._uk_uv()
    want = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).float()
    assert torch.equal(attn.latent_query(q_nope), want)
