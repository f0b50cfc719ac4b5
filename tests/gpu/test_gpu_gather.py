"""The one-launch gather of rows across layers (``kvstore.gpu.gather``, the vLLM connector's saves).

What a connector user depends on: the rows a save copies out of vLLM's per-layer caches are those
caches' own bits, at every slot asked for, in every layer, whatever the cache's dtype and row width
(4-, 2- and 1-byte words). On a CUDA device directly; on the CPU (CI) through Triton's interpreter,
in a child process because ``TRITON_INTERPRET`` is read at import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (dtype, blocks, block size, width, slots): vLLM's MLA bf16 rows, fp16, f32, fp8 bytes, an odd
# width (1-byte words), slots out of order, repeated, in the last block, and none
CASES = [
    ("bfloat16", 24, 16, 576, [5, 17, 200, 3, 383, 17, 0]),
    ("float16", 12, 16, 5, [1, 191, 64]),
    ("float32", 8, 16, 576, list(range(0, 128, 3))),
    ("uint8", 10, 16, 656, [159, 0, 80]),
    ("uint8", 10, 16, 7, [2, 9, 150, 151]),
    ("bfloat16", 4, 16, 576, []),
]

_CHECK = textwrap.dedent(
    """
    import json, sys
    import torch
    from kvstore.gpu.gather import LayerGather

    device = sys.argv[1]
    cases = json.loads(sys.argv[2])
    report = []
    gen = torch.Generator().manual_seed(7)
    for dtype_name, blocks, block, width, slots in cases:
        dtype = getattr(torch, dtype_name)
        caches = [
            torch.randint(0, 256, (blocks, block, width * torch.empty((), dtype=dtype).element_size()),
                          generator=gen, dtype=torch.uint8).view(dtype).to(device)
            for _ in range(3)
        ]
        gather = LayerGather(caches)
        index = torch.tensor(slots, dtype=torch.int64, device=device)
        got = gather(index)
        want = torch.stack([c.view(-1, width)[index] for c in caches])
        into = torch.full_like(want, 0)
        gather(index, out=into)
        same = lambda a, b: bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
        report.append({"case": [dtype_name, width, len(slots)], "word": gather._word,
                       "shape": list(got.shape), "same": same(got, want), "same_out": same(into, want)})
    print(json.dumps(report))
    """
)


def _run(device: str, env: dict) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, device, json.dumps(CASES)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(report: list[dict]) -> None:
    assert [row["word"] for row in report] == [4, 2, 4, 4, 1, 4]
    for row, (_, _, _, width, slots) in zip(report, CASES):
        assert row["shape"] == [3, len(slots), width], row
        assert row["same"] and row["same_out"], row


@needs_triton
def test_the_gather_under_the_interpreter_copies_every_layers_rows_bit_for_bit():
    _check(_run("cpu", {**os.environ, "TRITON_INTERPRET": "1"}))


@pytest.mark.gpu
def test_on_cuda_the_gather_copies_every_layers_rows_bit_for_bit():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check(_run("cuda", dict(os.environ)))


def test_caches_that_differ_are_refused_before_any_launch():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from kvstore.gpu.gather import LayerGather

    with pytest.raises(ValueError, match="share their device, dtype, width and row stride"):
        LayerGather([torch.zeros(2, 16, 576, dtype=torch.bfloat16), torch.zeros(2, 16, 576, dtype=torch.float16)])
    with pytest.raises(ValueError, match="share their device, dtype, width and row stride"):
        LayerGather([torch.zeros(2, 16, 576), torch.zeros(2, 16, 512)])
    gather = LayerGather([torch.zeros(2, 16, 8), torch.zeros(2, 16, 8)])
    with pytest.raises(ValueError, match="contiguous"):
        gather(torch.tensor([1]), out=torch.zeros(2, 2, 8))
