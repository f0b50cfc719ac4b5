"""The bundled MLA engine: a DeepSeek-V3-architecture decoder whose KV cache is the ``.coli_kv`` rows.

Parts: :mod:`~kvstore.engine.config` (``ModelConfig``, presets), :mod:`~kvstore.engine.model`
(the torch model: plain prefill, absorbed decode), :mod:`~kvstore.engine.weights` (load a
Hugging Face folder, random init, write a folder), :mod:`~kvstore.engine.cache` (latent-cache
tiers), :mod:`~kvstore.engine.attention` (decode backends per tier), :mod:`~kvstore.engine.quant`
(device codecs), :mod:`~kvstore.engine.generate` (``Engine``: prefix reuse, sampling, streaming).

Quick start::

    from kvstore.engine import Engine, write_random_model
    write_random_model("models/tiny", "tiny")
    engine = Engine.from_folder("models/tiny", tier="fp8")
    result = engine.generate("Hello", max_new_tokens=16)
"""

from kvstore.engine.cache import TIERS, CacheGeometry, LatentCache, StoredRows, make_cache, tier_bytes_per_token
from kvstore.engine.config import PRESETS, ModelConfig, RopeConfig, preset
from kvstore.engine.errors import CacheError, GenerationError, ModelConfigError, TierUnsupported, WeightsError
from kvstore.engine.generate import Engine, GenerationResult, GenerationStream, SamplingParams
from kvstore.engine.model import MLAForCausalLM
from kvstore.engine.weights import load_model, random_model, save_model, write_random_model

__all__ = [
    "PRESETS",
    "TIERS",
    "CacheError",
    "CacheGeometry",
    "Engine",
    "GenerationError",
    "GenerationResult",
    "GenerationStream",
    "LatentCache",
    "MLAForCausalLM",
    "ModelConfig",
    "ModelConfigError",
    "RopeConfig",
    "SamplingParams",
    "StoredRows",
    "TierUnsupported",
    "WeightsError",
    "load_model",
    "make_cache",
    "preset",
    "random_model",
    "save_model",
    "tier_bytes_per_token",
    "write_random_model",
]
