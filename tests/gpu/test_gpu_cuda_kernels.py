"""The CUDA kernels against the float64 reference, on fresh random data, on a CUDA device.

The generic checks are the attention conformance suite (every declared tier, dense and selected,
T = 1 .. 1M, H = 16 / 64 / 128, one sequence and 8 ragged ones, inert rows, ``out=``, reasons);
below, what only the kernels have: their launch variants, geometries, streams and NaN-code paths.

Bound: the kernels round q (per head, power-of-two scaled) and the softmax weights to f16 and, for
int4, the 16 levels to f16; codes are exact and every product accumulates in f32. An emulation of
those roundings gives ||out - ref|| / ||ref|| of 2e-4 to 1.2e-3 over T = 7 .. 200k; asserted < 4e-3.
Every output is NaN-poisoned before the call, so an element the kernels skip fails the check.
"""

from __future__ import annotations

import dataclasses
import secrets

import pytest
import torch

from conformance.attention import AttentionConformance
from kvstore.gpu import AttentionInputError, nvrtc, testing
from kvstore.gpu.cuda_backend import CudaBackend
from kvstore.gpu.registry import as_tier, get_backend

pytestmark = pytest.mark.gpu

KERNEL_BOUND = 4e-3
RUN_SEED = secrets.randbits(31)  # fresh data every run; printed with any failure
LENGTHS = [1, 7, 4097, 32768, 131072, 1 << 20]
HEADS = [16, 64, 128]
SELECTED = 2048  # a sparse-attention selection's size
TIERS = ["fp8", "int4"]


class TestCudaKernels(AttentionConformance):
    backend_name = "cuda"
    device = "cuda"
    bound = {"*": KERNEL_BOUND}
    kv_lora = 512
    qk_rope = 64
    cases = tuple((kind, longest, heads) for kind in ("single", "ragged") for heads in HEADS for longest in LENGTHS)
    selected_rows = SELECTED


@pytest.fixture(scope="module")
def cuda_backend():
    backend = get_backend("cuda")
    assert backend.name == "cuda", "the CUDA kernels must be the backend chosen on a CUDA device"
    return backend


def _check(case, backend, seed, **kwargs):
    out = testing.poisoned_out(case)
    result = testing.decode(case, out, backend=backend, **kwargs)
    assert result is out
    err = testing.relative_error(out, testing.reference(case))
    assert err < KERNEL_BOUND, f"rel err {err:.3e} >= {KERNEL_BOUND} (seed {seed})"
    empty = case.n_selected == 0 if case.selected else case.seq_len == 0
    assert bool((out[empty.to(out.device)] == 0).all()), "a sequence with no rows must get a zero context"
    return err


@pytest.mark.parametrize("tier", TIERS)
def test_host_lengths_and_unchecked_calls(cuda_backend, tier):
    """Lengths on the device bound the split plan by N (no synchronization); on the host it is exact."""
    seed = RUN_SEED + 11
    case = testing.make_case(tier, testing.ragged_lengths(50000, 8, seed), 64, device="cuda", seed=seed)
    ref = testing.reference(case)
    on_device = testing.decode(case, testing.poisoned_out(case), backend=cuda_backend, trusted=True)
    assert testing.relative_error(on_device, ref) < KERNEL_BOUND, f"seed {seed}"
    case.seq_start, case.seq_len = case.seq_start.cpu(), case.seq_len.cpu()
    on_host = testing.decode(case, testing.poisoned_out(case), backend=cuda_backend)
    assert testing.relative_error(on_host, ref) < KERNEL_BOUND, f"seed {seed}"


