# Over 500 lines: the launches of two kernel generations, their argument lists laid out one per line.
"""CUDA backend: the kernels of ``kernels/mla_decode.cu`` through cupy ``RawModule``.

For kv_lora 512 (the ``v2`` kernels) one call is two launches on the caller's current torch stream
(no host synchronization):

1. ``mla_decode_v2``: split-T flash decoding, one block per (head group, split, sequence); each
   block prepares its own f16 query tile (rotated for int4), streams raw code rows through a
   two-stage cp.async ring and converts codes to f16 as the mma fragments are loaded; for int4 it
   un-rotates its partial context;
2. ``mla_merge_v2``: the log-sum-exp merge of the f16 partial contexts, one block per (head, chunk
   of output dims, sequence), over the splits that hold rows (the split kernel counts them per
   sequence on the device); chunks of 32 dims for a lone sequence, wider for batches
   (:func:`merge_width`).

Other widths (and ``variant="v1"``) run the first kernels: ``mla_prep_query`` (q -> f16),
``mla_decode_split`` (codes converted once per tile into an f16 shared-memory tile) and
``mla_merge`` (merge + un-rotation, one block per head).

Modules are compiled by NVRTC on first use (:mod:`kvstore.gpu.cuda_build`). A split kernel's
head groups per block and blocks per SM are planned within the device's shared memory; a geometry
whose kernels do not fit at all (fp8 at kv_lora 512 on a GPU of 99 KB a block, sm_89 or sm_120)
runs the torch path, and :meth:`CudaBackend.configuration_reasons` says so to the registry.
Tensors cross as raw device pointers; outputs and workspaces are torch tensors.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvstore import config, tiers
from kvstore.gpu import launch, registry
from kvstore.gpu.cuda_build import (
    LOCK,
    MIN_CAPABILITY,
    compiled,
    cupy_module,
    cupy_stream,
    ptr,
    split_shared_memory,
)
from kvstore.gpu.cuda_plan import (
    MERGE_WIDTHS,
    KernelPlan,
    fitting_m_tiles,
    merge_kernel,
    merge_width,
    plan_launch,
    prep_query_kernel,
    runs_wgmma,
    split_kernel,
    triton_version,
    unrotate_kernel,
    wgmma_by_default,
    wgmma_for_call,
)
from kvstore.gpu.inputs import LatentBatch
from kvstore.gpu.registry import AttentionBackend, spec_of
from kvstore.gpu.torch_backend import decode_torch

__all__ = [
    "CudaBackend",
    "KernelPlan",
    "plan_launch",
]

#: The kernels' row format of each tier they decode (FMT in the source).
_FORMAT = {tiers.FP8.name: 0, tiers.INT4.name: 1}


class CudaBackend(AttentionBackend):
    """Tensor-core kernels (mma.sync f16) for the fp8 and int4 (rotated) latent caches.

    Calls whose geometry the kernels are not built for (see ``spec``), or whose kernels need more
    shared memory than the device's blocks may have, run the torch path instead; :meth:`why_not`
    says why.

    Parameters
    ----------
    device : the CUDA device
    variant : ``"v2"`` (the default: kv_lora 512, else v1 runs) or ``"v1"`` (benchmarks compare them)
    max_mt : most 16-head m-tiles per block of the v2 kernel (1, 2 or 4; default 4)
    min_tiles : fewest 64-row tiles per split (default 1: as many splits as fill one wave)
    merge_dims : output dims per merge block of the v2 kernels (one of ``MERGE_WIDTHS``; default
        :func:`merge_width` of each call)
    """

    spec = spec_of("cuda")

    def __init__(
        self,
        device: torch.device,
        variant: str | None = None,
        max_mt: int | None = None,
        min_tiles: int = 1,
        merge_dims: int | None = None,
        wgmma: bool | None = None,
        replay: bool = True,
    ):
        super().__init__(device)
        props = torch.cuda.get_device_properties(self.device)
        self.capability = (props.major, props.minor)
        self.n_sm = props.multi_processor_count
        #: shared memory a block may have (the opt-in limit) and an SM holds, bytes: the split
        #: kernels' head groups per block and blocks per SM are planned within them (the H200:
        #: 227 and 228 KB; sm_89 and sm_120: 99 and 100 KB)
        self.block_shared_memory = props.shared_memory_per_block_optin
        self.sm_shared_memory = props.shared_memory_per_multiprocessor
        #: (v2, kv_lora, qk_rope, fmt) -> m-tiles -> the split kernel's dynamic shared memory
        self._needs: dict[tuple, dict[int, int]] = {}
        self._sized: set[str] = set()  # split kernels whose shared-memory attribute is set
        self._built: dict[tuple[str, int, int], bool] = {}
        #: "v2" (two launches, fragments converted from code bytes) or "v1" (three launches)
        self.variant = variant or "v2"
        if self.variant not in ("v1", "v2"):
            raise ValueError(f"variant must be 'v1' or 'v2', not {self.variant!r}")
        #: most 16-head m-tiles per block (v2)
        self.max_mt = max_mt or 4
        #: fewest tiles per split (see :func:`plan_launch`)
        self.min_tiles = max(1, int(min_tiles))
        if merge_dims is not None and merge_dims not in MERGE_WIDTHS:
            raise ValueError(f"merge_dims must be one of {MERGE_WIDTHS}, not {merge_dims!r}")
        #: output dims per merge block (v2), or None to choose per call
        self.merge_dims = merge_dims
        #: replayable launch plans of plain calls, by operand signature (see kvstore.gpu.launch)
        self._fast: dict[tuple, launch.ReplayedCall] = {}
        #: plain calls served from a cached plan (the benchmarks and tests read it)
        self.fast_calls = 0
        #: dense fp8 and int4 calls with 64+ heads on sm_90 may run the warpgroup-MMA kernels of
        #: kvstore.gpu.wgmma_kernels (fp8 9-22 %, int4 25-35 % faster than v2 from 128k rows,
        #: docs/GPU-LOG.md round 10):
        #: by default on the Triton release they are tested with, for the calls of
        #: cuda_plan.wgmma_for_call; wgmma=True or KVSTORE_GPU_WGMMA=1: every eligible call;
        #: wgmma=False or KVSTORE_GPU_WGMMA=0: none
        forced = config.GPU_WGMMA.get() if wgmma is None else bool(wgmma)
        self.wgmma = wgmma_by_default(triton_version(), forced)
        #: every eligible call, plain calls of short contexts too (else cuda_plan.wgmma_for_call)
        self.wgmma_always = forced is True
        #: replay cached launch plans of plain calls (replay=False turns it off, for A/B runs)
        self.replay = bool(replay)

    @classmethod
    def environment_reasons(cls, device: torch.device) -> list[str]:
        if not torch.cuda.is_available():
            return ["torch.cuda.is_available() is False"]
        try:
            cupy_module()
        except ImportError as exc:
            return [f"cupy cannot be imported ({exc})"]
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            return [f"no CUDA device {index} (have {torch.cuda.device_count()})"]
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < MIN_CAPABILITY:
            return [f"compute capability {major}.{minor} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (e4m3 conversion)"]
        return []

    @classmethod
    def configuration_reasons(cls, device: torch.device, tier, kv_lora: int | None, qk_rope: int | None) -> list[str]:
        """Why the kernels cannot run this tier and geometry on ``device``: their shared memory."""
        if kv_lora is None or qk_rope is None:
            return []
        backend = registry.instance(cls.spec.name, device)
        if not isinstance(backend, CudaBackend):  # the name registered to another class since
            return []
        return backend.shared_memory_reasons(registry.as_tier(tier), kv_lora, qk_rope)

    def shared_memory_reasons(self, tier: tiers.Tier, kv_lora: int, qk_rope: int) -> list[str]:
        """Empty when a split kernel for ``tier`` at this geometry fits the device's shared memory
        (:attr:`block_shared_memory`, :attr:`sm_shared_memory`), else why not."""
        v2 = self.variant == "v2" and kv_lora == 512
        fmt = _FORMAT[tier.name]
        if self.split_fits(v2, kv_lora, qk_rope, fmt):
            return []
        least = min(self._shared_memory(v2, kv_lora, qk_rope, fmt).values())
        return [
            f"its {tier.name} kernels for kv_lora={kv_lora}, qk_rope={qk_rope} need {least:,} bytes of shared"
            f" memory a block; this device allows {self.block_shared_memory:,}"
        ]

    def _shared_memory(self, v2: bool, kv_lora: int, qk_rope: int, fmt: int) -> dict[int, int]:
        key = (v2, kv_lora, qk_rope, fmt)
        if key not in self._needs:  # two threads may both ask: the same answer
            self._needs[key] = split_shared_memory(v2, kv_lora, qk_rope, fmt, self.capability, self.device)
        return self._needs[key]

    def split_fits(self, v2: bool, kv_lora: int, qk_rope: int, fmt: int) -> dict[int, int]:
        """m-tiles -> resident blocks per SM, for the split kernels that fit the device (empty: none)."""
        needs = self._shared_memory(v2, kv_lora, qk_rope, fmt)
        return fitting_m_tiles(needs, self.block_shared_memory, self.sm_shared_memory, self.max_mt if v2 else 4)

    def _builds_for(self, tier: tiers.Tier, kv_lora: int, qk_rope: int) -> bool:
        """Whether the kernels are instantiated for this geometry (else the torch path runs)."""
        key = (tier.name, kv_lora, qk_rope)
        built = self._built.get(key)
        if built is None:
            built = self._built[key] = not self.spec.mismatches(tier=tier, kv_lora=kv_lora, qk_rope=qk_rope)
        return built

    # -- compilation ----------------------------------------------------------------------------

    def _get(self, name_expression: str):
        return compiled((name_expression,), self.capability, self.device.index)[0]

    def _split_kernel(self, m_tiles: int, kv_lora: int, qk_rope: int, fmt: int, gather: bool, v2: bool = False):
        """The split kernel and its dynamic shared memory (asked of the compiled source once)."""
        name = split_kernel(m_tiles, kv_lora, qk_rope, fmt, gather, v2)
        kernel = self._get(name)
        smem = self._shared_memory(v2, kv_lora, qk_rope, fmt)[m_tiles]
        if name not in self._sized:
            with LOCK:
                kernel.max_dynamic_shared_size_bytes = smem
                self._sized.add(name)
        return kernel, smem

    # -- the call -------------------------------------------------------------------------------

    def decode(
        self,
        q_lat: torch.Tensor,
        q_rope: torch.Tensor,
        batch: LatentBatch,
        softmax_scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp8 and int4 rows through the kernels; other tiers and geometries, and rows the kernels
        cannot read as 16-byte vectors, go the torch path. A call whose operands have the signature
        of an earlier one replays its launch plan (:mod:`kvstore.gpu.launch`)."""
        if batch.checked:
            batch.check_call(q_lat, q_rope, softmax_scale, out)
        fast_key = None
        if self.replay:
            operands = (q_lat, q_rope, *batch.operands)
            fast_key = launch.signature(batch.tier, softmax_scale, operands, out)
            fast = self._fast.get(fast_key) if fast_key is not None else None
            # a plain call's plan (v2) of a call the warpgroup-MMA kernels take when captured
            if fast is not None and not (fast.wgmma_when_captured and torch.cuda.is_current_stream_capturing()):
                done = fast.run(operands, out)
                if done is not None:
                    return done
        return self._launch(q_lat, q_rope, batch, softmax_scale, out, fast_key)

    def _launch(self, q_lat, q_rope, batch: LatentBatch, softmax_scale, out, fast_key):
        """The call that no cached plan serves: the kernels' plan, its launches, and the plan kept
        under ``fast_key`` (None: not kept) when the call can be replayed."""
        lc_codes, lc_scales, rc_codes, rc_scales = batch.lc_codes, batch.lc_scales, batch.rc_codes, batch.rc_scales
        seq_start, seq_len, indices, n_selected = batch.seq_start, batch.seq_len, batch.indices, batch.n_selected
        if (
            lc_scales is None
            or rc_scales is None
            or not self._builds_for(batch.tier, batch.kv_lora, batch.qk_rope)
            or not _aligned(lc_codes, rc_codes, lc_scales, rc_scales)
        ):
            return decode_torch(q_lat, q_rope, batch, softmax_scale, out)
        result = batch.output(out, q_lat.shape[1])
        if fast_key is not None and not launch.replayable(
            q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len, indices, n_selected
        ):
            fast_key = None
        device = batch.device
        batch_size, heads, k, r = batch.batch_size, q_lat.shape[1], batch.kv_lora, batch.qk_rope
        q_lat_c, q_rope_c = q_lat.contiguous(), q_rope.contiguous()
        # the rows' alignment is checked above (unaligned rows take the torch path)
        q_aligned = _aligned(q_lat_c, q_rope_c)
        seq_start_d, seq_len_d = (t.to(device=device, dtype=torch.int32).contiguous() for t in (seq_start, seq_len))
        indices_d, n_selected_d = (
            t if t is None else t.to(device=device, dtype=torch.int32).contiguous() for t in (indices, n_selected)
        )
        lc_codes, rc_codes = lc_codes.contiguous(), rc_codes.contiguous()
        lc_scales, rc_scales = lc_scales.contiguous(), rc_scales.contiguous()
        wgmma_eligible = runs_wgmma(
            self.wgmma, self.capability, batch.tier.name, batch.selected is not None, heads, k, r, q_aligned
        )
        if wgmma_eligible and (
            self.wgmma_always
            or wgmma_for_call(
                torch.cuda.is_current_stream_capturing(),
                heads,
                int(seq_len.clamp(min=0).sum()) if seq_len.device.type == "cpu" else None,
            )
        ):
            rows = (lc_codes, lc_scales, rc_codes, rc_scales)
            return self._wgmma_decode(batch, softmax_scale, (q_lat_c, q_rope_c), rows, seq_start_d, seq_len_d, result)
        if batch.selected is not None:
            max_rows = batch.selected
            mean_rows = (
                float(n_selected.to(torch.float32).mean())
                if n_selected is not None and n_selected.device.type == "cpu"
                else max_rows
            )
        elif seq_len.device.type == "cpu":
            max_rows = max(int(seq_len.max()), 0)
            mean_rows = float(seq_len.to(torch.float32).mean())
        else:  # device-side lengths: bound by the row array rather than synchronize
            max_rows = batch.n_rows
            mean_rows = batch.n_rows / batch_size
        v2 = self.variant == "v2" and k == 512 and q_aligned  # v2 reads q as float4
        fmt = _FORMAT[batch.tier.name]
        fits = self.split_fits(v2, k, r, fmt)
        if not fits:  # no split kernel's shared memory fits the device's blocks (shared_memory_reasons)
            return decode_torch(q_lat, q_rope, batch, softmax_scale, out)
        plan = plan_launch(batch_size, heads, max_rows, mean_rows, self.n_sm, max(fits), self.min_tiles, fits)
        # v2 keeps partial contexts in f16 with a power-of-two scale each (half the bytes written
        # and merged); v1 in f32
        o_part = torch.empty(
            (batch_size, plan.padded_heads, plan.n_splits, k),
            dtype=torch.float16 if v2 else torch.float32,
            device=device,
        )
        lse = torch.empty((batch_size, plan.padded_heads, plan.n_splits), dtype=torch.float32, device=device)

        if v2:
            return self._launch_v2(
                plan,
                batch,
                fmt,
                softmax_scale,
                q_lat_c,
                q_rope_c,
                lc_codes,
                lc_scales,
                rc_codes,
                rc_scales,
                seq_start_d,
                seq_len_d,
                indices_d,
                n_selected_d,
                o_part,
                lse,
                result,
                fast_key,
                wgmma_eligible,
            )
        q16, qmul = self._staged_query(batch, softmax_scale, q_lat_c, q_rope_c, plan.padded_heads)
        split, smem = self._split_kernel(plan.m_tiles, k, r, fmt, batch.selected is not None)
        merge = self._get(merge_kernel(k, fmt))
        cupy = cupy_module()
        stream = cupy_stream(torch.cuda.current_stream(device), device.index)
        with cupy.cuda.Device(device.index), stream:
            split(
                (plan.head_groups, plan.n_splits, batch_size),
                (256,),
                (
                    ptr(q16),
                    ptr(qmul),
                    ptr(lc_codes),
                    ptr(lc_scales),
                    ptr(rc_codes),
                    ptr(rc_scales),
                    ptr(seq_start_d),
                    ptr(seq_len_d),
                    ptr(indices_d),
                    ptr(n_selected_d),
                    np.int32(batch.selected or 0),
                    np.int64(batch.n_rows),
                    np.int32(plan.padded_heads),
                    np.int32(plan.n_splits),
                    np.int32(plan.blocks_per_split),
                    ptr(o_part),
                    ptr(lse),
                ),
                shared_mem=smem,
            )
            merge(
                (heads, batch_size),
                (256,),
                (
                    ptr(o_part),
                    ptr(lse),
                    np.int32(heads),
                    np.int32(plan.padded_heads),
                    np.int32(plan.n_splits),
                    ptr(result),
                ),
                shared_mem=4 * plan.n_splits,
            )
        return result

    def _wgmma_decode(
        self,
        batch: LatentBatch,
        softmax_scale: float,
        query: tuple[torch.Tensor, torch.Tensor],
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        seq_start: torch.Tensor,
        seq_len: torch.Tensor,
        result: torch.Tensor,
    ) -> torch.Tensor:
        """The warpgroup-MMA kernels (:mod:`kvstore.gpu.wgmma_kernels`, Triton's Gluon) over
        ``query`` (q_lat, q_rope) and ``rows`` (lc, ls, rc, rs): the query staged by
        :meth:`_staged_query` (rotated for int4) before them, and for int4 the context un-rotated by
        ``mla_unrotate`` after."""
        from kvstore.gpu.wgmma_kernels import BLOCK_H, wide_decode  # Gluon: imported when first used

        batch_size, heads, device = batch.batch_size, query[0].shape[1], batch.device
        int4 = _FORMAT[batch.tier.name] == 1
        q16, qmul = self._staged_query(batch, softmax_scale, *query, -(-heads // BLOCK_H) * BLOCK_H)
        wide_decode(q16, qmul, *rows, seq_start, seq_len, result, n_sm=self.n_sm, int4=int4)
        if int4 and batch_size * heads:
            unrotate = self._get(unrotate_kernel(batch.kv_lora))
            stream = cupy_stream(torch.cuda.current_stream(device), device.index)
            with cupy_module().cuda.Device(device.index), stream:
                unrotate((batch_size * heads,), (128,), (ptr(result),))
        return result

    def _staged_query(self, batch: LatentBatch, softmax_scale, q_lat, q_rope, heads_pad: int):
        """``mla_prep_query`` (the v1 kernels and the warpgroup-MMA ones): the query in f16 with a
        power-of-two scale per head and part, rotated for int4, in q16 f16[B, heads_pad, K + R], and
        per head the latent's and the rope's factors back to log2 units in qmul f32[B, heads_pad, 2]."""
        batch_size, heads, k, r = batch.batch_size, q_lat.shape[1], batch.kv_lora, batch.qk_rope
        device = batch.device
        q16 = torch.empty((batch_size, heads_pad, k + r), dtype=torch.float16, device=device)
        qmul = torch.empty((batch_size, heads_pad, 2), dtype=torch.float32, device=device)
        prep = self._get(prep_query_kernel(k, r, _FORMAT[batch.tier.name]))
        score_scale = np.float32(softmax_scale * math.log2(math.e))
        args = (ptr(q_lat), ptr(q_rope), np.int32(heads), np.int32(heads_pad), score_scale, ptr(q16), ptr(qmul))
        stream = cupy_stream(torch.cuda.current_stream(device), device.index)
        with cupy_module().cuda.Device(device.index), stream:
            prep((heads_pad, batch_size), (128,), args)
        return q16, qmul

    def _launch_v2(
        self,
        plan,
        batch: LatentBatch,
        fmt,
        softmax_scale,
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
        o_part,
        lse,
        result,
        fast_key=None,
        wgmma_eligible=False,
    ):
        device = batch.device
        batch_size, heads, k, r = batch.batch_size, q_lat.shape[1], batch.kv_lora, batch.qk_rope
        split, smem = self._split_kernel(plan.m_tiles, k, r, fmt, batch.selected is not None, v2=True)
        width = self.merge_dims or merge_width(batch_size, heads, k, self.n_sm)
        merge = self._get(merge_kernel(k, width=width))
        score_scale = np.float32(softmax_scale * math.log2(math.e))
        o_scale = torch.empty_like(lse)  # each f16 partial's power-of-two scale
        n_live = torch.empty(batch_size, dtype=torch.int32, device=device)  # splits holding rows, per sequence
        split_grid, merge_grid = (plan.head_groups, plan.n_splits, batch_size), (heads, k // width, batch_size)
        split_args = (
            ptr(q_lat),
            ptr(q_rope),
            np.int32(heads),
            score_scale,
            ptr(lc_codes),
            ptr(lc_scales),
            ptr(rc_codes),
            ptr(rc_scales),
            ptr(seq_start),
            ptr(seq_len),
            ptr(indices),
            ptr(n_selected),
            np.int32(batch.selected or 0),
            np.int64(batch.n_rows),
            np.int32(plan.padded_heads),
            np.int32(plan.n_splits),
            np.int32(plan.blocks_per_split),
            ptr(o_part),
            ptr(o_scale),
            ptr(lse),
            ptr(n_live),
        )
        merge_args = (
            ptr(o_part),
            ptr(o_scale),
            ptr(lse),
            ptr(n_live),
            np.int32(heads),
            np.int32(plan.padded_heads),
            np.int32(plan.n_splits),
            ptr(result),
        )
        cupy = cupy_module()
        stream = cupy_stream(torch.cuda.current_stream(device), device.index)
        with cupy.cuda.Device(device.index), stream:
            split(split_grid, (256,), split_args, shared_mem=smem)
            merge(merge_grid, (256,), merge_args, shared_mem=4 * plan.n_splits)
        if fast_key is not None:
            self._remember(
                fast_key,
                (split, split_grid, smem, split_args),
                (merge, merge_grid, 4 * plan.n_splits, merge_args),
                (o_part, o_scale, lse, n_live),
                torch.cuda.current_stream(device).cuda_stream,
                wgmma_eligible,
            )
        return result

    def _remember(self, key, split, merge, workspace, stream: int, wgmma_when_captured: bool) -> None:
        """Keep the launch plan of a call that ran, for plain calls with the same signature (and, unless
        ``wgmma_when_captured``, captured ones)."""
        driver = launch.driver_launch()
        split_fn, merge_fn = launch.function_pointer(split[0]), launch.function_pointer(merge[0])
        if driver is None or split_fn is None or merge_fn is None:
            return
        with LOCK:
            if len(self._fast) >= launch.MAX_PLANS:  # signatures come and go (batch sizes): keep the recent
                self._fast.clear()
            self._fast[key] = launch.ReplayedCall(
                self,
                driver,
                launch.PackedLaunch(split_fn, split[1], (256, 1, 1), split[2], split[3]),
                launch.PackedLaunch(merge_fn, merge[1], (256, 1, 1), merge[2], merge[3]),
                workspace,
                stream,
                wgmma_when_captured,
            )


def _aligned(*tensors: torch.Tensor) -> bool:
    """The kernels read 16-byte vectors: row arrays must start on 16-byte boundaries."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)
