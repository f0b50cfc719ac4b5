"""The pure-torch backend (the fallback without cupy/CUDA, and Metal's code path) against float64.

Runs on the CPU in CI. Bound: the torch path computes in f32 (dequantize + matmul, online softmax
over 16k-row chunks); ||out - ref|| / ||ref|| stays near 1e-6, asserted below 2e-5.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from kvstore.gpu import testing
from kvstore.gpu.registry import get_backend
from kvstore.gpu.torch_backend import TorchBackend

TORCH_BOUND = 2e-5
RUN_SEED = secrets.randbits(31)  # fresh data every run; printed with any failure

CASES = [
    # (lengths kind, T, H): every H at the short lengths, the long ones at one H each
    *[("single", t, h) for t in (1, 7, 4097) for h in (16, 64, 128)],
    ("single", 32768, 16),
    *[("ragged", t, h) for t in (7, 4097) for h in (16, 64)],
]


def _lengths(kind: str, longest: int, seed: int) -> list[int]:
    return [longest] if kind == "single" else testing.ragged_lengths(longest, 8, seed)


@pytest.mark.parametrize("tier", ["fp8", "tq-int4"])
@pytest.mark.parametrize("selected", [False, True], ids=["dense", "selected"])
@pytest.mark.parametrize("kind,longest,heads", CASES)
def test_torch_backend_matches_float64(tier, selected, kind, longest, heads):
    seed = RUN_SEED + longest * 131 + heads
    case = testing.make_case(tier, _lengths(kind, longest, seed), heads, seed=seed,
                             selected=min(longest, 2048) if selected else None)
    out = testing.poisoned_out(case)
    result = testing.decode(case, out, backend=TorchBackend(torch.device("cpu")))
    assert result is out
    ref = testing.reference(case)
    err = testing.relative_error(out, ref)
    assert err < TORCH_BOUND, f"rel err {err:.3e} >= {TORCH_BOUND} (seed {seed})"
    empty = case.seq_len == 0 if not selected else case.n_selected == 0
    assert bool((out[empty] == 0).all()), "a sequence with no rows must get a zero context"


def test_default_backend_on_cpu_is_torch():
    case = testing.make_case("fp8", [300, 5], 16, kv_lora=128, qk_rope=32, seed=RUN_SEED)
    assert get_backend("cpu").name == "torch"
    err = testing.relative_error(testing.decode(case), testing.reference(case))
    assert err < TORCH_BOUND


def test_nan_codes_read_as_zero():
    """A row made only of NaN codes with a huge scale contributes exactly like a zero row."""
    case = testing.make_case("fp8", [40], 16, kv_lora=128, qk_rope=32, seed=RUN_SEED + 1)
    zeroed = testing.make_case("fp8", [40], 16, kv_lora=128, qk_rope=32, seed=RUN_SEED + 1)
    row = int(case.seq_start[0]) + 3
    case.lc_codes[row] = torch.where(torch.arange(128) % 2 == 0, 0x7F, 0xFF).to(torch.uint8)
    case.rc_codes[row] = 0x7F
    case.lc_scales[row] = 1e30
    zeroed.lc_codes[row] = 0
    zeroed.rc_codes[row] = 0
    got = testing.decode(case)
    want = testing.decode(zeroed)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, rtol=1e-5, atol=0)


def test_int4_inert_rows_decode_to_zero():
    case = testing.make_case("tq-int4", [64], 16, kv_lora=128, qk_rope=32, seed=RUN_SEED + 2)
    case.lc_scales[:] = 0.0  # every latent row inert: the context is exactly zero
    out = testing.decode(case)
    assert bool((out == 0).all())


def test_validate_false_skips_range_checks_but_not_shape_checks():
    case = testing.make_case("fp8", [10], 16, kv_lora=128, qk_rope=32, seed=RUN_SEED + 3)
    case.q_lat = case.q_lat.double()
    with pytest.raises(ValueError, match="q_lat must be float32"):
        testing.decode(case, validate=False)
