"""Backend registry, selection, the operands' batch and its checks: the interface the engine relies
on, checked on the CPU."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from kvstore import gpu, tiers
from kvstore.gpu import registry, testing
from kvstore.gpu.errors import AttentionInputError, BackendUnavailable
from kvstore.gpu.inputs import LatentBatch, row_layout
from kvstore.gpu.registry import BackendSpec
from kvstore.gpu.torch_backend import TorchBackend

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None


def test_builtin_backends_in_preference_order():
    assert list(registry.registered())[:4] == ["cuda", "triton", "mps", "torch"]
    spec = registry.spec_of("cuda")
    assert spec.device_types == frozenset({"cuda"})
    assert set(spec.tiers) == {"fp8", "int4"}
    assert spec.kv_lora == (128, 256, 512) and spec.qk_rope == (32, 64)
    assert set(registry.spec_of("torch").tiers) == set(tiers.names())  # the torch path decodes every tier


def test_spec_mismatches_are_listed_as_reasons():
    why = registry.reasons("cuda", "cpu", tier="polar3", kv_lora=576, qk_rope=64)
    assert "runs on ['cuda'], not cpu" in why
    assert "tier 'polar3' is not one of ['fp8', 'int4']" in why
    assert "kv_lora=576 is not one of [128, 256, 512]" in why
    assert not any("qk_rope" in r for r in why)


def test_cuda_backend_reasons_match_the_environment():
    why = registry.reasons("cuda", "cuda:0", tier="fp8", kv_lora=512, qk_rope=64)
    if not HAS_CUPY:
        assert "Python module 'cupy' is not installed" in why
    elif not HAS_CUDA:
        assert "torch.cuda.is_available() is False" in why
    else:
        major, minor = torch.cuda.get_device_capability(0)
        assert (why == []) == ((major, minor) >= (8, 9)), why


def test_mps_backend_says_why_it_is_off():
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        pytest.skip("an Apple GPU is present: nothing to explain")
    why = registry.reasons("mps", "mps")
    assert why and all("MPS" in r or "mps" in r for r in why)
    assert registry.reasons("mps", "cpu") == ["runs on ['mps'], not cpu"]


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
def test_get_backend_without_cuda_raises_with_every_reason():
    with pytest.raises(BackendUnavailable) as info:
        registry.get_backend("cuda")
    assert set(info.value.reasons) >= {"cuda", "torch"}
    assert "no attention backend runs on cuda" in info.value.reason


def test_get_backend_caches_one_instance_per_device():
    first = registry.get_backend("cpu")
    assert first is registry.get_backend(torch.device("cpu"))
    assert isinstance(first, TorchBackend) and first.name == "torch"


def test_registered_backend_with_higher_priority_wins_and_can_be_removed():
    registry.register_backend(
        BackendSpec(name="cpu-first", device_types=frozenset({"cpu"}), priority=0),
        "kvstore.gpu.torch_backend:TorchBackend",
    )
    try:
        assert list(registry.registered())[0] == "cpu-first"
        assert registry.reasons("cpu-first", "cpu") == []
    finally:
        registry.unregister_backend("cpu-first")
    assert "cpu-first" not in registry.registered()
    with pytest.raises(ValueError, match="module:Class"):
        registry.register_backend(BackendSpec(name="bad", device_types=frozenset({"cpu"})), "no_colon")


class NarrowTorchBackend(TorchBackend):
    """The torch path, refusing kv_lora 512 as a backend whose kernels outgrow a device does."""

    @classmethod
    def configuration_reasons(cls, device, tier, kv_lora, qk_rope):
        return [f"kv_lora={kv_lora} outgrows this device"] if kv_lora == 512 else []


def test_a_configuration_the_device_cannot_hold_passes_to_the_next_backend():
    registry.register_backend(
        BackendSpec(name="narrow", device_types=frozenset({"cpu"}), priority=0), f"{__name__}:NarrowTorchBackend"
    )
    try:
        wide = registry.select("fp8", "cpu", kv_lora=512, qk_rope=64)
        assert wide.backend == "torch" and wide.rejected["narrow"] == ["kv_lora=512 outgrows this device"]
        assert registry.select("fp8", "cpu", kv_lora=128, qk_rope=32).backend == "narrow"
        assert registry.reasons("narrow", "cpu") == []  # no configuration named: nothing to refuse
        why = registry.backend_class("narrow").why_not(torch.device("cpu"), "int4", 512, 64)
        assert why == ["kv_lora=512 outgrows this device"]
    finally:
        registry.unregister_backend("narrow")


def _case(**kwargs):
    return testing.make_case("fp8", [20, 9], 16, kv_lora=128, qk_rope=32, seed=7, **kwargs)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda c: setattr(c, "q_lat", c.q_lat.half()), "q_lat must be float32"),
        (lambda c: setattr(c, "q_rope", c.q_rope[:, :8]), "q_rope .* does not match q_lat"),
        (lambda c: setattr(c, "lc_codes", c.lc_codes.to(torch.int16)), "lc_codes must be uint8"),
        (lambda c: setattr(c, "lc_codes", c.lc_codes[:, :64]), r"lc_codes must be u8\[N, 128\] for fp8"),
        (lambda c: setattr(c, "rc_scales", c.rc_scales[:-1]), "rc_scales has .* rows"),
        (lambda c: setattr(c, "seq_len", c.seq_len.long()), "seq_len must be int32"),
        (lambda c: setattr(c, "seq_start", c.seq_start[:1]), r"seq_start must be i32\[2\]"),
        (lambda c: setattr(c, "softmax_scale", float("nan")), "softmax_scale must be a finite float"),
        (lambda c: setattr(c, "lc_scales", c.lc_scales.numpy()), "lc_scales must be a torch tensor"),
        (lambda c: c.__dict__.update(q_lat=c.q_lat[:1], q_rope=c.q_rope[:1]), r"q_lat must be f32\[2, H, 128\] for"),
        (lambda c: setattr(c, "rc_codes", c.rc_codes[:, :16].contiguous()), r"rc_codes must be u8\[N, 32\] for fp8"),
        (lambda c: setattr(c, "indices", torch.zeros(2, 4, dtype=torch.int32)), "n_selected must be a torch tensor"),
    ],
)
def test_bad_inputs_raise_typed_errors(mutate, message):
    """Whether the batch refuses them when it is made or the call does, with the same reasons."""
    case = _case()
    mutate(case)
    backend = TorchBackend(torch.device("cpu"))
    with pytest.raises(AttentionInputError, match=message) as info:
        testing.decode(case, backend=backend)
    assert info.value.reason and isinstance(info.value, ValueError)


def test_unknown_tiers_and_wrong_row_layouts_are_refused():
    case = _case()
    bounds = case.seq_start, case.seq_len
    with pytest.raises(AttentionInputError, match="unknown tier 'fp4'"):
        LatentBatch("fp4", *case.rows(), *bounds, kv_lora=128, qk_rope=32)
    with pytest.raises(AttentionInputError, match="lc_codes must be int8, got uint8"):
        LatentBatch("q8", *case.rows(), *bounds, kv_lora=128, qk_rope=32)
    with pytest.raises(AttentionInputError, match="f32 rows have no scales"):
        LatentBatch(
            "f32", case.lc_codes.float(), case.lc_scales, case.rc_codes.float(), case.rc_scales, *bounds,
            kv_lora=128, qk_rope=32,
        )  # fmt: skip
    with pytest.raises(AttentionInputError, match="rc_codes is on meta, lc_codes on cpu"):
        LatentBatch("fp8", case.lc_codes, case.lc_scales, case.rc_codes.to("meta"), case.rc_scales, *bounds,
                    kv_lora=128, qk_rope=32)  # fmt: skip
    with pytest.raises(AttentionInputError, match="seq_len must hold one length per query"):
        LatentBatch("fp8", *case.rows(), case.seq_start[:0], case.seq_len[:0], kv_lora=128, qk_rope=32)


def test_int4_needs_power_of_two_widths():
    case = testing.make_case("int4", [5], 16, kv_lora=128, qk_rope=32, seed=3)
    case.q_lat = torch.zeros(1, 16, 96)
    with pytest.raises(AttentionInputError, match="kv_lora: int4 needs power-of-two row widths"):
        testing.decode(case)


def test_out_of_range_sequences_and_indices_are_refused():
    case = _case()
    case.seq_len[1] = case.lc_codes.shape[0]
    with pytest.raises(AttentionInputError, match="runs past"):
        testing.decode(case)
    case = _case(selected=8)
    case.indices[0, 0] = int(case.seq_len[0])  # one past the sequence
    with pytest.raises(AttentionInputError, match="outside its sequence"):
        testing.decode(case)
    case = _case(selected=8)
    case.n_selected[0] = 9
    with pytest.raises(AttentionInputError, match="n_selected must lie in 0..8"):
        testing.decode(case)


def test_out_must_match():
    case = _case()
    with pytest.raises(AttentionInputError, match="out must be a contiguous f32"):
        testing.decode(case, torch.empty(2, 16, 64))


def test_the_public_decode_dispatches_on_the_query_device():
    case = _case(selected=4)
    out = gpu.decode(case.q_lat, case.q_rope, case.batch(), case.softmax_scale)
    assert out.shape == (2, 16, 128) and torch.isfinite(out).all()
    assert torch.equal(
        out, registry.get_backend("cpu").decode(case.q_lat, case.q_rope, case.batch(), case.softmax_scale)
    )


def test_a_batch_carries_its_geometry_and_a_trusted_one_checks_nothing():
    case = _case(selected=4)
    batch = case.batch()
    assert (batch.tier, batch.batch_size, batch.n_rows, batch.kv_lora, batch.qk_rope, batch.selected) == (
        tiers.FP8,
        2,
        case.lc_codes.shape[0],
        128,
        32,
        4,
    )
    assert batch.checked and batch.device == torch.device("cpu")
    assert batch.operands == (*case.rows(), case.seq_start, case.seq_len, case.indices, case.n_selected)
    assert repr(batch) == f"LatentBatch(fp8, B=2, N={batch.n_rows}, K=128, R=32, S=4, on cpu)"
    # nothing is looked at: not the widths, not the dtypes, not the bounds
    odd = LatentBatch.trusted(tiers.FP8, case.lc_codes, None, case.rc_codes, None, case.seq_start, case.seq_len,
                              kv_lora=7, qk_rope=3)  # fmt: skip
    assert not odd.checked and (odd.kv_lora, odd.lc_scales, odd.selected) == (7, None, None)
    assert repr(odd).endswith(", trusted)")


@pytest.mark.parametrize("tier", tiers.names())
def test_row_layouts_follow_the_tier_sizes(tier):
    """The operands of every tier take exactly the bytes ``kvstore.tiers`` gives a row."""
    t = tiers.get(tier)
    for width in (32, 64, 512):
        layout = row_layout(t, width)
        scale_bytes = 0
        if layout.scales_dtype is not None:
            scale_bytes = math.prod(layout.scales_shape) * layout.scales_dtype.itemsize
        assert layout.code_width * layout.codes_dtype.itemsize + scale_bytes == t.row_bytes(width), width
    assert row_layout(tiers.Q8, 32).scales_shape == (1,) and row_layout(tiers.FP8, 32).scales_shape == ()


def test_cuda_launch_plan_head_groups_and_splits():
    """The split planner (host-side): head groups per block size, and one wave of blocks."""
    from kvstore.gpu.cuda_plan import plan_launch

    plan = plan_launch(1, 16, 1 << 20, 1 << 20, 132)
    assert (plan.m_tiles, plan.head_groups, plan.padded_heads, plan.blocks_per_sm) == (1, 1, 16, 2)
    assert plan.n_splits * plan.blocks_per_split * 64 >= 1 << 20 and plan.n_splits <= 264
    assert (plan_launch(1, 64, 4097, 4097, 132).m_tiles, plan_launch(1, 64, 4097, 4097, 132).head_groups) == (4, 1)
    narrow = plan_launch(1, 64, 4097, 4097, 132, max_mt=2)
    assert (narrow.m_tiles, narrow.head_groups, narrow.padded_heads) == (2, 2, 64)
    padded = plan_launch(2, 48, 9000, 5000, 132, max_mt=1)
    assert (padded.m_tiles, padded.head_groups, padded.padded_heads) == (1, 3, 48)
    assert plan_launch(1, 20, 100, 100, 132).padded_heads == 32
    # 32k rows = 512 tiles: 128 splits of 4 (fewer partials to merge), not 256 of 2; 4097 rows: 65 of 1
    assert (plan_launch(1, 16, 32768, 32768, 132).blocks_per_split, plan_launch(1, 16, 32768, 32768, 132).n_splits) == (
        4,
        128,
    )
    assert plan_launch(1, 16, 4097, 4097, 132).n_splits == 65
    assert plan_launch(1, 16, 4097, 4097, 132, min_tiles=4).blocks_per_split == 4
    # 16 ragged sequences in 242k rows: at most one wave of working blocks, however they fall
    lengths = [1024 * i for i in (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 26, 28, 30, 32)]
    ragged = plan_launch(16, 16, sum(lengths) + 800, (sum(lengths) + 800) / 16, 132)
    working = sum(math.ceil(math.ceil(n / 64) / ragged.blocks_per_split) for n in lengths)
    assert working <= 264 and ragged.n_splits * ragged.blocks_per_split * 64 >= max(lengths)


def test_cuda_launch_plan_bounds_the_partial_contexts_of_a_large_captured_batch():
    """A captured step bounds each sequence by the cache's rows only (here a 262k-row arena): a
    step of 512 entries planned 512 splits each, 4.3 GB of f16 partials per workspace. The planner
    keeps sequences x heads x splits within MAX_PARTIALS (longer splits), still covering the bound;
    the batches whose plans were measured (1 to 64 sequences, up to 1M rows) are planned as before."""
    from kvstore.gpu.cuda_plan import MAX_PARTIALS, plan_launch

    for batch in (256, 512):
        plan = plan_launch(batch, 16, 1 << 18, (1 << 18) / batch, 132)
        # at most 256 MB of f16 partials at kv_lora 512 (it was 2.1 and 4.3 GB)
        assert batch * plan.padded_heads * plan.n_splits * 512 * 2 <= 256 << 20
        assert plan.n_splits * plan.blocks_per_split * 64 >= 1 << 18
    small = plan_launch(64, 16, 1 << 18, (1 << 18) / 64, 132)
    assert (small.n_splits, small.blocks_per_split) == (196, 21)
    for heads in (16, 64, 128):
        for rows in (32768, 1 << 20):
            for batch in (1, 8, 16, 64):
                plan = plan_launch(batch, heads, rows, rows, 132)
                assert batch * plan.padded_heads * plan.n_splits <= MAX_PARTIALS // 16


def test_merge_chunks_widen_with_the_batch():
    """The merge's output dims per block: 32 for a lone sequence, wider when sequences x heads
    already give two blocks per SM (the engine's 16 x 16 batch: one wave of 128-dim blocks)."""
    from kvstore.gpu.cuda_plan import MERGE_WIDTHS, merge_width

    assert merge_width(1, 16, 512, 132) == 32
    assert merge_width(1, 64, 512, 132) == 32
    assert merge_width(1, 128, 512, 132) == 128
    assert merge_width(16, 16, 512, 132) == 128
    assert merge_width(8, 64, 512, 132) == 512
    for batch, heads in [(1, 1), (3, 20), (16, 16), (64, 128)]:
        width = merge_width(batch, heads, 512, 132)
        assert width in MERGE_WIDTHS and 512 % width == 0


def test_selection_is_data_driven_with_reasons():
    """One registry for the engine and the benchmarks: the first backend whose declared data and
    environment allow the tier, with the reasons of each one passed over."""
    choice = registry.select("fp8", "cpu", kv_lora=128, qk_rope=32)
    assert choice.backend == "torch" and choice.tier is tiers.FP8
    assert "runs on ['cuda'], not cpu" in choice.rejected["cuda"]
    polar = registry.select(tiers.polar(3), "cpu")
    # the backend's one entry point, whatever the tier or the variant: the batch carries them
    assert polar.function == registry.instance("torch", "cpu").decode and polar.tier.bits == 3
    assert registry.select("int4", "cpu", selected=True).function == polar.function
    with pytest.raises(tiers.UnknownTier, match="unknown tier 'fp4'"):
        registry.select("fp4", "cpu")
    with pytest.raises(BackendUnavailable, match="no decode backend for tier polar3 on meta") as info:
        registry.select("polar3", "meta")
    assert set(info.value.reasons) == set(registry.registered())
    assert all(isinstance(why, list) and why for why in info.value.reasons.values())


def test_prefer_puts_a_backend_first_and_old_tier_names_warn():
    registry.register_backend(
        BackendSpec(name="fp8-only", device_types=frozenset({"cpu"}), tiers=frozenset({"fp8"}), priority=5),
        "kvstore.gpu.torch_backend:TorchBackend",
    )
    try:
        assert registry.select("fp8", "cpu").backend == "fp8-only"
        assert registry.select("fp8", "cpu", prefer="torch").backend == "torch"
        choice = registry.select("q8", "cpu")
        assert choice.backend == "torch" and choice.rejected["fp8-only"] == ["tier 'q8' is not one of ['fp8']"]
    finally:
        registry.unregister_backend("fp8-only")
    with pytest.warns(tiers.TierSpellingDeprecated, match="use 'int4'"):
        assert registry.select("tq-int4", "cpu").tier is tiers.INT4
    with pytest.raises(BackendUnavailable, match="no backend named 'nope'"):
        registry.select("fp8", "cpu", prefer="nope")
    with pytest.raises(ValueError, match="not tier names"):
        registry.register_backend(
            BackendSpec(name="bad", device_types=frozenset({"cpu"}), tiers=frozenset({"tq-int4"})),
            "kvstore.gpu.torch_backend:TorchBackend",
        )


def test_the_environment_names_a_preferred_backend(monkeypatch):
    """KVSTORE_ATTENTION_BACKEND is tried first when the caller names none; a caller's choice wins."""
    monkeypatch.setenv("KVSTORE_ATTENTION_BACKEND", "torch")
    assert registry.select("fp8", "cpu", kv_lora=512, qk_rope=64).backend == "torch"
    monkeypatch.setenv("KVSTORE_ATTENTION_BACKEND", "cuda")  # cannot run here: the next one follows
    choice = registry.select("fp8", "cpu", kv_lora=512, qk_rope=64)
    assert choice.backend == "torch" and "cuda" in choice.rejected
    monkeypatch.setenv("KVSTORE_ATTENTION_BACKEND", "no-such-backend")
    with pytest.raises(BackendUnavailable, match="no-such-backend"):
        registry.select("fp8", "cpu")


def test_only_the_geometry_the_wgmma_kernels_are_built_for_goes_to_them():
    from kvstore.gpu.cuda_plan import runs_wgmma

    base = dict(
        enabled=True, capability=(9, 0), tier="fp8", selected=False, heads=64, kv_lora=512, qk_rope=64, aligned=True
    )
    assert runs_wgmma(**base)
    assert runs_wgmma(**{**base, "heads": 128})
    assert runs_wgmma(**{**base, "tier": "int4"})
    for change in (
        {"enabled": False},  # turned off (KVSTORE_GPU_WGMMA=0, another Triton release)
        {"capability": (8, 9)},  # no wgmma
        {"capability": (10, 0)},  # built for sm_90 only
        {"tier": "q8"},
        {"tier": "polar3"},
        {"selected": True},
        {"heads": 48},
        {"kv_lora": 256},
        {"qk_rope": 32},
        {"aligned": False},
    ):
        assert not runs_wgmma(**{**base, **change}), change


def test_the_wgmma_kernels_are_on_by_default_only_on_the_triton_they_are_tested_with():
    from kvstore.gpu.cuda_plan import WGMMA_TRITON, wgmma_by_default

    tested = WGMMA_TRITON[0] + ".0"
    assert wgmma_by_default(tested, None)
    assert wgmma_by_default(WGMMA_TRITON[0] + ".1+git0abc", None)
    assert not wgmma_by_default("3.9.0", None)  # Gluon's API changed: not used unless asked
    assert not wgmma_by_default("", None)  # no Triton
    # KVSTORE_GPU_WGMMA decides when set
    assert not wgmma_by_default(tested, False)
    assert wgmma_by_default("3.9.0", True)


def test_plain_calls_take_the_wgmma_kernels_only_where_their_gpu_time_pays_their_launches():
    from kvstore.gpu.cuda_plan import WGMMA_PLAIN_MIN_HEAD_ROWS, wgmma_for_call

    assert wgmma_for_call(True, 64, None)  # captured: a replay pays no host time
    assert wgmma_for_call(True, 64, 1)
    assert not wgmma_for_call(False, 64, None)  # lengths on the device: unknown, v2
    rows = WGMMA_PLAIN_MIN_HEAD_ROWS // 64
    assert wgmma_for_call(False, 64, rows)
    assert not wgmma_for_call(False, 64, rows - 1)
    assert wgmma_for_call(False, 128, rows // 2)  # twice the heads, half the rows
