"""The operands of one decode-attention call as one object: :class:`LatentBatch`, checked once.

A batch holds what the queries attend — a tier's latent and rope rows, the rows of each sequence
and, optionally, the rows each query selects — and the geometry they imply. Every backend has one
entry point, ``decode(q_lat, q_rope, batch, softmax_scale, out=None)``
(:meth:`kvstore.gpu.registry.AttentionBackend.decode`), which takes it.

Three levels of checking, each asked for explicitly:

- ``LatentBatch(...)`` checks shapes, dtypes and devices when it is made (metadata only: nothing is
  read back from a device), and each call on it checks the queries, the scale and ``out`` against
  it (:meth:`LatentBatch.check_call`);
- :meth:`LatentBatch.check_ranges` also checks that every sequence lies inside the row arrays and
  every selected index inside its sequence; it reads the bounds, one device-to-host
  synchronization when they live on a GPU (the CUDA kernels never read outside the row arrays
  either way: rows outside them are skipped);
- :meth:`LatentBatch.trusted` checks nothing, for callers that built the operands themselves (the
  engine's caches, calls captured in a CUDA graph): a plain call then costs the backend's work and
  nothing else.

Examples
--------
>>> import torch
>>> rows = torch.zeros(10, 64, dtype=torch.uint8), torch.ones(10), torch.zeros(10, 32, dtype=torch.uint8), torch.ones(10)
>>> bounds = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([4, 6], dtype=torch.int32)
>>> batch = LatentBatch("fp8", *rows, *bounds, kv_lora=64, qk_rope=32).check_ranges()
>>> batch
LatentBatch(fp8, B=2, N=10, K=64, R=32, on cpu)
>>> LatentBatch("int4", *rows, *bounds, kv_lora=64, qk_rope=32)
Traceback (most recent call last):
...
kvstore.gpu.errors.AttentionInputError: lc_codes must be u8[N, 32] for int4, got uint8[10, 64] on cpu
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from kvstore import tiers
from kvstore.gpu import codecs
from kvstore.gpu.errors import AttentionInputError

__all__ = ["LatentBatch", "RowLayout", "as_tier", "row_layout"]


@dataclass(frozen=True)
class RowLayout:
    """How one row of a tier reaches a decode function: its values/codes, and its scale part."""

    codes_dtype: torch.dtype
    code_width: int
    scales_dtype: torch.dtype | None  # None: the tier has no scales (f32, bf16)
    scales_shape: tuple[int, ...]  # trailing shape of one row's scales: () or (width // 32,)


_SHORT = {torch.uint8: "u8", torch.int8: "i8", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def _short(dtype) -> str:
    return _SHORT.get(dtype) or str(dtype).replace("torch.", "")


def row_layout(tier: tiers.Tier, width: int) -> RowLayout:
    """The operand layout of rows of ``width`` values in ``tier``: the dtypes of its torch twin
    (:func:`kvstore.gpu.codecs.torch_twin`), the sizes of its row codec (``Tier.row_codec``)."""
    twin, codec = codecs.torch_twin(tier), tier.row_codec
    return RowLayout(twin.codes_dtype, codec.code_width(width), twin.scales_dtype, codec.scale_shape(width))


def _need(cond: bool, reason: str | Callable[[], str]) -> None:
    # A message that formats tensors is passed as a lambda: formatted only when the check fails,
    # so a checked call pays for comparisons, not for strings.
    if not cond:
        raise AttentionInputError(reason() if callable(reason) else reason)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)} on {t.device}"


def _tensor(name: str, t, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """``t`` itself once it is a tensor of ``dtype`` with ``ndim`` dimensions."""
    _need(isinstance(t, torch.Tensor), lambda: f"{name} must be a torch tensor, got {_describe(t)}")
    _need(t.dtype == dtype, lambda: f"{name} must be {str(dtype).replace('torch.', '')}, got {_describe(t)}")
    _need(t.dim() == ndim, lambda: f"{name} must have {ndim} dimensions, got {_describe(t)}")
    return t


def _bounds(name: str, t, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``t`` once it is i32 of ``shape`` (-1: any size) on ``device`` or the CPU."""
    t = _tensor(name, t, torch.int32, len(shape))
    spelled = ", ".join("S" if n < 0 else str(n) for n in shape)
    _need(
        all(n < 0 or n == m for n, m in zip(shape, t.shape)),
        lambda: f"{name} must be i32[{spelled}], got {_describe(t)}",
    )
    _need(
        t.device == device or t.device.type == "cpu", lambda: f"{name} must be on {device} or the CPU, got {t.device}"
    )
    return t


