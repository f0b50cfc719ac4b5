"""Persist and resume Hugging Face ``transformers`` conversations through kvstore sessions.

Since transformers 5, the DeepSeek-V3 family (and the other MLA models: DeepSeek-V2, GLM-4-MoE-Lite,
...) caches the MLA latent itself. For every layer, ``DynamicCache`` holds

- ``keys``   = the ``kv_a_layernorm`` output, ``[batch, 1, T, kv_lora_rank]`` — the ``Lc`` row, and
- ``values`` = the roped shared key, ``[batch, 1, T, qk_rope_head_dim]`` (de-interleaved when the
  config says ``rope_interleave``) — the ``Rc`` row,

exactly the rows of a ``.coli_kv`` record, so a transformers cache and a kvstore session hold the
same numbers. Whether the installed transformers really caches that is checked at run time on the
model itself (:func:`check_cache_layout`); a version that caches something else is refused with
:class:`~kvstore.errors.CacheLayoutUnsupported` and what it found.

Where things are
----------------
======================  ===========================================================================
``layout.py``           the cache layout probe (:func:`check_cache_layout`, :class:`CacheLayout`),
                        :func:`geometry_of` a config, :func:`new_cache`, :func:`cache_kwargs`,
                        :func:`cache_length`
``rows.py``             rows in and out of a cache: :func:`cache_rows`, :func:`build_cache`,
                        :func:`cache_from_records`, :func:`cache_from_file` (any tier, e.g. a file
                        the C engine wrote)
``saving.py``           :func:`save`, :func:`save_batch`, :class:`Saved`; the continuation checks
``restoring.py``        :func:`restore`, :func:`restore_batch`, :func:`restore_prefix`
``results.py``          what a restore hands back: :class:`Restored`, :class:`BatchRestored`
``tokens.py``           token ids in; :func:`next_input_ids` and :func:`prefill_length`, which keep
                        ``generate`` from running a conversation twice (below)
``fingerprint.py``      :func:`model_info` (the model part of a session's fingerprint), the
                        ``tier=`` argument read through :mod:`kvstore.tiers`
======================  ===========================================================================

(``saving``/``restoring`` rather than ``save``/``restore``: the package exports functions of those
names, which would hide the modules.)

Tiers. ``tier=`` takes a :class:`~kvstore.tiers.Tier` or a file tier's name: ``f32`` (the default
for a new session; exact), ``fp8``, ``int4``, ``polar2`` .. ``polar6``. Old spellings (``v1``,
``v2``, ``v3``, ``tq-int4``, ``polar``, ``polar-3``) are read for one release with a
``TierSpellingDeprecated`` warning.

Fingerprint. A session records the six geometry words, the tier, and the model: ``name`` (the hub
id, or the folder's name), ``revision`` (the hub commit, ``local`` for a folder, ``memory`` for a
model that was never saved), ``weights_hash`` (``blake2b:`` over the folder's safetensors files, or
``tensors:blake2b:`` over the parameters of a model without a folder), ``tokenizer_hash`` and
``chat_template_hash`` (when the folder has them) and ``attention_variant`` :data:`ATTENTION_VARIANT`.
Restore compares every field and refuses a difference with
:class:`~kvstore.errors.FingerprintMismatch` naming it. The explicit override is
``override={"model.weights_hash", ...}`` (fields ``model.<name>`` and ``tier``), for a user who knows
the caches are interchangeable — e.g. the same weights re-saved, or a renamed folder.

All or nothing. A restore reads every record it serves, decodes and copies them to the device,
and only then returns a new cache; any failure (missing or truncated journal, fingerprint, device
memory) raises and leaves nothing behind. With ``verify=True`` the turn hashes are checked first
and a damaged tail is a miss, not an error: only the records before the first bad turn are served,
and ``reused_tokens`` / ``damaged_from`` say so.

Continuing. transformers' ``generate`` runs the input tokens past the cache's length; given an
input the cache already covers, it runs the whole input again on top of the cache. So
``restored.input_ids(turn)`` is the stored tokens then the new turn, and ``restored.input_ids()``
with no new turn hands the last stored token back (the cache gives up its row) so that ``generate``
continues exactly where the conversation stopped. An input built by hand is checked with
:func:`prefill_length` before ``generate`` (it refuses one the cache already covers).

Examples
--------
A conversation saved after each turn and resumed in another process (``store`` is a
:class:`kvstore.store.SessionStore`)::

    cache = hf.new_cache(model)
    out = model.generate(prompt_ids, max_new_tokens=32, **hf.cache_kwargs(model, cache))
    hf.save(store, "chat", model, cache, out[0], owner="me")

    # later, anywhere
    restored = hf.restore(store, "chat", model, owner="me")
    ids = restored.input_ids(next_turn_ids)          # stored tokens + the new turn
    out = model.generate(ids, max_new_tokens=32, **hf.cache_kwargs(model, restored.cache))
"""

from __future__ import annotations

from kvstore.engine.fingerprint import ATTENTION_VARIANT, tokenizer_hashes, weights_hash
from kvstore.engine.hf.fingerprint import model_info
from kvstore.engine.hf.layout import (
    CacheLayout,
    cache_kwargs,
    cache_length,
    check_cache_layout,
    geometry_of,
    new_cache,
)
from kvstore.engine.hf.restoring import restore, restore_batch, restore_prefix
from kvstore.engine.hf.results import BatchRestored, Restored
from kvstore.engine.hf.rows import build_cache, cache_from_file, cache_from_records, cache_rows
from kvstore.engine.hf.saving import Saved, save, save_batch
from kvstore.engine.hf.tokens import next_input_ids, prefill_length

__all__ = [
    "ATTENTION_VARIANT",
    "BatchRestored",
    "CacheLayout",
    "Restored",
    "Saved",
    "build_cache",
    "cache_from_file",
    "cache_from_records",
    "cache_kwargs",
    "cache_length",
    "cache_rows",
    "check_cache_layout",
    "geometry_of",
    "model_info",
    "new_cache",
    "next_input_ids",
    "prefill_length",
    "restore",
    "restore_batch",
    "restore_prefix",
    "save",
    "save_batch",
    "tokenizer_hashes",
    "weights_hash",
]
