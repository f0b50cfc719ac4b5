"""Absorbed MLA decode attention over cached latent rows, one function per cache tier.

Every function computes, for each query ``b`` (one token of a sequence whose rows are
``seq_start[b] .. seq_start[b] + seq_len[b] - 1`` of the row arrays)::

    p   = softmax(softmax_scale * (q_lat[b] . Lc[n] + q_rope[b] . Rc[n]))   per head
    ctx = sum_n p[n] * Lc[n]                                                 [H, kv_lora]

with the signature the CUDA kernels of ``kvstore.gpu`` share::

    mla_decode_fp8(q_lat f32[B,H,K], q_rope f32[B,H,R], lc_codes u8[N,K], lc_scales f32[N],
                   rc_codes u8[N,R], rc_scales f32[N], seq_start i32[B], seq_len i32[B],
                   softmax_scale, out=None) -> f32[B,H,K]
    mla_decode_int4(q_lat, q_rope, lc_codes u8[N,K/2], lc_radii f32[N], rc_codes u8[N,R/2],
                    rc_radii f32[N], seq_start, seq_len, softmax_scale, out=None) -> f32[B,H,K]

The torch implementations here run on any device. They stream the rows in chunks with an online
softmax, so memory stays bounded at any context length. TQ rows are attended in the rotated
domain: the rotation ``Q`` is orthogonal, so ``q . x = (Q q) . y`` and ``ctx = Q^T sum p y``; the
queries are rotated once and no row is ever un-rotated.

Which implementation a cache uses is decided in one place, :func:`select_decode`: a backend
declares the tiers and devices it supports as data and says why it cannot run a configuration;
``kvstore.gpu.get_backend(device)`` is consulted first on CUDA (imported lazily), then the torch
backend of this module.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvstore.engine import quant
from kvstore.engine.errors import CacheError, TierUnsupported

__all__ = [
    "DecodeBackend",
    "TORCH_BACKEND",
    "mla_decode_dense",
    "mla_decode_fp8",
    "mla_decode_int4",
    "mla_decode_polar",
    "mla_decode_q8",
    "select_decode",
]

# Rows per streamed chunk: bounds the dequantized rows and the score block held at once.
_CHUNK_ROWS = 8192


def _check_out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(like, dtype=torch.float32)
    if out.shape != like.shape or out.dtype != torch.float32 or out.device != like.device:
        raise CacheError(f"out must be f32{tuple(like.shape)} on {like.device}, got {out.dtype}{tuple(out.shape)}")
    return out


def _streamed(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    n_rows: int,
    rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    seq_start: torch.Tensor,
    seq_len: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Online-softmax attention over rows ``0 .. n_rows-1`` fetched chunk by chunk by ``rows``."""
    b, h, k = q_lat.shape
    dev = q_lat.device
    lo = seq_start.to(torch.int64)[:, None, None]
    hi = lo + seq_len.to(torch.int64)[:, None, None]
    running_max = torch.full((b, h, 1), float("-inf"), device=dev)
    denom = torch.zeros((b, h, 1), device=dev)
    acc = torch.zeros((b, h, k), device=dev)
    for a in range(0, n_rows, _CHUNK_ROWS):
        z = min(n_rows, a + _CHUNK_ROWS)
        lc, rc = rows(a, z)
        scores = (torch.matmul(q_lat, lc.T) + torch.matmul(q_rope, rc.T)) * softmax_scale  # [B, H, C]
        pos = torch.arange(a, z, device=dev)
        scores = scores.masked_fill((pos < lo) | (pos >= hi), float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        # A query with no visible row yet keeps max -inf: shift by 0 so exp() stays 0, not NaN.
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        weights = torch.exp(scores - shift)
        rescale = torch.exp(running_max - shift)
        denom = denom * rescale + weights.sum(dim=-1, keepdim=True)
        acc = acc * rescale + torch.matmul(weights, lc)
        running_max = new_max
    return acc / torch.where(denom > 0, denom, torch.ones_like(denom))


def mla_decode_dense(q_lat, q_rope, lc, rc, seq_start, seq_len, softmax_scale: float, out=None):
    """Decode attention over full-precision rows: lc f32/bf16[N, K], rc [N, R] -> f32[B, H, K]."""
    out = _check_out(out, q_lat)

    def rows(a: int, z: int):
        return lc[a:z].float(), rc[a:z].float()

    out.copy_(_streamed(q_lat.float(), q_rope.float(), lc.shape[0], rows, seq_start, seq_len, softmax_scale))
    return out


def mla_decode_fp8(q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len, softmax_scale: float, out=None):
    """Decode attention over fp8 rows (v2 codes + per-row scales) -> f32[B, H, K]."""
    out = _check_out(out, q_lat)

    def rows(a: int, z: int):
        return (
            quant.fp8_dequantize_rows(lc_codes[a:z], lc_scales[a:z]),
            quant.fp8_dequantize_rows(rc_codes[a:z], rc_scales[a:z]),
        )

    out.copy_(_streamed(q_lat.float(), q_rope.float(), lc_codes.shape[0], rows, seq_start, seq_len, softmax_scale))
    return out


def mla_decode_int4(q_lat, q_rope, lc_codes, lc_radii, rc_codes, rc_radii, seq_start, seq_len, softmax_scale: float, out=None):
    """Decode attention over rotated-int4 rows (v3 codec 1), in the rotated domain -> f32[B, H, K]."""
    out = _check_out(out, q_lat)

    def rows(a: int, z: int):
        return quant.int4_rotated_rows(lc_codes[a:z], lc_radii[a:z]), quant.int4_rotated_rows(rc_codes[a:z], rc_radii[a:z])

    ctx = _streamed(quant.tq_rotate(q_lat), quant.tq_rotate(q_rope), lc_codes.shape[0], rows, seq_start, seq_len, softmax_scale)
    out.copy_(quant.tq_unrotate(ctx))
    return out


def mla_decode_polar(q_lat, q_rope, lc_codes, lc_radii, rc_codes, rc_radii, seq_start, seq_len, softmax_scale: float, bits: int, out=None):
    """Decode attention over PolarQuant rows (v3 codec 0, ``bits``), in the rotated domain."""
    out = _check_out(out, q_lat)
    k, r = q_lat.shape[-1], q_rope.shape[-1]

    def rows(a: int, z: int):
        return (
            quant.polar_rotated_rows(lc_codes[a:z], lc_radii[a:z], k, bits),
            quant.polar_rotated_rows(rc_codes[a:z], rc_radii[a:z], r, bits),
        )

    ctx = _streamed(quant.tq_rotate(q_lat), quant.tq_rotate(q_rope), lc_codes.shape[0], rows, seq_start, seq_len, softmax_scale)
    out.copy_(quant.tq_unrotate(ctx))
    return out


def mla_decode_q8(q_lat, q_rope, lc_codes, lc_deltas, rc_codes, rc_deltas, seq_start, seq_len, softmax_scale: float, out=None):
    """Decode attention over Q8_0 rows (int8 codes, one f16 delta per 32 values)."""
    out = _check_out(out, q_lat)

    def rows(a: int, z: int):
        return (
            quant.q8_dequantize_blocks(lc_codes[a:z], lc_deltas[a:z]),
            quant.q8_dequantize_blocks(rc_codes[a:z], rc_deltas[a:z]),
        )

    out.copy_(_streamed(q_lat.float(), q_rope.float(), lc_codes.shape[0], rows, seq_start, seq_len, softmax_scale))
    return out


#: The decode function name a backend exports for each cache tier.
KERNEL_OF_TIER = {
    "f32": "mla_decode_dense",
    "bf16": "mla_decode_dense",
    "fp8": "mla_decode_fp8",
    "tq-int4": "mla_decode_int4",
    "tq-polar": "mla_decode_polar",
    "int8": "mla_decode_q8",
}


@dataclass(frozen=True)
class DecodeBackend:
    """A set of decode functions, with what it supports declared as data."""

    name: str
    device_types: frozenset[str]
    functions: dict[str, Callable] = field(default_factory=dict)  # kernel name -> function

    def why_not(self, tier: str, device: torch.device) -> list[str]:
        """Reasons this backend cannot run ``tier`` on ``device`` (empty: it can)."""
        reasons = []
        if device.type not in self.device_types:
            reasons.append(f"{self.name} runs on {sorted(self.device_types)}, not {device.type}")
        kernel = KERNEL_OF_TIER.get(tier)
        if kernel is None:
            reasons.append(f"unknown cache tier {tier!r}")
        elif kernel not in self.functions:
            reasons.append(f"{self.name} has no {kernel} for tier {tier}")
        return reasons


TORCH_BACKEND = DecodeBackend(
    name="torch",
    device_types=frozenset({"cpu", "cuda", "mps", "xpu"}),
    functions={
        "mla_decode_dense": mla_decode_dense,
        "mla_decode_fp8": mla_decode_fp8,
        "mla_decode_int4": mla_decode_int4,
        "mla_decode_polar": mla_decode_polar,
        "mla_decode_q8": mla_decode_q8,
    },
)


def _gpu_backend(device: torch.device, tier: str, kv_lora: int | None, qk_rope: int | None) -> tuple[DecodeBackend | None, str]:
    """The ``kvstore.gpu`` backend for ``device`` as a DecodeBackend, or None with the reason.

    ``kvstore.gpu.get_backend(device)`` picks the device's preferred backend; its ``why_not``
    (when it has one) says whether it runs this tier and geometry.
    """
    if device.type not in ("cuda", "mps"):
        return None, "kvstore.gpu is consulted for cuda and mps devices"
    try:
        from kvstore import gpu  # lazily: importing it may load compiled kernels
    except ImportError as exc:
        return None, f"kvstore.gpu unavailable ({exc})"
    get_backend = getattr(gpu, "get_backend", None)
    if not callable(get_backend):
        return None, "kvstore.gpu has no get_backend"
    try:
        backend = get_backend(device)
    except Exception as exc:  # no driver, no cupy, no kernel for this device: fall back, with the reason
        return None, f"kvstore.gpu.get_backend: {exc}"
    name = str(getattr(backend, "name", "kvstore.gpu"))
    why_not = getattr(backend, "why_not", None)
    if callable(why_not):
        try:
            reasons = why_not(device, tier=tier, kv_lora=kv_lora, qk_rope=qk_rope, q_dtype=torch.float32)
        except TypeError as exc:
            return None, f"kvstore.gpu {name}: why_not has an unexpected signature ({exc})"
        if reasons:
            return None, f"kvstore.gpu {name}: " + "; ".join(map(str, reasons))
    functions = {
        kernel: _trusted(getattr(backend, kernel))
        for kernel in set(KERNEL_OF_TIER.values())
        if callable(getattr(backend, kernel, None))
    }
    return DecodeBackend(name=f"kvstore.gpu:{name}", device_types=frozenset({device.type}), functions=functions), ""


def _trusted(kernel: Callable) -> Callable:
    """Bind ``validate=False`` where a kernel takes it: the cache builds its operands itself
    (sequence ranges within the rows it passes), and validation would cost a host sync per call."""
    try:
        takes_validate = "validate" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        takes_validate = False
    return functools.partial(kernel, validate=False) if takes_validate else kernel


@dataclass(frozen=True)
class DecodeChoice:
    """The function a cache tier decodes with, the backend it came from, and the ones passed over."""

    function: Callable
    backend: str
    rejected: tuple[str, ...] = ()


def select_decode(
    tier: str,
    device: torch.device | str,
    prefer: str | None = None,
    *,
    kv_lora: int | None = None,
    qk_rope: int | None = None,
) -> DecodeChoice:
    """Pick the decode function for ``tier`` on ``device``: kvstore.gpu first on cuda/mps, then torch.

    Parameters
    ----------
    tier : cache tier name (``f32``, ``bf16``, ``fp8``, ``tq-int4``, ``tq-polar``, ``int8``)
    device : torch device of the cache
    prefer : ``"torch"`` to skip the GPU kernels (parity tests, benchmarks against the fallback)
    kv_lora, qk_rope : the row widths, for backends that only run some geometries

    Raises
    ------
    TierUnsupported
        When no backend can run the tier, with every backend's reason.
    """
    device = torch.device(device)
    rejected: list[str] = []
    candidates: list[DecodeBackend] = []
    if prefer != "torch":
        gpu_backend, reason = _gpu_backend(device, tier, kv_lora, qk_rope)
        if gpu_backend is not None:
            candidates.append(gpu_backend)
        elif device.type in ("cuda", "mps"):
            rejected.append(reason)
    candidates.append(TORCH_BACKEND)
    for backend in candidates:
        reasons = backend.why_not(tier, device)
        if not reasons:
            return DecodeChoice(backend.functions[KERNEL_OF_TIER[tier]], backend.name, tuple(rejected))
        rejected.extend(reasons)
    raise TierUnsupported(f"no decode backend for tier {tier} on {device}: " + "; ".join(rejected))
