"""The capturable decode step and its CUDA graphs.

On every device: ``decode_step`` (token and position in device memory, attention over the whole
capacity) gives the plain absorbed step's logits and writes the same rows. On CUDA: an engine that
replays graphs generates the tokens of one that runs every kernel from Python, across bucket
growths and restores.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvstore.engine import Engine, make_cache, preset, random_model
from kvstore.engine.graphs import MIN_BUCKET, bucket


def test_buckets_are_powers_of_two_from_the_minimum():
    assert [bucket(n) for n in (1, MIN_BUCKET, MIN_BUCKET + 1, 5000)] == [MIN_BUCKET, MIN_BUCKET, 2 * MIN_BUCKET, 8192]


@pytest.mark.parametrize("tier", ["f32", "fp8", "int4", "q8"])
def test_decode_step_equals_the_plain_absorbed_step(tier):
    cfg = preset("tiny")
    model = random_model(cfg, seed=2)
    prompt = np.random.default_rng(3).integers(2, cfg.vocab_size, 40)
    plain = Engine(model, tier=tier)
    plain.prefill(prompt[:-1])
    expect = plain.decode_logits(int(prompt[-1]), len(prompt) - 1)
    stepped = Engine(model, tier=tier)
    stepped.prefill(prompt[:-1])
    cache = stepped.cache
    cache.prepare(len(prompt) - 1, 1)
    cache.reserve(256)
    token = torch.tensor([int(prompt[-1])])
    position = torch.tensor([len(prompt) - 1])
    got = model.decode_step(token, position, cache, n_rows=cache.capacity)[0]
    cache.commit(len(prompt) - 1, [int(prompt[-1])])
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    for name, field in cache._fields.items():
        torch.testing.assert_close(field[:, : len(prompt)], plain.cache._fields[name][:, : len(prompt)])


def test_the_regions_say_combo_kernels_either_way_as_the_switch_says(monkeypatch):
    """``model.COMBO_KERNELS`` (on by default) reaches the regions' inductor options, and an inductor
    set to combine kernels process-wide does not turn it on for them where it is off; every option is
    one inductor knows."""
    import torch._inductor.config as inductor_config

    from kvstore.engine import model as model_module
    from kvstore.engine.model import region_compile_options

    cpu = torch.device("cpu")
    options = region_compile_options(cpu)
    assert options["combo_kernels"] is True and options["emulate_precision_casts"] is True
    with inductor_config.patch(**options):  # refuses a name it does not know
        pass
    monkeypatch.setattr(model_module, "COMBO_KERNELS", False)
    with inductor_config.patch(combo_kernels=True):  # (a monkeypatch would delete the option on undo)
        assert region_compile_options(cpu)["combo_kernels"] is False


def test_a_cpu_step_stays_eager_and_never_asks_for_dependent_launch():
    """The compiled regions (and their dependent launches, sm_90+ only, on by default) are CUDA's:
    on the CPU the step is the eager one the transformers oracle tests pin, switch or not."""
    from kvstore.engine import launches

    assert launches.DEPENDENT_LAUNCH
    model = random_model(preset("tiny"), seed=0)
    assert not model.compile_decode()
    assert not launches.dependent_launch(torch.device("cpu"))


def test_a_region_built_under_inductors_own_wait_placement_is_never_loaded_for_ours(tmp_path, monkeypatch):
    """The waits' placement is patched code (launches.wait_before_every_access), not a config value:
    with dependent launch on, a region compiled by inductor's own placement (a process without the
    patch, an older kvstore) has the same cache key and would be loaded from inductor's cache, race
    and all. The regions' options name the placement in the key: a graph cached without it is a
    miss for a compile with it, and one cached with it is a hit (so the cache is on here)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from kvstore.engine import launches

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launches, "dependent_launch", lambda device: True)
    ours = launches.region_options(torch.device("cuda"))
    assert ours["triton.enable_pdl"] is True
    inductors = {"triton.enable_pdl": True}
    x = torch.randn(64)

    def compile_once(options):
        torch._dynamo.reset()
        counters.clear()
        torch.compile(lambda t: torch.sin(t) * 3 + 1, options=options)(x)
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    assert compile_once(inductors) == (0, 1)
    assert compile_once(inductors) == (1, 0)
    assert compile_once(ours) == (0, 1)
    assert compile_once(ours) == (1, 0)
    torch._dynamo.reset()


