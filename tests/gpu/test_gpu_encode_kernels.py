"""A layer's rows encoded (fp8, rotated int4) and stored in one Triton kernel (kvstore.gpu.encode_kernels)
against ``kvstore.formats``.

On the CPU (CI) through Triton's interpreter (``TRITON_INTERPRET=1``, in a child process because the
variable is read at import): every width the spec encodes, inert rows (zero, NaN, infinity,
subnormal, past the bounds, overflowing the butterflies), bf16 and strided inputs, two row sets in
one launch, rows written into a cache layer's slots, the golden vectors' int4 rows rebuilt into the
``v3c1b4`` files' bytes, and every value of ``fp8_enc.bin`` encoded as the file has it. On a CUDA
device: the same bytes as the reference codecs and as the torch twins, the kernel inside a captured
CUDA graph, and a cache's :meth:`write_at` (the decode step's write) against its encode-then-store.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.formats import fp8, tq

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _rows(n: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, width)) * np.exp(rng.uniform(-8, 8, (n, 1)))).astype(np.float32)
    x[0] = 0
    x[1, 0] = np.nan
    x[2] = 1e-39  # subnormal: below both floors
    x[3, 0] = np.inf
    x[4] = 3e38  # past the radius bound: inert int4, live fp8
    x[5] = 2e37  # int4: a finite radius whose butterflies overflow f32 (level 0 where a sum is not finite)
    x[6, :2] = -0.0
    return x


def reference(tier: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(codes, scales) as ``kvstore.formats`` writes them; an f32 cache's values as they are."""
    if tier == "f32":
        return x, None
    return fp8.quantize_rows(x) if tier == "fp8" else tq.quantize_rows(x, tq.CODEC_INT4, 4)


