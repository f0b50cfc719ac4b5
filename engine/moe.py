"""The feed-forward half of a decoder layer: the dense MLP and the mixture of experts (router,
routed experts, shared experts), with the paths the routed experts take on each device.

On CUDA in bf16/f16 a decode step's few (token, expert) pairs run the Triton kernels of
:mod:`kvstore.engine.expert_kernels`; larger bf16 calls the grouped GEMM; elsewhere the gathered or
per-expert (segmented) paths, whose summation order the transformers oracle tests pin on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstore.engine import products
from kvstore.engine.config import ModelConfig

__all__ = ["DenseMLP", "MoE", "RoutedExperts", "Router", "grouped_mm_available", "has_triton", "with_shared_columns"]


# Grouped GEMM (bf16 on sm90+ in CUDA builds): the routed experts' path on CUDA. The CPU keeps the
# per-expert loop, whose summation order the transformers oracle tests pin.
_GROUPED_MM = getattr(torch, "_grouped_mm", None)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = getattr(self, "_gate_up", None)
        if gate_up is not None:  # one GEMM for both halves (fuse_gate_up)
            gate, up = F.linear(x, gate_up).split(self.gate_proj.weight.shape[0], dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse_gate_up(self) -> None:
        """Store gate and up as the two halves of one [2I, hidden] weight (the parameters become
        views of it, values unchanged): one GEMM reads both where a decode step launched two."""
        if getattr(self, "_gate_up", None) is not None:
            return
        fused = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data])
        self.gate_proj.weight.data = fused[: self.gate_proj.weight.shape[0]]
        self.up_proj.weight.data = fused[self.gate_proj.weight.shape[0] :]
        self.register_buffer("_gate_up", fused, persistent=False)  # converted with the parameters


def with_shared_columns(
    top_idx: torch.Tensor, weights: torch.Tensor, n_routed: int, n_shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes ``[T, k]`` with each token's row extended by the ``n_shared`` shared experts (ids
    ``n_routed ..``, weight 1), as the experts' kernels take them when they run the shared MLP."""
    if not n_shared:
        return top_idx, weights
    t = top_idx.shape[0]
    ids = torch.arange(n_routed, n_routed + n_shared, device=top_idx.device, dtype=top_idx.dtype)
    return (
        torch.cat([top_idx, ids.expand(t, n_shared)], dim=1),
        torch.cat([weights, weights.new_ones(t, n_shared)], dim=1),
    )