_PLANTED = """
triton_poi_fused_0 = async_compile.triton('triton_poi_fused_0', '''
@triton_heuristics.pointwise(triton_meta={'signature': {}, 'launch_pdl': True})
@triton.jit
def triton_poi_fused_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    tl.extra.cuda.gdc_wait()
    tmp0 = tl.load(in_ptr0 + (x0), xmask)
    tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr0 + (x0), tmp0, xmask)
''', device_str='cuda')
triton_red_fused_1 = async_compile.triton('triton_red_fused_1', '''
@triton_heuristics.reduction(triton_meta={'signature': {}, 'launch_pdl': True})
@triton.jit
def triton_red_fused_1(in_ptr0, in_ptr1, out_ptr0, xnumel, r0_numel):
    tmp0 = tl.load(in_ptr0 + (r0_1), r0_mask, eviction_policy='evict_first', other=0.0)
    tl.extra.cuda.gdc_wait()
    tmp1 = tl.load(in_ptr1 + (r0_1), r0_mask)
    tl.store(out_ptr0 + (x0), tmp1, xmask)
''', device_str='cuda')
triton_poi_fused_2 = async_compile.triton('triton_poi_fused_2', '''
@triton_heuristics.pointwise(triton_meta={'signature': {}, 'launch_pdl': True})
@triton.jit
def triton_poi_fused_2(out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tmp0 = 0.0
    tl.store(out_ptr0 + (x0), tmp0, xmask)
''', device_str='cuda')
triton_poi_fused_3 = async_compile.triton('triton_poi_fused_3', '''
@triton_heuristics.pointwise(triton_meta={'signature': {}, 'launch_pdl': False})
@triton.jit
def triton_poi_fused_3(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tl.store(out_ptr0 + (x0), tl.load(in_ptr0 + (x0)), xmask)
''', device_str='cuda')
"""

# Combo kernels: a sub-kernel per branch of ``pid``, each waiting before its first access; the
# same kernel with the second branch's wait planted out; one waiting before its branches.
_COMBO_WAITING = """
triton_for_fused_4 = async_compile.triton('triton_for_fused_4', '''
@triton_heuristics.foreach(triton_meta={'signature': {}, 'launch_pdl': True})
@triton.jit
def triton_for_fused_4(in_ptr0, in_ptr1, out_ptr0, out_ptr1):
    pid = tl.program_id(0)
    if pid < num_xblocks_0:
        pid_offset = pid
        tl.extra.cuda.gdc_wait()
        tmp0 = tl.load(in_ptr0 + (x0), xmask)
        tl.store(out_ptr0 + (x0), tmp0, xmask)
    elif pid < num_xblocks_1:
        pid_offset = pid - num_xblocks_0
        tl.extra.cuda.gdc_wait()
        tmp1 = tl.load(in_ptr1 + (x1), xmask)
        tl.store(out_ptr1 + (x1), tmp1, xmask)
    else:
        pass
''', device_str='cuda')
"""
_COMBO_SECOND_UNWAITED = _COMBO_WAITING.replace("fused_4", "fused_5").replace(
    "        pid_offset = pid - num_xblocks_0\n        tl.extra.cuda.gdc_wait()\n",
    "        pid_offset = pid - num_xblocks_0\n",
)
_PLANTED += (
    _COMBO_WAITING
    + _COMBO_SECOND_UNWAITED
    + """
triton_for_fused_6 = async_compile.triton('triton_for_fused_6', '''
@triton_heuristics.foreach(triton_meta={'signature': {}, 'launch_pdl': True})
@triton.jit
def triton_for_fused_6(in_ptr0, in_ptr1, out_ptr0, out_ptr1):
    pid = tl.program_id(0)
    tl.extra.cuda.gdc_wait()
    if pid < num_xblocks_0:
        tl.store(out_ptr0 + (x0), tl.load(in_ptr0 + (x0), xmask), xmask)
    elif pid < num_xblocks_1:
        tl.store(out_ptr1 + (x1), tl.load(in_ptr1 + (x1), xmask), xmask)
''', device_str='cuda')
"""
)


