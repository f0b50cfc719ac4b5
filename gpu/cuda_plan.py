"""Launch geometry of the CUDA decode-attention kernels (``kernels/mla_decode.cu``), host-side:
from shapes and known bounds only, so it runs (and is tested) without a GPU.

* :func:`plan_launch`: head groups per block and the split of every sequence into tiles, so that
  one wave of blocks fills the GPU;
* :func:`merge_width`: output dims per block of ``mla_merge_v2``;
* :func:`wgmma_by_default` and :func:`runs_wgmma`: whether a call goes to the warpgroup-MMA
  kernels instead;
* :func:`fitting_m_tiles`: which head groups per block fit the device's shared memory, and how
  many blocks of each an SM holds;
* the name of every kernel instantiation the backend compiles (:func:`split_kernel` ...,
  :func:`instantiations`), one place for the backend and the offline build checks.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "MERGE_WIDTHS",
    "M_TILES",
    "NVRTC_OPTIONS",
    "RESERVED_SHARED_MEMORY",
    "TILE_ROWS",
    "WGMMA_MIN_HEADS",
    "WGMMA_TRITON",
    "KernelPlan",
    "fitting_m_tiles",
    "generations",
    "instantiations",
    "merge_kernel",
    "merge_width",
    "plan_launch",
    "prep_query_kernel",
    "runs_wgmma",
    "smem_query_kernel",
    "split_kernel",
    "triton_version",
    "unrotate_kernel",
    "wgmma_by_default",
    "wgmma_for_call",
]

#: Rows per tile of mla_decode_split (BN in the kernel source).
TILE_ROWS = 64
#: Upper bound on splits per sequence (the merge keeps one weight per split in shared memory).
MAX_SPLITS = 4096
#: From LONG_SPLITS_FROM tiles per SM up, a split holds at least LONG_SPLIT_TILES tiles: fewer
#: partial contexts to write and merge (H200, 32k rows, 16 heads: fp8 21.0 -> 19.6 us, int4
#: 25.8 -> 22.8 us); shorter sequences keep one tile per split (4k rows: 10.2 us, 15.8 with 4).
LONG_SPLITS_FROM = 3
LONG_SPLIT_TILES = 4
#: The most partial contexts (sequences x padded heads x splits) a call writes: its workspace is that
#: many kv_lora vectors (256 MB in f16 at 512). A captured step only bounds its sequences by the
#: cache's rows, so its grid covers that bound for every sequence: a scheduler step of 512 entries
#: over a 262k-row arena planned 512 splits each, 4.3 GB of partials per workspace, kept for each
#: stream and graph that ran it (most likely why an H100 server ran out of memory). Past this,
#: splits grow longer.
MAX_PARTIALS = 1 << 18
#: Output dims per block of mla_merge_v2 that are instantiated, widest first.
MERGE_WIDTHS = (512, 128, 32)
#: 16-head m-tiles per block the split kernels are instantiated with.
M_TILES = (1, 2, 4)
#: NVRTC options besides the architecture: the same at run time (cupy) and offline (kvstore.gpu.nvrtc).
NVRTC_OPTIONS = ("--std=c++17",)
#: Shared memory the driver keeps for itself in every resident block (sm_80 and later:
#: cudaDevAttrReservedSharedMemoryPerBlock), on top of what the kernel asks for.
RESERVED_SHARED_MEMORY = 1024
#: Fewest heads for the warpgroup-MMA kernels (one 64-head block is a wgmma's M).
WGMMA_MIN_HEADS = 64
#: The tiers the warpgroup-MMA kernels read: fp8 codes, and int4 codes in the rotated domain.
WGMMA_TIERS = ("fp8", "int4")
#: Triton releases (major.minor) whose Gluon the warpgroup-MMA kernels are written for and were
#: tested with on the H200. Gluon's API changes between releases (3.9 renamed thread_barrier and
#: replaced async_copy_global_to_shared), so on another release they are not used by default.
WGMMA_TRITON = ("3.6",)


#: A plain (not graph-captured) call through the warpgroup-MMA path pays two Triton launches and
#: the query staging on the host: 143 us (fp8) and 164 us (int4, which also un-rotates) a call on
#: the H200's host against 38 us for v2's replayed launch plan (bench/gpu_host.py --heads 64, 32k
#: rows). Plain calls take that path only when their lengths are on the host and heads x live rows
#: reaches this: 64 heads x 512k rows, about 240 us of its GPU time, where the GPU time it saves
#: exceeds that cost.
WGMMA_PLAIN_MIN_HEAD_ROWS = 64 * (1 << 19)


def wgmma_for_call(capturing: bool, heads: int, rows_on_host: int | None) -> bool:
    """Whether an eligible call (:func:`runs_wgmma`) of a backend left to choose takes the
    warpgroup-MMA kernels: always inside a CUDA-graph capture (a replay pays no host time); a plain
    call when its live rows (summed over the batch) are known on the host and ``heads`` x rows
    reaches :data:`WGMMA_PLAIN_MIN_HEAD_ROWS`."""
    if capturing:
        return True
    return rows_on_host is not None and heads * rows_on_host >= WGMMA_PLAIN_MIN_HEAD_ROWS


def triton_version() -> str:
    """The installed Triton's version ("" if none), read from its metadata (no import)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return ""


