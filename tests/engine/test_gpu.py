"""The engine on CUDA (skipped without a CUDA device): device codecs, kernels, whole model.

* rows quantized on the GPU are the bytes ``kvstore.formats`` writes from the same f32 rows;
* the decode attention the cache selects (the ``kvstore.gpu`` kernels when they run this tier and
  geometry) agrees with the engine's torch implementation;
* the tiny model on CUDA gives the CPU model's logits;
* with the kernels' latent width the CUDA engine picks the CPU engine's tokens (fp8, int4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.engine import CacheGeometry, Engine, make_cache, preset, random_model
from kvstore.formats import fp8, tq
from kvstore.gpu import codecs

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _rows(n: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, width)) * np.exp(rng.uniform(-8, 8, (n, 1)))).astype(np.float32)
    x[0] = 0
    x[1, 0] = np.nan
    x[2] = 1e-39
    x[3, 1] = np.inf
    return x


def test_fp8_encoder_on_cuda_is_byte_identical(vectors):
    pairs = np.fromfile(vectors / "fp8_enc.bin", dtype=np.dtype([("x", "<f4"), ("code", "u1")]))
    got = codecs.fp8_encode(torch.from_numpy(np.ascontiguousarray(pairs["x"])).to(CUDA)).cpu().numpy()
    np.testing.assert_array_equal(got, pairs["code"])
    x = _rows(4096, 512, 1)
    codes, scales = fp8.quantize_rows(x)
    got_codes, got_scales = codecs.fp8_quantize_rows(torch.from_numpy(x).to(CUDA))
    np.testing.assert_array_equal(got_codes.cpu().numpy(), codes)
    assert got_scales.cpu().numpy().tobytes() == scales.tobytes()


def test_int4_encoder_on_cuda_matches_formats_tq():
    """Bit-exact but for the f64 radius sum, whose order on the GPU may differ from the host's in
    the last f64 bit: that moves the f32 radius on ~1e-9 of rows, so a handful per million."""
    x = _rows(8192, 512, 2)
    codes, radii = tq.quantize_rows(x, tq.CODEC_INT4, 4)
    got_codes, got_radii = codecs.int4_quantize_rows(torch.from_numpy(x).to(CUDA))
    same = (got_codes.cpu().numpy() == codes).all(axis=-1) & (got_radii.cpu().numpy() == radii)
    assert same.mean() >= 0.9999


def test_compiled_encoders_write_the_format_bytes():
    """The decode step's rows are encoded inside ``torch.compile``d regions on CUDA: fused by
    inductor, the encoders must still give ``kvstore.formats``' bytes (a file the C engine reads)."""
    from kvstore.engine.cache import encode_fields
    from kvstore.tiers import FP8, INT4, TIERS

    x = _rows(4096, 512, 3)
    r = _rows(4096, 64, 4)
    fused = torch.compile(lambda name, lc, rc: encode_fields(TIERS[name], lc, rc))
    for tier in (FP8, INT4):
        lc, rc = torch.from_numpy(x).to(CUDA), torch.from_numpy(r).to(CUDA)
        want = {name: t.cpu().numpy() for name, t in encode_fields(tier, lc, rc).items()}  # builds the tables
        got = {name: t.cpu().numpy() for name, t in fused(tier.name, lc, rc).items()}
        for name in want:
            same = (got[name] == want[name]).reshape(len(x), -1).all(axis=-1)
            assert same.mean() >= (1.0 if tier is FP8 else 0.9999), (tier.name, name, same.mean())


