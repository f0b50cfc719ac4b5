"""What the torch codecs share: small per-device tables built once, and exact f32 helpers.

(:mod:`kvstore.gpu.codecs` and :mod:`kvstore.gpu.tq_codecs` use them; nothing else should.)
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import numpy as np
import torch

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