def test_the_wait_check_finds_a_dependent_kernel_that_touches_memory_before_it_waits():
    """The GPU test of the regions' generated code reads it with these helpers: each dependently
    launched kernel must wait before its first load or store. Planted here: one kernel that waits
    first, one that loads before its wait (inductor's own placement did this), one fill with no
    wait at all, one launched plainly (not a dependent kernel, so not checked), and three combo
    kernels (one sub-kernel per branch of ``pid``): each branch waiting, the second branch not
    (its programs would read before the kernel ahead is done), and one wait before the branches."""
    from kernel_waits import accesses_before_the_wait, dependent_kernels, is_combo

    kernels = dependent_kernels(_PLANTED)
    assert [name for name, text in kernels.items() if is_combo(text)] == [f"triton_for_fused_{i}" for i in (4, 5, 6)]
    assert sorted(kernels) == [
        "triton_for_fused_4",
        "triton_for_fused_5",
        "triton_for_fused_6",
        "triton_poi_fused_0",
        "triton_poi_fused_2",
        "triton_red_fused_1",
    ]
    assert accesses_before_the_wait(kernels["triton_poi_fused_0"]) is None
    assert accesses_before_the_wait(kernels["triton_red_fused_1"]).startswith("tmp0 = tl.load(in_ptr0")
    assert accesses_before_the_wait(kernels["triton_poi_fused_2"]).startswith("tl.store(out_ptr0")
    assert accesses_before_the_wait(kernels["triton_for_fused_4"]) is None
    assert accesses_before_the_wait(kernels["triton_for_fused_5"]).startswith("tmp1 = tl.load(in_ptr1")
    assert accesses_before_the_wait(kernels["triton_for_fused_6"]) is None


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_merged_regions_give_the_layer_by_layer_steps_logits_and_rows(compiled):
    """A step whose regions run each layer's outputs with the next layer's inputs (and the last
    layer's with the head) computes what the layer-by-layer step does: the same operations, grouped
    otherwise. Eager, bit for bit; compiled (here for the CPU: the regions trace with two layers as
    arguments, dense-then-MoE and MoE-then-MoE), up to the fused kernels' rounding."""
    from kvstore.engine.model import DecoderLayer, MLAForCausalLM, StepRegions

    cfg = preset("tiny")
    model = random_model(cfg, seed=4)
    assert cfg.first_k_dense_replace >= 1 and cfg.num_hidden_layers > cfg.first_k_dense_replace + 1
    prompt = np.random.default_rng(5).integers(2, cfg.vocab_size, 30)
    # (compiled on the CPU, an f32 cache: the CPU's fp8 encoder runs numpy, which dynamo does not trace)
    tier = "f32" if compiled else "fp8"
    engine = Engine(model, tier=tier)
    engine.prefill(prompt[:-1])
    wrap = torch.compile if compiled else (lambda fn: fn)
    layered = StepRegions.eager()
    merged = StepRegions(
        wrap(DecoderLayer.step_inputs),
        DecoderLayer.step_outputs,
        MLAForCausalLM.logits_of,
        between=wrap(DecoderLayer.step_between),
        last=wrap(DecoderLayer.step_last),
    )
    assert merged.merges(tier) and not layered.merges(tier)
    results = []
    for regions in (layered, merged):
        model.regions = regions
        cache = engine.cache.copy()
        cache.prepare(len(prompt) - 1, 1)
        cache.reserve(64)
        token, position = torch.tensor([int(prompt[-1])]), torch.tensor([len(prompt) - 1])
        results.append((model.decode_step(token, position, cache, n_rows=cache.capacity)[0], cache))
    model.regions = StepRegions.eager()
    (want, want_cache), (got, got_cache) = results
    if compiled:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(got, want)
    tol = 1e-4 if compiled else 0.0
    for name, field in want_cache._fields.items():
        torch.testing.assert_close(
            got_cache._fields[name][:, : len(prompt)], field[:, : len(prompt)], rtol=tol, atol=tol
        )


