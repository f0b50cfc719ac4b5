"""The attention's projections at decode sizes on CUDA as one Triton kernel each, the input norm folded in.

A compiled decode step of one to a few tokens multiplies them by each layer's fused input projection
(``[q | kv_a]``, 3,648 x 2,048 on V2-Lite) and its output projection (2,048 x 2,048): matrix-vector
products whose time is one read of the weight. As reductions (:mod:`kvstore.engine.products`)
inductor gives each output row its own program, which recomputes the input norm and reloads the
input for that row alone. Here a program takes ``BLOCK_N`` output rows: it computes the norm's
statistics once, streams its rows' weights ``BLOCK_K`` columns at a time and keeps every token's
sums in f32, rounding once to the model's dtype.

The input norm (``RMSNorm``: ``weight * round(x / sqrt(mean(x^2) + eps))``, the inner product rounded
to the model's dtype before the weight multiplies it, and that product rounded again) is applied to
each slice of the input as the kernel loads it, with the roundings of the eager step. No program
waits on another and nothing is read back: a step stays capturable in a CUDA graph, and
``torch.compile`` traces the kernel as a user-defined Triton kernel.

Off unless ``products.GEMV_KERNELS`` is on (``bench/engine_ab.py --variant
"products.GEMV_KERNELS=1"``). ``TRITON_INTERPRET=1`` runs it on CPU tensors (the CPU tests use it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_K", "BLOCK_N", "MAX_TOKENS", "project"]

#: Output rows per program (3,648 / 8 = 456 programs for V2-Lite's input projection, 256 for o_proj).
BLOCK_N = 8
#: Input columns per step of a program's loop.
BLOCK_K = 512
#: Warps per program.
WARPS = 4
#: Pipeline stages of the weight tiles.
STAGES = 3
#: Most tokens a call takes (each program keeps [tokens, BLOCK_N] sums and loads [tokens, BLOCK_K]).
MAX_TOKENS = 16


@triton.jit
def _project_kernel(
    x_ptr,
    w_ptr,
    norm_ptr,
    bias_ptr,
    out_ptr,
    n_tokens,
    n_out,
    n_in,
    stride_x,
    stride_w,
    stride_out,
    eps,
    NORM: tl.constexpr,
    BIAS: tl.constexpr,
    TP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_out
    t = tl.arange(0, TP)
    t_ok = t < n_tokens
    ks = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    inv = tl.full((TP,), 1.0, dtype=tl.float32)
    if NORM:  # each token's 1 / sqrt(mean(x^2) + eps), from one pass over its row (f32)
        squares = tl.zeros((TP, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            mask = t_ok[:, None] & ((k0 + ks) < n_in)[None, :]
            xv = tl.load(x_ptr + t[:, None] * stride_x + (k0 + ks)[None, :], mask=mask, other=0.0).to(tl.float32)
            squares += xv * xv
        inv = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / n_in + eps)
    acc = tl.zeros((TP, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        cols = k0 + ks
        col_ok = cols < n_in
        xv = tl.load(x_ptr + t[:, None] * stride_x + cols[None, :], mask=t_ok[:, None] & col_ok[None, :], other=0.0)
        if NORM:  # the norm's two roundings to the model's dtype, as the eager step rounds them
            h = (xv.to(tl.float32) * inv[:, None]).to(dtype)
            g = tl.load(norm_ptr + cols, mask=col_ok, other=0.0)
            xv = (g.to(tl.float32)[None, :] * h.to(tl.float32)).to(dtype)
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + t[:, None] * stride_out + rows[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=t_ok[:, None] & row_ok[None, :],
    )


def project(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    warps: int = WARPS,
    stages: int = STAGES,
) -> torch.Tensor:
    """``x`` [T, K] (normed first by ``norm`` [K] with ``eps`` when given) @ ``weight`` [N, K]^T
    (+ ``bias`` [N]): [T, N] in ``x``'s dtype, f32 sums rounded once, as ``F.linear`` gives it.

    ``block_n``, ``block_k``, ``warps``, ``stages``: the kernel's tiles (``bench/engine_gemv.py``
    sweeps them)."""
    t, k = x.shape
    n = weight.shape[0]
    if t > MAX_TOKENS:
        raise ValueError(f"{t} tokens: the projection kernel takes at most {MAX_TOKENS}")
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N, {k}] with contiguous rows")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"norm weight {tuple(norm.shape)} must be [{k}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{n}]")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    _project_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        x if norm is None else norm,  # unread without NORM
        x if bias is None else bias,  # unread without BIAS
        out,
        t,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        eps,
        NORM=norm is not None,
        BIAS=bias is not None,
        TP=max(1, triton.next_power_of_2(t)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,  # pyright: ignore[reportCallIssue]  (launch options, not kernel parameters)
        num_stages=stages,  # pyright: ignore[reportCallIssue]
    )
    return out