_INTERPRETED = textwrap.dedent(
    """
    import importlib.util, json
    import numpy as np
    import torch
    from kvstore.gpu.encode_kernels import encode_rows

    def module(path):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded

    here = module(tests / "gpu" / "test_gpu_encode_kernels.py")
    vector_files = module(tests / "formats" / "test_tq.py")

    def same(tier, x, got):
        codes, scales = here.reference(tier, x)
        if scales is None:  # f32: bit for bit, NaN included
            return got[1] is None and got[0].numpy().tobytes() == codes.tobytes()
        return bool(np.array_equal(got[0].numpy(), codes)) and got[1].numpy().tobytes() == scales.tobytes()

    report = {}
    for tier in ("fp8", "int4", "f32"):
        for width in (2, 8, 64, 512, 2048):
            x = here._rows(24, width, width)
            report[f"{tier} width {width}"] = same(tier, x, encode_rows(tier, (torch.from_numpy(x),))[0])
        wide = here._rows(24, 1024, 7)
        report[f"{tier} strided"] = same(tier, wide[:, ::2].copy(), encode_rows(tier, (torch.from_numpy(wide)[:, ::2],))[0])
        half = torch.from_numpy(here._rows(24, 64, 3)).to(torch.bfloat16)
        half[2] = 0  # the interpreter widens a subnormal bf16 wrongly (the GPU test has one)
        report[f"{tier} bf16"] = same(tier, half.float().numpy(), encode_rows(tier, (half,))[0])
        lc, rc = here._rows(30, 512, 8).reshape(3, 10, 512), here._rows(30, 64, 9).reshape(3, 10, 64)
        first, second = encode_rows(tier, (torch.from_numpy(lc), torch.from_numpy(rc)))
        report[f"{tier} pair"] = same(tier, lc, first) and same(tier, rc, second)
        # into a layer's slots: rows 0..3 at slots 5, 0, 9, 2 of ten; the other slots untouched
        slots = torch.tensor([5, 0, 9, 2])
        out = []
        for rows in (lc[0, :4], rc[0, :4]):
            codes, scales = here.reference(tier, np.zeros((10, rows.shape[1]), np.float32))
            scales = torch.zeros(10) if scales is None else torch.from_numpy(scales.copy())
            out.append((torch.from_numpy(codes.copy()) + 1, None if tier == "f32" else scales + 7))
        before = [(c.clone(), torch.zeros(10) if s is None else s.clone()) for c, s in out]
        encode_rows(tier, (torch.from_numpy(lc[0, :4]), torch.from_numpy(rc[0, :4])), tuple(out), slots)
        kept = [i for i in range(10) if i not in (5, 0, 9, 2)]
        report[f"{tier} slots"] = all(
            same(tier, rows, (codes[slots], None if scales is None else scales[slots]))
            and torch.equal(codes[kept], old[0][kept])
            and (scales is None or torch.equal(scales[kept], old[1][kept]))
            for rows, (codes, scales), old in zip((lc[0, :4], rc[0, :4]), out, before)
        )
    for name in vector_files.GEOMETRIES:  # the files' records: [n_layers, n] rows of each kind
        _, L, R, _ = vector_files.load_source(vectors, name)
        _, _, records = vector_files.load_v3(vectors, name, 1, 4)
        encoded = encode_rows("int4", (torch.from_numpy(L.copy()), torch.from_numpy(R.copy())))
        report[f"int4 vectors {name}"] = all(
            np.array_equal(codes.numpy(), stored[0]) and radii.numpy().tobytes() == stored[1].tobytes()
            for (codes, radii), stored in zip(encoded, (vector_files.stored_rows(records, w) for w in "LR"))
        )
    # fp8_enc.bin: every value that can share a row with 448 (which makes the row's factor exactly
    # 1) must encode to the file's byte
    pairs = np.fromfile(vectors / "fp8_enc.bin", dtype=np.dtype([("x", "<f4"), ("code", "u1")]))
    keep = ~(np.abs(pairs["x"]) > 448)
    values, want = pairs["x"][keep], pairs["code"][keep]
    rows = np.full((-(-len(values) // 511), 512), 448.0, np.float32)
    flat = rows[:, 1:].reshape(-1)
    flat[: len(values)] = values
    rows[:, 1:] = flat.reshape(rows.shape[0], 511)
    codes, scales = encode_rows("fp8", (torch.from_numpy(rows),))[0]
    report["fp8_enc.bin"] = bool(
        np.array_equal(codes[:, 1:].reshape(-1)[: len(values)].numpy(), want) and (scales == 1).all()
    )
    print(json.dumps(report))
    """
)


def test_the_kernel_under_the_interpreter_writes_the_formats_bytes(vectors):
    env = dict(os.environ, TRITON_INTERPRET="1")
    tests = Path(__file__).resolve().parents[1]
    script = f"from pathlib import Path\nvectors, tests = Path({str(vectors)!r}), Path({str(tests)!r})\n" + _INTERPRETED
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 3 * 9 + 2 + 1, report
    assert all(report.values()), {case: ok for case, ok in report.items() if not ok}


def test_bad_calls_are_refused():
    from kvstore.gpu.encode_kernels import encode_rows

    with pytest.raises(ValueError, match="leading shape"):
        encode_rows("int4", (torch.zeros(3, 8), torch.zeros(4, 8)))
    with pytest.raises(ValueError, match="one or two"):
        encode_rows("fp8", ())
    with pytest.raises(ValueError, match="not 'q8'"):
        encode_rows("q8", (torch.zeros(3, 8),))
    with pytest.raises(ValueError, match="go together"):
        encode_rows("fp8", (torch.zeros(3, 8),), positions=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        encode_rows(
            "fp8", (torch.zeros(3, 8),), ((torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4)),), torch.zeros(3)
        )


