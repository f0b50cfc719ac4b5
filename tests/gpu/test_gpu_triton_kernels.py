"""The Triton kernels for f32 and bf16 rows against the float64 reference.

On a CUDA device: the attention conformance suite (f32 and bf16, T = 1 .. 1M, H = 16 / 64 / 128, one
sequence and 8 ragged ones, inert rows, ``out=``, reasons), lengths on the host and on the device,
and a CUDA graph replayed with new lengths. On the CPU (CI): the same kernels through Triton's
interpreter (``TRITON_INTERPRET=1``, in a child process because the variable is read at import),
ragged and empty sequences, several split plans, rows past the sequences (NaN, never read), widths
that are not powers of two and a strided query included.

Bound: the products run in tf32 with f32 accumulation; the relative error against float64 measured
on the H200 is ~1e-3, asserted < 4e-3 (the fp8 and int4 kernels' bound). The interpreter computes
the products in f32, so there the same bound checks the masking, splits and merge.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
import textwrap

import pytest
import torch

from conformance.attention import AttentionConformance
from kvstore.gpu import registry, testing

BOUND = 4e-3
RUN_SEED = secrets.randbits(31)  # fresh data every run; printed with any failure
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.gpu
class TestTritonKernels(AttentionConformance):
    backend_name = "triton"
    device = "cuda"
    bound = {"*": BOUND}
    kv_lora = 512
    qk_rope = 64
    cases = tuple(
        (kind, longest, heads)
        for kind in ("single", "ragged")
        for heads in (16, 64, 128)
        for longest in (1, 7, 4097, 32768, 131072, 1 << 20)
        if heads == 16 or longest <= 131072
    )


@pytest.mark.gpu
def test_the_engine_picks_triton_for_f32_and_bf16_on_cuda():
    for tier in ("f32", "bf16"):
        assert registry.select(tier, "cuda", kv_lora=512, qk_rope=64).backend == "triton"
    assert registry.select("fp8", "cuda", kv_lora=512, qk_rope=64).backend == "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["f32", "bf16"])
def test_host_lengths_and_a_graph_replayed_with_new_lengths(tier):
    """Lengths given on the host or on the device give the same answer, and one captured call serves
    every length that fits: each replay plans from the lengths it finds (what the engine's decode
    graphs rely on)."""
    backend = registry.instance("triton", "cuda")
    seed = RUN_SEED + 31
    case = testing.make_case(tier, testing.ragged_lengths(40000, 8, seed), 16, device="cuda", seed=seed)
    ref = testing.reference(case)
    host = testing.make_case(tier, testing.ragged_lengths(40000, 8, seed), 16, device="cuda", seed=seed)
    host.seq_start, host.seq_len = host.seq_start.cpu(), host.seq_len.cpu()
    assert testing.relative_error(testing.decode(host, backend=backend), ref) < BOUND, f"seed {seed}"
    out = torch.full_like(testing.poisoned_out(case), float("nan"))
    batch = case.batch(trusted=True)
    backend.decode(case.q_lat, case.q_rope, batch, case.softmax_scale, out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.decode(case.q_lat, case.q_rope, batch, case.softmax_scale, out)
    graph.replay()
    torch.cuda.synchronize()
    assert testing.relative_error(out, ref) < BOUND, f"seed {seed}"
    case.seq_len.copy_(torch.div(case.seq_len, 3, rounding_mode="floor"))  # shorter: same graph
    graph.replay()
    torch.cuda.synchronize()
    assert testing.relative_error(out, testing.reference(case)) < BOUND, f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("tier,selected", [("fp8", None), ("f32", 64), ("bf16", 64)])
def test_batches_the_kernels_lack_take_the_torch_path(tier, selected):
    """The one entry point runs any batch: a quantized tier or selected rows give the torch
    backend's result, bit for bit."""
    backend = registry.instance("triton", "cuda")
    seed = RUN_SEED + 37
    case = testing.make_case(
        tier, testing.ragged_lengths(3000, 4, seed), 16, device="cuda", seed=seed, selected=selected
    )
    torch_path = testing.decode(case, backend=registry.instance("torch", "cuda"))
    assert torch.equal(testing.decode(case, testing.poisoned_out(case), backend=backend), torch_path)


_INTERPRETED = textwrap.dedent(
    """
    import json, sys
    import torch
    from kvstore.gpu import testing, triton_backend
    from kvstore.gpu.triton_backend import dense_decode
    seed = int(sys.argv[1])
    report = []
    cases = [  # (tier, lengths, heads, SMs the plan fills, kv_lora, qk_rope)
        ("f32", [300], 16, 4, 128, 32), ("bf16", [300], 16, 4, 128, 32),
        ("f32", testing.ragged_lengths(257, 8, seed), 16, 4, 128, 32),
        ("bf16", testing.ragged_lengths(257, 8, seed), 20, 64, 128, 32), ("f32", [0, 0], 16, 4, 128, 32),
        ("f32", [1, 0, 70], 16, 1, 128, 32), ("f32", [50, 0, 17], 8, 2, 96, 32), ("bf16", [33], 3, 2, 48, 16),
        ("f32", [40, 9], 16, 2, 512, 64), ("bf16", [21, 0, 64], 16, 2, 200, 64),  # merges in several dim chunks
    ]
    for tier, lengths, heads, n_sm, kv_lora, qk_rope in cases:
        case = testing.make_case(tier, lengths, heads, kv_lora=kv_lora, qk_rope=qk_rope, device="cpu", seed=seed)
        out = testing.poisoned_out(case)
        q_lat = case.q_lat.transpose(0, 1).contiguous().transpose(0, 1)  # strided: batch is not outermost
        if tier == "f32" and len(lengths) > 1:  # rows past the sequences (a pool's room) are never read
            case.lc_codes = torch.cat([case.lc_codes, torch.full_like(case.lc_codes[:40], float("nan"))])
            case.rc_codes = torch.cat([case.rc_codes, torch.full_like(case.rc_codes[:40], float("nan"))])
        dense_decode(q_lat, case.q_rope, case.lc_codes, case.rc_codes, case.seq_start, case.seq_len,
                     case.softmax_scale, out, n_sm=n_sm)
        ref = testing.reference(case)
        empty = case.seq_len == 0
        report.append({
            "case": f"{tier} {lengths} H{heads} K{kv_lora} R{qk_rope}",
            "splits": max(triton_backend.plan_splits(lengths, heads, n_sm)[1]),
            "err": 0.0 if bool(empty.all()) else testing.relative_error(out, ref),
            "finite": bool(torch.isfinite(out).all()),
            "empty_zero": bool((out[empty] == 0).all()),
        })
    print(json.dumps(report))
    """
)


@needs_triton
def test_kernels_under_the_interpreter_match_float64():
    """The split and merge kernels themselves, run by Triton's interpreter on CPU tensors."""
    import json

    seed = RUN_SEED + 41
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, str(seed)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(row["splits"] > 1 for row in report), "some case must be cut into several splits"
    for row in report:
        assert row["finite"] and row["empty_zero"], f"{row} (seed {seed})"
        assert row["err"] < BOUND, f"{row} (seed {seed})"


def test_the_triton_backend_is_declared_for_cuda_only():
    spec = registry.spec_of("triton")
    assert spec.device_types == frozenset({"cuda"}) and spec.tiers == frozenset({"f32", "bf16"})
    assert not spec.selected  # the selected-rows variant of dense rows stays on the torch path
    assert registry.select("f32", "cpu", kv_lora=512, qk_rope=64).backend == "torch"
    assert "runs on ['cuda'], not cpu" in registry.reasons("triton", "cpu", tier="f32")