@pytest.mark.parametrize(
    "variant",
    ["default", "gemms-layered", "gemm-projections", "no-combo-kernels", "row-per-expert", "own-kernels-plain"],
)
@pytest.mark.parametrize("tier", ["f32", "fp8", "int4"])
def test_the_compiled_step_is_the_eager_step(tier, variant, monkeypatch):
    """bf16 V2-style layers (grouped experts) on CUDA: the compiled regions give the eager step's
    logits up to bf16 rounding and write the same rows — as compiled by default (the small products
    and the attention's projections as reductions, kvstore.engine.products, in merged regions,
    model.MERGED_REGIONS), with all of them switched off (cuBLAS's GEMMs, each layer its own
    regions), with only the projections as GEMMs (products.REDUCED_PROJECTIONS off), with
    inductor's combo kernels off (model.COMBO_KERNELS), and with the experts' kernels launching a row
    of programs per expert rather than per pair (expert_kernels.COMPACT_GRID off), and with the
    engine's own Triton kernels launched plainly (launches.OWN_KERNELS_DEPENDENT off)."""
    import torch._dynamo

    from kvstore.engine import expert_kernels, launches, products
    from kvstore.engine import model as model_module
    from kvstore.engine.model import StepRegions

    if variant == "gemms-layered":
        monkeypatch.setattr(products, "REDUCED_TOKENS", 0)
        monkeypatch.setattr(model_module, "MERGED_REGIONS", False)
    if variant in ("gemms-layered", "gemm-projections"):
        monkeypatch.setattr(products, "REDUCED_PROJECTIONS", False)
    if variant == "no-combo-kernels":
        monkeypatch.setattr(model_module, "COMBO_KERNELS", False)
    if variant == "row-per-expert":
        monkeypatch.setattr(expert_kernels, "COMPACT_GRID", False)
    if variant == "own-kernels-plain":
        monkeypatch.setattr(launches, "OWN_KERNELS_DEPENDENT", False)
    torch._dynamo.reset()  # the regions are traced afresh under this setting

    cfg = preset("tiny-512")
    model = random_model(cfg, seed=7, device=CUDA, dtype="bfloat16")
    prompt = np.random.default_rng(2).integers(2, cfg.vocab_size, 300)
    engine = Engine(model, tier=tier, cuda_graphs=False)
    engine.prefill(prompt[:-1])
    experts = model.model.layers[1].mlp.experts
    before = (experts.gate_proj.detach().clone(), experts.up_proj.detach().clone())
    caches, logits = [], []
    for compiled in (False, True):
        if compiled:
            assert model.compile_decode()
        else:
            model.regions = StepRegions.eager()
        cache = engine.cache.copy()
        cache.prepare(len(prompt) - 1, 1)
        cache.reserve(1024)
        step = model.decode_step(
            torch.tensor([int(prompt[-1])], device=CUDA), torch.tensor([len(prompt) - 1], device=CUDA), cache, 1024
        )
        logits.append(step[0].float())
        caches.append(cache)
    model.regions = StepRegions.eager()
    assert experts._gate_up is not None  # compile_decode fused gate and up: the values are kept
    assert torch.equal(experts.gate_proj, before[0]) and torch.equal(experts.up_proj, before[1])
    assert experts.gate_proj.data_ptr() == experts._gate_up.data_ptr()
    scale = float(logits[0].abs().max())
    assert float((logits[1] - logits[0]).abs().max()) <= 0.02 * scale
    n = len(prompt)
    for layer in range(cfg.num_hidden_layers):
        for eager, fused in zip(caches[0].read(layer, n), caches[1].read(layer, n)):
            assert torch.equal(eager[:-1], fused[:-1])  # the step wrote only its own row
            assert float((fused[-1] - eager[-1]).abs().max()) <= 0.1 * float(eager[-1].abs().max())


