"""Model geometry parsed from a Hugging Face ``config.json`` of the DeepSeek-V3 architecture.

Field names and defaults are those of ``transformers.DeepseekV3Config``; a field missing from the
file takes transformers' default, so both readers agree on what the file means. Legacy files
(``rope_theta`` + ``rope_scaling``) and transformers >= 5 files (``rope_parameters``) both parse.

Examples
--------
>>> cfg = preset("tiny")
>>> cfg.n_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.is_moe_layer(0), cfg.is_moe_layer(1)
(4, 64, 32, False, True)
>>> ModelConfig.from_dict(cfg.to_hf_dict()) == cfg
True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.engine.errors import ModelConfigError

__all__ = ["ModelConfig", "PRESETS", "RopeConfig", "preset"]

SUPPORTED_MODEL_TYPES = ("deepseek_v3",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary-embedding parameters, normalized the way transformers' ``standardize_rope_params`` does.

    ``factor`` is None for yarn files that derive it from ``max_position_embeddings /
    original_max_position_embeddings`` (resolved by :meth:`ModelConfig.rope_factor`).
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.kind, "rope_theta": self.theta}
        optional = {
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "mscale": self.mscale,
            "mscale_all_dim": self.mscale_all_dim,
            "attention_factor": self.attention_factor,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        if not self.truncate:
            out["truncate"] = False
        return out


@dataclass(frozen=True)
class ModelConfig:
    """The DeepSeek-V3 hyper-parameters the engine uses (transformers' field names).

    ``q_lora_rank`` None means a direct ``q_proj``. Layers ``>= first_k_dense_replace`` are MoE.
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    attention_bias: bool = False

    # -- derived geometry ---------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.n_routed_experts > 0

    def rope_factor(self) -> float | None:
        """The yarn/linear scale factor, derived from the position limits when the file omits it."""
        if self.rope.factor is not None or self.rope.kind != "yarn":
            return self.rope.factor
        return self.max_position_embeddings / self.original_max_positions()

    def original_max_positions(self) -> int:
        return self.rope.original_max_position_embeddings or self.max_position_embeddings

    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for scaled rope.

        Mirrors transformers' ``yarn_apply_mscale``: any non-default rope type with a truthy
        ``mscale_all_dim`` rescales the logits.
        """
        scale = self.qk_head_dim**-0.5
        if self.rope.kind != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope_factor() or 1.0, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def coli_geometry(self):
        """The ``.coli_kv`` fingerprint (h0..h5) of this model: no sparse indexer rows."""
        from kvstore.formats.coli_kv import Geometry

        return Geometry(
            n_layers=self.n_layers,
            kv_lora=self.kv_lora_rank,
            qk_rope=self.qk_rope_head_dim,
            index_hd=0,
            nic=0,
            vocab=self.vocab_size,
        )

    # -- parsing -----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse a ``config.json`` mapping; refuse what the engine cannot run, with the reason."""
        if not isinstance(raw, dict):
            raise ModelConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type", "deepseek_v3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported: the engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if raw.get("quantization_config"):
            method = raw["quantization_config"].get("quant_method", "?")
            raise ModelConfigError(
                f"quantized checkpoints ({method}) are not supported: convert the weights to bf16/f32 first"
            )
        defaults = cls()
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in ("rope", "eos_token_id"):
                continue
            values[f.name] = raw.get(f.name, getattr(defaults, f.name))
        for name in ("norm_topk_prob", "tie_word_embeddings", "rope_interleave", "attention_bias"):
            values[name] = bool(values[name])  # transformers reads these as truthy/falsy
        eos = raw.get("eos_token_id", defaults.eos_token_id)
        values["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        values["rope"] = _parse_rope(raw)
        try:
            cfg = cls(**values)
        except TypeError as exc:  # pragma: no cover - dataclass arity is fixed above
            raise ModelConfigError(f"bad config: {exc}") from exc
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``config.json`` (a file, or the model folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            text = path.read_text()
        except FileNotFoundError as exc:
            raise ModelConfigError(f"no config.json at {path}") from exc
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` mapping that ``transformers.AutoConfig`` reads as the same model."""
        out: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
        for f in dataclasses.fields(self):
            if f.name == "rope":
                continue
            out[f.name] = getattr(self, f.name)
        eos = list(self.eos_token_id)
        out["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        out["num_key_value_heads"] = self.num_attention_heads
        out["rope_parameters"] = self.rope.to_hf_dict()
        # No multi-token-prediction modules: the engine decodes one token per step.
        out["num_nextn_predict_layers"] = 0
        out["dtype"] = "float32"
        return out

    def replace(self, **changes: Any) -> "ModelConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise :class:`ModelConfigError` for a geometry the model cannot be built with."""
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "intermediate_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(f"qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ModelConfigError(f"q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}")
        if self.hidden_act != "silu":
            raise ModelConfigError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        for name in (
            "first_k_dense_replace",
            "n_routed_experts",
            "n_shared_experts",
            "n_group",
            "topk_group",
            "num_experts_per_tok",
            "moe_intermediate_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ModelConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if self.first_k_dense_replace < self.num_hidden_layers and self.n_routed_experts > 0:
            self._validate_moe()
        if not self.rms_norm_eps > 0:
            raise ModelConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        for token in (self.bos_token_id, self.pad_token_id, *self.eos_token_id):
            if token is not None and not 0 <= token < self.vocab_size:
                raise ModelConfigError(f"special token id {token} is outside the vocabulary of {self.vocab_size}")
        if self.rope.kind not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope type {self.rope.kind!r} is not supported (known: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.rope.kind in ("linear", "yarn") and not (self.rope_factor() or 0) > 0:
            raise ModelConfigError(f"{self.rope.kind} rope needs a positive factor, got {self.rope_factor()!r}")
        if not self.rope.theta > 0:
            raise ModelConfigError(f"rope_theta must be > 0, got {self.rope.theta}")

    def _validate_moe(self) -> None:
        e, g = self.n_routed_experts, self.n_group
        if self.moe_intermediate_size <= 0:
            raise ModelConfigError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if not (isinstance(g, int) and g > 0 and e % g == 0):
            raise ModelConfigError(f"n_group {g} must divide n_routed_experts {e}")
        if e // g < 2:
            # the group score is the sum of each group's top-2 expert scores
            raise ModelConfigError(f"each expert group needs at least 2 experts, got {e // g} ({e} / {g} groups)")
        if not 0 < self.topk_group <= g:
            raise ModelConfigError(f"topk_group must be in 1..n_group ({g}), got {self.topk_group}")
        if not 0 < self.num_experts_per_tok <= self.topk_group * (e // g):
            raise ModelConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts of the "
                f"{self.topk_group} selected groups ({self.topk_group * (e // g)})"
            )
        if self.n_shared_experts < 0:
            raise ModelConfigError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """yarn's magnitude correction for a rope scaled by ``scale`` (transformers' ``get_mscale``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"rope_parameters must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError("per-layer-type rope parameters are not supported by this architecture")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    original = params.get("original_max_position_embeddings")
    if original is None and kind == "yarn":
        original = raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))

    def num(name: str) -> float | None:
        value = params.get(name)
        return None if value is None else float(value)

    return RopeConfig(
        theta=float(theta),
        kind=str(kind),
        factor=num("factor"),
        original_max_position_embeddings=None if original is None else int(original),
        beta_fast=num("beta_fast"),
        beta_slow=num("beta_slow"),
        mscale=num("mscale"),
        mscale_all_dim=num("mscale_all_dim"),
        attention_factor=num("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


# -- presets -------------------------------------------------------------------------------------
# `tiny` is the CI model: MoE layers with group-limited routing, kv_lora 64 / qk_rope 32 (powers
# of two, so every cache tier including TQ holds its rows, and multiples of 32 for Q8_0 blocks).
# transformers' default init scale (0.02): the regime of the C engine's tiny oracle, so the
# per-tier agreement numbers are comparable with its table.
_TINY = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=64,
    q_lora_rank=None,
    qk_rope_head_dim=32,
    v_head_dim=32,
    qk_nope_head_dim=32,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=65536,
    initializer_range=0.02,
    bos_token_id=0,
    eos_token_id=(1,),
    rope=RopeConfig(theta=10000.0),
    rope_interleave=True,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    # The same size with q LoRA and yarn rope (mscale folded into the softmax scale), as DeepSeek-V3.
    "tiny-yarn": dataclasses.replace(
        _TINY,
        q_lora_rank=48,
        max_position_embeddings=65536,
        rope=RopeConfig(
            theta=10000.0,
            kind="yarn",
            factor=8.0,
            original_max_position_embeddings=8192,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    # The tiny model with DeepSeek's latent widths (kv_lora 512, qk_rope 64): the oracle model at
    # the widths the CUDA kernels are built for.
    "tiny-512": dataclasses.replace(_TINY, kv_lora_rank=512, qk_rope_head_dim=64),
    # DeepSeek-V2-Lite's geometry on the V3 architecture (sigmoid, bias-corrected routing), for
    # GPU benchmarks with random weights.
    "v2-lite": ModelConfig(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        routed_scaling_factor=1.0,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        norm_topk_prob=False,
        max_position_embeddings=163840,
        initializer_range=0.02,
        bos_token_id=100000,
        eos_token_id=(100001,),
        rope=RopeConfig(
            theta=10000.0,
            kind="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        rope_interleave=True,
    ),
}


def preset(name: str) -> ModelConfig:
    """A named geometry: ``tiny``, ``tiny-yarn``, ``tiny-512`` or ``v2-lite``."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None
