"""What the torch codecs share: small per-device tables built once, and exact f32 helpers.

(:mod:`kvstore.gpu.codecs`, :mod:`kvstore.gpu.tq_codecs` and :mod:`kvstore.gpu.encode_kernels` use
them; nothing else should.)
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import numpy as np
import torch

from kvstore.formats import fp8

# e4m3 from the bits of an f32 value (docs/FORMAT.md section 3), as kvstore.gpu.codecs.fp8_encode and
# the encode kernel (kvstore.gpu.encode_kernels) compute it
F32_NAN_BITS = 0x7F800000  # magnitudes above this are NaN (IEEE 754)
F32_448_BITS = int(np.float32(fp8.MAX).view(np.uint32))  # magnitudes at or above 448 saturate to 0x7E
F32_2POW_M6_BITS = int(np.float32(2.0**-6).view(np.uint32))  # below 2^-6 the e4m3 grid is subnormal
E4M3_REBIAS = (127 - 7) << 3  # f32 exponent bias -> e4m3 bias, in (exp << 3 | mant) units
E4M3_ANCHOR = 16384.0  # 2^14: its f32 ulp is 2^-9, the e4m3 subnormal step
E4M3_ANCHOR_BITS = int(np.float32(E4M3_ANCHOR).view(np.uint32))

# Small per-device tables (LUT, sign vectors, level tables), built once per (kind, width, device).
_tables: dict[tuple, Any] = {}
T = TypeVar("T")


def _device_key(device: torch.device) -> tuple[str, int | None]:
    return device.type, device.index


def device_table(key: tuple, device: torch.device, build: Callable[[], T]) -> T:
    full = (*key, *_device_key(device))
    value = _tables.get(full)
    if value is None:
        value = build()
        _tables[full] = value
    return value


def device_tensor(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array))  # a writable copy: the format's tables are read-only
    return tensor.to(device=device, dtype=dtype) if dtype is not None else tensor.to(device)


def f32_quotient(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """The correctly rounded f32 quotient ``a / b`` of f32 values (tensors or floats, one a tensor),
    also inside ``torch.compile``: there a float division becomes a multiply by a reciprocal (divisor
    constant) or triton's approximate ``div.full.f32`` (2 ulp), either of which moves a scale's last
    bit off the format's. In f64 and rounded once to f32 the result is exact: an f32 quotient is
    never within f64 precision of an f32 rounding midpoint, so the double rounding cannot differ."""
    if isinstance(a, torch.Tensor):
        return (a.double() / (b.double() if isinstance(b, torch.Tensor) else float(b))).float()
    if isinstance(b, torch.Tensor):
        return (float(a) / b.double()).float()
    raise TypeError("f32_quotient divides tensors: one operand must be a tensor")


def fill_where(t: torch.Tensor, mask: torch.Tensor, value: float) -> None:
    """``t[mask] = value`` in place. On the CPU skipped when nothing matches — the common case, as
    no encoder writes what sanitizing clears, and CPU ``masked_fill_`` is slow; on a device always,
    since asking would stall the pipeline on a device-to-host sync."""
    if t.device.type != "cpu" or bool(mask.any()):
        t.masked_fill_(mask, value)
