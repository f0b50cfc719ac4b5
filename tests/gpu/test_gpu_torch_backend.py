"""The pure-torch backend (every tier; the engine's path, the fallback without cupy/CUDA, Metal's code
path) through the attention conformance suite, on the CPU in CI; the Metal backend through the same
suite where an Apple GPU is present.

Bound: the torch path computes in f32 (decode + matmul, one online softmax over row chunks);
``||out - ref|| / ||ref||`` stays near 1e-6, asserted below 2e-5.
"""

from __future__ import annotations

import pytest
import torch

from conformance.attention import AttentionConformance
from kvstore import tiers
from kvstore.gpu import testing, torch_backend
from kvstore.gpu.inputs import LatentBatch
from kvstore.gpu.registry import get_backend

TORCH_BOUND = 2e-5


class TestTorchBackend(AttentionConformance):
    backend_name = "torch"
    bound = {"*": TORCH_BOUND}
    kv_lora = 512
    qk_rope = 64
    #: the tiers of the CUDA kernels, at the sizes they are checked at there (short of the longest)
    kernel_cases = (
        *[("single", t, h) for t in (1, 7, 4097) for h in (16, 64, 128)],
        ("single", 32768, 16),
        *[("ragged", t, h) for t in (7, 4097) for h in (16, 64)],
    )
    selected_rows = 2048

    def cases_for(self, tier):
        # the other tiers decode through the same streamed code: a one-row, a long and a ragged case
        return (
            self.kernel_cases
            if tier in ("fp8", "int4")
            else (("single", 1, 16), ("single", 3000, 16), ("ragged", 257, 16))
        )


@pytest.mark.gpu
class TestTorchBackendOnCuda(AttentionConformance):
    """The engine's path on CUDA for the tiers the kernels lack (and the fallback without cupy)."""

    backend_name = "torch"
    device = "cuda"
    bound = {"*": TORCH_BOUND}
    kv_lora = 512
    qk_rope = 64
    cases = (("single", 1, 16), ("single", 4097, 64), ("ragged", 4097, 16))
    selected_rows = 2048


class TestMpsBackend(AttentionConformance):
    """Skipped (with the backend's reasons) without an Apple GPU."""

    backend_name = "mps"
    device = "mps"
    bound = {"*": TORCH_BOUND}


def test_default_backend_on_cpu_is_torch():
    case = testing.make_case("fp8", [300, 5], 16, kv_lora=128, qk_rope=32, seed=11)
    assert get_backend("cpu").name == "torch"
    assert testing.relative_error(testing.decode(case), testing.reference(case)) < TORCH_BOUND


def _f32_batch(lc, rc, seq_start, seq_len) -> LatentBatch:
    return LatentBatch(tiers.F32, lc, None, rc, None, seq_start, seq_len, kv_lora=lc.shape[1], qk_rope=rc.shape[1])