@pytest.mark.parametrize("combo", [True, False], ids=["combo-kernels", "no-combo-kernels"])
@pytest.mark.parametrize("tier", ["fp8", "int4"])
def test_every_dependently_launched_kernel_waits_before_it_touches_memory(tier, combo, monkeypatch):
    """Programmatic dependent launch (on by default, sm_90+) lets a compiled kernel start while the
    one ahead of it still runs; it must wait for it (``gdc_wait``) before its first load or store.
    Inductor's own placement waited only where the kernel just before wrote what was touched, and
    otherwise after the first load; launches.wait_before_every_access has it wait first in every
    kernel. Read from the code the engine's regions compile to, alone and batched, built afresh:
    every kernel that launches dependently waits before it touches memory — inductor's combo kernels
    (model.COMBO_KERNELS, on by default) too."""
    import torch._dynamo
    from torch._inductor import utils as inductor_utils

    from kernel_waits import accesses_before_the_wait, dependent_kernels, greedy_rows, is_combo
    from kvstore.engine import launches
    from kvstore.engine import model as model_module

    if not launches.dependent_launch_available(CUDA):
        pytest.skip("no programmatic dependent launch on this GPU or in this torch")
    monkeypatch.setattr(launches, "DEPENDENT_LAUNCH", True)
    monkeypatch.setattr(model_module, "COMBO_KERNELS", combo)
    torch._dynamo.reset()
    fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    with fresh():
        _, sources = inductor_utils.run_and_get_code(greedy_rows, tier, 2)
    kernels = [kernel for source in sources for kernel in dependent_kernels(source).items()]
    assert len(kernels) >= 10, f"only {len(kernels)} dependently launched kernels in {len(sources)} modules"
    combos = [name for name, text in kernels if is_combo(text)]
    assert bool(combos) == combo, f"combo kernels {combos} with model.COMBO_KERNELS {combo}"
    early = [(name, line) for name, text in kernels if (line := accesses_before_the_wait(text))]
    assert not early, early