@pytest.mark.parametrize("kv_lora,qk_rope,heads", [(256, 32, 20), (128, 64, 48), (96, 32, 16)])
def test_other_geometries(cuda_backend, kv_lora, qk_rope, heads):
    """Other instantiations (padded head groups), and a width the kernels lack (torch path)."""
    seed = RUN_SEED + kv_lora + heads
    for tier in TIERS if kv_lora != 96 else ("fp8",):
        case = testing.make_case(
            tier,
            testing.ragged_lengths(3000, 4, seed),
            heads,
            kv_lora=kv_lora,
            qk_rope=qk_rope,
            device="cuda",
            seed=seed,
        )
        _check(case, cuda_backend, seed)


def test_kernels_run_on_the_callers_stream(cuda_backend):
    seed = RUN_SEED + 9
    case = testing.make_case("int4", [70000], 64, device="cuda", seed=seed)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = testing.decode(case, backend=cuda_backend, trusted=True)
    torch.cuda.current_stream().wait_stream(side)
    err = testing.relative_error(out, testing.reference(case))
    assert err < KERNEL_BOUND, f"rel err {err:.3e} (seed {seed})"


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("selected", [False, True], ids=["dense", "selected"])
@pytest.mark.parametrize("heads,longest", [(16, 4097), (64, 131072), (128, 7)])
def test_v1_kernels_still_match(tier, selected, heads, longest):
    """The first-generation kernels (still used for kv_lora 128/256) at kv_lora 512 too."""
    backend = CudaBackend(torch.device("cuda"), variant="v1")
    seed = RUN_SEED + 17 * heads + longest
    case = testing.make_case(
        tier,
        testing.ragged_lengths(longest, 8, seed),
        heads,
        device="cuda",
        seed=seed,
        selected=min(longest, SELECTED) if selected else None,
    )
    _check(case, backend, seed)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("max_mt", [1, 2])
@pytest.mark.parametrize("heads,longest,qk_rope", [(64, 70000, 64), (128, 4097, 64), (48, 9000, 32), (20, 3000, 64)])
def test_v2_head_group_sizes(tier, max_mt, heads, longest, qk_rope):
    """v2 with 16 or 32 heads per block (more head groups), also with padded groups and qk_rope 32."""
    backend = CudaBackend(torch.device("cuda"), variant="v2", max_mt=max_mt)
    seed = RUN_SEED + 23 * heads + max_mt
    case = testing.make_case(
        tier, testing.ragged_lengths(longest, 4, seed), heads, qk_rope=qk_rope, device="cuda", seed=seed
    )
    _check(case, backend, seed)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(
    "lengths,qk_rope,nan_rate",
    [([1 << 20], 64, 0.0), ([70000, 1, 4097, 333], 64, 0.02), ([9000, 65], 32, 0.0), ([5000, 700], 32, 0.02)],
)
def test_16_head_blocks_every_rope_width(cuda_backend, tier, lengths, qk_rope, nan_rate):
    """16-head blocks over every swizzled rope layout (fp8 rope rows of 64 / 32 bytes, int4 of 32 /
    16), ragged sequences and fp8 NaN codes, dense and selected rows."""
    seed = RUN_SEED + 41 * len(lengths) + qk_rope
    case = testing.make_case(
        tier, lengths, 16, qk_rope=qk_rope, device="cuda", seed=seed, nan_rate=nan_rate if tier == "fp8" else 0.0
    )
    _check(case, cuda_backend, seed)
    sel = testing.make_case(tier, lengths, 16, qk_rope=qk_rope, device="cuda", seed=seed + 1, selected=2048)
    _check(sel, cuda_backend, seed + 1)


@pytest.mark.parametrize("min_tiles", [4, 64])
def test_longer_splits(min_tiles):
    """Fewer, longer splits (the planner's min_tiles) give the same context."""
    backend = CudaBackend(torch.device("cuda"), min_tiles=min_tiles)
    seed = RUN_SEED + 43 + min_tiles
    case = testing.make_case("fp8", testing.ragged_lengths(40000, 4, seed), 16, device="cuda", seed=seed)
    _check(case, backend, seed)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("merge_dims", [32, 128, 512])