@pytest.fixture
def encode_kernels_on():
    from kvstore.gpu import codecs

    codecs.use_encode_kernels(True)  # the default; set again in case a test before switched it off
    yield


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["fp8", "int4"])
def test_the_kernel_on_cuda_gives_the_reference_and_the_twins_bytes(tier, encode_kernels_on):
    """int4 is bit-exact but for the f64 radius sum, whose order on the GPU may differ from the
    host's in the last f64 bit (a handful of rows per million move their f32 radius)."""
    from kvstore.gpu import codecs
    from kvstore.gpu.encode_kernels import encode_rows

    cuda = torch.device("cuda")
    twin = codecs.fp8_quantize_rows if tier == "fp8" else lambda r: codecs.int4_quantize_rows(r, kernel=False)
    for width in (2, 64, 512, 2048):
        x = _rows(8192, width, width)
        codes, scales = reference(tier, x)
        rows = torch.from_numpy(x).to(cuda)
        ((got_codes, got_scales),) = encode_rows(tier, (rows,))
        twin_codes, twin_scales = twin(rows)
        same = (got_codes.cpu().numpy() == codes).all(axis=-1) & (got_scales.cpu().numpy() == scales)
        assert same.mean() >= (1.0 if tier == "fp8" else 0.9999), (width, same.mean())
        assert torch.equal(got_codes, twin_codes) and torch.equal(got_scales, twin_scales), width
    if tier == "int4":  # the twin itself takes the kernel on CUDA
        assert torch.equal(codecs.int4_quantize_rows(rows)[0], got_codes)


