"""The warpgroup-MMA kernels (``kvstore.gpu.wgmma_kernels``: fp8 and rotated int4, 64+ heads, sm_90,
warp-specialized; the CUDA backend's default there) against the float64 reference, on a CUDA device.

Bound as for the other CUDA kernels: q (per head, power-of-two scaled) and the softmax weights are
rounded to f16, codes are exact (int4 levels rounded to f16), every product accumulates in f32;
asserted < 4e-3. Outputs are NaN-poisoned before each call, so an element the kernels skip fails
the check.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from kvstore import config
from kvstore.gpu import testing
from kvstore.gpu.cuda_backend import CudaBackend

pytestmark = pytest.mark.gpu

KERNEL_BOUND = 4e-3
RUN_SEED = secrets.randbits(31)


@pytest.fixture(scope="module")
def wgmma_backend():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup-MMA kernels are built for sm_90")
    return CudaBackend(torch.device("cuda"), wgmma=True)


def _check(case, backend, seed):
    out = testing.poisoned_out(case)
    assert testing.decode(case, out, backend=backend) is out
    err = testing.relative_error(out, testing.reference(case))
    assert err < KERNEL_BOUND, f"rel err {err:.3e} >= {KERNEL_BOUND} (seed {seed})"


@pytest.mark.parametrize("heads", [64, 100, 128, 192])
@pytest.mark.parametrize("longest", [1, 7, 4097, 131072, 1 << 20])
@pytest.mark.parametrize("kind", ["single", "ragged"])
@pytest.mark.parametrize("tier", ["fp8", "int4"])
def test_dense_against_float64(wgmma_backend, tier, heads, longest, kind):
    if longest == 1 << 20 and heads not in (64, 128):
        pytest.skip("1M rows at the model head counts only")
    seed = RUN_SEED + heads + longest
    lengths = [longest] if kind == "single" else testing.ragged_lengths(longest, 8, seed)
    case = testing.make_case(tier, lengths, heads, device="cuda", seed=seed, nan_rate=0.0)
    _check(case, wgmma_backend, seed)


@pytest.mark.parametrize("nan_rate", [1e-3, 0.05])
def test_nan_codes_read_as_zero(wgmma_backend, nan_rate):
    """A tile whose scores show a NaN is converted again with the NaN codes cleared and scored again."""
    seed = RUN_SEED + 7
    case = testing.make_case(
        "fp8", testing.ragged_lengths(40000, 8, seed), 128, device="cuda", seed=seed, nan_rate=nan_rate
    )
    _check(case, wgmma_backend, seed)


def test_whole_rows_of_nan_codes(wgmma_backend):
    seed = RUN_SEED + 11
    case = testing.make_case("fp8", [5000], 64, device="cuda", seed=seed, nan_rate=0.0)
    case.lc_codes[100:164] = 0x7F
    case.rc_codes[2000:2010] = 0xFF
    _check(case, wgmma_backend, seed)


@pytest.mark.parametrize("tier", ["fp8", "int4"])
def test_a_captured_graph_follows_the_lengths(wgmma_backend, tier):
    """The plan is derived on the device from the lengths (and int4's query rotated, its context
    un-rotated, in the same stream): one graph replays at other lengths."""
    seed = RUN_SEED + 13
    case = testing.make_case(tier, [30000, 12000, 0, 9000], 128, device="cuda", seed=seed, nan_rate=0.0)
    out = testing.poisoned_out(case)
    testing.decode(case, out, backend=wgmma_backend, trusted=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        testing.decode(case, out, backend=wgmma_backend, trusted=True)
    for lengths in ([30000, 12000, 0, 9000], [17, 11999, 4000, 1]):
        case.seq_len.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = testing.relative_error(out, testing.reference(case))
        assert err < KERNEL_BOUND, f"{lengths}: rel err {err:.3e} (seed {seed})"


def test_the_default_backend_sends_captured_calls_to_them_and_short_plain_calls_to_v2(wgmma_backend):
    """Left to choose, a backend runs these kernels in CUDA graphs (no host time in a replay) and
    keeps plain calls with lengths on the device on v2, whose replayed launch plan costs less host
    time than the kernels' three Triton launches (cuda_plan.wgmma_for_call)."""
    from kvstore.gpu.cuda_plan import triton_version, wgmma_by_default

    default = CudaBackend(torch.device("cuda"))
    assert default.wgmma == wgmma_by_default(triton_version(), config.GPU_WGMMA.get())
    if not default.wgmma or default.wgmma_always:
        pytest.skip("another Triton release, or KVSTORE_GPU_WGMMA set: nothing left to choose")
    v2 = CudaBackend(torch.device("cuda"), wgmma=False)
    case = testing.make_case("fp8", [5000, 300], 64, device="cuda", seed=RUN_SEED + 17, nan_rate=0.0)
    # the same kernels give the same bits: a plain call here is v2's
    plain = testing.decode(case, testing.poisoned_out(case), backend=default, trusted=True)
    assert torch.equal(plain, testing.decode(case, testing.poisoned_out(case), backend=v2, trusted=True))
    # and a captured one (after that plain call left its launch plan) the warpgroup-MMA kernels'
    theirs = testing.decode(case, testing.poisoned_out(case), backend=wgmma_backend, trusted=True)
    torch.cuda.synchronize()  # (compiled outside the capture)
    captured = testing.poisoned_out(case)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        testing.decode(case, captured, backend=default, trusted=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, theirs)
