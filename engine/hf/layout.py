"""What a transformers MLA model caches, established on the model itself; empty caches for it.

Since transformers 5, the DeepSeek-V3 family caches, per layer, ``keys`` = the ``kv_a_layernorm``
output ``[batch, 1, T, kv_lora_rank]`` (the ``Lc`` row) and ``values`` = the roped shared key
``[batch, 1, T, qk_rope_head_dim]`` (the ``Rc`` row). :func:`check_cache_layout` proves it on the
model with one forward of three tokens (memoized per model) before any row is read or written.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from kvstore import tiers
from kvstore.engine.errors import CacheLayoutUnsupported
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry

__all__ = ["CacheLayout", "cache_kwargs", "cache_length", "check_cache_layout", "geometry_of", "new_cache"]

# Models that also cache a sparse-attention indexer key (DeepSeek-V3.2 style): their records
# would need the indexer rows too, which transformers keeps outside the latent layers.
_INDEXER_FIELDS = ("index_topk", "index_head_dim", "index_n_heads")


def text_config(config):
    """The decoder's config of a (possibly multimodal) transformers config."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def geometry_of(config) -> Geometry:
    """The ``.coli_kv`` geometry (h0..h5) of a transformers MLA config.

    Raises
    ------
    CacheLayoutUnsupported
        The config is not an MLA model, or one that also caches sparse-indexer keys.
    """
    cfg = text_config(config)
    model_type = getattr(cfg, "model_type", "?")
    words = {}
    for name in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "vocab_size"):
        value = getattr(cfg, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CacheLayoutUnsupported(
                f"model type {model_type!r} has no {name}: kvstore stores the MLA latent rows of "
                f"DeepSeek-V3-style models (kv_lora_rank + qk_rope_head_dim per layer)"
            )
        words[name] = value
    if any(getattr(cfg, name, None) for name in _INDEXER_FIELDS):
        raise CacheLayoutUnsupported(
            f"model type {model_type!r} caches sparse-attention indexer keys besides the latent; "
            f"the transformers interop stores the latent rows only"
        )
    geometry = Geometry(
        words["num_hidden_layers"], words["kv_lora_rank"], words["qk_rope_head_dim"], 0, 0, words["vocab_size"]
    )
    coli_kv.check_geometry(geometry, tiers.F32)
    return geometry


@dataclass(frozen=True)
class CacheLayout:
    """What :func:`check_cache_layout` established about a model.

    Attributes
    ----------
    geometry : the ``.coli_kv`` geometry of the model
    cache_argument : the keyword ``forward``/``generate`` take the cache by (``cache`` from
        transformers 5.24, ``past_key_values`` before)
    transformers_version : the version that was probed
    """

    geometry: Geometry
    cache_argument: str
    transformers_version: str


_layouts: "weakref.WeakKeyDictionary[torch.nn.Module, CacheLayout]" = weakref.WeakKeyDictionary()


def new_cache(model):
    """An empty ``DynamicCache`` for ``model`` (one layer per decoder layer)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # versions whose DynamicCache takes no config grow layers on update
        return DynamicCache()


def cache_layers(cache, n_layers: int, what: str = "the cache") -> list:
    """The per-layer ``keys``/``values`` holders of a ``DynamicCache``, checked to be ``n_layers``."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        raise CacheLayoutUnsupported(
            f"{what} is a {type(cache).__name__} without per-layer keys/values (cache.layers); "
            f"use a transformers DynamicCache from transformers >= 5"
        )
    if len(layers) != n_layers:
        raise CacheLayoutUnsupported(f"{what} has {len(layers)} layers, the model {n_layers}")
    return list(layers)