def test_write_at_is_write():
    cfg = preset("tiny")
    a, b = make_cache("fp8", cfg, capacity=16), make_cache("fp8", cfg, capacity=16)
    lc, rc = torch.randn(1, cfg.kv_lora_rank), torch.randn(1, cfg.qk_rope_head_dim)
    a.write(2, 5, lc, rc)
    b.write_at(2, torch.tensor([5]), lc, rc)
    for name in a._fields:
        assert torch.equal(a._fields[name], b._fields[name])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()  # outputs of modules with weights that track gradients
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["f32", "fp8", "int4"])
def test_cuda_graph_steps_give_the_plain_steps_logits(tier):
    """Teacher-forced through the plain engine's greedy answer, across a bucket growth and a restore:
    the replayed steps give the plain steps' logits (the attention reads a whole bucket, so its sums
    run in another order: equal up to f32 rounding, not bit for bit)."""
    cfg = preset("tiny-512")
    model = random_model(cfg, seed=5).to("cuda")
    prompt = np.random.default_rng(1).integers(2, cfg.vocab_size, MIN_BUCKET - 20)
    graphs = Engine(model, tier=tier)
    plain = Engine(model, tier=tier, cuda_graphs=False)
    assert graphs._graphs is not None and plain._graphs is None
    answer = plain.generate(prompt, max_new_tokens=48, stop_tokens=()).tokens
    plain.cache.truncate(0)
    worst = max(_relative(graphs.prefill(prompt)[0], plain.prefill(prompt)[0]), 0.0)
    for token in answer[:-1]:  # crosses from the 1024-row bucket into the 2048-row one
        got = graphs.decode_logits(token, graphs.cache.length).clone()
        worst = max(worst, _relative(got, plain.decode_logits(token, plain.cache.length)))
    assert worst < 2e-3, worst
    assert graphs._graphs.captures == 2
    assert np.array_equal(graphs.cache.tokens, plain.cache.tokens)
    # a restore that fits the buffers copies its rows in: the graphs stay, and still agree
    graphs.cache.restore(plain.export_rows())
    token = 7
    got = graphs.decode_logits(token, graphs.cache.length).clone()
    assert _relative(got, plain.decode_logits(token, plain.cache.length)) < 2e-3
    assert graphs._graphs.captures == 2


@pytest.mark.gpu
def test_warm_graphs_capture_every_bucket_ahead():
    cfg = preset("tiny-512")
    engine = Engine(random_model(cfg, seed=5).to("cuda"), tier="fp8")
    assert engine.warm_graphs(3000) == 3  # 1024, 2048 and 4096 rows
    prompt = np.random.default_rng(2).integers(2, cfg.vocab_size, 2100)
    engine.generate(prompt, max_new_tokens=4, stop_tokens=())
    assert engine._graphs.captures == 3 and engine.cache.length == 2100 + 3


def _experts_and_routes(device, dtype, tokens=37, seed=1):
    cfg = preset("tiny")
    model = random_model(cfg, seed=seed, dtype=dtype).to(device)
    experts = next(layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden_size, generator=generator).to(device, getattr(torch, dtype))
    routes = torch.stack(
        [torch.randperm(cfg.n_routed_experts, generator=generator)[: cfg.num_experts_per_tok] for _ in range(tokens)]
    ).to(device)
    weights = torch.rand(tokens, cfg.num_experts_per_tok, generator=generator).to(device)
    return experts, x, routes, weights


def test_grouped_experts_equal_the_per_expert_loop_on_the_cpu():
    experts, x, routes, weights = _experts_and_routes("cpu", "bfloat16")
    got = experts._grouped(x, routes, weights).float()
    want = copy.deepcopy(experts).float()._segmented(x.float(), routes, weights)  # f32: no rounding of its own
    assert _relative(got, want) <= 1e-2
    # no worse than the bf16 loop: one rounding of the weighted sum instead of one per expert
    assert _relative(got, want) <= _relative(experts._segmented(x, routes, weights), want)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 6, 300])