def test_streaming_over_many_chunks_matches_one_pass(monkeypatch):
    """Chunks of 7 rows (many of them, some with no visible row) give the one-pass result up to f32
    rounding, which the reordered sums change legitimately.

    Bound: on each side an output element is a rounded sum whose every term went through at most
    m = K + R + N + chunks roundings (the K + R products of a score, carried through exp into its
    weight; the N-term weighted sum; one rescale per chunk), so it is within gamma_m * sum_n
    p_n |L_n| <= gamma_m * max |L| of the exact context, gamma_m = m eps / (1 - m eps) with eps the
    f32 unit roundoff; the two results differ by at most twice that.
    """
    gen = torch.Generator().manual_seed(4)
    heads, k, r, n = 3, 64, 32, 50
    q_lat, q_rope = torch.randn(4, heads, k, generator=gen), torch.randn(4, heads, r, generator=gen)
    lc, rc = torch.randn(n, k, generator=gen) * 2, torch.randn(n, r, generator=gen) * 2
    seq_start = torch.tensor([0, 20, 31, 7], dtype=torch.int32)
    seq_len = torch.tensor([20, 11, 19, 0], dtype=torch.int32)
    backend = torch_backend.TorchBackend(torch.device("cpu"))
    batch = _f32_batch(lc, rc, seq_start, seq_len)
    whole = backend.decode(q_lat, q_rope, batch, 0.17)
    chunk = 7
    monkeypatch.setattr(torch_backend, "CHUNK_ROWS", chunk)
    chunked = backend.decode(q_lat, q_rope, batch, 0.17)
    eps = torch.finfo(torch.float32).eps / 2  # unit roundoff
    m = k + r + n + -(-n // chunk)
    bound = 2 * (m * eps / (1 - m * eps)) * float(lc.abs().max())
    assert float((chunked - whole).abs().max()) <= bound
    assert torch.equal(chunked[3], torch.zeros(heads, k))  # the query that sees no row


@pytest.mark.parametrize("n", [50, 3000])
def test_the_one_pass_f32_path_is_the_streamed_one(n):
    """The f32 path a CUDA device takes (one pass over the rows read in place, the context product
    split along the rows) gives the streamed result, here run on the CPU; a query that sees no
    row gets zeros, and rows past a whole slice are summed too (3000 = 2 slices + 952)."""
    gen = torch.Generator().manual_seed(5)
    heads, k, r = 4, 64, 32
    q_lat, q_rope = torch.randn(3, heads, k, generator=gen), torch.randn(3, heads, r, generator=gen)
    lc, rc = torch.randn(n, k, generator=gen), torch.randn(n, r, generator=gen)
    seq_start = torch.tensor([0, n // 3, n - 1], dtype=torch.int32)
    seq_len = torch.tensor([n, n // 2, 0], dtype=torch.int32)
    streamed = torch_backend.TorchBackend(torch.device("cpu")).decode(
        q_lat, q_rope, _f32_batch(lc, rc, seq_start, seq_len), 0.11
    )
    lo = seq_start.long()[:, None, None]
    hi = (seq_start + seq_len).long()[:, None, None]
    one_pass = torch_backend._dense_one_pass(q_lat, q_rope, lc, rc, lo, hi, 0.11)
    torch.testing.assert_close(one_pass, streamed, rtol=1e-5, atol=1e-5)
    assert torch.equal(one_pass[2], torch.zeros(heads, k))


@pytest.mark.parametrize("tier", ["f32", "fp8", "int4"])
def test_a_batch_of_sequences_with_rows_of_their_own_reads_each_its_own_rows(monkeypatch, tier):
    """A batched decode (every query one sequence, with a region of rows of its own) of very uneven
    lengths is read per group of similar lengths, each query its own rows — not every query against
    the span of all of them, which made one long session slow every step of a batch by the batch
    size — and gives the reference's answer, and the one-span answer, within the backend's bound."""
    lengths = [3000, 40, 7, 300, 65, 1, 0, 129]  # one long sequence among short ones; one with no row
    case = testing.make_case(tier, lengths, 16, kv_lora=128, qk_rope=32, seed=21)
    taken = []
    real = torch_backend._attend_groups
    monkeypatch.setattr(torch_backend, "_attend_groups", lambda *a, **k: taken.append(len(a[5])) or real(*a, **k))
    grouped = testing.decode(case)
    assert taken and taken[0] >= 3  # lengths 3000 / 300 / 129 / 65 / 40 / 7 / 1: several groups
    assert testing.relative_error(grouped, testing.reference(case)) < TORCH_BOUND
    assert torch.equal(grouped[6], torch.zeros_like(grouped[6]))  # the sequence with no row
    monkeypatch.setattr(torch_backend, "_disjoint_groups", lambda *a: None)
    one_span = testing.decode(case)
    assert testing.relative_error(grouped, one_span) < TORCH_BOUND


def test_queries_sharing_rows_stay_one_pass_over_them():
    """The tokens of one sequence (a short turn's absorbed prefill: nested spans over the same rows)
    are not split into per-query reads, which would read the shared rows once per token."""
    lo = torch.zeros(6, dtype=torch.int64)
    hi = torch.arange(1000, 1006, dtype=torch.int64)
    assert torch_backend._disjoint_groups(lo, hi, 6 * 1006) is None
    # and regions of their own but equal and adjacent: one group, cheaper than the span
    lo = torch.arange(0, 4000, 1000, dtype=torch.int64)
    groups = torch_backend._disjoint_groups(lo, lo + 1000, 4 * 4000)
    assert groups is not None and len(groups) == 1