def _forward_argument(model) -> str:
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_cache_layout(model) -> CacheLayout:
    """Establish that ``model``'s transformers cache holds the MLA latent rows (memoized per model).

    One forward of three tokens runs with hooks on layer 0: the cached keys must be the
    ``kv_a_layernorm`` output, the cached values the shared rope key — at position 0 (no rotation)
    the pre-rope key in the cache's pair layout, at position 2 visibly rotated.

    Raises
    ------
    CacheLayoutUnsupported
        With the shapes or values found, when the model or the installed transformers caches
        anything else.
    """
    known = _layouts.get(model)
    if known is not None:
        return known
    import transformers

    version = transformers.__version__
    geometry = geometry_of(model.config)
    cfg = text_config(model.config)
    attentions = {
        getattr(module, "layer_idx", None): module
        for module in model.modules()
        if hasattr(module, "kv_a_layernorm") and hasattr(module, "kv_a_proj_with_mqa")
    }
    if len(attentions) != geometry.n_layers or 0 not in attentions:
        raise CacheLayoutUnsupported(
            f"{type(model).__name__} has {len(attentions)} latent-attention modules (kv_a_layernorm) for "
            f"{geometry.n_layers} cache layers: not a DeepSeek-V3-style MLA model"
        )
    captured: dict[str, torch.Tensor] = {}
    hooks = [
        attentions[0].kv_a_layernorm.register_forward_hook(
            lambda _m, _i, out: captured.__setitem__("latent", out.detach())
        ),
        attentions[0].kv_a_proj_with_mqa.register_forward_hook(
            lambda _m, _i, out: captured.__setitem__("compressed", out.detach())
        ),
    ]
    argument = _forward_argument(model)
    cache = new_cache(model)
    ids = torch.arange(3, device=model.device)[None] % geometry.vocab
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{argument: cache})
    finally:
        for hook in hooks:
            hook.remove()
    layers = cache_layers(cache, geometry.n_layers, f"the cache transformers {version} builds")
    keys, values = layers[0].keys, layers[0].values
    want_keys, want_values = (1, 1, 3, geometry.kv_lora), (1, 1, 3, geometry.qk_rope)
    if tuple(keys.shape) != want_keys or tuple(values.shape) != want_values:
        raise CacheLayoutUnsupported(
            f"transformers {version} caches keys {list(keys.shape)} and values {list(values.shape)} per layer for "
            f"{type(model).__name__}, not the MLA latent {list(want_keys)} / shared rope key {list(want_values)}; "
            f"kvstore needs a transformers version that caches the latent (5.x)"
        )
    latent = captured["latent"].reshape(3, geometry.kv_lora).float()
    if _relative_gap(keys[0, 0].float(), latent) > 1e-3:
        raise CacheLayoutUnsupported(
            f"transformers {version} caches keys of the latent width that are not the kv_a_layernorm output"
        )
    raw = captured["compressed"].reshape(3, -1)[:, geometry.kv_lora :].float()
    if getattr(cfg, "rope_interleave", False):
        raw = torch.cat((raw[:, 0::2], raw[:, 1::2]), dim=-1)  # transformers' de-interleaved pair layout
    cached = values[0, 0].float()
    scale = float((cached[0] * raw[0]).sum() / (raw[0] * raw[0]).sum().clamp_min(1e-30))
    if not scale > 0 or _relative_gap(cached[0], scale * raw[0]) > 2e-2:
        raise CacheLayoutUnsupported(
            f"transformers {version} caches values that are not the shared rope key in the layout kvstore stores"
        )
    if _relative_gap(cached[2], scale * raw[2]) < 5e-2:
        raise CacheLayoutUnsupported(
            f"transformers {version} caches the shared key before rope; kvstore stores it roped"
        )
    layout = CacheLayout(geometry, argument, version)
    _layouts[model] = layout
    return layout


def cache_kwargs(model, cache) -> dict[str, Any]:
    """``{name: cache}`` for ``model.generate``/``model(...)``: the keyword this transformers uses."""
    return {check_cache_layout(model).cache_argument: cache}


def cache_length(cache) -> int:
    """Rows the cache holds (0 for an empty one, or for None)."""
    return int(cache.get_seq_length()) if cache is not None else 0