def test_every_merge_width_over_mostly_empty_splits(tier, merge_dims):
    """Each merge width gives the same context; lengths on the device bound the plan by the whole
    row array, so most splits hold no rows and the merge must weigh only those that do (and a
    sequence with no rows still gets zeros)."""
    backend = CudaBackend(torch.device("cuda"), merge_dims=merge_dims)
    seed = RUN_SEED + 71 + merge_dims
    case = testing.make_case(tier, testing.ragged_lengths(30000, 16, seed), 16, device="cuda", seed=seed)
    assert case.seq_len.device.type == "cuda"
    _check(case, backend, seed)
    with pytest.raises(ValueError, match="merge_dims"):
        CudaBackend(torch.device("cuda"), merge_dims=64)


@pytest.mark.parametrize("nan_rate", [0.0, 0.05])
def test_fp8_with_and_without_nan_codes(cuda_backend, nan_rate):
    """v2 takes its fast path on NaN-free tiles and clears NaN codes where a tile holds some."""
    seed = RUN_SEED + 31
    case = testing.make_case("fp8", [20000, 333], 16, device="cuda", seed=seed, nan_rate=nan_rate)
    _check(case, cuda_backend, seed)


def test_whole_rows_of_nan_codes(cuda_backend):
    """Rows made only of NaN codes decode as zero rows (score 0, zero value)."""
    seed = RUN_SEED + 37
    case = testing.make_case("fp8", [3000], 16, device="cuda", seed=seed, nan_rate=0.0)
    start = int(case.seq_start[0])
    case.lc_codes[start + 64 : start + 200] = 0xFF
    case.rc_codes[start + 100 : start + 300] = 0x7F
    _check(case, cuda_backend, seed)


def _same_shapes_new_values(case):
    """Another problem with the case's exact shapes (a replayable signature): rows rolled, new queries."""
    rolled = {name: getattr(case, name).roll(7, 0) for name in ("lc_codes", "lc_scales", "rc_codes", "rc_scales")}
    return dataclasses.replace(case, q_lat=torch.randn_like(case.q_lat), q_rope=torch.randn_like(case.q_rope), **rolled)


