"""Pure-torch decode attention over every cache tier: the engine's path, the fallback without cupy, Metal.

For each query ``b`` (one token of a sequence whose rows are ``seq_start[b] .. seq_start[b] +
seq_len[b] - 1`` of the row arrays, or the ``n_selected[b]`` rows ``indices[b]`` picks there)::

    p   = softmax(softmax_scale * (q_lat[b] . Lc[n] + q_rope[b] . Rc[n]))   per head
    ctx = sum_n p[n] * Lc[n]                                                 [H, kv_lora]

Rows are decoded chunk by chunk by the tier's codec of :mod:`kvstore.gpu.codecs` and attended with
one online softmax (:func:`_online_softmax`), so memory stays bounded at any context length; the
queries of a batch share the same matrix products, with the rows a query may not see masked — or,
when their bounds are on the host and each reads rows of its own (a batched decode over many
sessions), they go in groups of similar lengths, each query over its own rows gathered, so one long
session does not make every query of the batch read its span — and no value is read back to the host (the engine calls this on CUDA for the tiers the kernels lack).
TQ rows are attended in the rotated domain: the rotation ``Q`` is orthogonal, so ``q . x = (Q q) .
y`` and ``ctx = Q^T sum p y``; the queries are rotated once and no row is ever un-rotated. f32
throughout; the same code runs on ``cpu``, ``cuda``, ``mps`` and ``xpu`` (no float64, no custom
kernels).

The Metal backend (:class:`MpsBackend`) is this implementation on torch's ``mps`` device, chosen
automatically on Apple hardware. It cannot be exercised on the Linux machines this project is
tested on: the tests cover everything up to the device call (the same code on the CPU, and the
backend's reasons when ``mps`` is absent).
"""

from __future__ import annotations

from typing import Callable

import torch

from kvstore import tiers
from kvstore.gpu import codecs
from kvstore.gpu.inputs import LatentBatch
from kvstore.gpu.registry import AttentionBackend, spec_of

__all__ = ["CHUNK_ROWS", "ONE_PASS_ELEMENTS", "SPLIT_ROWS", "MpsBackend", "TorchBackend", "decode_torch"]

#: Rows decoded per step (fewer when the batch is wide: see :data:`SCORE_ELEMENTS`).
CHUNK_ROWS = 8192
#: Most f32 elements of one step's scores ([B, H, rows]) or per-query gathered rows ([B, rows, K + R]).
SCORE_ELEMENTS = 1 << 24
#: Most f32 scores ([B, H, rows]) the one-pass f32 path on CUDA materializes (256 MiB).
ONE_PASS_ELEMENTS = 1 << 26

