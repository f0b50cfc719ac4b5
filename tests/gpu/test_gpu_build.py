"""The CUDA kernels built with no GPU: every instantiation the backend can ask for compiles for the
architectures it runs on, within the registers its launch plan counts on, and the launch plan of
every geometry fits the shared memory of each class of device (NVRTC from the ``nvidia-cuda-nvrtc``
wheel through :mod:`kvstore.gpu.nvrtc`, the compiler and options the backend uses through cupy).

Without NVRTC these tests skip, except in CI (``KVSTORE_CI=1``: the ``test`` extra installs it),
where they fail instead.
"""

from __future__ import annotations

import functools

import pytest

from kvstore import config
from kvstore.gpu import cuda_plan, nvrtc, registry
from kvstore.gpu.cuda_build import kernel_source
from kvstore.gpu.errors import KernelBuildError

SPEC = registry.spec_of("cuda")
GEOMETRIES = [(k, r) for k in SPEC.kv_lora for r in SPEC.qk_rope]
#: Threads of a split kernel's block (THREADS in the source) and the registers of an SM.
THREADS, SM_REGISTERS = 256, 65536
#: Spill traffic a kernel may have, bytes a thread: a few words are noise; a tile's worth is a
#: regression that costs time on the H200 (docs/GPU-LOG.md).
MAX_SPILL = 64


@pytest.fixture(scope="module", autouse=True)
def _nvrtc():
    try:
        nvrtc.library()
    except KernelBuildError as exc:
        if config.CI.get():
            pytest.fail(f"CI installs NVRTC with the test extra: {exc}")
        pytest.skip(str(exc))


@functools.lru_cache(maxsize=None)
def _build(arch: str) -> nvrtc.Build:
    names = [name for k, r in GEOMETRIES for name in cuda_plan.instantiations(k, r)]
    return nvrtc.compile_source(kernel_source(), list(dict.fromkeys(names)), arch)


@functools.lru_cache(maxsize=None)
def _needs() -> dict[tuple, dict[int, int]]:
    """(v2, kv_lora, qk_rope, fmt) -> m-tiles -> the split kernel's dynamic shared memory."""
    return nvrtc.split_shared_memory(kernel_source(), GEOMETRIES)


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_every_instantiation_compiles_within_the_registers_its_plan_counts_on(arch):
    build = _build(arch)
    assert "warning" not in build.log.lower(), build.log
    assert len(build.resources) == len(build.lowered) > 150
    for name, used in build.resources.items():
        assert used.registers <= 255, (name, used)
        assert used.spill_stores <= MAX_SPILL and used.spill_loads <= MAX_SPILL, (name, used)
        if name.startswith(("mla_decode_v2<1,", "mla_decode_split<1,")):
            # the planner runs two 16-head blocks per SM: their registers must allow it
            assert 2 * THREADS * used.registers <= SM_REGISTERS, (name, used)


@pytest.mark.parametrize("device", sorted(nvrtc.DEVICE_SHARED_MEMORY))
def test_every_planned_launch_fits_the_devices_shared_memory(device):
    """Each geometry, tier, kernel generation and head count: the blocks the plan puts on an SM
    fit its shared memory, or the backend says the configuration does not fit (and the torch path
    runs it)."""
    block, sm = nvrtc.DEVICE_SHARED_MEMORY[device]
    for (v2, k, r, fmt), needs in _needs().items():
        fits = cuda_plan.fitting_m_tiles(needs, block, sm, 4)
        assert all(m in fits for m in cuda_plan.M_TILES if m <= max(fits, default=0)), (fits, needs)
        for heads in (1, 16, 20, 48, 64, 128):
            if not fits:
                continue
            plan = cuda_plan.plan_launch(3, heads, 70000, 40000, 132, max(fits), 1, fits)
            used = needs[plan.m_tiles]
            assert used <= block, (device, v2, k, r, fmt, heads, plan)
            assert plan.blocks_per_sm * (used + cuda_plan.RESERVED_SHARED_MEMORY) <= sm, (device, plan, used)


def test_the_h200_keeps_the_plans_it_was_measured_with():
    """On sm_90 every split kernel fits with the launch bounds' blocks per SM (16-head blocks two
    to an SM): the plans of docs/GPU-LOG.md's tables."""
    block, sm = nvrtc.DEVICE_SHARED_MEMORY["sm_90"]
    for (v2, k, r, fmt), needs in _needs().items():
        assert cuda_plan.fitting_m_tiles(needs, block, sm, 4) == {1: 2, 2: 1, 4: 1}, (v2, k, r, fmt, needs)


def test_a_99_kb_block_runs_int4_with_fewer_heads_and_deepseeks_fp8_rows_on_the_torch_path():
    block, sm = nvrtc.DEVICE_SHARED_MEMORY["sm_89"]
    needs = _needs()
    # fp8 at DeepSeek's geometry (kv_lora 512, qk_rope 64): even a 16-head block holds over 99 KB
    # (a query tile and two stages of 576-byte rows), in both kernel generations
    assert cuda_plan.fitting_m_tiles(needs[(True, 512, 64, 0)], block, sm) == {}
    assert cuda_plan.fitting_m_tiles(needs[(False, 512, 64, 0)], block, sm) == {}
    # with 544-byte rows a 16-head block fits, one to an SM
    assert cuda_plan.fitting_m_tiles(needs[(True, 512, 32, 0)], block, sm) == {1: 1}
    for r in (32, 64):
        # int4 rows are half as wide: 16 and 32 heads a block, one block an SM
        assert cuda_plan.fitting_m_tiles(needs[(True, 512, r, 1)], block, sm) == {1: 1, 2: 1}
    # the narrower geometries keep 32-head blocks
    assert max(cuda_plan.fitting_m_tiles(needs[(False, 256, 64, 0)], block, sm)) == 2


def test_a_source_that_does_not_compile_raises_with_the_compilers_log():
    source = kernel_source().replace("#define BN 64", "#define BN 64 +", 1)
    with pytest.raises(KernelBuildError, match=r"could not compile for sm_90[\s\S]*error"):
        nvrtc.compile_source(source, [cuda_plan.unrotate_kernel(512)], "sm_90")


def test_a_missing_library_is_named(monkeypatch, tmp_path):
    missing = tmp_path / "libnvrtc.so.13"
    monkeypatch.setenv("KVSTORE_NVRTC", str(missing))
    nvrtc.library.cache_clear()
    try:
        with pytest.raises(KernelBuildError, match="nvidia-cuda-nvrtc") as caught:
            nvrtc.library()
        assert str(missing) in str(caught.value)
    finally:
        monkeypatch.delenv("KVSTORE_NVRTC")
        nvrtc.library.cache_clear()
