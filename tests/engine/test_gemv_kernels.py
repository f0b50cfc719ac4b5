"""The attention's projections as one Triton kernel each (kvstore.engine.gemv_kernels) on the CPU,
through Triton's interpreter (``TRITON_INTERPRET=1``, in a child process because the variable is
read at import): against a float64 product of the same inputs, with and without the input norm
folded in, with a bias, token counts and widths that are not multiples of the tiles; and the
layer's ``project`` / ``latent_output`` through the kernels against the layer's own eager path. f32
and f16 here (the interpreter's bf16 is not trusted, tests/engine/test_expert_kernels.py); bf16 runs
in the compiled-step GPU test ("gemv-kernels")."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from interpreted import run_interpreted
from kvstore.engine import products
from kvstore.engine.config import preset
from kvstore.engine.model import MLAttention, RMSNorm

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_INTERPRETED = textwrap.dedent(
    """
    import json
    import torch
    from kvstore.engine import products
    from kvstore.engine.config import preset
    from kvstore.engine.gemv_kernels import project
    from kvstore.engine.model import MLAttention, RMSNorm
    from kvstore.engine.rotary import Rotary

    report = []
    gen = torch.Generator().manual_seed(3)
    cases = [  # (tokens, out rows, in columns, dtype, norm, bias, tiles)
        (1, 40, 96, "float32", True, False, {}),
        (3, 19, 1100, "float16", True, False, {}),
        (2, 33, 64, "float32", False, True, {"block_n": 16, "block_k": 32}),
        (4, 8, 512, "float16", False, False, {"block_n": 4}),
        (5, 70, 130, "float32", True, True, {"block_k": 64}),
    ]
    for t, n, k, dtype, with_norm, with_bias, tiles in cases:
        dt = getattr(torch, dtype)
        x = torch.randn(t, k, generator=gen).to(dt)
        w = (torch.randn(n, k, generator=gen) * 0.1).to(dt)
        bias = torch.randn(n, generator=gen).to(dt) if with_bias else None
        norm = RMSNorm(k, 1e-6).to(dt)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(k, generator=gen) + 0.5)
        rows = norm(x) if with_norm else x  # the module's own roundings of the normed rows
        want = rows.double() @ w.double().T + (bias.double() if with_bias else 0.0)
        got = project(x, w, norm=norm.weight.detach() if with_norm else None, eps=1e-6, bias=bias, **tiles)
        report.append({
            "case": f"T{t} N{n} K{k} {dtype} norm {with_norm} bias {with_bias}",
            "dtype": str(got.dtype).removeprefix("torch."),
            "want_dtype": dtype,
            "shape": list(got.shape),
            "want_shape": [t, n],
            "err": float((got.double() - want).norm() / want.norm()),
        })
    # the layer's projections through the kernels (as a compiled CUDA step would take them, forced
    # here) against its eager path: the norm folded into the input projection's kernel
    cfg = preset("tiny")
    attn = MLAttention(cfg, 0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.05, generator=gen)
    attn.fuse_x_projections()
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(cfg.hidden_size, generator=gen) + 0.5)
    rotary = Rotary(cfg)
    x = torch.randn(2, cfg.hidden_size, generator=gen)
    cos, sin = rotary(torch.tensor([5, 6]))
    ctx = torch.randn(2, cfg.num_attention_heads, cfg.kv_lora_rank, generator=gen)
    want = [*attn.project(x, cos, sin, rotary, norm=norm), attn.latent_output(ctx)]
    products.GEMV_KERNELS = True
    products.as_reduction = lambda t, any_tokens=False: True
    got = [*attn.project(x, cos, sin, rotary, norm=norm), attn.latent_output(ctx)]
    for name, g, w in zip(["q_nope", "q_rope", "lc", "rc", "out"], got, want):
        report.append({
            "case": f"layer {name}",
            "dtype": str(g.dtype).removeprefix("torch."),
            "want_dtype": str(w.dtype).removeprefix("torch."),
            "shape": list(g.shape),
            "want_shape": list(w.shape),
            "err": float((g.double() - w.double()).norm() / w.double().norm()),
        })
    print(json.dumps(report))
    """
)


@needs_triton
def test_the_kernel_under_the_interpreter_matches_the_products_and_the_layer():
    report = run_interpreted(_INTERPRETED)
    assert len(report) == 10
    for row in report:
        assert row["dtype"] == row["want_dtype"] and row["shape"] == row["want_shape"], row
        bound = 2e-3 if row["dtype"] == "float16" else 1e-5  # f16: one rounding of the output
        assert row["err"] < bound, row


@needs_triton
def test_bad_shapes_and_too_many_tokens_are_refused():
    from kvstore.engine.gemv_kernels import MAX_TOKENS, project

    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="at most"):
        project(torch.zeros(MAX_TOKENS + 1, 16), w)
    with pytest.raises(ValueError, match="contiguous rows"):
        project(torch.zeros(2, 16), torch.zeros(16, 8).T)
    with pytest.raises(ValueError, match=r"must be \[N, 16\]"):
        project(torch.zeros(2, 16), torch.zeros(8, 12))
    with pytest.raises(ValueError, match="norm weight"):
        project(torch.zeros(2, 16), w, norm=torch.ones(12))
    with pytest.raises(ValueError, match="bias"):
        project(torch.zeros(2, 16), w, bias=torch.ones(16))


def test_the_eager_projection_norms_first_exactly_as_before(monkeypatch):
    """Outside a compiled CUDA step (or with the kernels off) ``project(x, norm=...)`` is the norm's
    module and then the projection, bit for bit: the transformers oracle's order is kept."""
    cfg = preset("tiny")
    attn = MLAttention(cfg, 0)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.05, generator=gen)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    from kvstore.engine.rotary import Rotary

    rotary = Rotary(cfg)
    x = torch.randn(3, cfg.hidden_size, generator=gen)
    cos, sin = rotary(torch.tensor([1, 2, 3]))
    monkeypatch.setattr(products, "GEMV_KERNELS", True)  # switched on, but not a compiled CUDA step
    for fused in (False, True):
        if fused:
            attn.fuse_x_projections()
        got = attn.project(x, cos, sin, rotary, norm=norm)
        want = attn.project(norm(x), cos, sin, rotary)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert products.gemv_kernels(x) is None


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4])
def test_the_kernel_on_cuda_is_the_normed_linear_in_bf16(tokens):
    """bf16 on the GPU, V2-Lite's widths (the fused input projection with its norm, o_proj with a
    bias): within one rounding of the f64 product of the same normed rows, and no farther from it
    than the reduction the compiled step takes otherwise (products.project_rows)."""
    from kvstore.engine.gemv_kernels import project

    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(tokens)
    for n, k, with_norm, with_bias in [(3648, 2048, True, False), (2048, 2048, False, True)]:
        x = torch.randn(tokens, k, generator=gen).to(cuda, torch.bfloat16)
        w = (torch.randn(n, k, generator=gen) * 0.02).to(cuda, torch.bfloat16)
        bias = torch.randn(n, generator=gen).to(cuda, torch.bfloat16) if with_bias else None
        norm = RMSNorm(k, 1e-6).to(cuda, torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(k, generator=gen) + 0.5)
        rows = norm(x) if with_norm else x
        want = rows.double() @ w.double().T + (bias.double() if with_bias else 0.0)
        got = project(x, w, norm=norm.weight.detach() if with_norm else None, eps=1e-6, bias=bias)
        reduced = products.project_rows(rows, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (tokens, n)
        err = float((got.double() - want).abs().max() / want.abs().max())
        assert err <= 1e-2
        assert err <= 1.5 * float((reduced.double() - want).abs().max() / want.abs().max()) + 1e-3
