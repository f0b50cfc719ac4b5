"""The DeepSeek-V3 decoder in torch, numerically the one transformers defines.

Activations are ``[T, hidden]`` for the ``T`` new tokens at absolute positions ``start ..
start+T-1`` of one sequence, or, in a packed prefill, the chunks of several sequences one after
another (:class:`Segment`: each its own cache and start): the projections, norms and experts run
once over every token, the attention once per segment. Every layer writes its new latent rows into the cache and reads
the rows it attends to back through the cache (so a quantized tier affects prefill and decode
alike), in one of two forms:

* **plain** (prefill): the cached latents are expanded by ``kv_b_proj`` into per-head keys and
  values and attended with SDPA, in query chunks so long prompts fit in memory;
* **absorbed** (decode): ``kv_b_proj`` is folded into the query and the output, so attention runs
  directly over the cached rows ``Lc`` [N, kv_lora] and ``Rc`` [N, qk_rope] — the rows a
  ``.coli_kv`` record stores — through the cache tier's decode backend.

Parameter names follow transformers' checkpoint names (``model.layers.3.self_attn.kv_b_proj``),
except that routed experts are stacked per layer (``mlp.experts.gate_proj`` [E, I, hidden]);
:mod:`kvstore.engine.weights` maps between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from kvstore import tiers
from kvstore.engine import launches, products
from kvstore.engine.cache import encode_fields
from kvstore.engine.config import ModelConfig
from kvstore.engine.moe import DenseMLP, MoE, RoutedExperts, Router, grouped_mm_available, has_triton
from kvstore.engine.rotary import Rotary

__all__ = ["MLAForCausalLM", "Segment", "region_compile_options"]

# The two latent norms are built with transformers' default eps, not the config's.
_LATENT_NORM_EPS = 1e-6
# Upper bound on one chunk of attention scores in the plain path (bytes of f32 scores), for
# backends that materialize them (CPU); CUDA's fused kernels do not, and get a larger budget.
_SCORE_BUDGET_BYTES = 256 << 20
_FUSED_BUDGET_FACTOR = 16
# New prompts of at most this many tokens in a packed prefill share one masked attention call (its
# scores cover every such prompt's tokens against every other's, masked: cheap while they are short)
SHARED_ATTENTION_TOKENS = 128
# graphs dynamo keeps per compiled region: (batch size classes up to 256) x (dense, MoE) x tiers
RECOMPILE_LIMIT = 64
# A compiled step runs each layer's outputs and the next layer's inputs as one region (the residual's
# add fused into the next norm, a region's boundary fewer): measured on an H100 (BENCHMARKS.md;
# bench/engine_decode.py --layer-regions turns it off); read by compile_decode
MERGED_REGIONS = True
# Inductor's combo kernels in the compiled regions: independent small kernels of a region launched
# as one (its ``combo_kernels``). +2.0-3.3% tokens/s single-stream on an H100, fp8 and int4, 1k and
# 32k, 16 and 64 sessions unchanged (bench/engine_ab.py, BENCHMARKS.md); the compiled-step and
# wait-placement GPU tests run with it on and off. Read by compile_decode
COMBO_KERNELS = True


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in f32 and cast back before the weight."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        if x.device.type == "cuda":
            # torch's fused kernel: one launch instead of five (a decode step runs 109 norms); the
            # CPU keeps transformers' exact sequence of operations (the oracle tests compare bits)
            h = F.rms_norm(h, (h.shape[-1],), eps=self.eps)
        else:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention of one layer."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = cfg.num_attention_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.softmax_scale = cfg.softmax_scale()
        qk = cfg.qk_head_dim
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: Rotary):
        """Queries and the new latent rows of ``x`` [T, hidden].

        Returns
        -------
        q_nope : [T, H, qk_nope], q_rope : [T, H, qk_rope] (roped),
        lc : [T, kv_lora] (normed latent), rc : [T, qk_rope] (roped shared key)
        """
        t = x.shape[0]
        first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        fused = getattr(self, "_x_proj", None)
        if fused is not None:  # both of x's projections in one GEMM (fuse_x_projections)
            both = products.project_rows(x, fused) if products.as_projection_reduction(x) else F.linear(x, fused)
            q, compressed = both.split([first.weight.shape[0], self.kv_a_proj_with_mqa.weight.shape[0]], -1)
        else:
            q, compressed = first(x), self.kv_a_proj_with_mqa(x)
        if not hasattr(self, "q_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]
        lc = self.kv_a_layernorm(compressed[:, : self.kv_lora])
        rc = rotary.rotate(compressed[:, self.kv_lora :], cos, sin)
        return q_nope, rotary.rotate(q_rope, cos, sin), lc, rc

    def fuse_x_projections(self) -> None:
        """Store the two projections of the layer's input — the query's (``q_proj``, or ``q_a_proj``
        with a query LoRA) and ``kv_a_proj_with_mqa`` — as the two parts of one weight (the
        parameters become views of it, values unchanged): one GEMM reads both where a decode step
        launched two. Not done where they carry biases."""
        first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        if getattr(self, "_x_proj", None) is not None or first.bias is not None:
            return
        if self.kv_a_proj_with_mqa.bias is not None:
            return
        fused = torch.cat([first.weight.data, self.kv_a_proj_with_mqa.weight.data])
        first.weight.data = fused[: first.weight.shape[0]]
        self.kv_a_proj_with_mqa.weight.data = fused[first.weight.shape[0] :]
        self.register_buffer("_x_proj", fused, persistent=False)  # converted with the parameters

    def _uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, qk_nope, kv_lora], W_UV [H, v_head, kv_lora]."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x, cos, sin, rotary, segments: "Sequence[Segment]") -> torch.Tensor:
        """``x`` holds each segment's tokens in turn; each writes its rows into its own cache and
        attends over that cache alone."""
        q_nope, q_rope, lc, rc = self.project(x, cos, sin, rotary)
        if len(segments) == 1:
            seg = segments[0]
            seg.cache.write(self.layer, seg.start, lc, rc)
            out = self._attend(q_nope, q_rope, seg)
            return self.o_proj(out.reshape(x.shape[0], self.n_heads * self.v_dim))
        # A packed prefill: the rows of every segment encoded at once, then placed in their caches
        first = segments[0].cache
        fields = first.encode(lc, rc)
        spans = []
        a = 0
        for seg in segments:
            spans.append((a, a + seg.tokens))
            a += seg.tokens
        put_rows(self.layer, segments, spans, fields)
        # Short new prompts (Segment.shares_attention) lead a packed forward: they attend over their
        # own rows only, so they share one attention call, masked to each prompt's own tokens — a
        # call per segment is a dozen small operations, and a forward of many short prompts was
        # spent launching them.
        fresh = 0
        while fresh < len(segments) and segments[fresh].shares_attention:
            fresh += 1
        outs = []
        if fresh > 1:
            stop = spans[fresh - 1][1]
            lc_read, rc_read = first.decode({name: value[:stop] for name, value in fields.items()})
            lengths = [seg.tokens for seg in segments[:fresh]]
            outs.append(self._plain_fresh(q_nope[:stop], q_rope[:stop], lc_read, rc_read, lengths))
        else:
            fresh = 0
        for seg, (a, b) in zip(segments[fresh:], spans[fresh:]):
            outs.append(self._attend(q_nope[a:b], q_rope[a:b], seg))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o_proj(out.reshape(x.shape[0], self.n_heads * self.v_dim))

    def _attend(self, q_nope, q_rope, seg: "Segment") -> torch.Tensor:
        """One segment's attention over its cache (its rows written): [t, H, v_head]."""
        if seg.absorbed:
            seq_len = torch.arange(seg.start + 1, seg.start + seg.tokens + 1, dtype=torch.int32, device=q_nope.device)
            return self._absorbed(q_nope, q_rope, seg.cache, seq_len, n_rows=seg.start + seg.tokens)
        return self._plain(q_nope, q_rope, seg.cache, seg.start)

    def latent_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_lat[t, h] = q_nope[t, h] @ W_UK[h]: the query in latent space, f32[T, H, kv_lora]."""
        w_uk, _ = self._uk_uv()
        if products.as_reduction(q_nope):  # a compiled step of a few tokens: one reduction kernel
            return products.head_products(q_nope, w_uk, contract_last=False).float()
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).float().contiguous()

    def latent_output(self, ctx_lat: torch.Tensor) -> torch.Tensor:
        """out[t, h] = ctx_lat[t, h] @ W_UV[h]^T, through ``o_proj``: [T, hidden]."""
        _, w_uv = self._uk_uv()
        ctx_lat = ctx_lat.to(w_uv.dtype)
        if products.as_reduction(ctx_lat):
            out = products.head_products(ctx_lat, w_uv, contract_last=True)
        else:
            out = torch.bmm(ctx_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        flat = out.reshape(ctx_lat.shape[0], self.n_heads * self.v_dim)
        if products.as_projection_reduction(flat):
            return products.project_rows(flat, self.o_proj.weight, self.o_proj.bias)
        return self.o_proj(flat)

    def _absorbed(
        self, q_nope, q_rope, cache, seq_len: torch.Tensor, n_rows: int, seq_start: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention over the cached rows with kv_b_proj folded in; token t sees rows
        ``seq_start[t] .. seq_start[t] + seq_len[t] - 1`` (``seq_start`` default 0)."""
        t = q_nope.shape[0]
        _, w_uv = self._uk_uv()
        if seq_start is None:
            seq_start = torch.zeros(t, dtype=torch.int32, device=q_nope.device)
        ctx_lat = cache.attend(
            self.layer,
            self.latent_query(q_nope),
            q_rope.float().contiguous(),
            seq_start,
            seq_len,
            self.softmax_scale,
            n_rows=n_rows,
        )
        # out[t, h] = ctx_lat[t, h] @ W_UV[h]^T
        ctx_lat = ctx_lat.to(w_uv.dtype)
        return torch.bmm(ctx_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _expanded(self, q_nope, q_rope, lc, rc) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [1, H, T or N, D] for SDPA, the keys and values expanded from
        the rows ``lc`` [N, kv_lora], ``rc`` [N, qk_rope] by ``kv_b_proj``."""
        n = lc.shape[0]
        dtype = q_nope.dtype
        kv = self.kv_b_proj(lc.to(dtype)).view(n, self.n_heads, self.nope + self.v_dim)
        keys = torch.cat((kv[..., : self.nope], rc.to(dtype)[:, None, :].expand(n, self.n_heads, self.rope_dim)), -1)
        values = kv[..., self.nope :]
        queries = torch.cat((q_nope, q_rope), dim=-1)
        pad = queries.shape[-1] - self.v_dim
        if pad > 0 and q_nope.device.type == "cuda":
            # The fused (flash) kernels take one head width for q, k and v: zero columns added to v
            # (sliced off after) keep attention off the math path, which materializes every score.
            values = F.pad(values, (0, pad))
        # [1, H, N, D] for SDPA: with 3-D inputs it never picks a fused kernel
        queries, keys, values = (t.transpose(0, 1)[None] for t in (queries, keys, values))
        return queries, keys, values

    def _query_chunk(self, t: int, n: int, device: torch.device) -> int:
        """Queries per SDPA call of ``t`` queries over ``n`` keys: the f32 scores of a call within
        the score budget (larger where the fused kernels do not materialize them)."""
        budget = _SCORE_BUDGET_BYTES * (_FUSED_BUDGET_FACTOR if device.type == "cuda" else 1)
        return max(1, min(t, budget // max(1, 4 * self.n_heads * n)))

    def _plain(self, q_nope, q_rope, cache, start: int) -> torch.Tensor:
        """Prefill attention: expand the cached latents to per-head keys/values, causal SDPA."""
        t = q_nope.shape[0]
        n = start + t
        dtype = q_nope.dtype
        queries, keys, values = self._expanded(q_nope, q_rope, *cache.read(self.layer, n))
        if start == 0 and q_nope.device.type == "cuda":
            # A prefill from the first position is square: one causal call the fused (flash) kernel
            # runs without materializing scores. (Later chunks see their keys lower-right aligned,
            # which sends SDPA to the math path; they go by query chunks below.)
            whole = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=self.softmax_scale)
            return whole[0, ..., : self.v_dim].transpose(0, 1)
        out = torch.empty(self.n_heads, t, self.v_dim, dtype=dtype, device=q_nope.device)
        chunk = self._query_chunk(t, n, q_nope.device)
        for q0 in range(0, t, chunk):
            q1 = min(t, q0 + chunk)
            visible = start + q1  # the last query of the chunk sees rows 0 .. start+q1-1
            # the chunk's queries are the last rows of the visible keys: lower-right causal
            out[:, q0:q1] = F.scaled_dot_product_attention(
                queries[:, :, q0:q1],
                keys[:, :, :visible],
                values[:, :, :visible],
                attn_mask=causal_lower_right(q1 - q0, visible),
                scale=self.softmax_scale,
            )[0, ..., : self.v_dim]
        return out.transpose(0, 1)

    def _plain_fresh(self, q_nope, q_rope, lc, rc, lengths: list[int]) -> torch.Tensor:
        """New prompts' attention in one call: ``lengths`` prompts' tokens in turn, each query
        seeing the rows of its own prompt up to itself (a block-diagonal causal mask); ``lc``, ``rc``
        are their rows as read back through the tier (f32[n, ...]). Returns [n, H, v_head]."""
        n = q_nope.shape[0]
        dtype = q_nope.dtype
        queries, keys, values = self._expanded(q_nope, q_rope, lc, rc)
        owner = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)).to(q_nope.device)
        index = torch.arange(n, device=q_nope.device)
        visible = (owner[:, None] == owner[None, :]) & (index[None, :] <= index[:, None])
        out = torch.empty(self.n_heads, n, self.v_dim, dtype=dtype, device=q_nope.device)
        chunk = self._query_chunk(n, n, q_nope.device)
        for q0 in range(0, n, chunk):
            q1 = min(n, q0 + chunk)
            out[:, q0:q1] = F.scaled_dot_product_attention(
                queries[:, :, q0:q1], keys, values, attn_mask=visible[q0:q1], scale=self.softmax_scale
            )[0, ..., : self.v_dim]
        return out.transpose(0, 1)


def put_rows(layer: int, segments: "Sequence[Segment]", spans: list[tuple[int, int]], fields) -> None:
    """Encoded rows ``fields`` (each ``[T, ...]``, the segments' tokens in turn) into each segment's
    cache at its positions: one ``_foreach_copy_`` for every (segment, field) — a copy each from
    Python would cost a launch each."""
    for seg in segments:
        seg.cache.check_room(seg.start, seg.tokens)
    dst, src = [], []
    for seg, (a, b) in zip(segments, spans):
        for name, value in fields.items():
            dst.append(seg.cache.field(name)[layer, seg.start : seg.start + seg.tokens])
            src.append(value[a:b])
    # torch's multi-tensor copy, as its optimizers use it (not in torch's typed exports)
    torch._foreach_copy_(dst, src)  # pyright: ignore[reportPrivateImportUsage]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, rotary, segments: "Sequence[Segment]") -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, rotary, segments)
        return x + self.mlp(self.post_attention_layernorm(x))

    def step(self, x, cos, sin, rotary, cache, slots: StepSlots, n_rows: int, regions: "StepRegions") -> torch.Tensor:
        """One decode step of this layer: ``regions.inputs`` (norm, projections, rotary, the rows'
        encoding), the cache write and the attention call, then ``regions.outputs`` (output
        projection, MLP or experts). The two regions are what ``torch.compile`` fuses on CUDA; the
        attention kernels and the write into the cache's buffers stay between them."""
        name, encode = cache.tier.name, cache.write_kernels is None
        q_lat, q_rope, fields = regions.inputs_for(name)(self, x, cos, sin, rotary, name, encode)
        ctx_lat = self.step_attend(cache, slots, n_rows, q_lat, q_rope, fields)
        return regions.outputs(self, x, ctx_lat)

    def step_attend(self, cache, slots: StepSlots, n_rows: int, q_lat, q_rope, fields) -> torch.Tensor:
        """The step's new rows written into the cache (``fields`` from :meth:`step_inputs`) and the
        attention over it: ctx_lat f32[B, H, kv_lora]."""
        attn = self.self_attn
        if cache.write_kernels is None:  # encoded by step_inputs
            cache.store_at(attn.layer, slots.rows, fields)
        else:  # rows as they are: one kernel encodes them into their slots
            cache.write_at(attn.layer, slots.rows, fields["lc"], fields["rc"])
        return cache.attend(attn.layer, q_lat, q_rope, slots.seq_start, slots.seq_len, attn.softmax_scale, n_rows)

    def step_inputs(
        self, x, cos, sin, rotary, tier: str, encode: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(q_lat f32[B, H, kv_lora], q_rope f32[B, H, qk_rope], the new rows encoded in the tier
        named ``tier``, or with ``encode`` False as they are: ``{"lc", "rc"}`` in the model's dtype,
        for the cache's own kernel). The tier comes by name: a compiled region guards on a string's
        value, so each tier gets its own graph (a frozen Tier object is not guarded that finely)."""
        attn = self.self_attn
        q_nope, q_rope, lc, rc = attn.project(self.input_layernorm(x), cos, sin, rotary)
        fields = encode_fields(tiers.TIERS[tier], lc.float(), rc.float()) if encode else {"lc": lc, "rc": rc}
        return attn.latent_query(q_nope), q_rope.float().contiguous(), fields

    def step_outputs(self, x, ctx_lat) -> torch.Tensor:
        x = x + self.self_attn.latent_output(ctx_lat)
        return x + self.mlp(self.post_attention_layernorm(x))

    def step_between(self, nxt: "DecoderLayer", x, ctx_lat, cos, sin, rotary, tier: str, encode: bool = True):
        """This layer's :meth:`step_outputs` and ``nxt``'s :meth:`step_inputs` as one region: (x,
        q_lat, q_rope, fields). Compiled, the residual's add joins the next layer's norm."""
        x = self.step_outputs(x, ctx_lat)
        return (x, *nxt.step_inputs(x, cos, sin, rotary, tier, encode))

    def step_last(self, model: "MLAForCausalLM", x, ctx_lat) -> torch.Tensor:
        """The last layer's :meth:`step_outputs` and the model's head as one region: the logits."""
        return model.logits_of(self.step_outputs(x, ctx_lat))


class DecoderStack(nn.Module):
    """transformers' ``model.*``: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)


class MLAForCausalLM(nn.Module):
    """The whole model. Build with :mod:`kvstore.engine.weights` (load or random init)."""

    #: the checkpoint's tensors no parameter took (set by kvstore.engine.weights)
    unused_weights: list[str]

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.regions = StepRegions.eager()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def use_expert_kernels(self, enabled: bool, *, fold_shared: bool = True, route: bool = True) -> None:
        """Whether decode steps on CUDA run the routed experts' Triton kernels (the default) or keep
        the grouped GEMM for every call (``bench/engine_decode.py --grouped-experts`` compares them),
        whether those kernels also run the shared experts (``--shared-apart``), and whether the
        routing runs as one kernel (``--torch-routing``)."""
        for module in self.modules():
            if isinstance(module, RoutedExperts):
                module.triton_kernels = bool(enabled)
                module.fold_shared = bool(fold_shared)
            elif isinstance(module, Router):
                module.triton_route = bool(route)

    @torch.inference_mode()
    def forward_tokens(
        self,
        token_ids: torch.Tensor,
        cache,
        start: int,
        *,
        absorbed: bool,
        logits: str = "last",
    ) -> torch.Tensor | None:
        """Run ``T`` new tokens at positions ``start ..`` against ``cache`` (rows ``< start`` reused).

        The cache receives every layer's rows for the new positions; committing them (moving the
        cache length) is the caller's job, so a failed call leaves the committed rows untouched.

        Parameters
        ----------
        token_ids : int64[T] on the model's device
        cache : a :class:`kvstore.engine.cache.LatentCache` holding at least ``start`` rows
        start : absolute position of the first new token
        absorbed : True for the absorbed (decode) attention, False for the plain (prefill) form
        logits : ``"last"`` -> f32[vocab] of the last token, ``"all"`` -> f32[T, vocab], ``"none"``

        Returns
        -------
        f32 logits as asked, or None.
        """
        t = token_ids.shape[0]
        positions = torch.arange(start, start + t, device=token_ids.device)
        x = self._layers(token_ids, positions, [Segment(cache, start, t, absorbed)])
        if logits == "none":
            return None
        if logits == "last":
            x = x[-1:]
        out = self.lm_head(self.model.norm(x)).float()
        return out[0] if logits == "last" else out

    @torch.inference_mode()
    def forward_packed(self, token_ids: torch.Tensor, segments: "Sequence[Segment]") -> None:
        """Prefill several sequences' chunks in one forward, computing no logits.

        ``token_ids`` int64[sum of the segments' tokens] on the model's device: each segment's tokens
        in turn. Each segment's rows go to its own cache at its own positions, committed by the
        caller (as :meth:`forward_tokens`); the caches must be distinct. What one forward of many
        short prompts saves is the per-layer work a short prompt pays in full: the weights, above
        all the routed experts', are read once for every segment instead of once each.
        """
        starts = [seg.start for seg in segments]
        lengths = [seg.tokens for seg in segments]
        if sum(lengths) != token_ids.shape[0]:
            raise ValueError(f"the segments hold {sum(lengths)} tokens, {token_ids.shape[0]} were given")
        if len({id(seg.cache) for seg in segments}) != len(segments):
            raise ValueError("a packed prefill takes one chunk per cache")
        device = token_ids.device
        positions = torch.cat([torch.arange(a, a + t, device=device) for a, t in zip(starts, lengths)])
        self._layers(token_ids, positions, segments)

    def _layers(self, token_ids: torch.Tensor, positions: torch.Tensor, segments: "Sequence[Segment]") -> torch.Tensor:
        rotary = self.model.rotary
        x = self.model.embed_tokens(token_ids)
        cos, sin = (c.to(x.dtype) for c in rotary(positions))  # cast once, not in every layer
        for layer in self.model.layers:
            x = layer(x, cos, sin, rotary, segments)
        return x

    @torch.inference_mode()
    def decode_step(
        self, token_ids: torch.Tensor, positions: torch.Tensor, cache, n_rows: int, slots: StepSlots | None = None
    ) -> torch.Tensor:
        """One decode step with its tokens and positions on the device: the form a CUDA graph captures.

        Every shape is fixed by the batch and ``n_rows``, and nothing is read back to the host, so
        the same call replays for any tokens and positions (``kvstore.engine.graphs``).

        Parameters
        ----------
        token_ids : int64[B] on the model's device, one token per sequence
        positions : int64[B] — each token's position in its own sequence (its rotary angle)
        cache : a :class:`kvstore.engine.cache.LatentCache` with capacity >= ``n_rows``
        n_rows : rows the attention may read (the cache's capacity)
        slots : where each sequence's rows live in ``cache`` (:class:`StepSlots`); None: one
            sequence whose rows start at row 0 (the engine's own cache)

        Returns
        -------
        f32[B, vocab]: the logits of each sequence's next token.
        """
        if slots is None:
            slots = StepSlots.single(positions)
        rotary = self.model.rotary
        x = self.model.embed_tokens(token_ids)
        cos, sin = (c.to(x.dtype) for c in rotary(positions))  # cast once, not in every layer
        layers = cast("list[DecoderLayer]", list(self.model.layers))  # (a ModuleList types its items as Module)
        regions, name, encode = self.regions, cache.tier.name, cache.write_kernels is None
        if not regions.merges(name):
            for layer in layers:
                x = layer.step(x, cos, sin, rotary, cache, slots, n_rows, regions)
            return regions.head(self, x)
        # merged regions: each layer's outputs and the next one's inputs in one compiled region
        assert regions.between is not None and regions.last is not None
        q_lat, q_rope, fields = regions.inputs(layers[0], x, cos, sin, rotary, name, encode)
        for layer, nxt in zip(layers, layers[1:]):
            ctx_lat = layer.step_attend(cache, slots, n_rows, q_lat, q_rope, fields)
            x, q_lat, q_rope, fields = regions.between(layer, nxt, x, ctx_lat, cos, sin, rotary, name, encode)
        ctx_lat = layers[-1].step_attend(cache, slots, n_rows, q_lat, q_rope, fields)
        return regions.last(layers[-1], self, x, ctx_lat)

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: f32[B, vocab]."""
        return self.lm_head(self.model.norm(x)).float()

    def fuse_projections(self) -> None:
        """Weights that multiply the same input stored as parts of one tensor (the parameters become
        views of it, values unchanged): each layer's two projections of its input, the MLPs' gate
        and up, the routed experts' gate and up. Fewer, larger GEMMs: each reads its weights at a
        better share of the bandwidth, and a decode step launches fewer kernels."""
        for layer in cast("list[DecoderLayer]", list(self.model.layers)):
            cast(MLAttention, layer.self_attn).fuse_x_projections()
            if isinstance(layer.mlp, MoE) and grouped_mm_available():
                layer.mlp.experts.fuse_gate_up()
            mlp = layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp
            if isinstance(mlp, DenseMLP):
                mlp.fuse_gate_up()

    def compile_decode(self) -> bool:
        """Fuse the elementwise work of every decode step with ``torch.compile`` (CUDA with triton).

        A step is ~1,500 small kernels otherwise (norms, rotary, router, the rows' encoding), and on
        a GPU their launches and memory round trips, not the weights' one read, bound the step. The
        regions are compiled once for all layers (every layer runs the same code on its own
        parameters: dense and MoE layers give two graphs) and run inside the step's CUDA graph. The
        CPU keeps the eager step, whose operation order the transformers oracle tests pin.

        Returns True when the regions are compiled (False: not CUDA, or no triton).
        """
        if self.device.type != "cuda" or not has_triton():
            return False
        self.fuse_projections()
        options = region_compile_options(self.device)
        # A region compiles once per decode batch size and layer kind (dense, MoE): a scheduler's
        # size classes (1, 2, 4, ... max batch) times two outgrow dynamo's default of 8 graphs a
        # function, past which it runs the region eagerly for every new size.
        import torch._dynamo

        config = torch._dynamo.config
        if hasattr(config, "recompile_limit"):
            config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        merged = MERGED_REGIONS
        self.regions = StepRegions(
            torch.compile(DecoderLayer.step_inputs, options=options),
            torch.compile(DecoderLayer.step_outputs, options=options),
            torch.compile(MLAForCausalLM.logits_of, options=options),
            compiled=True,
            between=torch.compile(DecoderLayer.step_between, options=options) if merged else None,
            last=torch.compile(DecoderLayer.step_last, options=options) if merged else None,
        )
        return True


def region_compile_options(device: torch.device) -> dict[str, Any]:
    """The inductor options of the compiled step's regions on ``device``: intermediates rounded to
    the model's dtype where the eager step rounds them (so the fused step computes what the eager one
    does, not a more precise, different answer), how the kernels launch
    (:func:`launches.region_options`), and whether combo kernels are on (:data:`COMBO_KERNELS`, said
    either way, so a process-wide inductor setting does not turn on for the regions what was not
    checked)."""
    import torch._inductor.config as inductor_config

    options: dict[str, Any] = {"emulate_precision_casts": True}
    options.update(launches.region_options(device))
    if hasattr(inductor_config, "combo_kernels"):
        options["combo_kernels"] = COMBO_KERNELS
    return options


@dataclass(frozen=True)
class Segment:
    """One sequence's chunk in a forward: ``tokens`` new tokens at positions ``start ..`` of
    ``cache``, attended in the absorbed (decode) form or the plain (prefill) one."""

    cache: Any
    start: int
    tokens: int
    absorbed: bool

    @property
    def shares_attention(self) -> bool:
        """A new prompt's first chunk, short enough that attending over the packed prompts' rows
        (masked to its own) costs less than launching a call of its own; the forward puts such
        segments first."""
        return self.start == 0 and not self.absorbed and self.tokens <= SHARED_ATTENTION_TOKENS


@dataclass(frozen=True)
class StepRegions:
    """The two halves of a layer's decode step around its attention call, and the model's head:
    the plain methods, or their ``torch.compile`` versions (:meth:`MLAForCausalLM.compile_decode`)."""

    inputs: Callable[..., Any]
    outputs: Callable[..., Any]
    head: Callable[..., Any]
    compiled: bool = False
    #: with :data:`MERGED_REGIONS`, a layer's outputs and the next layer's inputs as one region
    #: (:meth:`DecoderLayer.step_between`), and the last layer's outputs with the head
    between: Callable[..., Any] | None = None
    last: Callable[..., Any] | None = None

    #: Tiers whose encoders the compiled input region traces (pure torch, checked byte for byte on
    #: the H200); the others encode in the eager region.
    COMPILED_TIERS = frozenset({"f32", "bf16", "fp8", "int4"})

    @classmethod
    def eager(cls) -> "StepRegions":
        return cls(DecoderLayer.step_inputs, DecoderLayer.step_outputs, MLAForCausalLM.logits_of)

    def inputs_for(self, tier: str) -> Callable[..., Any]:
        if self.compiled and tier not in self.COMPILED_TIERS:
            return DecoderLayer.step_inputs
        return self.inputs

    def merges(self, tier: str) -> bool:
        """Whether a step of this tier runs the merged regions (the compiled inputs take its tier)."""
        return self.between is not None and self.inputs_for(tier) is self.inputs


@dataclass(frozen=True)
class StepSlots:
    """Where the tokens of one decode step live in a cache, as device tensors (a graph captures them).

    Sequence ``b``'s rows are ``seq_start[b] ..`` of the cache: its new token's rows go to row
    ``rows[b]`` and its attention reads ``seq_len[b]`` rows from ``seq_start[b]`` (the new one
    included). Several sequences share one cache this way (``kvstore.engine.batch``).
    """

    rows: torch.Tensor  # int64[B]
    seq_start: torch.Tensor  # int32[B]
    seq_len: torch.Tensor  # int32[B]

    @classmethod
    def single(cls, positions: torch.Tensor) -> "StepSlots":
        """Sequences whose rows start at row 0: row = position."""
        return cls(positions, torch.zeros_like(positions, dtype=torch.int32), (positions + 1).to(torch.int32))

    @classmethod
    def packed(cls, offsets: torch.Tensor, positions: torch.Tensor) -> "StepSlots":
        """Sequence ``b`` stored from row ``offsets[b]`` (int64), its token at ``positions[b]``."""
        return cls(offsets + positions, offsets.to(torch.int32), (positions + 1).to(torch.int32))