@pytest.mark.parametrize("own", [False, True], ids=["own-kernels-plain", "own-kernels-dependent"])
@pytest.mark.parametrize("tier", ["fp8", "int4"])
def test_dependent_launches_change_no_bit_of_a_whole_decode(tier, own, monkeypatch):
    """Dependent launch (on by default) may change no bit: the very same kernels launched with the
    attribute and without it (Triton's launcher told to drop it: nothing overlaps, the waits return
    at once) give a whole 48-token decode, alone and three sessions together, bit for bit. On an
    H100 this held on both tiers, and also with inductor's own placement and with every wait
    planted out: the tiny model's kernels end before a dependent one is up, so this cannot show a
    missing wait (the test above reads the waits from the code). What it rules out is that the
    overlap itself changes a row; a build with dependent launch against one without may differ by a
    rounding of differently built kernels, as any two builds may. With ``own`` the engine's own
    Triton kernels (the experts', the routing, the cache's encoder) launch dependently too
    (launches.OWN_KERNELS_DEPENDENT), and each of the three must be among the launches told to go
    plainly."""
    import torch._dynamo

    from kernel_waits import DroppedLaunches, greedy_rows
    from kvstore.engine import expert_kernels, launches
    from kvstore.gpu import encode_kernels

    if not launches.dependent_launch_available(CUDA):
        pytest.skip("no programmatic dependent launch on this GPU or in this torch")
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    launcher = getattr(driver, "CudaLauncher", None)
    if launcher is None:
        pytest.skip("this Triton's CUDA launcher is not the one this test can tell to launch plainly")
    dropped = DroppedLaunches()
    monkeypatch.setattr(launcher, "launch_pdl", dropped.launch_pdl(), raising=False)
    monkeypatch.setattr(launches, "DEPENDENT_LAUNCH", True)
    monkeypatch.setattr(launches, "OWN_KERNELS_DEPENDENT", own)
    own_dropped: set[str] = set()  # which of the engine's own kernels were told to go plainly
    for module, name in (
        (expert_kernels, "_launch"),
        (expert_kernels, "_launch_route"),
        (encode_kernels, "encode_rows"),
    ):
        launch = getattr(module, name)

        def counted(*args, _launch=launch, _name=name, **kwargs):
            if kwargs.get("dependent") and dropped.plain:
                own_dropped.add(_name)
            return _launch(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    runs = []
    for plain in (False, True):
        dropped.plain = plain
        torch._dynamo.reset()  # built afresh: the launchers (and the graphs) are made anew
        tokens, rows, batch_tokens, batch_rows = greedy_rows(tier, 48)
        runs.append((tokens, rows.tobytes(), batch_tokens, [r.tobytes() for r in batch_rows]))
    assert dropped.dropped > 0, "no kernel asked for a dependent launch"
    assert own_dropped == ({"_launch", "_launch_route", "encode_rows"} if own else set()), own_dropped
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert runs[0][2] == runs[1][2] and runs[0][3] == runs[1][3]


@pytest.mark.parametrize("tier", ["fp8", "int4", "polar4", "q8", "bf16"])
def test_selected_decode_backend_agrees_with_the_torch_path(tier):
    geometry = CacheGeometry.of(preset("v2-lite"))
    selected = make_cache(tier, geometry, CUDA)
    reference = make_cache(tier, geometry, CUDA, prefer_backend="torch")
    n = 3000
    gen = torch.Generator(device=CUDA).manual_seed(0)
    lc = torch.randn(n, geometry.kv_lora, device=CUDA, generator=gen)
    rc = torch.randn(n, geometry.qk_rope, device=CUDA, generator=gen)
    for cache in (selected, reference):
        cache.prepare(0, n)
        cache.write(0, 0, lc, rc)
        cache.commit(0, np.zeros(n, np.int32))
    q_lat = torch.randn(4, 16, geometry.kv_lora, device=CUDA, generator=gen) * 0.05
    q_rope = torch.randn(4, 16, geometry.qk_rope, device=CUDA, generator=gen) * 0.05
    seq_start = torch.tensor([0, 100, 0, 2999], dtype=torch.int32, device=CUDA)
    seq_len = torch.tensor([n, 900, 1, 1], dtype=torch.int32, device=CUDA)
    got = selected.attend(0, q_lat, q_rope, seq_start, seq_len, 0.1, n_rows=n)
    want = reference.attend(0, q_lat, q_rope, seq_start, seq_len, 0.1, n_rows=n)
    print(f"\n{tier}: backend {selected.decode_choice.backend}; passed over: {selected.decode_choice.rejected}")
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_tiny_model_on_cuda_matches_cpu():
    cfg = preset("tiny-yarn")
    cpu_model = random_model(cfg, seed=3)
    cuda_model = random_model(cfg, seed=3).to(CUDA)  # the same weights, moved
    prompt = np.random.default_rng(0).integers(2, cfg.vocab_size, 200)
    for tier in ("f32", "fp8"):
        cpu_logits, _, _ = Engine(cpu_model, tier=tier).prefill(prompt)
        cuda_engine = Engine(cuda_model, tier=tier)
        cuda_logits, _, _ = cuda_engine.prefill(prompt)
        rel = float((cuda_logits.cpu() - cpu_logits).abs().max() / cpu_logits.abs().max())
        assert rel < 1e-3, (tier, rel)
        result = cuda_engine.generate(np.concatenate([prompt, [5]]), max_new_tokens=8, stop_tokens=())
        assert len(result.tokens) == 8 and result.reused_tokens == 200


@pytest.mark.parametrize("tier", ["fp8", "int4"])
def test_cuda_kernels_decode_the_cpu_engine_tokens(tier):
    """The oracle model at the kernels' latent widths (``tiny-512``, checked against transformers in
    test_oracle): on CUDA the decode attention runs in the ``kvstore.gpu`` kernels, and teacher-forced
    through the CPU engine's greedy continuation it picks the CPU's token at every position (a
    different pick is allowed only where the CPU's own top two logits are a near-tie)."""
    cfg = preset("tiny-512")
    cpu = Engine(random_model(cfg, seed=5), tier=tier)
    gpu = Engine(random_model(cfg, seed=5).to(CUDA), tier=tier)
    assert gpu.cache.decode_choice.backend == "cuda", gpu.cache.decode_choice.rejected
    prompt = np.random.default_rng(1).integers(2, cfg.vocab_size, 64)
    answer = np.asarray(cpu.generate(prompt, max_new_tokens=32, stop_tokens=()).tokens)
    picks = {}
    for name, engine in (("cpu", cpu), ("cuda", gpu)):
        first, _, _ = engine.prefill(prompt)
        rest = engine.score(answer[:-1], start=prompt.shape[0], absorbed=True)
        picks[name] = torch.cat([first[None].cpu(), rest.cpu()]).float()
    cpu_logits = picks["cpu"]
    agree = picks["cuda"].argmax(-1) == torch.from_numpy(answer)
    assert (cpu_logits.argmax(-1).numpy() == answer).all()  # the CPU's teacher-forced picks are its greedy run
    top2 = cpu_logits.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) < 1e-3 * cpu_logits.abs().amax(-1)
    print(f"\n{tier}: CUDA kernels pick the CPU engine's token at {int(agree.sum())}/32 positions")
    assert bool((agree | near_tie).all()), (
        f"disagreements away from near-ties at {torch.nonzero(~agree).ravel().tolist()}"
    )
    assert int(agree.sum()) >= 31