@pytest.mark.gpu
def test_a_captured_kernel_encodes_the_rows_of_each_replay():
    from kvstore.gpu.encode_kernels import encode_rows

    cuda = torch.device("cuda")
    lc = torch.zeros(16, 512, device=cuda)
    rc = torch.zeros(16, 64, device=cuda)
    encode_rows("int4", (lc, rc))  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (lc_codes, lc_radii), (rc_codes, rc_radii) = encode_rows("int4", (lc, rc))
    for seed in (1, 2):
        x, r = _rows(16, 512, seed), _rows(16, 64, 10 + seed)
        lc.copy_(torch.from_numpy(x))
        rc.copy_(torch.from_numpy(r))
        graph.replay()
        torch.cuda.synchronize()
        for rows, codes, radii in ((x, lc_codes, lc_radii), (r, rc_codes, rc_radii)):
            want_codes, want_radii = reference("int4", rows)
            np.testing.assert_array_equal(codes.cpu().numpy(), want_codes)
            np.testing.assert_array_equal(radii.cpu().numpy(), want_radii)


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["fp8", "int4", "f32"])
def test_a_cache_write_at_is_its_encode_then_store(tier, encode_kernels_on):
    """The decode step's write (one kernel into the slots) leaves the cache's buffers as the torch
    twins' encode and ``store_at`` leave them, bf16 rows as the model gives them."""
    from kvstore.engine import CacheGeometry, make_cache

    cuda = torch.device("cuda")
    geometry = CacheGeometry(n_layers=3, kv_lora=512, qk_rope=64)
    fused, plain = make_cache(tier, geometry, cuda, capacity=64), make_cache(tier, geometry, cuda, capacity=64)
    assert fused.write_kernels is not None
    plain.write_kernels = None  # the torch twins' encode, then index_copy_ into the slots
    slots = torch.tensor([7, 3, 40, 0, 63, 12, 5, 33], device=cuda)  # one per row of _rows' cases
    for layer in range(3):
        lc = torch.from_numpy(_rows(len(slots), 512, layer)).to(cuda, torch.bfloat16)
        rc = torch.from_numpy(_rows(len(slots), 64, 10 + layer)).to(cuda, torch.bfloat16)
        fused.write_at(layer, slots, lc, rc)
        plain.write_at(layer, slots, lc, rc)
    for name in ("lc", "rc") if tier == "f32" else ("lc", "lc_scales", "rc", "rc_scales"):
        # an f32 cache keeps a NaN as the row has it, in both (and NaN != NaN for torch.equal)
        torch.testing.assert_close(fused.field(name), plain.field(name), rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("tier", ["fp8", "int4", "f32"])
def test_the_kernel_compiles_for_sm_90_with_no_gpu(tier):
    """Triton's own compiler for an H100/H200 target, here: what the interpreter does not check (a
    shape Triton cannot lower, a constexpr reassigned in a loop), no product fused into a sum (the
    launch turns fusion off) and the int4 product that must stay unfused under ``torch.compile``
    (which drops that option) written as ``mul.rn.f32``, and no spill to local memory. Launched
    dependently (``WAIT``, kvstore.gpu.dependent) it waits for the grid ahead before its first
    global load or store, and a plain launch has no wait."""
    from kernel_waits import can_compile_for_sm90, compile_for_sm90, ptx_accesses_before_the_wait
    from kvstore.gpu import encode_kernels

    if not can_compile_for_sm90():
        pytest.skip("this Triton has no ptxas")
    fn = encode_kernels._encode_kernel
    rows, codes = "*bf16", "*fp32" if tier == "f32" else "*u8"
    types = {name: "*fp32" for name in fn.arg_names if name.endswith("_ptr")}
    types.update(x0_ptr=rows, x1_ptr=rows, codes0_ptr=codes, codes1_ptr=codes, positions_ptr="*i64")
    for n0, n1 in ((512, 64), (2048, 2)):
        for wait in (False, True):
            constants = dict(FORMAT=encode_kernels.FORMATS[tier], N0=n0, LOG_N0=n0.bit_length() - 1, N1=n1,
                             LOG_N1=n1.bit_length() - 1, POSITIONS=True, EXACT=True, WAIT=wait)  # fmt: skip
            asm = compile_for_sm90(fn, types, constants, num_warps=4, enable_fp_fusion=False, launch_pdl=wait)
            ptx = asm["ptx"]
            assert asm["cubin"] and ".local" not in ptx, (tier, n0)
            assert "fma.rn.f32" not in ptx, (tier, n0)  # no f32 product fused into a sum anywhere
            assert ("mul.rn.f32 %" in ptx) == (tier == "int4"), (tier, n0)  # int4's guard (inline PTX)
            if wait:
                assert ptx_accesses_before_the_wait(ptx) is None, (tier, n0)
            else:
                assert "griddepcontrol" not in ptx, (tier, n0)


def test_the_kernel_is_switched_on_and_off():
    from kvstore.gpu import codecs, encode_kernels

    # on by default: the module where Triton runs (has_triton: a CUDA device), else None
    assert codecs.encode_kernels() in (encode_kernels, None)
    try:
        codecs.use_encode_kernels(False)
        assert codecs.encode_kernels() is None
        codecs.use_encode_kernels(True)
        assert codecs.encode_kernels() in (encode_kernels, None)
    finally:
        codecs.use_encode_kernels(True)


@pytest.mark.gpu
def test_the_kernel_inside_torch_compile_writes_the_formats_bytes(encode_kernels_on):
    """``encode_fields`` compiled (the kernel as a user-defined Triton kernel in the graph, launched
    without compile options there) gives the reference codecs' bytes."""
    from kvstore.engine.cache import encode_fields
    from kvstore.tiers import TIERS

    cuda = torch.device("cuda")
    x, r = _rows(4096, 512, 3), _rows(4096, 64, 4)
    fused = torch.compile(lambda name, lc, rc: encode_fields(TIERS[name], lc, rc))
    for tier in ("fp8", "int4"):
        lc, rc = torch.from_numpy(x).to(cuda), torch.from_numpy(r).to(cuda)
        encode_fields(TIERS[tier], lc, rc)  # the tables, outside the compiled region
        got = fused(tier, lc, rc)
        for prefix, rows in (("lc", x), ("rc", r)):
            codes, scales = reference(tier, rows)
            same = (got[prefix].cpu().numpy() == codes).all(axis=-1) & (got[f"{prefix}_scales"].cpu().numpy() == scales)
            assert same.mean() >= (1.0 if tier == "fp8" else 0.9999), (tier, prefix, same.mean())
