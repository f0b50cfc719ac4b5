"""The suite every decode-attention backend passes (subclass, set ``backend_name`` and the bounds).

A backend of ``kvstore.gpu.registry`` is held to what its spec declares: its one entry point
(``decode``, with the interface's signature) for every tier it names, dense and (when
``spec.selected``) over selected rows, against the float64 reference of ``kvstore.gpu.reference``
on fresh random data (ragged batches with an empty and a one-row sequence, rows at random
offsets), NaN-poisoned outputs so a skipped element fails, inert rows (fp8 NaN codes under a huge
scale, radius 0, delta 0, zeros) contributing exactly nothing, the ``out=`` contract, a trusted
batch giving the checked one's bits, the checks of a checked batch (shapes when it is made and
called, ranges when asked), and refusals given as a list of reasons. A backend whose environment is
missing (no CUDA, no Metal) is skipped with its reasons.

Subclasses pick the problem sizes: ``cases`` (lengths kind, longest, heads; per tier through
``cases_for``), ``kv_lora``/``qk_rope``,
``selected_rows`` (S of the selected-rows cases) and ``bound`` (largest ``||out - ref|| / ||ref||``).
"""

from __future__ import annotations

import inspect
import secrets

import pytest
import torch

from kvstore import tiers
from kvstore.gpu import registry, testing
from kvstore.gpu.errors import AttentionInputError

RUN_SEED = secrets.randbits(31)  # fresh data every run; printed with any failure