class Router(nn.Module):
    """Sigmoid scores, group-limited top-k on bias-corrected scores, weights from raw scores."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        # Kept in f32 whatever the model dtype, as transformers does.
        self.weight = nn.Parameter(torch.zeros(self.n_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))
        #: on CUDA the routing after the router's product runs as one Triton kernel
        #: (:func:`kvstore.engine.expert_kernels.route`) instead of ~6 small ones (sigmoid, top-k,
        #: gather, normalization, the shared experts' columns) wherever it can (:attr:`kernel_routes`);
        #: False keeps torch's (the benchmarks compare them)
        self.triton_route = True

    @property
    def kernel_routes(self) -> bool:
        """Whether the routing kernel takes this router's shape: group-limited routing needs
        power-of-two counts of experts and of groups."""
        pow2 = not self.n_experts & (self.n_experts - 1) and not self.n_group & (self.n_group - 1)
        return self.topk_group >= self.n_group or pow2

    def forward(self, x: torch.Tensor, n_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns expert indices int64[T, top_k] and their weights f32[T, top_k]; with
        ``n_shared``, each token's row ends with the shared experts (ids ``n_experts ..``, weight 1):
        ``[T, top_k + n_shared]``."""
        if products.as_reduction(x):  # a compiled step of a few tokens: one reduction, not cuBLAS's GEMV
            logits = products.linear_rows(x, self.weight)
        else:
            logits = F.linear(x.float(), self.weight.float())
        use = self.triton_route and x.device.type == "cuda" and self.kernel_routes
        kernels = _expert_kernels() if use else None
        if kernels is not None:
            return kernels.route(
                logits,
                self.e_score_correction_bias.float(),
                self.top_k,
                n_group=self.n_group,
                topk_group=self.topk_group,
                norm=self.norm_topk_prob,
                scale=self.routed_scaling_factor,
                n_shared=n_shared,
            )
        return with_shared_columns(*self._route(logits), self.n_experts, n_shared)

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = logits.shape[0]
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.n_group:  # otherwise every group is kept and the mask is a no-op
            per_group = self.n_experts // self.n_group
            group_scores = choice.view(t, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
            expert_mask = group_mask[:, :, None].expand(t, self.n_group, per_group).reshape(t, self.n_experts)
            choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        top_idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, top_idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return top_idx, weights * self.routed_scaling_factor


class RoutedExperts(nn.Module):
    """The routed experts of one layer, stacked: gate/up [E, I, hidden], down [E, hidden, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, h))
        self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        #: a decode step's few (token, expert) pairs on CUDA in bf16 or f16 run the Triton kernels of
        #: engine/expert_kernels.py, which read each hit expert's weights at the copy bandwidth's
        #: pace; False keeps the grouped GEMM (bf16) or the gathered / per-expert paths for every
        #: size (:meth:`MLAForCausalLM.use_expert_kernels`; the benchmarks compare them)
        self.triton_kernels = True
        #: the kernels also run the layer's shared experts, as experts every token chose (weight 1):
        #: their weights are read by the same two kernels, not by three GEMMs and an elementwise
        #: kernel of their own; False keeps the shared MLP apart (the benchmarks compare them)
        self.fold_shared = True

    def _kernels(self, x: torch.Tensor):
        """The decode kernels' module where they take ``x`` (CUDA, bf16/f16, triton), else None."""
        half = x.dtype in (torch.bfloat16, torch.float16)
        return _expert_kernels() if self.triton_kernels and x.device.type == "cuda" and half else None

    def folded(self, x: torch.Tensor, shared: DenseMLP | None, top_k: int):
        """The shared MLP as experts for the decode kernels (:func:`expert_kernels.shared_as_experts`)
        when they run it for these tokens (few enough pairs, ``fold_shared``), else None."""
        kernels = self._kernels(x)
        if kernels is None or shared is None or not self.fold_shared:
            return None
        views = kernels.shared_as_experts(
            shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight, self.gate_proj.shape[1]
        )
        return views if x.shape[0] * (top_k + views[0].shape[0]) <= kernels.FOLD_MAX_PAIRS else None

    def forward(
        self,
        x: torch.Tensor,
        top_idx: torch.Tensor,
        weights: torch.Tensor,
        shared: DenseMLP | None = None,
        folded: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The routed experts' weighted sum, plus ``shared(x)`` when a shared MLP is given; with
        ``folded`` (:meth:`folded`), the routes end with the shared experts' columns and the decode
        kernels run them."""
        kernels = self._kernels(x)
        if folded is not None and kernels is not None:
            return kernels.routed_experts(
                x,
                top_idx,
                weights,
                self.gate_proj,
                self.up_proj,
                self.down_proj,
                shared=folded,
            )
        out = self._routed(x, top_idx, weights, kernels)
        return out if shared is None else out + shared(x)

    def _routed(self, x, top_idx, weights, kernels) -> torch.Tensor:
        t, k = top_idx.shape
        n_experts = self.gate_proj.shape[0]
        if kernels is not None and t * k <= kernels.MAX_PAIRS:
            return kernels.routed_experts(x, top_idx, weights, self.gate_proj, self.up_proj, self.down_proj)
        if _GROUPED_MM is not None and x.device.type == "cuda" and x.dtype == torch.bfloat16:
            return self._grouped(x, top_idx, weights)
        if x.device.type != "cpu" and (
            t * k <= n_experts or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()
        ):
            # few pairs, or a step compiled for (or captured in) a CUDA graph (the per-expert loop
            # reads counts back to the host, which a capture cannot): gather the chosen experts' weights
            return self._gathered(x, top_idx, weights)
        return self._segmented(x, top_idx, weights)

    def fuse_gate_up(self) -> None:
        """Store gate and up as the two halves of one [E, 2I, hidden] tensor (the parameters become
        views of it, values unchanged), so the grouped path runs one GEMM for both: a decode step
        then launches two grouped GEMMs per layer instead of three, each reading its experts'
        weights once. Done layer by layer: the extra memory is one layer's gate and up, briefly."""
        if getattr(self, "_gate_up", None) is not None:
            return
        gate, up = self.gate_proj.data, self.up_proj.data
        fused = torch.empty(gate.shape[0], 2 * gate.shape[1], gate.shape[2], dtype=gate.dtype, device=gate.device)
        fused[:, : gate.shape[1]] = gate
        fused[:, gate.shape[1] :] = up
        self.gate_proj.data = fused[:, : gate.shape[1]]
        self.up_proj.data = fused[:, gate.shape[1] :]
        # a buffer, not a plain attribute: a later .to()/.float() converts it with the parameters,
        # so the fused path never reads stale values (a non-persistent one: not in state_dict)
        self.register_buffer("_gate_up", fused, persistent=False)

    def _grouped(self, x, top_idx, weights):
        """Grouped matmuls over the (token, expert) pairs sorted by expert: each hit expert's weights
        are read once, in place (no gathered copy), and no count goes back to the host, so prefill
        runs no per-expert loop and a decode step stays capturable in a CUDA graph."""
        t, k = top_idx.shape
        flat = top_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // k  # pairs are token-major: pair p belongs to token p // k
        counts = torch.zeros(self.gate_proj.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount would sync
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = x[token_of]
        grouped_mm = _GROUPED_MM
        if grouped_mm is None:  # forward only sends bf16 CUDA calls here when torch has it
            raise RuntimeError("this torch build has no torch._grouped_mm")
        gate_up = getattr(self, "_gate_up", None)
        if gate_up is not None:  # one GEMM for both halves (fuse_gate_up)
            both = grouped_mm(xs, gate_up.transpose(1, 2), offs=offsets)
            gate, up = both[:, : self.gate_proj.shape[1]], both[:, self.gate_proj.shape[1] :]
        else:
            gate = grouped_mm(xs, self.gate_proj.transpose(1, 2), offs=offsets)
            up = grouped_mm(xs, self.up_proj.transpose(1, 2), offs=offsets)
        y = grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)
        # Back to token-major order by a gather (no atomic adds: deterministic, and 6x faster than
        # index_add_ at 32k tokens), then each token's k outputs weighted and summed in one bmm
        # (f32 accumulation, one rounding).
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        y = y[inverse].view(t, k, -1)
        return torch.bmm(weights.to(y.dtype)[:, None, :], y)[:, 0]

    def _gathered(self, x, top_idx, weights):
        """Few tokens: gather the chosen experts' weights and run one batched matmul (no host sync)."""
        t, k = top_idx.shape
        flat = top_idx.reshape(-1)
        xs = x.repeat_interleave(k, dim=0)[:, None, :]  # [T*k, 1, hidden]
        gate = torch.bmm(xs, self.gate_proj[flat].transpose(1, 2))
        up = torch.bmm(xs, self.up_proj[flat].transpose(1, 2))
        y = torch.bmm(F.silu(gate) * up, self.down_proj[flat].transpose(1, 2))[:, 0]  # [T*k, hidden]
        y = y * weights.reshape(-1, 1).to(y.dtype)
        return y.view(t, k, -1).sum(dim=1)

    def _segmented(self, x, top_idx, weights):
        """Many tokens: sort the (token, expert) pairs by expert and run one matmul per expert hit."""
        t, k = top_idx.shape
        flat_expert = top_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_of = torch.arange(t, device=x.device).repeat_interleave(k)[order]
        weight_of = weights.reshape(-1)[order]
        counts = torch.bincount(flat_expert, minlength=self.gate_proj.shape[0]).tolist()
        out = torch.zeros_like(x)
        offset = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = token_of[offset : offset + count]
            xe = x[rows]
            h = F.silu(xe @ self.gate_proj[expert].T) * (xe @ self.up_proj[expert].T)
            ye = (h @ self.down_proj[expert].T) * weight_of[offset : offset + count, None].to(x.dtype)
            out.index_add_(0, rows, ye)
            offset += count
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = (
            DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts > 0
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        folded = self.experts.folded(x, self.shared_experts, self.gate.top_k)
        top_idx, weights = self.gate(x, n_shared=0 if folded is None else folded[0].shape[0])
        return self.experts(x, top_idx, weights, shared=self.shared_experts, folded=folded)


def has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


_EXPERT_MODULE = None


def _expert_kernels():
    """:mod:`kvstore.engine.expert_kernels` where its kernels run (triton present), else None;
    looked up once (a compiled step reads the cached answer)."""
    global _EXPERT_MODULE
    if _EXPERT_MODULE is None:
        _EXPERT_MODULE = False
        if has_triton():
            from kvstore.engine import expert_kernels

            _EXPERT_MODULE = expert_kernels
    return _EXPERT_MODULE or None


def grouped_mm_available() -> bool:
    """Whether this torch build has the grouped GEMM the routed experts use on CUDA."""
    return _GROUPED_MM is not None