def _check_rows(
    tier: tiers.Tier, prefix: str, codes, scales, width: int, n_rows: int | None = None, device=None
) -> tuple[int, torch.device]:
    """Check one part of the rows (``lc`` or ``rc``): its codes or values, then its scales; returns
    (rows, device), which the other part is held to (the first part's own when not given)."""
    layout = row_layout(tier, width)
    values = _tensor(f"{prefix}_codes", codes, layout.codes_dtype, 2)
    n_rows = values.shape[0] if n_rows is None else n_rows
    device = values.device if device is None else device
    _need(
        values.shape[1] == layout.code_width,
        lambda: (
            f"{prefix}_codes must be {_short(layout.codes_dtype)}[N, {layout.code_width}] for {tier.name}, "
            f"got {_describe(values)}"
        ),
    )
    _need(values.shape[0] == n_rows, lambda: f"{prefix}_codes has {values.shape[0]} rows, lc_codes {n_rows}")
    _need(values.device == device, lambda: f"{prefix}_codes is on {values.device}, lc_codes on {device}")
    if layout.scales_dtype is None:
        _need(scales is None, lambda: f"{tier.name} rows have no scales, got {prefix}_scales {_describe(scales)}")
        return n_rows, device
    part = _tensor(f"{prefix}_scales", scales, layout.scales_dtype, 1 + len(layout.scales_shape))
    _need(
        tuple(part.shape[1:]) == layout.scales_shape,
        lambda: (
            f"{prefix}_scales must be {_short(layout.scales_dtype)}[N{''.join(f', {d}' for d in layout.scales_shape)}] "
            f"for {tier.name}, got {_describe(part)}"
        ),
    )
    _need(part.shape[0] == n_rows, lambda: f"{prefix}_scales has {part.shape[0]} rows, lc_codes {n_rows}")
    _need(part.device == device, lambda: f"{prefix}_scales is on {part.device}, lc_codes on {device}")
    return n_rows, device


def as_tier(tier: tiers.Tier | str) -> tiers.Tier:
    """The tier of a Tier or a name; a name that is no tier is an AttentionInputError."""
    if isinstance(tier, tiers.Tier):
        return tier
    try:
        return tiers.parse(tier)
    except tiers.UnknownTier as exc:
        raise AttentionInputError(exc.reason) from None