def wgmma_by_default(version: str, forced: bool | None) -> bool:
    """Whether a CUDA backend made without ``wgmma=`` sends eligible calls to the warpgroup-MMA
    kernels: ``KVSTORE_GPU_WGMMA`` (``forced``, ``kvstore.config.GPU_WGMMA``) decides when set;
    otherwise yes when the installed Triton (``version``, "" if none) is a release of
    :data:`WGMMA_TRITON`."""
    if forced is not None:
        return forced
    return ".".join(version.split(".")[:2]) in WGMMA_TRITON


def runs_wgmma(
    enabled: bool,
    capability: tuple[int, int],
    tier: str,
    selected: bool,
    heads: int,
    kv_lora: int,
    qk_rope: int,
    aligned: bool,
) -> bool:
    """Whether a call runs the warpgroup-MMA kernels of ``kvstore.gpu.wgmma_kernels``: enabled
    (:func:`wgmma_by_default`), on sm_90 (their ``wgmma``), dense fp8 or int4 rows, 64+ heads,
    kv_lora 512 (two warpgroups of 256 context dims) and qk_rope 64 (the geometry they are built
    and tested for), and 16-byte aligned queries and rows (their 16-byte copies); else the v1/v2
    kernels."""
    return (
        enabled
        and capability == (9, 0)
        and tier in WGMMA_TIERS
        and not selected
        and heads >= WGMMA_MIN_HEADS
        and kv_lora == 512
        and qk_rope == 64
        and aligned
    )


