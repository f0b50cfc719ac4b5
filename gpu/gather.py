"""One launch gathering the rows at the same slots of many caches (the vLLM connector's saves).

vLLM keeps one paged cache tensor per attention layer. A save copies a prompt's rows out of every
layer: with torch, one ``index_select`` a layer (27 launches for DeepSeek-V2-Lite, 61 for V3), each
costing the step's thread tens of microseconds of host time, and a short prefill step is
launch-bound — the host barely keeps ahead of the device — so those microseconds lengthened it.
:class:`LayerGather` reads every layer in one Triton launch: a device table of the caches' base
addresses (made once; vLLM allocates its caches at start and never moves them) and the slots.

The rows are copied as words (4, 2 or 1 bytes, the widest the row's bytes and the caches'
addresses allow), whatever the cache's dtype (bf16, fp16, f32, fp8 bytes): the output holds the
caches' own bits. ``TRITON_INTERPRET=1`` runs it on CPU tensors (the CPU tests use it).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

__all__ = ["LayerGather"]

#: Rows a program copies (with every word of each row).
ROWS = 8

_WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit(do_not_specialize=["n"])  # one compile whatever the rows (n == 1 or n % 16 == 0 would add two)
def _gather_rows(
    table,  # int64 [layers]: each cache's base address
    slots,  # int64 [n]: the rows to copy (the same in every layer)
    out,  # words [layers, n, row_words]
    n,
    stride_words,  # words from one cache row to the next
    ROW_WORDS: tl.constexpr,
    COLS: tl.constexpr,  # ROW_WORDS rounded up to a power of two
    ROWS_PER: tl.constexpr,
    WORD_BYTES: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS_PER + tl.arange(0, ROWS_PER)
    cols = tl.arange(0, COLS)
    live = rows < n
    slot = tl.load(slots + rows, mask=live, other=0)
    address = tl.load(table + layer)
    if WORD_BYTES == 4:
        base = address.to(tl.pointer_type(tl.int32))
    elif WORD_BYTES == 2:
        base = address.to(tl.pointer_type(tl.int16))
    else:
        base = address.to(tl.pointer_type(tl.uint8))
    mask = live[:, None] & (cols[None, :] < ROW_WORDS)
    words = tl.load(base + slot[:, None] * stride_words + cols[None, :], mask=mask)
    at = (layer * n + rows[:, None].to(tl.int64)) * ROW_WORDS + cols[None, :]
    tl.store(out + at, words, mask=mask)


class LayerGather:
    """Rows at ``slots`` of every cache in ``caches`` (in order) into one ``[layers, n, width]``
    tensor, in one launch.

    Parameters
    ----------
    caches : tensors on one device, of one dtype, each viewable as ``[rows, width]`` (vLLM's
        ``[blocks, block_size, width]``: a slot is ``block * block_size + offset``), one width
    """

    def __init__(self, caches: list[torch.Tensor]):
        if not caches:
            raise ValueError("a gather needs at least one cache")
        first = caches[0]
        views = [cache.view(-1, cache.shape[-1]) for cache in caches]
        if len({(c.device, c.dtype, v.shape[1], v.stride()) for c, v in zip(caches, views)}) != 1:
            raise ValueError("the caches of one gather share their device, dtype, width and row stride")
        size = first.element_size()
        row_bytes, stride_bytes = views[0].shape[1] * size, views[0].stride(0) * size
        word = next(
            w
            for w in (4, 2, 1)
            if row_bytes % w == 0 and stride_bytes % w == 0 and all(c.data_ptr() % w == 0 for c in caches)
        )
        self.device, self.dtype, self.width = first.device, first.dtype, views[0].shape[1]
        self.layers = len(caches)
        self._word = word
        self._row_words, self._stride_words = row_bytes // word, stride_bytes // word
        self._caches = caches  # held: the table holds their addresses
        self._table = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
        if first.device.type == "cuda":  # compiled now, not in the first step that saves (Triton
            self(torch.zeros(1, dtype=torch.int64, device=first.device))  # builds at a first launch)

    def __call__(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows at ``slots`` (int64 on the caches' device) of every cache, ``[layers, n, width]``
        in the caches' dtype (into ``out`` when given: contiguous, that shape and dtype)."""
        n = int(slots.numel())
        shape = (self.layers, n, self.width)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        elif tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"the gather's output must be a contiguous {self.dtype} tensor of shape {shape}")
        if n:
            words = out.view(torch.uint8).view(_WORD_DTYPES[self._word])
            # a launcher takes the kernel's parameters, constexprs as plain values
            launch: Callable[..., Any] = _gather_rows[(self.layers, triton.cdiv(n, ROWS))]
            launch(
                self._table,
                slots,
                words,
                n,
                self._stride_words,
                ROW_WORDS=self._row_words,
                COLS=triton.next_power_of_2(self._row_words),
                ROWS_PER=ROWS,
                WORD_BYTES=self._word,
            )
        return out
