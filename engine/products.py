"""Small matrix products of a decode step written as reductions, for ``torch.compile`` to fuse.

A decode step of one sequence multiplies a single token by a few small weights per layer: the
query into latent space (``W_UK``, one [qk_nope, kv_lora] block per head), the context out of it
(``W_UV``) and the router's logits (f32 [experts, hidden]); and it sums each token's experts'
outputs by their weights. cuBLAS runs each as its own batched GEMV — two or three kernels with a
cast or a transposition beside them — whose launches, not their few megabytes of weights, cost the
time. Written as a product and a sum, each becomes one reduction kernel inside the compiled region,
the casts and layouts fused into its loads and stores.

Only while compiling for CUDA, and for the weight products only at a few tokens
(:func:`as_reduction`): a larger batch reuses each weight across its tokens, which a GEMM does and
a reduction does not (the experts' weighted sum reads no weights and takes the reduction whatever
the batch). The eager step keeps the operation order the transformers oracle tests pin on the CPU.
Every product accumulates in f32 and rounds once to the output dtype, as cuBLAS does; only the
order of the sum differs.
"""

from __future__ import annotations

import torch

__all__ = [
    "REDUCED_PROJECTIONS",
    "REDUCED_TOKENS",
    "as_projection_reduction",
    "as_reduction",
    "head_products",
    "linear_rows",
    "project_rows",
    "weighted_sum",
]

#: steps of at most this many tokens take the reductions; more reuse the weights through a GEMM.
#: Measured on an H100 with the encode kernel and merged regions (BENCHMARKS.md); 0 turns them off
#: (``bench/engine_decode.py --reduced-tokens 0``)
REDUCED_TOKENS = 4

#: The attention's input projections (one fused weight) and its output projection as reductions too,
#: in the same steps: inductor can then fold the norm before them and the split, rotary and cast
#: after them into the product's kernel, where cuBLAS read those 23 MB a layer at ~58% of the copy
#: bandwidth (an H100 profile, BENCHMARKS.md). Measured on an H100: +0.6-1.5% tokens/s at 1k and 32k
#: on the fp8 and int4 caches, single-stream; batches of 16 and 64 take the GEMMs as before
#: (``bench/engine_decode.py --gemm-projections`` turns it off).
REDUCED_PROJECTIONS = True


def as_reduction(x: torch.Tensor, *, any_tokens: bool = False) -> bool:
    """Whether ``x`` [T, ...]'s small products run as reductions: a compiled CUDA region, T small
    (with ``any_tokens``, for a product that reads no weights, T any: while the reductions are on)."""
    few = 0 < x.shape[0] <= REDUCED_TOKENS or (any_tokens and REDUCED_TOKENS > 0)
    return x.is_cuda and few and torch.compiler.is_compiling()


def as_projection_reduction(x: torch.Tensor) -> bool:
    """Whether the attention's projections of ``x`` [T, K] run as reductions: switched on
    (``REDUCED_PROJECTIONS``) and where the other products do (:func:`as_reduction`)."""
    return REDUCED_PROJECTIONS and as_reduction(x)


def head_products(x: torch.Tensor, w: torch.Tensor, *, contract_last: bool) -> torch.Tensor:
    """Per-head products of ``x`` [T, H, K] with ``w`` [H, ., .], accumulated in f32 and rounded to
    ``x``'s dtype: with ``contract_last`` ``w`` is [H, N, K] and the result ``x[t, h] @ w[h]^T``,
    otherwise ``w`` is [H, K, N] and the result ``x[t, h] @ w[h]``; [T, H, N] either way."""
    xf, wf = x.float(), w.float()
    if contract_last:
        out = (xf.unsqueeze(2) * wf.unsqueeze(0)).sum(-1)
    else:
        out = (xf.unsqueeze(-1) * wf.unsqueeze(0)).sum(2)
    return out.to(x.dtype)


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x`` [T, K] @ ``w`` [N, K]^T in f32: [T, N]."""
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(-1)


def project_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [T, K] @ ``w`` [N, K]^T (+ ``bias``) as ``F.linear`` gives it: f32 sums (the bias
    added in f32), rounded once to ``x``'s dtype."""
    out = linear_rows(x, w)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def weighted_sum(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * y[t, j]``: ``weights`` [T, k], ``y`` [T, k, N] -> [T, N] in ``y``'s
    dtype, f32 sums (the weights as given: the caller rounds them as its GEMM would)."""
    return (weights.float().unsqueeze(-1) * y.float()).sum(1).to(y.dtype)