class AttentionConformance:
    backend_name: str
    device: str = "cpu"
    #: largest relative error against the float64 reference, per tier name (``"*"`` for the rest)
    bound: dict[str, float]
    kv_lora = 128
    qk_rope = 32
    #: (lengths kind "single" or "ragged", longest sequence, heads)
    cases: tuple[tuple[str, int, int], ...] = (("single", 1, 16), ("single", 300, 16), ("ragged", 257, 16))
    selected_rows = 64
    #: the tiers checked (default: every tier the spec declares)
    tier_names: tuple[str, ...] | None = None

    # ---- set-up ----------------------------------------------------------------------------------
    def declared(self) -> list[str]:
        spec = registry.spec_of(self.backend_name)
        names = self.tier_names or tuple(spec.tiers)
        return [name for name in tiers.names() if name in names]

    def cases_for(self, tier: str) -> tuple[tuple[str, int, int], ...]:
        """The problem sizes checked for ``tier`` (default :attr:`cases` for every tier)."""
        return self.cases

    def pytest_generate_tests(self, metafunc):
        if "case" in metafunc.fixturenames:
            pairs = [(tier, case) for tier in self.declared() for case in self.cases_for(tier)]
            metafunc.parametrize("tier,case", pairs, ids=[f"{t}-{k}-T{n}-H{h}" for t, (k, n, h) in pairs])
        elif "tier" in metafunc.fixturenames:
            metafunc.parametrize("tier", self.declared())

    @pytest.fixture
    def backend(self):
        why = registry.reasons(self.backend_name, self.device)
        if why:
            pytest.skip(f"backend {self.backend_name} cannot run on {self.device}: {'; '.join(why)}")
        return registry.instance(self.backend_name, self.device)

    def tolerance(self, tier: str) -> float:
        return self.bound.get(tier, self.bound["*"])

    def make(self, tier: str, lengths, heads: int, seed: int, **kwargs) -> testing.DecodeCase:
        return testing.make_case(
            tier, lengths, heads, kv_lora=self.kv_lora, qk_rope=self.qk_rope, device=self.device, seed=seed, **kwargs
        )

    def check(self, backend, case: testing.DecodeCase, seed: int, **kwargs) -> torch.Tensor:
        out = testing.poisoned_out(case)
        result = testing.decode(case, out, backend=backend, **kwargs)
        assert result is out, "the result must be written into out and returned"
        err = testing.relative_error(out, testing.reference(case))
        limit = self.tolerance(case.tier.name)
        assert err < limit, f"{self.backend_name} {case.tier.name}: rel err {err:.3e} >= {limit} (seed {seed})"
        empty = case.n_selected == 0 if case.selected else case.seq_len == 0
        assert bool((out[empty.to(out.device)] == 0).all()), "a sequence with no rows must get a zero context"
        return out

    @staticmethod
    def lengths(kind: str, longest: int, seed: int) -> list[int]:
        return [longest] if kind == "single" else testing.ragged_lengths(longest, 8, seed)

    # ---- what the spec declares is there -----------------------------------------------------------
    def test_every_declared_tier_is_selected_to_the_one_entry_point(self, backend, tier):
        assert backend.name == self.backend_name
        assert (
            registry.reasons(self.backend_name, self.device, tier=tier, kv_lora=self.kv_lora, qk_rope=self.qk_rope)
            == []
        )
        choice = registry.select(
            tier, self.device, kv_lora=self.kv_lora, qk_rope=self.qk_rope, prefer=self.backend_name
        )
        assert choice.backend == self.backend_name and choice.function == backend.decode

    def test_the_entry_point_has_the_interface_signature(self, backend):
        def shape(function):
            return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

        assert shape(type(backend).decode) == shape(registry.AttentionBackend.decode)

    def test_refusals_are_a_list_of_reasons(self):
        spec = registry.spec_of(self.backend_name)
        foreign = next(t for t in ("meta", "cpu", "cuda") if t not in spec.device_types)
        why = registry.reasons(self.backend_name, foreign, tier="fp4")
        assert isinstance(why, list) and why and all(isinstance(reason, str) and reason for reason in why)
        assert any(foreign in reason for reason in why)
        assert any("fp4" in reason for reason in why)
        undeclared = [name for name in tiers.names() if name not in spec.tiers]
        if undeclared:
            assert any(
                undeclared[0] in reason
                for reason in registry.reasons(self.backend_name, self.device, tier=undeclared[0])
            )

    # ---- results against float64 -------------------------------------------------------------------
    def test_dense_matches_float64(self, backend, tier, case):
        kind, longest, heads = case
        seed = RUN_SEED + longest * 131 + heads + tiers.names().index(tier)
        self.check(backend, self.make(tier, self.lengths(kind, longest, seed), heads, seed), seed)

    def test_selected_rows_match_float64(self, backend, tier, case):
        if not backend.spec.selected:
            pytest.skip(f"{self.backend_name} declares no selected-rows variants")
        kind, longest, heads = case
        seed = RUN_SEED + longest * 137 + heads + tiers.names().index(tier)
        problem = self.make(
            tier, self.lengths(kind, longest, seed), heads, seed, selected=min(longest, self.selected_rows)
        )
        self.check(backend, problem, seed)

    def test_every_query_empty(self, backend, tier):
        seed = RUN_SEED + 3
        problem = self.make(tier, [0, 0], 16, seed)
        out = testing.decode(problem, testing.poisoned_out(problem), backend=backend)
        assert bool((out == 0).all())

    # ---- inert rows --------------------------------------------------------------------------------
    def test_inert_latent_rows_give_a_zero_context(self, backend, tier):
        """Latent rows that decode to zeros contribute exactly zero, however the scores fall: fp8
        rows of NaN codes (which read 0) under a huge scale, TQ rows of radius 0, Q8_0 blocks of
        delta 0, zero values."""
        seed = RUN_SEED + 5
        problem = self.make(tier, testing.ragged_lengths(40, 4, seed), 16, seed)
        if problem.tier is tiers.FP8:
            problem.lc_codes[:] = torch.where(torch.arange(self.kv_lora, device=self.device) % 2 == 0, 0x7F, 0xFF).to(
                torch.uint8
            )
            problem.lc_scales[:] = 1e30
        elif problem.lc_scales is None:
            problem.lc_codes.zero_()
        else:
            problem.lc_scales.zero_()
        out = testing.decode(problem, testing.poisoned_out(problem), backend=backend)
        assert bool((out == 0).all())

    def test_fp8_nan_codes_read_as_zero(self, backend):
        """NaN codes (0x7F/0xFF, which no encoder writes) read as 0: against float64 under the row's
        own scale, and exactly like zero codes under a huge one."""
        if "fp8" not in self.declared():
            pytest.skip("fp8 is not declared")
        seed = RUN_SEED + 7
        poisoned = self.make("fp8", [40, 7], 16, seed)
        zeroed = self.make("fp8", [40, 7], 16, seed)
        row = int(poisoned.seq_start[0]) + 3
        for problem, latent, rope in ((poisoned, 0x7F, 0xFF), (zeroed, 0, 0)):
            problem.lc_codes[row] = latent
            problem.rc_codes[row] = rope
        self.check(backend, poisoned, seed)
        for problem in (poisoned, zeroed):
            problem.lc_scales[row] = 1e30
        got = testing.decode(poisoned, backend=backend)
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, testing.decode(zeroed, backend=backend), rtol=1e-5, atol=0)

    # ---- the call's contract -----------------------------------------------------------------------
    def test_out_is_checked(self, backend, tier):
        problem = self.make(tier, [20, 9], 16, RUN_SEED + 9)
        with pytest.raises(AttentionInputError, match="out must be a contiguous f32"):
            testing.decode(problem, torch.empty(2, 16, self.kv_lora + 1, device=self.device), backend=backend)
        with pytest.raises(AttentionInputError, match="out must be a contiguous f32"):
            testing.decode(
                problem, torch.empty(2, 16, self.kv_lora, dtype=torch.float64, device=self.device), backend=backend
            )

    def test_a_checked_batch_checks_each_call_and_its_ranges_on_request(self, backend, tier):
        problem = self.make(tier, [10], 16, RUN_SEED + 11)
        problem.q_lat = problem.q_lat.double()
        with pytest.raises(AttentionInputError, match="q_lat must be float32"):
            testing.decode(problem, backend=backend)
        problem = self.make(tier, [10], 16, RUN_SEED + 11)
        problem.seq_len[0] = problem.lc_codes.shape[0] + 1
        batch = problem.batch(ranges=False)  # made: its shapes are right
        with pytest.raises(AttentionInputError, match="runs past"):
            batch.check_ranges()

    def test_a_trusted_batch_gives_the_checked_batchs_bits(self, backend, tier):
        problem = self.make(tier, testing.ragged_lengths(40, 4, RUN_SEED + 13), 16, RUN_SEED + 13)
        checked = testing.decode(problem, testing.poisoned_out(problem), backend=backend)
        assert torch.equal(
            testing.decode(problem, testing.poisoned_out(problem), backend=backend, trusted=True), checked
        )
