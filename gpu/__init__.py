"""Device backends for absorbed MLA decode attention over quantized latent caches.

For each query token ``b`` (a sequence owning cache rows ``seq_start[b] .. seq_start[b] +
seq_len[b] - 1``) and head ``h``::

    s[n]   = softmax_scale * (q_lat[b,h] . (lut[Lc[n]] * Ls[n]) + q_rope[b,h] . (lut[Rc[n]] * Rs[n]))
    out[b,h] = softmax(s) @ (lut[Lc] * Ls)                                      f32[kv_lora]

``lut`` is the fp8 e4m3 decode (NaN codes read as 0) for the ``fp8`` tier; for the ``int4`` tier
(rotated int4, TQ codec 1) a row is ``unrotate(level[c] * radius / sqrtf(n))`` and the kernels work
in the rotated domain (the query is rotated once, the context un-rotated once). A sequence with no
rows gets a zero context. Tiers are the names of :mod:`kvstore.tiers`.

The operands of a call travel as one :class:`LatentBatch` (:mod:`kvstore.gpu.inputs`): the rows
of a tier, the sequences, optionally the selected rows, checked once when it is made
(:meth:`LatentBatch.trusted` makes one unchecked, for the engine's own caches and captured calls;
:meth:`LatentBatch.check_ranges` reads the bounds, one host synchronization). Every backend has
one entry point, ``decode(q_lat, q_rope, batch, softmax_scale, out=None)``; :func:`decode` calls
the preferred backend of the query's device, :func:`select` (:mod:`kvstore.gpu.registry`) chooses
the backend for a tier on a device once and holds its entry point in ``Selection.function``, the
one place the engine's caches and the benchmarks choose. Backends:

- ``cuda``: tensor-core split-T kernels compiled with NVRTC through cupy (sm_89+), fp8 and int4;
- ``triton``: split-T Triton kernels for f32 and bf16 rows on CUDA;
- ``mps``: the torch implementation on Apple's Metal (untested here, see docs/GPU.md);
- ``torch``: every tier (f32, bf16, fp8, int4, polar2..6, q8), decode + matmul with torch ops.

A backend runs any batch: what its kernels lack goes through the torch path.
:mod:`kvstore.gpu.codecs` holds the torch twins of the ``kvstore.formats`` codecs (one rotation,
one fp8 sanitize, one dequantizer per tier). Importing this package needs numpy and torch only;
cupy is imported when the CUDA backend is used.

Examples
--------
>>> import torch
>>> from kvstore import gpu
>>> from kvstore.gpu.testing import make_case
>>> case = make_case("fp8", [5, 3], heads=2, kv_lora=64, qk_rope=32, seed=1)
>>> batch = gpu.LatentBatch(
...     "fp8", case.lc_codes, case.lc_scales, case.rc_codes, case.rc_scales, case.seq_start, case.seq_len,
...     kv_lora=64, qk_rope=32,
... ).check_ranges()
>>> out = gpu.decode(case.q_lat, case.q_rope, batch, case.softmax_scale)
>>> tuple(out.shape), out.dtype
((2, 2, 64), torch.float32)
>>> choice = gpu.select("fp8", "cpu", kv_lora=64, qk_rope=32)
>>> torch.equal(choice.function(case.q_lat, case.q_rope, batch, case.softmax_scale), out)
True
"""

from __future__ import annotations

import torch

from kvstore.gpu.errors import AttentionInputError, BackendUnavailable
from kvstore.gpu.inputs import LatentBatch
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
    "LatentBatch",
    "PinnedUploader",
    "QuantizedRows",
    "Selection",
    "decode",
    "get_backend",
    "reasons",
    "register_backend",
    "registered",
    "restore_quantized_rows",
    "select",
]


def decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    batch: LatentBatch,
    softmax_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over ``batch`` on the preferred backend of the query's device
    (:meth:`AttentionBackend.decode`; to choose the backend for a tier once, :func:`select`).

    Parameters
    ----------
    q_lat : f32[B, H, K];  q_rope : f32[B, H, R]
    batch : LatentBatch
    softmax_scale : float
    out : f32[B, H, K], optional

    Returns
    -------
    f32[B, H, K]
    """
    return get_backend(q_lat.device).decode(q_lat, q_rope, batch, softmax_scale, out)