def _head_tiles(heads: int, max_mt: int = 4) -> tuple[int, int]:
    """(m-tiles of 16 heads per block, head groups): 64 heads per block from 48 heads up
    (at most ``max_mt`` m-tiles, a power of two)."""
    m_tiles = -(-heads // 16)
    per_block = 4 if m_tiles >= 3 else m_tiles
    while per_block > max(1, max_mt):
        per_block //= 2
    return per_block, -(-m_tiles // per_block)


@dataclass(frozen=True)
class KernelPlan:
    """Launch geometry of one call (host-side, from shapes and known bounds only)."""

    m_tiles: int  # MT: 16-head m-tiles per block
    head_groups: int
    padded_heads: int  # Hp = head_groups * 16 * MT
    blocks_per_split: int  # BN-row tiles per split
    n_splits: int
    blocks_per_sm: int


def fitting_m_tiles(needs: Mapping[int, int], block_limit: int, sm_limit: int, max_mt: int = 4) -> dict[int, int]:
    """The m-tiles per block whose split kernel fits a device, with the blocks of it an SM holds.

    A split kernel's launch bounds ask for two resident blocks with one m-tile (16 heads), one
    with more; a device whose shared memory holds fewer runs fewer, and one whose blocks may not
    have a kernel's shared memory cannot launch it at all (sm_89 and sm_120 allow 99 KB a block,
    sm_90 227 KB).

    Parameters
    ----------
    needs : m-tiles -> dynamic shared memory (bytes) of the split kernel
    block_limit : the most shared memory a block may have (the device's opt-in limit)
    sm_limit : shared memory of one multiprocessor
    max_mt : most m-tiles to consider

    Returns
    -------
    dict
        m-tiles -> resident blocks per SM, for each m-tile count that fits (empty: none does)
    """
    fits = {}
    for m_tiles, smem in sorted(needs.items()):
        wanted = 2 if m_tiles == 1 else 1
        held = min(wanted, sm_limit // (smem + RESERVED_SHARED_MEMORY))
        if m_tiles <= max_mt and smem <= block_limit and held > 0:
            fits[m_tiles] = held
    return fits


def plan_launch(
    batch: int,
    heads: int,
    max_rows: int,
    mean_rows: float,
    n_sm: int,
    max_mt: int = 4,
    min_tiles: int = 1,
    blocks_per_sm: Mapping[int, int] | None = None,
) -> KernelPlan:
    """Choose the split of every sequence so that one wave of blocks fills the GPU.

    Parameters
    ----------
    batch, heads : query batch and heads
    max_rows : an upper bound on any sequence's rows (sets the grid's split count)
    mean_rows : the typical sequence length (sets the split size)
    n_sm : multiprocessors of the device
    max_mt : most 16-head m-tiles per block (1, 2 or 4)
    min_tiles : fewest tiles per split (fewer, longer splits write fewer partial contexts)
    blocks_per_sm : m-tiles -> resident blocks per SM (:func:`fitting_m_tiles`); default what the
        kernels' launch bounds ask (two blocks of one m-tile, one of more)

    Returns
    -------
    KernelPlan
    """
    m_tiles, groups = _head_tiles(heads, max_mt)
    resident = blocks_per_sm[m_tiles] if blocks_per_sm is not None else (2 if m_tiles == 1 else 1)
    tiles_max = max(1, -(-max_rows // TILE_ROWS))
    tiles_mean = max(1, math.ceil(mean_rows / TILE_ROWS))
    splits_wanted = max(1, -(-(n_sm * resident) // (batch * groups)))
    per_split = max(1, min_tiles, -(-tiles_mean // splits_wanted), -(-tiles_max // MAX_SPLITS))
    if tiles_mean >= LONG_SPLITS_FROM * n_sm:  # e.g. 32k rows: 128 splits of 4 tiles, not 256 of 2
        per_split = max(per_split, LONG_SPLIT_TILES)
    wave = n_sm * resident
    spare = wave - batch * groups  # each sequence may end in one partial split
    if batch > 1 and 2 * spare >= wave:
        # Ragged sequences: every working block in one wave. Rounding each sequence's splits up
        # otherwise spills a few blocks into a second wave that costs as much as the first (H200,
        # 16 sequences of 1k..32k, 16 heads: 14 tiles per split 94.4 us, 16 tiles 78.3 us).
        per_split = max(per_split, -(-tiles_mean * batch * groups // spare))
    splits_allowed = max(1, MAX_PARTIALS // (batch * groups * 16 * m_tiles))
    per_split = max(per_split, -(-tiles_max // splits_allowed))
    return KernelPlan(m_tiles, groups, groups * 16 * m_tiles, per_split, -(-tiles_max // per_split), resident)


def merge_width(batch: int, heads: int, kv_lora: int, n_sm: int) -> int:
    """Output dims per merge block: the widest that still gives two blocks per SM.

    A merge block's fixed cost (weighing its splits, two barriers) is paid once per chunk, so a
    batch of sequences merges in wide chunks (16 sequences x 16 heads: 1,024 blocks of 128 dims, one
    wave, where 32-dim chunks made four); a lone 16-head sequence keeps 32 dims (256 blocks).
    """
    for width in MERGE_WIDTHS:
        if kv_lora % width == 0 and batch * heads * (kv_lora // width) >= 2 * n_sm:
            return width
    return MERGE_WIDTHS[-1]


# -- the kernel instantiations, by the names NVRTC instantiates them under -----------------------


def _flag(value: bool) -> str:
    return "true" if value else "false"


def split_kernel(m_tiles: int, kv_lora: int, qk_rope: int, fmt: int, gather: bool, v2: bool) -> str:
    """The split kernel (``mla_decode_v2`` or, v1, ``mla_decode_split``); ``fmt`` 0 fp8, 1 int4."""
    stem = "mla_decode_v2" if v2 else "mla_decode_split"
    return f"{stem}<{m_tiles},{kv_lora},{qk_rope},{fmt},{_flag(gather)}>"


def smem_query_kernel(m_tiles: int, kv_lora: int, qk_rope: int, fmt: int, v2: bool) -> str:
    """The kernel that stores the dynamic shared memory of :func:`split_kernel` (either ``gather``)."""
    stem = "mla_split_smem_v2" if v2 else "mla_split_smem"
    return f"{stem}<{m_tiles},{kv_lora},{qk_rope},{fmt}>"


def merge_kernel(kv_lora: int, fmt: int | None = None, width: int | None = None) -> str:
    """The merge: v1's ``mla_merge`` (``fmt``: int4 un-rotates there) or v2's ``mla_merge_v2``
    (``width`` output dims per block)."""
    if width is not None:
        return f"mla_merge_v2<{kv_lora},{width}>"
    return f"mla_merge<{kv_lora},{_flag(fmt == 1)}>"


def prep_query_kernel(kv_lora: int, qk_rope: int, fmt: int) -> str:
    """``mla_prep_query``: the query in f16 (rotated for int4) for v1 and the warpgroup-MMA kernels."""
    return f"mla_prep_query<{kv_lora},{qk_rope},{_flag(fmt == 1)}>"


def unrotate_kernel(kv_lora: int) -> str:
    """``mla_unrotate``: an int4 context un-rotated in place after the warpgroup-MMA kernels."""
    return f"mla_unrotate<{kv_lora}>"


def generations(kv_lora: int) -> tuple[bool, ...]:
    """The kernel generations built for rows of ``kv_lora`` dims, as the ``v2`` flag of
    :func:`split_kernel`: v1 always, v2 at kv_lora 512."""
    return (False, True) if kv_lora == 512 else (False,)


def instantiations(kv_lora: int, qk_rope: int) -> list[str]:
    """Every kernel the CUDA backend may compile for rows of this geometry (both tiers, both
    kernel generations where built, dense and selected rows, every m-tile count and merge width)."""
    names = [merge_kernel(kv_lora, width=w) for w in MERGE_WIDTHS if kv_lora == 512 and kv_lora % w == 0]
    names.append(unrotate_kernel(kv_lora))
    for fmt in (0, 1):
        names += [prep_query_kernel(kv_lora, qk_rope, fmt), merge_kernel(kv_lora, fmt)]
        for v2 in generations(kv_lora):
            for m_tiles in M_TILES:
                names.append(smem_query_kernel(m_tiles, kv_lora, qk_rope, fmt, v2))
                names += [split_kernel(m_tiles, kv_lora, qk_rope, fmt, gather, v2) for gather in (False, True)]
    return names
