"""The TQ randomized Hadamard rotation (FORMAT.md section 5) on torch tensors, any device.

``rotate(x) = FWHT(x * sign) / sqrt(n)`` and ``unrotate(y) = FWHT(y) / sqrt(n) * sign``, with the
sign vector of :func:`kvstore.formats.tq.signs`. The transform is orthonormal and symmetric, so
``q . unrotate(y) = rotate(q) . y``: queries are rotated once and rows stay in the rotated domain.

Examples
--------
>>> import torch
>>> x = torch.tensor([3.0, -4.0, 0.0, 0.0])
>>> rotate(x).tolist()
[-3.5, 0.5, -3.5, 0.5]
>>> torch.allclose(unrotate(rotate(x)), x)
True
"""

from __future__ import annotations

import functools
import math

import torch

from kvstore.formats import tq

__all__ = ["fwht", "rotate", "sign_vector", "unrotate"]


@functools.lru_cache(maxsize=32)
def _signs_cpu(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(tq.signs(n).copy()).to(dtype)


def sign_vector(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotation's +-1 sign vector of width ``n``.

    Returns
    -------
    dtype[n] on ``device``
    """
    return _signs_cpu(int(n), dtype).to(device)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalized fast Walsh-Hadamard transform along the last axis (butterflies in the spec's order).

    Parameters
    ----------
    x : float[..., n], n a power of two

    Returns
    -------
    float[..., n] (a new tensor)
    """
    n = x.shape[-1]
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    span = 1
    while span < n:
        pairs = y.reshape(y.shape[0], n // (2 * span), 2, span)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2).reshape(-1, n)
        span *= 2
    return (y * (1.0 / math.sqrt(n))).reshape(*lead, n)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``FWHT(x * sign)``, normalized; ``x`` float[..., n]."""
    return fwht(x * sign_vector(x.shape[-1], x.dtype, x.device))


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """``FWHT(y) * sign``, normalized; the inverse of :func:`rotate`."""
    return fwht(y) * sign_vector(y.shape[-1], y.dtype, y.device)