@pytest.mark.parametrize("tier", TIERS)
def test_plain_calls_replay_a_cached_plan_with_new_operands(tier):
    """A repeated plain call (a trusted batch) replays its launch plan: it must attend the operands
    it is given now (new rows, new bounds, a new out), on any stream, and inside a CUDA graph."""
    seed = RUN_SEED + 41
    backend = CudaBackend(torch.device("cuda"))
    first = testing.make_case(tier, [30000, 1000], 16, device="cuda", seed=seed)
    second = _same_shapes_new_values(first)
    for case in (first, second, first):
        out = testing.decode(case, testing.poisoned_out(case), backend=backend, trusted=True)
        assert testing.relative_error(out, testing.reference(case)) < KERNEL_BOUND
    assert backend.fast_calls == 2, "the second and third calls must replay the first one's plan"
    fresh = testing.decode(second, None, backend=backend, trusted=True)  # out=None: its own signature
    again = testing.decode(second, None, backend=backend, trusted=True)
    assert backend.fast_calls == 3 and fresh.data_ptr() != again.data_ptr()
    assert torch.equal(fresh, again)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = testing.decode(first, testing.poisoned_out(first), backend=backend, trusted=True)
    torch.cuda.current_stream().wait_stream(side)
    assert testing.relative_error(out, testing.reference(first)) < KERNEL_BOUND
    out = testing.poisoned_out(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        testing.decode(first, out, backend=backend, trusted=True)
    for name in ("q_lat", "q_rope", "lc_codes", "lc_scales", "rc_codes", "rc_scales", "seq_start", "seq_len"):
        getattr(first, name).copy_(getattr(second, name))
    graph.replay()
    torch.cuda.synchronize()
    assert testing.relative_error(out, testing.reference(second)) < KERNEL_BOUND
    # back on the first stream after the others: its own workspace again, and the right answer
    again = testing.decode(first, testing.poisoned_out(first), backend=backend, trusted=True)
    assert testing.relative_error(again, testing.reference(first)) < KERNEL_BOUND


def test_a_replayed_plan_serves_only_the_calls_it_fits():
    """The plan is keyed by every operand's shape, dtype and device: a checked batch of the wrong
    shape is refused when it is made, and a call of the plan's signature whose rows the kernels
    cannot read as 16-byte vectors runs without it. A checked call of the same signature replays it
    after its checks."""
    seed = RUN_SEED + 43
    backend = CudaBackend(torch.device("cuda"))
    case = testing.make_case("fp8", [5000], 16, device="cuda", seed=seed)
    for _ in range(2):
        testing.decode(case, testing.poisoned_out(case), backend=backend, trusted=True)
    with pytest.raises(AttentionInputError, match="lc_codes must be u8"):
        testing.decode(dataclasses.replace(case, lc_codes=case.lc_codes[:, :100]), backend=backend)  # the wrong width
    before = backend.fast_calls
    testing.decode(case, testing.poisoned_out(case), backend=backend)
    assert backend.fast_calls == before + 1
    misaligned = _same_shapes_new_values(case)
    shifted = torch.empty(misaligned.lc_codes.numel() + 1, dtype=torch.uint8, device="cuda")[1:]
    misaligned.lc_codes = shifted.view(case.lc_codes.shape).copy_(misaligned.lc_codes)
    before = backend.fast_calls
    out = testing.decode(misaligned, backend=backend, trusted=True)  # same signature, an address off 16 bytes
    assert backend.fast_calls == before
    assert testing.relative_error(out, testing.reference(misaligned)) < KERNEL_BOUND


# sm_89 (L4, L40S, RTX 4090) and sm_120 (RTX 5090): 99 KB of shared memory a block, 100 KB an SM
SMALL_BLOCK, SMALL_SM = nvrtc.DEVICE_SHARED_MEMORY["sm_89"]


def test_this_device_runs_every_geometry_with_the_plans_it_was_measured_with():
    """On the H200 every split kernel fits: nothing is refused, and 16-head blocks keep two per SM."""
    backend = CudaBackend(torch.device("cuda"))
    for tier in TIERS:
        for kv_lora, qk_rope in [(512, 64), (512, 32), (256, 64), (128, 32)]:
            assert backend.shared_memory_reasons(as_tier(tier), kv_lora, qk_rope) == []
        assert backend.split_fits(True, 512, 64, TIERS.index(tier)) == {1: 2, 2: 1, 4: 1}  # fmt: 0 fp8, 1 int4


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("heads", [16, 64])
def test_a_device_of_smaller_blocks_plans_within_them(tier, heads):
    """With a 99 KB block (this device's limits set to an sm_89's) the split kernels that fit run,
    with fewer heads per block and one block per SM, and the ones that do not fit (fp8 at kv_lora
    512) run the torch path, which the registry's reasons name; every output matches float64."""
    backend = CudaBackend(torch.device("cuda"), wgmma=False)
    backend.block_shared_memory, backend.sm_shared_memory = SMALL_BLOCK, SMALL_SM
    seed = RUN_SEED + 59 * heads + len(tier)
    case = testing.make_case(tier, testing.ragged_lengths(70000, 4, seed), heads, device="cuda", seed=seed)
    why = backend.shared_memory_reasons(as_tier(tier), 512, 64)
    fits = backend.split_fits(True, 512, 64, TIERS.index(tier))  # fmt: 0 fp8, 1 int4
    if tier == "fp8":
        assert not fits and why and "101,376" in why[0], why
    else:
        assert not why and max(fits) == 2 and fits[1] == 1, fits
    _check(case, backend, seed)