class LatentBatch:
    """The cache operands of one decode-attention call and the geometry they imply.

    For each query ``b`` (one token of a sequence): the rows ``seq_start[b] .. seq_start[b] +
    seq_len[b] - 1`` of the row arrays or, with ``indices``, the ``n_selected[b]`` rows
    ``seq_start[b] + indices[b, :n_selected[b]]``. Made this way, the operands are checked (shapes,
    dtypes, devices; nothing is read back from a device); :meth:`trusted` makes one unchecked.
    Treat a batch as read-only: a call reads whatever its tensors hold when it runs.

    Parameters
    ----------
    tier : a ``kvstore.tiers.Tier`` or its name
    lc_codes : the latent rows as :func:`row_layout` says: f32[N, K] (f32), bf16[N, K] (bf16),
        u8[N, K] (fp8), u8[N, rb(K)] (int4, polarB: the tier's ``payload_bytes``), i8[N, K] (q8)
    lc_scales : f32[N] (fp8 scales, TQ radii), f16[N, K/32] (q8 deltas), None (f32, bf16)
    rc_codes, rc_scales : the rope rows, the same with R
    seq_start, seq_len : i32[B], on the rows' device or on the CPU
    kv_lora, qk_rope : K and R, the values in a latent row and in a rope row
    indices : i32[B, S], optional
        Rows relative to each sequence's start; entries ``j < n_selected[b]`` are attended.
    n_selected : i32[B], with ``indices``

    Attributes
    ----------
    tier : the ``kvstore.tiers.Tier``
    lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len, indices, n_selected, kv_lora,
    qk_rope : the parameters
    batch_size, n_rows, selected : B, N, and S (None without ``indices``), read from the operands
    device : the rows' device
    checked : True for a checked batch: calls on it check the queries, scale and ``out`` too
    operands : (lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len, indices, n_selected),
        the order the kernels take them in

    Raises
    ------
    AttentionInputError
        With the first problem found.
    """

    # The operands are kept as the one tuple the kernels' signature reads and the geometry is read
    # from them when asked: a trusted batch, made once per layer and step, sets five fields.
    __slots__ = ("tier", "operands", "kv_lora", "qk_rope", "checked")
    tier: tiers.Tier
    operands: tuple[
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor | None,
    ]
    kv_lora: int
    qk_rope: int
    checked: bool

    def __init__(
        self,
        tier: tiers.Tier | str,
        lc_codes: torch.Tensor,
        lc_scales: torch.Tensor | None,
        rc_codes: torch.Tensor,
        rc_scales: torch.Tensor | None,
        seq_start: torch.Tensor,
        seq_len: torch.Tensor,
        *,
        kv_lora: int,
        qk_rope: int,
        indices: torch.Tensor | None = None,
        n_selected: torch.Tensor | None = None,
    ):
        tier = as_tier(tier)
        for name, width in (("kv_lora", kv_lora), ("qk_rope", qk_rope)):
            _need(isinstance(width, int) and width >= 1, lambda: f"{name} must be a positive int, got {width!r}")
            problem = tier.width_problem(width)
            _need(problem is None, lambda: f"{name}: {problem}")
        n_rows, device = _check_rows(tier, "lc", lc_codes, lc_scales, kv_lora)
        _check_rows(tier, "rc", rc_codes, rc_scales, qk_rope, n_rows, device)
        # seq_len first: its length is the batch's, which the other bounds are held to
        seq_len = _bounds("seq_len", seq_len, (-1,), device)
        batch_size = seq_len.shape[0]
        _need(batch_size >= 1, "seq_len must hold one length per query, got none")
        seq_start = _bounds("seq_start", seq_start, (batch_size,), device)
        if indices is not None or n_selected is not None:
            indices = _bounds("indices", indices, (batch_size, -1), device)
            n_selected = _bounds("n_selected", n_selected, (batch_size,), device)
        self.tier, self.kv_lora, self.qk_rope, self.checked = tier, kv_lora, qk_rope, True
        self.operands = (lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len, indices, n_selected)

    @classmethod
    def trusted(
        cls,
        tier: tiers.Tier,
        lc_codes: torch.Tensor,
        lc_scales: torch.Tensor | None,
        rc_codes: torch.Tensor,
        rc_scales: torch.Tensor | None,
        seq_start: torch.Tensor,
        seq_len: torch.Tensor,
        *,
        kv_lora: int,
        qk_rope: int,
        indices: torch.Tensor | None = None,
        n_selected: torch.Tensor | None = None,
    ) -> LatentBatch:
        """A batch of operands the caller vouches for, checked not at all (parameters as the class's;
        ``tier`` a ``kvstore.tiers.Tier``).

        For callers that build the operands themselves — the engine's caches, once per layer and
        step, and calls captured in a CUDA graph — where the checks would be repeated work on the
        hot path. Calls on it check nothing either: wrong shapes here are undefined behaviour, not an
        :class:`AttentionInputError`.
        """
        batch = cls.__new__(cls)
        batch.tier, batch.kv_lora, batch.qk_rope, batch.checked = tier, kv_lora, qk_rope, False
        batch.operands = (lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len, indices, n_selected)
        return batch

    @property
    def lc_codes(self) -> torch.Tensor:
        return self.operands[0]

    @property
    def lc_scales(self) -> torch.Tensor | None:
        return self.operands[1]

    @property
    def rc_codes(self) -> torch.Tensor:
        return self.operands[2]

    @property
    def rc_scales(self) -> torch.Tensor | None:
        return self.operands[3]

    @property
    def seq_start(self) -> torch.Tensor:
        return self.operands[4]

    @property
    def seq_len(self) -> torch.Tensor:
        return self.operands[5]

    @property
    def indices(self) -> torch.Tensor | None:
        return self.operands[6]

    @property
    def n_selected(self) -> torch.Tensor | None:
        return self.operands[7]

    @property
    def batch_size(self) -> int:
        """B, the sequences (one query each)."""
        return self.operands[5].shape[0]

    @property
    def n_rows(self) -> int:
        """N, the rows of the row arrays."""
        return self.operands[0].shape[0]

    @property
    def selected(self) -> int | None:
        """S, the index columns of selected rows; None for dense attention."""
        indices = self.operands[6]
        return None if indices is None else indices.shape[1]

    @property
    def device(self) -> torch.device:
        """The rows' device."""
        return self.operands[0].device

    def __repr__(self) -> str:
        selected = "" if self.selected is None else f", S={self.selected}"
        return (
            f"LatentBatch({self.tier.name}, B={self.batch_size}, N={self.n_rows}, K={self.kv_lora}, "
            f"R={self.qk_rope}{selected}, on {self.device}{'' if self.checked else ', trusted'})"
        )

    def check_ranges(self) -> LatentBatch:
        """Check that every sequence lies inside the row arrays and every selected index inside its
        sequence; returns the batch.

        Reads the values (one synchronization when they are on a GPU).

        Raises
        ------
        AttentionInputError
        """
        start = self.seq_start.to(torch.int64)
        length = self.seq_len.to(torch.int64)
        problems = torch.stack(
            [
                (length < 0).any(),
                (start < 0).any(),
                (start + length > self.n_rows).any(),
            ]
        )
        indices, n_selected = self.indices, self.n_selected
        if indices is not None and n_selected is not None:
            n_sel = n_selected.to(device=indices.device, dtype=torch.int64)
            columns = torch.arange(indices.shape[1], device=indices.device)
            used = columns[None, :] < n_sel[:, None]
            limit = length.to(indices.device)[:, None]
            bad_index = used & ((indices < 0) | (indices.to(torch.int64) >= limit))
            problems = torch.cat(
                [
                    problems.to(indices.device),
                    torch.stack([((n_sel < 0) | (n_sel > indices.shape[1])).any(), bad_index.any()]),
                ]
            )
        flags = problems.cpu().tolist()
        _need(not flags[0], "seq_len holds a negative length")
        _need(not flags[1], "seq_start holds a negative row")
        _need(not flags[2], lambda: f"a sequence runs past the {self.n_rows} cache rows (seq_start + seq_len > N)")
        if indices is not None:
            _need(not flags[3], lambda: f"n_selected must lie in 0..{indices.shape[1]}")
            _need(not flags[4], "indices hold a row outside its sequence (each must be in 0..seq_len-1)")
        return self

    def check_call(self, q_lat, q_rope, softmax_scale, out=None) -> None:
        """Check one call's queries, scale and output against the batch (what a backend's ``decode``
        does first on a checked batch).

        Parameters
        ----------
        q_lat : f32[B, H, K] on the rows' device;  q_rope : f32[B, H, R] there
        softmax_scale : finite float
        out : contiguous f32[B, H, K] on the rows' device, optional

        Raises
        ------
        AttentionInputError
        """
        q_lat = _tensor("q_lat", q_lat, torch.float32, 3)
        q_rope = _tensor("q_rope", q_rope, torch.float32, 3)
        _need(
            q_rope.shape[:2] == q_lat.shape[:2],
            lambda: f"q_rope {_describe(q_rope)} does not match q_lat {_describe(q_lat)}",
        )
        batch_size, heads, device = self.batch_size, q_lat.shape[1], self.device
        _need(heads >= 1, lambda: f"empty query {_describe(q_lat)}")
        for name, q, width in (("q_lat", q_lat, self.kv_lora), ("q_rope", q_rope, self.qk_rope)):
            _need(
                q.shape[0] == batch_size and q.shape[2] == width,
                lambda: f"{name} must be f32[{batch_size}, H, {width}] for this batch, got {_describe(q)}",
            )
            _need(q.device == device, lambda: f"{name} is on {q.device}, the rows on {device}")
        _need(
            isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale),
            lambda: f"softmax_scale must be a finite float, got {softmax_scale!r}",
        )
        if out is not None:
            _need(
                isinstance(out, torch.Tensor)
                and out.dtype == torch.float32
                and tuple(out.shape) == (batch_size, heads, self.kv_lora)
                and out.device == device
                and out.is_contiguous(),
                lambda: (
                    f"out must be a contiguous f32[{batch_size}, {heads}, {self.kv_lora}] on {device}, "
                    f"got {_describe(out)}"
                ),
            )

    def output(self, out: torch.Tensor | None, heads: int) -> torch.Tensor:
        """``out`` itself, or a new f32[B, ``heads``, K] on the rows' device."""
        if out is None:
            return torch.empty((self.batch_size, heads, self.kv_lora), dtype=torch.float32, device=self.device)
        return out