def test_grouped_experts_on_cuda_agree_with_the_loop(tokens):
    experts, x, routes, weights = _experts_and_routes("cuda", "bfloat16", tokens)
    got = experts._grouped(x, routes, weights).float()
    # the reference in f32 (bf16 per-expert sums would carry their own rounding)
    want = copy.deepcopy(experts).float()._segmented(x.float(), routes, weights)
    assert _relative(got, want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_decode_expert_kernels_on_cuda_agree_with_the_loop(tokens, dtype, monkeypatch):
    """The Triton experts (engine/expert_kernels.py; 200 tokens: experts with several passes of
    pairs) within the grouped path's bound of the f32 loop, and in bf16 no farther from it than the
    grouped GEMM, which rounds gate and up before their product; a decode step's pairs take them.
    With fewer pairs than experts (one token), the grid of a row per pair (COMPACT_GRID, the
    default) gives the same bits as the row per expert."""
    from kvstore.engine import expert_kernels
    from kvstore.engine.expert_kernels import MAX_PAIRS, routed_experts

    monkeypatch.setattr(expert_kernels, "COMPACT_GRID", False)  # a row of programs per expert
    experts, x, routes, weights = _experts_and_routes("cuda", dtype, tokens)
    want = copy.deepcopy(experts).float()._segmented(x.float(), routes, weights)
    got = routed_experts(x, routes, weights, experts.gate_proj, experts.up_proj, experts.down_proj)
    assert got.dtype == getattr(torch, dtype) and got.shape == x.shape
    assert _relative(got, want) <= 1e-2
    if dtype == "bfloat16":
        assert _relative(got, want) <= 1.25 * _relative(experts._grouped(x, routes, weights), want) + 1e-4
    experts.fuse_gate_up()  # gate and up as halves of one tensor: the same kernels over views
    fused = routed_experts(x, routes, weights, experts.gate_proj, experts.up_proj, experts.down_proj)
    assert torch.equal(fused, got)
    if routes.numel() <= MAX_PAIRS:
        assert torch.equal(experts(x, routes, weights), got)
    if routes.numel() < experts.gate_proj.shape[0]:
        monkeypatch.setattr(expert_kernels, "COMPACT_GRID", True)
        compact = routed_experts(x, routes, weights, experts.gate_proj, experts.up_proj, experts.down_proj)
        assert torch.equal(compact, got)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, compact", [(16, False), (3, True)], ids=["a-row-per-expert", "a-row-per-pair"])
def test_decode_expert_kernels_replay_in_a_cuda_graph(tokens, compact, monkeypatch):
    """Nothing goes back to the host: one capture replays with new tokens and new routes — with a
    row of programs per pair too (6 pairs, 8 experts), whose rows find their experts on the device."""
    from kvstore.engine import expert_kernels
    from kvstore.engine.expert_kernels import routed_experts

    monkeypatch.setattr(expert_kernels, "COMPACT_GRID", compact)
    experts, x, routes, weights = _experts_and_routes("cuda", "bfloat16", tokens, seed=3)
    _, x2, routes2, weights2 = _experts_and_routes("cuda", "bfloat16", tokens, seed=4)
    params = (experts.gate_proj, experts.up_proj, experts.down_proj)
    routed_experts(x, routes, weights, *params)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts(x, routes, weights, *params)
    x.copy_(x2)
    routes.copy_(routes2)
    weights.copy_(weights2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, routed_experts(x2, routes2, weights2, *params))


def test_fused_gate_and_up_keep_the_values_and_the_output():
    """``fuse_gate_up`` (what ``compile_decode`` does to every MoE layer on CUDA) makes gate and up
    views of one tensor and runs one grouped GEMM for both: same parameters, same experts' output,
    and still the same after the module is converted."""
    experts, x, routes, weights = _experts_and_routes("cpu", "bfloat16")
    gate, up = experts.gate_proj.detach().clone(), experts.up_proj.detach().clone()
    want = experts._grouped(x, routes, weights).float()
    experts.fuse_gate_up()
    assert torch.equal(experts.gate_proj, gate) and torch.equal(experts.up_proj, up)
    assert "_gate_up" not in experts.state_dict()
    assert _relative(experts._grouped(x, routes, weights).float(), want) <= 1e-2
    converted = copy.deepcopy(experts).float()
    assert torch.equal(converted._gate_up[:, : gate.shape[1]], gate.float())


def test_fused_projections_keep_the_values_and_the_logits():
    """``fuse_projections`` (what ``compile_decode`` does on CUDA) stores a layer's two projections
    of its input and each MLP's gate and up as parts of one tensor: the same parameters, the same
    prefill and decode logits (f32 on the CPU: one GEMM's columns are the two GEMMs' columns)."""
    cfg = preset("tiny")
    model = random_model(cfg, seed=4)
    prompt = np.random.default_rng(5).integers(2, cfg.vocab_size, 30)
    attn = model.model.layers[0].self_attn
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    def run():
        engine = Engine(model, tier="f32")
        engine.prefill(prompt[:-1])
        return engine.decode_logits(int(prompt[-1]), len(prompt) - 1)

    want = run()
    model.fuse_projections()
    assert attn._x_proj is not None and attn.kv_a_proj_with_mqa.weight.data_ptr() != attn._x_proj.data_ptr()
    first = attn.q_proj if hasattr(attn, "q_proj") else attn.q_a_proj
    assert first.weight.data_ptr() == attn._x_proj.data_ptr()  # a view of the fused weight, no copy
    assert "_x_proj" not in model.state_dict() and "_gate_up" not in str(list(model.state_dict()))
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    torch.testing.assert_close(run(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
def test_shared_experts_in_the_expert_kernels_agree_with_the_shared_mlp(tokens):
    """On CUDA the experts' kernels also run a layer's shared MLP (as experts every token chose):
    the layer's output within the bf16 bound of an f32 reference, and no farther from it than the
    routed kernels plus the shared MLP's own GEMMs."""
    cfg = preset("tiny")
    model = random_model(cfg, seed=6, dtype="bfloat16").to("cuda")
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert moe.shared_experts is not None
    moe.shared_experts.fuse_gate_up()
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    reference = copy.deepcopy(moe).float()
    reference.experts.triton_kernels = False
    want = reference(x.float())
    folded = moe(x)
    moe.experts.fold_shared = False
    apart = moe(x)
    assert folded.dtype == torch.bfloat16 and folded.shape == x.shape
    assert not torch.equal(folded, apart)  # two paths: the shared MLP ran in the kernels
    assert _relative(folded, want) <= 1e-2
    assert _relative(folded, want) <= 1.25 * _relative(apart, want) + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_the_routing_kernel_on_cuda_routes_as_torch(tokens):
    """The decode step's routing kernel picks each token's experts as the router's torch path does
    (group-limited, tiny's 2 groups of 4) and gives them the same weights; with the shared experts'
    columns appended when the experts' kernels run them."""
    cfg = preset("tiny")
    model = random_model(cfg, seed=8).to("cuda")
    router = next(layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate"))
    with torch.no_grad():
        router.e_score_correction_bias.normal_().mul_(0.1)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to("cuda")
    assert router.triton_route and router.kernel_routes
    ids, weights = router(x, n_shared=1)
    want_ids, want_weights = router._route(torch.nn.functional.linear(x.float(), router.weight))
    k = cfg.num_experts_per_tok
    assert torch.equal(ids[:, :k].sort(dim=1).values, want_ids.sort(dim=1).values)
    by_id = torch.zeros(tokens, cfg.n_routed_experts, device="cuda").scatter_(1, want_ids, want_weights)
    torch.testing.assert_close(weights[:, :k], by_id.gather(1, ids[:, :k]), rtol=1e-6, atol=1e-6)
    assert torch.all(ids[:, k:] == cfg.n_routed_experts) and torch.all(weights[:, k:] == 1.0)