# The bound a bf16 resume keeps from the uninterrupted bf16 run of the same tier (next-token logits,
# see docs/ENGINE.md "Resume against re-prefill in bf16"): the rows are the same bytes, and the two
# differ only where the uninterrupted run's last token takes the prefill form (plain bf16 attention
# over expanded heads) while the resumed one takes the decode form (absorbed attention, f32 sums).
# Measured on an H200 (tiny-512, 1,024 rows): max |Δlogit| 0.004..0.016, KL up to 1.3e-5 nats.
RESUME_BOUND = (0.05, 1e-4)  # max |Δlogit|, KL nats


@pytest.mark.parametrize("tier", ["f32", "fp8", "int4"])
def test_a_bf16_resume_is_the_uninterrupted_run_within_the_stated_logit_distance(tier):
    cfg = preset("tiny-512")
    model = random_model(cfg, seed=9, dtype="bfloat16").to(CUDA)
    context = np.random.default_rng(4).integers(2, cfg.vocab_size, 1025)
    uninterrupted = Engine(model, tier=tier)
    want = uninterrupted.prefill(context)[0].double().cpu()
    resumed = Engine(model, tier=tier)
    resumed.restore(uninterrupted.export_rows(0, 1024))  # the journal's rows: the tier's own bytes
    got, prefilled, reused = resumed.prefill(context)
    assert (prefilled, reused) == (1, 1024)
    got = got.double().cpu()
    max_delta = float((got - want).abs().max())
    p_log, q_log = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    kl = float((p_log.exp() * (p_log - q_log)).sum())
    print(f"\n{tier}: max |Δlogit| {max_delta:.4f} (logits span {float(want.max() - want.min()):.2f}), KL {kl:.2e}")
    assert max_delta <= RESUME_BOUND[0] and kl <= RESUME_BOUND[1], (max_delta, kl)


@pytest.mark.parametrize("tier", ["bf16", "fp8", "int4"])
def test_a_packed_prefill_on_cuda_gives_each_session_its_next_tokens_alone(tier):
    """Sessions prefilled together (``Engine.prefill_many``: the flash path for prompts from row 0,
    the absorbed kernels for a short chunk after cached rows) decode what each decodes prefilled
    alone; the rows agree but for values rounded across a code boundary."""
    cfg = preset("tiny-512")
    engine = Engine(random_model(cfg, seed=6).to(CUDA), tier=tier, prefill_chunk=64)
    rng = np.random.default_rng(3)
    history = rng.integers(2, cfg.vocab_size, 300)
    prompts = [rng.integers(2, cfg.vocab_size, n) for n in (150, 7, 1, 40, 64)]
    cached = (0, 300, 300, 0, 0)

    def sessions():
        caches = [engine.new_cache() for _ in prompts]
        for cache, n in zip(caches, cached):
            if n:
                engine.prefill_into(cache, history[:n], 0)
        return caches

    alone, packed = sessions(), sessions()
    for cache, ids in zip(alone, prompts):
        engine.prefill_into(cache, ids, cache.length)
    assert engine.prefill_many(list(zip(packed, prompts))) < sum(-(-len(p) // 64) for p in prompts)
    g = engine.config.coli_geometry()
    for a, b in zip(alone, packed):
        ra, rb = a.export_rows(), b.export_rows()
        assert ra.tokens.tolist() == rb.tokens.tolist()
        for x, y in zip(ra.dequantize(g.kv_lora, g.qk_rope), rb.dequantize(g.kv_lora, g.qk_rope)):
            assert (~np.isclose(y, x, rtol=1e-2, atol=1e-3)).mean() < 0.1
        tokens = []
        for cache in (a, b):
            twin = Engine(engine.model, tier=tier)
            twin.cache.restore(cache.export_rows())
            tokens.append(twin.generate(twin.cache.tokens.tolist(), max_new_tokens=8, stop_tokens=()).tokens)
        assert tokens[0] == tokens[1]