# (lc rows, rc rows, hidden) of columns a..z: rows [C, w] shared by every query or [B, C, w] per
# query, and a mask broadcastable to [B, H, C] of the columns a query may not see.
Chunk = Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _online_softmax(
    q_lat: torch.Tensor, q_rope: torch.Tensor, n_cols: int, chunk: Chunk, step: int, softmax_scale: float
) -> torch.Tensor:
    """Streamed softmax attention of queries f32[B, H, K] / f32[B, H, R] over ``n_cols`` columns.

    Returns f32[B, H, K]; a query that sees no column gets zeros.
    """
    b, h, k = q_lat.shape
    dev = q_lat.device
    running_max = torch.full((b, h, 1), float("-inf"), device=dev)
    denom = torch.zeros((b, h, 1), device=dev)
    acc = torch.zeros((b, h, k), device=dev)
    for a in range(0, n_cols, step):
        lat, rope, hidden = chunk(a, min(n_cols, a + step))
        scores = (torch.matmul(q_lat, lat.mT) + torch.matmul(q_rope, rope.mT)) * softmax_scale  # [B, H, C]
        scores = scores.masked_fill(hidden, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        # A query with no visible row yet keeps max -inf: shift by 0 so exp() stays 0, not NaN.
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        weights = torch.exp(scores - shift)
        rescale = torch.exp(running_max - shift)
        denom = denom * rescale + weights.sum(dim=-1, keepdim=True)
        acc = acc * rescale + torch.matmul(weights, lat)
        running_max = new_max
    return acc / torch.where(denom > 0, denom, torch.ones_like(denom))


#: Rows per slice of the context product's reduction in :func:`_dense_one_pass` (a split K).
SPLIT_ROWS = 1024


def _dense_one_pass(q_lat, q_rope, lat, rope, lo, hi, softmax_scale: float) -> torch.Tensor:
    """Softmax attention of queries f32[B, H, K] / [B, H, R] over f32 rows [N, K] / [N, R] read in
    place, query b seeing rows ``lo[b] .. hi[b]-1`` (int64[B, 1, 1]): one pass, no chunk loop.

    The context product ``weights @ rows`` reduces over N with only B*H output rows: as one GEMM
    it runs on a handful of thread blocks, so the rows are cut into slices of
    :data:`SPLIT_ROWS` multiplied as a batch and summed (a split K).
    """
    n, k = lat.shape
    scores = (torch.matmul(q_lat, lat.mT) + torch.matmul(q_rope, rope.mT)) * softmax_scale  # [B, H, N]
    position = torch.arange(n, device=lat.device)
    scores = scores.masked_fill((position < lo) | (position >= hi), float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)  # no visible row: exp() gives 0
    weights = torch.exp(scores - peak)
    denom = weights.sum(dim=-1, keepdim=True)
    b, h = weights.shape[:2]
    whole = n - n % SPLIT_ROWS
    flat = weights.reshape(b * h, n)
    ctx = torch.zeros(b * h, k, device=lat.device, dtype=torch.float32)
    if whole:
        slices = whole // SPLIT_ROWS
        parts = torch.bmm(
            flat[:, :whole].reshape(b * h, slices, SPLIT_ROWS).transpose(0, 1),
            lat[:whole].reshape(slices, SPLIT_ROWS, k),
        )
        ctx = ctx + parts.sum(dim=0)
    if whole < n:
        ctx = ctx + flat[:, whole:] @ lat[whole:]
    return ctx.reshape(b, h, k) / torch.where(denom > 0, denom, torch.ones_like(denom))


_compiled_one_pass = None


def _one_pass_function():
    """:func:`_dense_one_pass`, fused by ``torch.compile`` where triton is available (masking,
    softmax and the split sums become a few kernels), else as is."""
    global _compiled_one_pass
    if _compiled_one_pass is None:
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - every supported torch has it
            has_triton = None
        # dynamic: a plain (uncaptured) step attends a different number of rows every token
        fused = has_triton is not None and has_triton()
        _compiled_one_pass = torch.compile(_dense_one_pass, dynamic=True) if fused else _dense_one_pass
    return _compiled_one_pass


def _row_decoder(batch: LatentBatch) -> Callable[[object], tuple[torch.Tensor, torch.Tensor]]:
    """``rows(index) -> (lat f32[..., K], rope f32[..., R])`` in the domain attention reads (rotated for TQ)."""
    tier, kv_lora, qk_rope = batch.tier, batch.kv_lora, batch.qk_rope
    lc, lc_scales, rc, rc_scales = batch.lc_codes, batch.lc_scales, batch.rc_codes, batch.rc_scales
    if lc_scales is None or rc_scales is None:  # f32 and bf16 rows: the values themselves

        def widened(index):
            return lc[index].float(), rc[index].float()

        return widened
    if tier.rotated:

        def rotated(index):
            return (
                codecs.rotated_rows(tier, lc[index], lc_scales[index], kv_lora),
                codecs.rotated_rows(tier, rc[index], rc_scales[index], qk_rope),
            )

        return rotated

    def decoded(index):
        return (
            codecs.decode_tier(tier, lc[index], lc_scales[index], kv_lora),
            codecs.decode_tier(tier, rc[index], rc_scales[index], qk_rope),
        )

    return decoded


def decode_torch(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    batch: LatentBatch,
    softmax_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention with torch ops for any tier, dense or over selected rows; checks nothing
    (:meth:`TorchBackend.decode` checks a checked batch's call first).

    Parameters
    ----------
    q_lat : f32[B, H, K];  q_rope : f32[B, H, R]
    batch : the rows, their tier and the sequences (:class:`~kvstore.gpu.inputs.LatentBatch`)
    softmax_scale : float
    out : f32[B, H, K], optional

    Returns
    -------
    f32[B, H, K]
    """
    tier = batch.tier
    batch_size, heads, k, r = batch.batch_size, q_lat.shape[1], batch.kv_lora, batch.qk_rope
    result = batch.output(out, heads)
    dev = batch.device
    seq_start, seq_len, indices, n_selected = batch.seq_start, batch.seq_len, batch.indices, batch.n_selected
    rows = _row_decoder(batch)
    q_l, q_r = (codecs.rotate(q_lat), codecs.rotate(q_rope)) if tier.rotated else (q_lat, q_rope)
    start = seq_start.to(device=dev, dtype=torch.int64)
    length = seq_len.to(device=dev, dtype=torch.int64).clamp_min(0)
    if indices is None or n_selected is None:
        # Columns are rows of the arrays, shared by every query; the span read is narrowed to the
        # sequences' rows when their bounds are already on the host (no synchronization either way).
        first, stop = 0, batch.n_rows
        if seq_start.device.type == "cpu" and seq_len.device.type == "cpu":
            lo, hi = seq_start.to(torch.int64), seq_start.to(torch.int64) + seq_len.to(torch.int64).clamp_min(0)
            live = hi > lo
            if bool(live.any()):
                first, stop = max(0, int(lo[live].min())), min(batch.n_rows, int(hi[live].max()))
            else:
                first = stop = 0
            groups = _disjoint_groups(lo, hi, batch_size * (stop - first))
            if groups is not None:
                _attend_groups(q_l, q_r, rows, lo, hi - lo, groups, batch, float(softmax_scale), result)
                if tier.rotated:
                    result.copy_(codecs.unrotate(result))
                return result
        lo, hi = start[:, None, None], (start + length)[:, None, None]

        def chunk(a: int, z: int):
            lat, rope = rows(slice(first + a, first + z))
            position = torch.arange(first + a, first + z, device=dev)
            return lat, rope, (position < lo) | (position >= hi)

        n_cols = stop - first
        if tier is tiers.F32 and dev.type == "cuda" and 0 < batch_size * heads * n_cols <= ONE_PASS_ELEMENTS:
            # f32 rows are read in place, with no decoded copy: one pass over every row, fused.
            ctx = _one_pass_function()(
                q_l,
                q_r,
                batch.lc_codes[first:stop],
                batch.rc_codes[first:stop],
                lo - first,
                hi - first,
                float(softmax_scale),
            )
            result.copy_(ctx)
            return result
        step = max(1, min(CHUNK_ROWS, SCORE_ELEMENTS // (batch_size * heads)))
    else:
        # Columns are selection slots, each query gathering its own rows: [B, C, width].
        n_cols = indices.shape[1] if batch.n_rows else 0
        picked = indices.to(device=dev, dtype=torch.int64) + start[:, None]
        picked = picked.clamp(0, max(batch.n_rows - 1, 0))  # unused slots may hold anything: masked below
        count = n_selected.to(device=dev, dtype=torch.int64)[:, None, None]

        def chunk(a: int, z: int):
            lat, rope = rows(picked[:, a:z])
            slot = torch.arange(a, z, device=dev)
            return lat, rope, slot >= count

        step = max(1, min(CHUNK_ROWS, SCORE_ELEMENTS // (batch_size * max(heads, k + r))))
    ctx = _online_softmax(q_l, q_r, n_cols, chunk, step, float(softmax_scale))
    result.copy_(codecs.unrotate(ctx) if tier.rotated else ctx)
    return result


def _disjoint_groups(lo: torch.Tensor, hi: torch.Tensor, masked_work: int) -> list[torch.Tensor] | None:
    """The queries in groups of similar lengths when every query reads rows of its own (a batched
    decode: each sequence its own region), and reading each group's rows per query costs under
    half of scoring every query against the span of all of them (``masked_work``: queries x span);
    else None. A group holds lengths within a factor of two, so it reads at most twice its rows."""
    n = lo.shape[0]
    length = (hi - lo).clamp_min(0)
    live = torch.nonzero(length > 0).flatten()
    if n < 2 or live.numel() < 2:
        return None
    order = live[torch.argsort(lo[live])]
    if bool((hi[order[:-1]] > lo[order[1:]]).any()):
        return None  # queries share rows (the tokens of one sequence): one pass over them is cheaper
    lengths = length[live]
    bucket = torch.ceil(torch.log2(lengths.double())).to(torch.int64)
    groups = [live[bucket == b] for b in torch.unique(bucket).tolist()]
    grouped_work = sum(int(g.numel()) * int(length[g].max()) for g in groups)
    return groups if 2 * grouped_work <= masked_work else None


def _attend_groups(q_l, q_r, rows, lo, length, groups, batch: LatentBatch, softmax_scale: float, result) -> None:
    """Each group's queries over their own rows, gathered per query ([B, C, width] columns): the
    work is each query's rows, not the span of all; queries of no group (no rows) get zeros."""
    heads, k, r = q_l.shape[1], batch.kv_lora, batch.qk_rope
    result.zero_()
    for group in groups:
        longest = int(length[group].max())
        first = lo[group].to(device=batch.device, dtype=torch.int64)
        count = length[group].to(device=batch.device, dtype=torch.int64)[:, None, None]
        picked = (first[:, None] + torch.arange(longest, device=batch.device)).clamp(0, max(batch.n_rows - 1, 0))

        def chunk(a: int, z: int, picked=picked, count=count):
            lat, rope = rows(picked[:, a:z])
            return lat, rope, torch.arange(a, z, device=batch.device) >= count

        index = group.to(batch.device)
        step = max(1, min(CHUNK_ROWS, SCORE_ELEMENTS // (int(group.numel()) * max(heads, k + r))))
        result[index] = _online_softmax(q_l[index], q_r[index], longest, chunk, step, softmax_scale)


class TorchBackend(AttentionBackend):
    """Decode attention with torch ops, every tier, on any torch device (the engine's default path)."""

    spec = spec_of("torch")

    @classmethod
    def environment_reasons(cls, device: torch.device) -> list[str]:
        if device.type == "cuda" and not torch.cuda.is_available():
            return ["torch.cuda.is_available() is False"]
        if device.type == "mps":
            return _mps_reasons()
        if device.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            return ["torch.xpu.is_available() is False"]
        return []

    def decode(
        self,
        q_lat: torch.Tensor,
        q_rope: torch.Tensor,
        batch: LatentBatch,
        softmax_scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if batch.checked:
            batch.check_call(q_lat, q_rope, softmax_scale, out)
        return decode_torch(q_lat, q_rope, batch, softmax_scale, out)


def _mps_reasons() -> list[str]:
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_built():
        return ["this torch build has no MPS (Metal) support"]
    if not mps.is_available():
        return ["torch.backends.mps.is_available() is False (no Apple GPU, or macOS older than 12.3)"]
    return []


class MpsBackend(TorchBackend):
    """The torch implementation on Apple's Metal through torch's ``mps`` device (untested here)."""

    spec = spec_of("mps")

    @classmethod
    def environment_reasons(cls, device: torch.device) -> list[str]:
        return _mps_reasons()
