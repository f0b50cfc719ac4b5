"""The bundled MLA engine: a DeepSeek-V3-architecture decoder whose KV cache is the ``.coli_kv`` rows.

Parts: :mod:`~kvstore.engine.config` (``ModelConfig``, presets), :mod:`~kvstore.engine.model`
(the torch model: plain prefill, absorbed decode), :mod:`~kvstore.engine.weights` (load a
Hugging Face folder, random init, write a folder), :mod:`~kvstore.engine.cache` (``LatentCache``:
the rows of any ``kvstore.tiers`` tier on any device; its codecs are ``kvstore.gpu.codecs`` and its
decode attention is chosen by ``kvstore.gpu.registry.select``), :mod:`~kvstore.engine.rows`
(``StoredRows``: rows as a journal holds them), :mod:`~kvstore.engine.restore` (``.coli_kv`` records
into a cache on the device), :mod:`~kvstore.engine.generate` (``Engine``: prefix reuse, sampling, streaming),
:mod:`~kvstore.engine.batch` (several sessions decoding together, one forward per step),
:mod:`~kvstore.engine.session` (``SessionEngine``: conversation turns on stored sessions),
:mod:`~kvstore.engine.hf` (transformers interop). The commands that drive it (``kvstore new-model``,
``generate``, ``chat``, ``hf-chat``) live in ``kvstore.cli``.

The names below are imported on first use, so ``import kvstore.engine.config`` (which the
``kvstore`` command line imports to list the presets) does not pay for torch.

Quick start::

    from kvstore.engine import Engine, write_random_model
    write_random_model("models/tiny", "tiny")
    engine = Engine.from_folder("models/tiny", tier="fp8")
    result = engine.generate("Hello", max_new_tokens=16)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BatchResult": "batch",
    "BatchSequence": "batch",
    "CacheGeometry": "cache",
    "LatentCache": "cache",
    "StoredRows": "rows",
    "make_cache": "cache",
    "PRESETS": "config",
    "ModelConfig": "config",
    "RopeConfig": "config",
    "preset": "config",
    "CacheError": "errors",
    "GenerationError": "errors",
    "ModelConfigError": "errors",
    "TierUnsupported": "errors",
    "WeightsError": "errors",
    "Engine": "generate",
    "GenerationResult": "generate",
    "GenerationStream": "generate",
    "SamplingParams": "generate",
    "SessionEngine": "session",
    "TurnResult": "session",
    "MLAForCausalLM": "model",
    "load_model": "weights",
    "random_model": "weights",
    "save_model": "weights",
    "write_random_model": "weights",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvstore.engine.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
