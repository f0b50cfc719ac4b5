"""Device backends for absorbed MLA decode attention over quantized latent caches.

For each query token ``b`` (a sequence owning cache rows ``seq_start[b] .. seq_start[b] +
seq_len[b] - 1``) and head ``h``::

    s[n]   = softmax_scale * (q_lat[b,h] . (lut[Lc[n]] * Ls[n]) + q_rope[b,h] . (lut[Rc[n]] * Rs[n]))
    out[b,h] = softmax(s) @ (lut[Lc] * Ls)                                      f32[kv_lora]

``lut`` is the fp8 e4m3 decode (NaN codes read as 0) for the ``fp8`` tier; for the ``int4`` tier
(rotated int4, TQ codec 1) a row is ``unrotate(level[c] * radius / sqrtf(n))`` and the kernels work
in the rotated domain (the query is rotated once, the context un-rotated once). A sequence with no
rows gets a zero context. Tiers are the names of :mod:`kvstore.tiers`.

Backends (see :mod:`kvstore.gpu.registry`: :func:`get_backend` for a device, :func:`select` for a
tier on a device, the one place the engine's caches and the benchmarks choose a decode function):

- ``cuda``: tensor-core split-T kernels compiled with NVRTC through cupy (sm_89+), fp8 and int4;
- ``mps``: the torch implementation on Apple's Metal (untested here, see docs/GPU.md);
- ``torch``: every tier (f32, bf16, fp8, int4, polar2..6, q8), decode + matmul with torch ops.

:mod:`kvstore.gpu.codecs` holds the torch twins of the ``kvstore.formats`` codecs (one rotation,
one fp8 sanitize, one dequantizer per tier). Importing this package needs numpy and torch only;
cupy is imported when the CUDA backend is used.

Examples
--------
>>> import torch
>>> from kvstore import gpu
>>> from kvstore.gpu.testing import make_case
>>> case = make_case("fp8", [5, 3], heads=2, kv_lora=64, qk_rope=32, seed=1)
>>> out = gpu.mla_decode_fp8(*case.args())
>>> tuple(out.shape), out.dtype
((2, 2, 64), torch.float32)
"""

from __future__ import annotations

from kvstore.gpu.errors import AttentionInputError, BackendUnavailable
from kvstore.gpu.registry import (
    AttentionBackend,
    BackendSpec,
    Selection,
    get_backend,
    reasons,
    register_backend,
    registered,
    select,
)
from kvstore.gpu.upload import PinnedUploader, QuantizedRows, restore_quantized_rows

__all__ = [
    "AttentionBackend",
    "AttentionInputError",
    "BackendSpec",
    "BackendUnavailable",
    "PinnedUploader",
    "QuantizedRows",
    "Selection",
    "get_backend",
    "mla_decode_fp8",
    "mla_decode_fp8_selected",
    "mla_decode_int4",
    "mla_decode_int4_selected",
    "reasons",
    "register_backend",
    "registered",
    "restore_quantized_rows",
    "select",
]


def mla_decode_fp8(
    q_lat,
    q_rope,
    lc_codes,
    lc_scales,
    rc_codes,
    rc_scales,
    seq_start,
    seq_len,
    softmax_scale,
    out=None,
    *,
    validate=True,
):
    """Decode attention over an fp8 e4m3 latent cache, on the backend of the query's device.

    Parameters
    ----------
    q_lat : f32[B, H, K]
        Absorbed queries (``q_nope @ W_UK``), K = kv_lora.
    q_rope : f32[B, H, R]
        Rope queries, R = qk_rope.
    lc_codes : u8[N, K];  lc_scales : f32[N]
        Latent rows: e4m3 codes and one scale per row.
    rc_codes : u8[N, R];  rc_scales : f32[N]
        Rope-key rows.
    seq_start, seq_len : i32[B]
        Rows of each sequence (on the query's device or the CPU; ragged batches allowed).
    softmax_scale : float
    out : f32[B, H, K], optional
        Written in place and returned.
    validate : bool
        Check that every sequence lies within the N rows (one host synchronization on a GPU).

    Returns
    -------
    f32[B, H, K]
    """
    return get_backend(q_lat.device).mla_decode_fp8(
        q_lat,
        q_rope,
        lc_codes,
        lc_scales,
        rc_codes,
        rc_scales,
        seq_start,
        seq_len,
        softmax_scale,
        out,
        validate=validate,
    )


def mla_decode_int4(
    q_lat, q_rope, lc_codes, lc_radii, rc_codes, rc_radii, seq_start, seq_len, softmax_scale, out=None, *, validate=True
):
    """Decode attention over an ``int4`` (rotated int4, TQ codec 1) latent cache.

    Parameters
    ----------
    q_lat : f32[B, H, K];  q_rope : f32[B, H, R]  (K, R powers of two)
    lc_codes : u8[N, K/2];  lc_radii : f32[N]
        Packed 4-bit codes (element 2i in the low nibble of byte i) and row radii.
    rc_codes : u8[N, R/2];  rc_radii : f32[N]
    seq_start, seq_len : i32[B]
    softmax_scale : float
    out : f32[B, H, K], optional
    validate : bool

    Returns
    -------
    f32[B, H, K]
        The context in the original (un-rotated) latent space.
    """
    return get_backend(q_lat.device).mla_decode_int4(
        q_lat, q_rope, lc_codes, lc_radii, rc_codes, rc_radii, seq_start, seq_len, softmax_scale, out, validate=validate
    )


def mla_decode_fp8_selected(
    q_lat,
    q_rope,
    lc_codes,
    lc_scales,
    rc_codes,
    rc_scales,
    seq_start,
    seq_len,
    indices,
    n_selected,
    softmax_scale,
    out=None,
    *,
    validate=True,
):
    """fp8 decode attention over selected rows (sparse-attention selections).

    Parameters
    ----------
    indices : i32[B, S]
        Row indices relative to each sequence's start; entries ``j < n_selected[b]`` are attended.
    n_selected : i32[B]
        Selected entries per sequence (0..S).
    Other parameters as :func:`mla_decode_fp8`; ``validate`` also checks every used index lies in
    ``0 .. seq_len[b] - 1``.

    Returns
    -------
    f32[B, H, K]
    """
    return get_backend(q_lat.device).mla_decode_fp8_selected(
        q_lat,
        q_rope,
        lc_codes,
        lc_scales,
        rc_codes,
        rc_scales,
        seq_start,
        seq_len,
        indices,
        n_selected,
        softmax_scale,
        out,
        validate=validate,
    )


def mla_decode_int4_selected(
    q_lat,
    q_rope,
    lc_codes,
    lc_radii,
    rc_codes,
    rc_radii,
    seq_start,
    seq_len,
    indices,
    n_selected,
    softmax_scale,
    out=None,
    *,
    validate=True,
):
    """Rotated-int4 decode attention over selected rows; parameters as :func:`mla_decode_fp8_selected`.

    Returns
    -------
    f32[B, H, K]
    """
    return get_backend(q_lat.device).mla_decode_int4_selected(
        q_lat,
        q_rope,
        lc_codes,
        lc_radii,
        rc_codes,
        rc_radii,
        seq_start,
        seq_len,
        indices,
        n_selected,
        softmax_scale,
        out,
        validate=validate,
    )
