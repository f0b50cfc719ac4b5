"""How the compiled decode regions' kernels launch: programmatic dependent launch on Hopper and later.

With inductor's ``triton.enable_pdl`` a region's kernel may start while the one before it ends, its
set-up overlapping that kernel's tail (+0.7-2.1% tokens/s single-stream on an H100 in an interleaved
A/B, ``bench/engine_ab.py``; BENCHMARKS.md), and so do the engine's own Triton kernels in the step
(:data:`OWN_KERNELS_DEPENDENT`). Inductor's own placement
of the kernels' waits can let a kernel touch memory before the kernel ahead of it is done;
:func:`wait_before_every_access` has every kernel wait first, and the placement is put in inductor's
cache key (:func:`region_options`). On by default where available; ``bench/engine_decode.py
--plain-launches`` turns it off. Read by ``MLAForCausalLM.compile_decode``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = [
    "DEPENDENT_LAUNCH",
    "OWN_KERNELS_DEPENDENT",
    "dependent_launch",
    "dependent_launch_available",
    "inductor_offers_dependent_launch",
    "region_options",
    "wait_before_every_access",
]

#: Compiled regions launch with programmatic dependent launch where available.
DEPENDENT_LAUNCH = True
#: Where they do, the engine's own Triton kernels in the step — the experts', the routing and the
#: cache's encoder — launch dependently too (:func:`own_kernels_dependent`). Inductor launches the
#: user-defined kernels it traces plainly, with no launch attribute, so the experts' and the
#: routing kernels go through custom ops (``kvstore::experts_project_dependently``, ...); the
#: encoder runs between the regions and is launched directly. Each waits for the grid before it
#: (``gdc_wait``) ahead of its first load or store. On an H100, +1.2-2.7% tokens/s single-stream
#: (fp8 and int4, 1k and 32k), unchanged with 16 and 64 sessions (``bench/engine_ab.py --variant
#: "launches.OWN_KERNELS_DEPENDENT=0"``; BENCHMARKS.md).
OWN_KERNELS_DEPENDENT = True


def inductor_offers_dependent_launch() -> bool:
    """Whether this torch's inductor has the ``triton.enable_pdl`` option."""
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config.triton, "enable_pdl")


def dependent_launch_available(device: torch.device) -> bool:
    """Whether compiled regions on ``device`` could launch with programmatic dependent launch: a
    GPU that has it (sm_90+) and an inductor that offers it."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (9, 0)
        and inductor_offers_dependent_launch()
    )


def dependent_launch(device: torch.device) -> bool:
    """Whether compiled regions on ``device`` launch with programmatic dependent launch: asked for
    (``DEPENDENT_LAUNCH``) where it is available. When so, every kernel inductor writes for them
    waits on the kernel before it (``wait_before_every_access``)."""
    return DEPENDENT_LAUNCH and dependent_launch_available(device) and wait_before_every_access()


def own_kernels_dependent(device: torch.device) -> bool:
    """Whether the engine's own Triton kernels launch dependently on ``device`` (a tensor's: CUDA
    ones carry their index): asked for (``OWN_KERNELS_DEPENDENT``) where the compiled regions launch
    so (:func:`dependent_launch`) and this Triton has the wait."""
    return device.type == "cuda" and _own_kernels_dependent_on(device.index or 0)


@torch.compiler.assume_constant_result
def _own_kernels_dependent_on(device_index: int) -> bool:
    """:func:`own_kernels_dependent` for a CUDA device by index: a constant to ``torch.compile`` (the
    device does not change under a region, and a region's trace calls this once)."""
    return OWN_KERNELS_DEPENDENT and DEPENDENT_LAUNCH and _own_kernels_can_wait(device_index)


@functools.lru_cache(maxsize=None)
def _own_kernels_can_wait(device_index: int) -> bool:
    """The device's and the libraries' part of :func:`own_kernels_dependent`, looked up once a
    device (an eager step asks for every layer's write)."""
    from kvstore.gpu.dependent import gdc_wait

    device = torch.device("cuda", device_index)
    return gdc_wait is not None and dependent_launch_available(device) and wait_before_every_access()


def wait_before_every_access() -> bool:
    """Make inductor's dependent-launch kernels wait for the grid before them ahead of their first
    load or store, whichever kernel wrote what they touch.

    Inductor (torch 2.11) puts the wait before an access only when the kernel just before wrote (or,
    for a store, read) that buffer, and otherwise after the first load. A kernel that loads nothing
    (a fill, an iota) then never waits and may end before the kernel ahead of it does; the kernel
    after it waits only on it, so it can read a buffer two kernels back that is still being written.
    Here inductor's own placement runs as if every kernel were a region's first, which always waits.
    Process-wide, idempotent, and it changes only code generated with ``triton.enable_pdl``. False
    where this inductor places its waits in some other way: the regions then launch plainly.
    (Inductor's placement was first suspected of parting a decode's rows; measured since, those rows
    came from the other build, not from any overlap: BENCHMARKS.md.)"""
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.virtualized import V

    placement = getattr(TritonKernel, "_handle_pdl_before_access", None)
    if placement is None:
        return False
    if getattr(placement, "waits_always", False):
        return True

    def wait_always(self: Any, wait_buffer: Any, *dependencies: Any, consider_reads: bool = False) -> None:
        scheduler = V.graph.scheduler
        if scheduler is None:  # no kernel before, as far as inductor knows: its rule waits already
            placement(self, wait_buffer, *dependencies, consider_reads=consider_reads)
            return
        before, scheduler.previous_node = scheduler.previous_node, None
        try:
            placement(self, wait_buffer, *dependencies, consider_reads=consider_reads)
        finally:
            scheduler.previous_node = before

    wait_always.waits_always = True  # type: ignore[attr-defined]
    TritonKernel._handle_pdl_before_access = wait_always  # type: ignore[method-assign]
    return True


def region_options(device: torch.device) -> dict[str, Any]:
    """The inductor options of the compiled regions that say how their kernels launch.

    ``triton.enable_pdl`` is said either way, so an environment's ``TORCHINDUCTOR_ENABLE_PDL=1``
    cannot turn on for these regions what was not checked. With dependent launch on, the wait
    placement is put in inductor's cache key (a graph pass that does nothing but name it): the
    placement is patched code, not a config value, and without this a region could load from the
    cache a graph built under inductor's own placement, whose key is the same."""
    if not inductor_offers_dependent_launch():
        return {}
    dependent = dependent_launch(device)
    options: dict[str, Any] = {"triton.enable_pdl": dependent}
    if dependent:
        options["post_grad_custom_pre_pass"] = _placement_in_cache_key()
    return options


def _placement_in_cache_key() -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class PlacementInCacheKey(CustomGraphPass):
        def __call__(self, graph: Any) -> None:  # changes nothing: it only names the placement
            return None

        def uuid(self) -> str:
            return "kvstore.engine.launches: dependent-launch waits before every access, v1"

    return PlacementInCacheKey()
