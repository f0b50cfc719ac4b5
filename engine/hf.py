"""Persist and resume Hugging Face ``transformers`` conversations through kvstore sessions.

Since transformers 5, the DeepSeek-V3 family (and the other MLA models: DeepSeek-V2, GLM-4-MoE-Lite,
...) caches the MLA latent itself. For every layer, ``DynamicCache`` holds

- ``keys``   = the ``kv_a_layernorm`` output, ``[batch, 1, T, kv_lora_rank]`` — the ``Lc`` row, and
- ``values`` = the roped shared key, ``[batch, 1, T, qk_rope_head_dim]`` (de-interleaved when the
  config says ``rope_interleave``) — the ``Rc`` row,

exactly the rows of a ``.coli_kv`` record, so a transformers cache and a kvstore session hold the
same numbers. Whether the installed transformers really caches that is checked at run time on the
model itself (:func:`check_cache_layout`): one forward of three tokens compares the cache with the
``kv_a_layernorm`` output and the pre-rope key. A version that caches something else (per-head
keys and values, an un-normalized latent, an un-roped key) is refused with
:class:`~kvstore.errors.CacheLayoutUnsupported` and what it found.

Public API
----------
:func:`save` / :func:`save_batch`
    Append the rows of a cache that the session does not hold yet (creating the session).
:func:`restore`, :func:`restore_batch`, :func:`restore_prefix`
    Build a ``DynamicCache`` that ``model.generate(..., cache=...)`` continues from: one session,
    several sessions left-padded into one batch, or the longest stored prefix of a prompt.
:func:`model_info`
    The model part of the session fingerprint: name, revision, weights hash (once per folder, cached
    on disk), tokenizer and chat-template hashes.
:func:`cache_rows`, :func:`build_cache`, :func:`cache_from_records`, :func:`cache_from_file`, :func:`cache_kwargs`
    The lower level: rows out of a cache, a cache out of rows or out of a ``.coli_kv`` body or file
    (any tier, e.g. a file the C engine wrote), the keyword transformers takes the cache by.

Restores go through ``kvstore.engine.restore``: the records are uploaded as stored (a file is read
straight into pinned memory) and split and decoded on the cache's device.

Fingerprint. A session records the six geometry words, the cache tier, and the model: ``name``
(the hub id, or the folder's name), ``revision`` (the hub commit, ``local`` for a folder,
``memory`` for a model that was never saved), ``weights_hash`` (``blake2b:`` over the folder's
safetensors files, or ``tensors:blake2b:`` over the parameters of a model without a folder),
``tokenizer_hash`` and ``chat_template_hash`` (when the folder has them) and ``attention_variant``
:data:`ATTENTION_VARIANT`. Restore compares every field and refuses a difference with
:class:`~kvstore.errors.FingerprintMismatch` naming it. The explicit override is
``override={"model.weights_hash", ...}`` (fields ``model.<name>`` and ``tier``), for a user who knows
the caches are interchangeable — e.g. the same weights re-saved, or a renamed folder.

All or nothing. A restore reads every record it serves, decodes and copies them to the device,
and only then returns a new cache; any failure (missing or truncated journal, fingerprint, device
memory) raises and leaves nothing behind: no cache is returned, the caller's own caches are never
touched, the session is not written. With ``verify=True`` the turn hashes are checked first and a
damaged tail is a miss, not an error: only the records before the first bad turn are served, and
``reused_tokens`` / ``damaged_from`` say so.

Examples
--------
A conversation saved after each turn and resumed in another process (``store`` is a
:class:`kvstore.sessions.SessionStore`)::

    cache = hf.new_cache(model)
    out = model.generate(prompt_ids, max_new_tokens=32, **hf.cache_kwargs(model, cache))
    hf.save(store, "chat", model, cache, out[0], owner="me")

    # later, anywhere
    restored = hf.restore(store, "chat", model, owner="me")
    ids = restored.input_ids(next_turn_ids)          # stored tokens + the new turn
    out = model.generate(ids, max_new_tokens=32, **hf.cache_kwargs(model, restored.cache))
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import torch

from kvstore.errors import (
    CacheLayoutUnsupported,
    ConversationMismatch,
    FormatError,
    GeometryMismatch,
    InvalidRequest,
    SessionExists,
    SessionNotFound,
)
from kvstore.engine.fingerprint import (  # noqa: F401  (weights_hash and friends are part of this module's API)
    ATTENTION_VARIANT,
    _folder_hashes,
    refuse_mismatch,
    tokenizer_hashes,
    weight_files,
    weights_hash,
)
from kvstore.engine import restore as device_restore
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, KVRecords, Tier
from kvstore import tiers

if TYPE_CHECKING:  # the session store needs lmdb; the row helpers must import without it
    from kvstore.sessions import Fingerprint, ModelInfo, SessionInfo, SessionStore

__all__ = [
    "ATTENTION_VARIANT",
    "BatchRestored",
    "CacheLayout",
    "Restored",
    "Saved",
    "build_cache",
    "cache_kwargs",
    "cache_from_file",
    "cache_from_records",
    "cache_length",
    "cache_rows",
    "check_cache_layout",
    "geometry_of",
    "model_info",
    "new_cache",
    "parse_tier",
    "restore",
    "restore_batch",
    "restore_prefix",
    "save",
    "save_batch",
    "tokenizer_hashes",
    "weights_hash",
]

logger = logging.getLogger(__name__)

TIER_ALIASES = {"f32": "v1", "fp8": "v2", "tq": "v3", "int4": "v3", "tq-int4": "v3"}
# Models that also cache a sparse-attention indexer key (DeepSeek-V3.2 style): their records
# would need the indexer rows too, which transformers keeps outside the latent layers.
_INDEXER_FIELDS = ("index_topk", "index_head_dim", "index_n_heads")


# ---------------------------------------------------------------------------- tiers and geometry
def parse_tier(tier: Tier | str | None, default: str = "v1") -> Tier:
    """A :class:`Tier` from a Tier or a name: ``v1``/``f32``, ``v2``/``fp8``, ``v3``/``tq``/``int4``
    (rotated int4), ``polar`` (PolarQuant 4 bits), ``polar-N`` (N bits)."""
    if isinstance(tier, Tier):
        return tier
    name = default if tier is None else str(tier).strip().lower()
    try:
        if name in ("polar", "tq-polar") or name.startswith(("polar-", "tq-polar-")):
            suffix = name.rsplit("-", 1)[-1]
            return tiers.parse("v3", codec="polar", bits=int(suffix) if suffix.isdigit() else 4)
        return tiers.parse(TIER_ALIASES.get(name, name))
    except FormatError as exc:
        raise InvalidRequest(f"unknown tier {tier!r} ({exc.reason}): use v1/f32, v2/fp8, v3/int4, polar or polar-N (N = 2..6 bits)") from None


def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def geometry_of(config) -> Geometry:
    """The ``.coli_kv`` geometry (h0..h5) of a transformers MLA config.

    Raises
    ------
    CacheLayoutUnsupported
        The config is not an MLA model, or one that also caches sparse-indexer keys.
    """
    cfg = _text_config(config)
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
    geometry = Geometry(words["num_hidden_layers"], words["kv_lora_rank"], words["qk_rope_head_dim"], 0, 0, words["vocab_size"])
    coli_kv.check_geometry(geometry, tiers.F32)
    return geometry


# ---------------------------------------------------------------------------- cache layout probe
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


def _cache_layers(cache, n_layers: int, what: str = "the cache") -> list:
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
    cfg = _text_config(model.config)
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
        attentions[0].kv_a_layernorm.register_forward_hook(lambda _m, _i, out: captured.__setitem__("latent", out.detach())),
        attentions[0].kv_a_proj_with_mqa.register_forward_hook(lambda _m, _i, out: captured.__setitem__("compressed", out.detach())),
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
    layers = _cache_layers(cache, geometry.n_layers, f"the cache transformers {version} builds")
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
        raise CacheLayoutUnsupported(f"transformers {version} caches the shared key before rope; kvstore stores it roped")
    layout = CacheLayout(geometry, argument, version)
    _layouts[model] = layout
    return layout


def cache_kwargs(model, cache) -> dict[str, Any]:
    """``{name: cache}`` for ``model.generate``/``model(...)``: the keyword this transformers uses."""
    return {check_cache_layout(model).cache_argument: cache}


def cache_length(cache) -> int:
    """Rows the cache holds (0 for an empty one)."""
    return int(cache.get_seq_length()) if cache is not None else 0


# ---------------------------------------------------------------------------- rows in and out
def cache_rows(model, cache, start: int = 0, stop: int | None = None, *, batch_index: int = 0, slots=None) -> tuple[np.ndarray, np.ndarray]:
    """The latent rows a cache holds, as f32 arrays in ``.coli_kv`` order.

    Parameters
    ----------
    start, stop : the token range (default: all rows)
    batch_index : which sequence of a batched cache
    slots : optional bool[T] — take the rows where it is true instead of ``start:stop`` (padding
        left out), then ``start:stop`` indexes the selected rows

    Returns
    -------
    L : f32[n_layers, k, kv_lora]
    R : f32[n_layers, k, qk_rope]
    """
    geometry = check_cache_layout(model).geometry
    layers = _cache_layers(cache, geometry.n_layers)
    keys, values = [], []
    for layer in layers:
        k, v = layer.keys[batch_index, 0], layer.values[batch_index, 0]
        if slots is not None:
            k, v = k[slots], v[slots]
        keys.append(k[start:stop])
        values.append(v[start:stop])
    L = torch.stack(keys).to(device="cpu", dtype=torch.float32).numpy()
    R = torch.stack(values).to(device="cpu", dtype=torch.float32).numpy()
    if L.shape[2] != geometry.kv_lora or R.shape[2] != geometry.qk_rope:
        raise CacheLayoutUnsupported(f"the cache rows are {L.shape[2]}/{R.shape[2]} wide, the model's latent {geometry.kv_lora}/{geometry.qk_rope}")
    return L, R


def build_cache(model, L, R, *, device=None, dtype=None):
    """A ``DynamicCache`` holding the given rows.

    Parameters
    ----------
    L : f32[n_layers, batch, T, kv_lora] (numpy or torch)
    R : f32[n_layers, batch, T, qk_rope]
    device, dtype : where the cache lives (default: the model's)
    """
    geometry = check_cache_layout(model).geometry
    device, dtype = _target(model, device, dtype)
    L, R = torch.as_tensor(L), torch.as_tensor(R)
    if L.ndim != 4 or tuple(L.shape[::3]) != (geometry.n_layers, geometry.kv_lora):
        raise InvalidRequest(f"L must be [n_layers={geometry.n_layers}, batch, T, {geometry.kv_lora}], got {list(L.shape)}")
    if tuple(R.shape) != (*L.shape[:3], geometry.qk_rope):
        raise InvalidRequest(f"R must be {[*L.shape[:3], geometry.qk_rope]}, got {list(R.shape)}")
    cache = new_cache(model)
    if L.shape[2] == 0:
        return cache
    for layer in range(geometry.n_layers):
        cache.update(L[layer, :, None].to(device=device, dtype=dtype), R[layer, :, None].to(device=device, dtype=dtype), layer)
    return cache


def _target(model, device, dtype) -> tuple[torch.device, torch.dtype]:
    return torch.device(device) if device is not None else model.device, dtype if dtype is not None else model.dtype


def _placement(geometry: Geometry, tier: Tier) -> device_restore.Placement:
    """Records -> latent rows of the cache's dtype, on the device: v1 rows by a (converting) copy
    of the stored f32 field, v2/v3 rows sanitized and decoded (engine/restore.py)."""
    if tier.version == 1:
        return device_restore.Placement(geometry, tier, native={"lc": "Lc", "rc": "Rc"})
    return device_restore.Placement(geometry, tier, encode=lambda lc, rc: {"lc": lc, "rc": rc})


def cache_from_records(model, records: KVRecords, *, device=None, dtype=None):
    """A ``DynamicCache`` holding every record of a ``.coli_kv`` body (any tier), built whole.

    For rows that did not come through a session: a file loaded with ``kvstore.formats.coli_kv.load``
    or ``KVFile.load`` — e.g. written by the C engine. The records are uploaded as stored and
    decoded on ``device``. The file's geometry must be the model's
    (:class:`~kvstore.errors.GeometryMismatch` otherwise).

    Parameters
    ----------
    records : KVRecords with ``n`` records
    device, dtype : where the cache lives (default: the model's)

    Returns
    -------
    ``DynamicCache`` with rows ``[1, 1, n, kv_lora]`` / ``[1, 1, n, qk_rope]``
    """
    geometry = check_cache_layout(model).geometry
    if records.geometry != geometry:
        raise GeometryMismatch("the records are for another model: " + "; ".join(records.geometry.mismatches(geometry)))
    device, dtype = _target(model, device, dtype)
    return _build(model, device_restore.MemoryBody(records), geometry, device, dtype)[0]


def cache_from_file(model, path: str | os.PathLike, *, upto: int | None = None, device=None, dtype=None) -> "Restored":
    """Restore a bare ``.coli_kv`` file (any tier) into a ``DynamicCache``: the body is read
    straight into pinned memory, uploaded once and decoded on ``device``.

    Parameters
    ----------
    upto : restore at most this many records (default: every committed, complete record)
    device, dtype : where the cache lives (default: the model's)

    Returns
    -------
    Restored — unpacks as ``(tokens int32[n], DynamicCache)``; ``tier`` is the file's.

    Raises
    ------
    GeometryMismatch (the file is for another model), TruncatedHeader, BadMagic, BadHeader, OSError
    """
    geometry = check_cache_layout(model).geometry
    device, dtype = _target(model, device, dtype)
    with device_restore.FileBody(path, expect=geometry) as body:
        if upto is not None:
            body.limit(upto)
        cache, tokens = _build(model, body, geometry, device, dtype)
        return Restored(tokens, cache, int(tokens.shape[0]), tier=body.tier)


def _build(model, body, geometry: Geometry, device: torch.device, dtype: torch.dtype):
    """(DynamicCache, tokens int32[n]) of ``body``'s records; nothing escapes on a failure."""
    cache = new_cache(model)  # local until every layer is in: a failure on the way returns nothing
    if body.n == 0:
        return cache, np.zeros(0, dtype=np.int32)
    # All layers in one buffer per row kind, filled chunk by chunk on the device; each layer is
    # then handed to the cache (DynamicCache.update concatenates, a device-side copy).
    keys = torch.empty((geometry.n_layers, 1, 1, body.n, geometry.kv_lora), dtype=dtype, device=device)
    values = torch.empty((geometry.n_layers, 1, 1, body.n, geometry.qk_rope), dtype=dtype, device=device)
    n, tokens = device_restore.fill(body, {"lc": keys[:, 0, 0], "rc": values[:, 0, 0]}, _placement(body.geometry, body.tier), device)
    for layer in range(geometry.n_layers if n else 0):
        cache.update(keys[layer, :, :, :n], values[layer, :, :, :n], layer)
    return cache, tokens


# ---------------------------------------------------------------------------- fingerprint
# weights_hash, tokenizer_hashes, refuse_mismatch and ATTENTION_VARIANT live in
# kvstore.engine.fingerprint (shared with the bundled engine's sessions).
_tensor_hashes: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def _tensors_hash(model) -> str:
    """``tensors:blake2b:<hex>`` over a model's state dict (name, dtype, shape, bytes), once per model."""
    known = _tensor_hashes.get(model)
    if known is not None:
        return known
    hasher = hashlib.blake2b(digest_size=32)
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach()
        hasher.update(f"{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        hasher.update(tensor.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    value = "tensors:blake2b:" + hasher.hexdigest()
    _tensor_hashes[model] = value
    return value


def _model_folder(model) -> tuple[Path | None, str, str]:
    """(local folder, name, revision) of a transformers model."""
    config = model.config
    source = getattr(config, "_name_or_path", "") or getattr(model, "name_or_path", "") or ""
    commit = getattr(config, "_commit_hash", None)
    if source and os.path.isdir(source):
        folder = Path(source).resolve()
        return folder, folder.name, commit or "local"
    if source:
        try:  # a hub model: its snapshot folder in the local cache, without the network
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(source, revision=commit, local_files_only=True))
            return folder, source, commit or "unknown"
        except Exception:  # not cached locally or no hub client: hash the parameters instead
            return None, source, commit or "unknown"
    return None, getattr(config, "model_type", None) or type(model).__name__, "memory"


_model_infos: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def model_info(model, *, tokenizer_folder: str | os.PathLike | None = None) -> "ModelInfo":
    """The model part of a session's fingerprint (memoized per model and tokenizer folder).

    Parameters
    ----------
    model : a transformers model (``from_pretrained`` folder, hub model, or built in memory)
    tokenizer_folder : where the tokenizer files are, when not beside the weights
    """
    from kvstore.sessions import ModelInfo

    memo = _model_infos.setdefault(model, {})
    key = None if tokenizer_folder is None else str(Path(tokenizer_folder).resolve())
    if key in memo:
        return memo[key]
    folder, name, revision = _model_folder(model)
    weights = weights_hash(folder) if folder is not None and weight_files(folder) else _tensors_hash(model)
    tokenizer_hash = template_hash = None
    tokenizer_source = tokenizer_folder if tokenizer_folder is not None else folder
    if tokenizer_source is not None:
        tokenizer_hash, template_hash = tokenizer_hashes(tokenizer_source)
    info = ModelInfo(
        name=name[-256:],
        revision=revision[:256],
        weights_hash=weights,
        tokenizer_hash=tokenizer_hash,
        chat_template_hash=template_hash,
        attention_variant=ATTENTION_VARIANT,
    )
    memo[key] = info
    return info


def _expected(model, tier: Tier, given: "ModelInfo | dict | None") -> "Fingerprint":
    from kvstore.sessions import Fingerprint, ModelInfo

    layout = check_cache_layout(model)
    info = ModelInfo.from_dict(given) if given is not None else model_info(model)
    return Fingerprint(info, layout.geometry, tier)


# ---------------------------------------------------------------------------- tokens
def _token_array(tokens, vocab: int, what: str = "tokens") -> np.ndarray:
    """1-D int64 token ids (from a list, numpy array, or torch tensor of shape [S] or [1, S])."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    array = np.asarray(tokens)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise InvalidRequest(f"{what} must be a 1-D sequence of token ids, got shape {list(array.shape)}")
    array = array.astype(np.int64)
    if array.size and (array.min() < 0 or array.max() >= vocab):
        raise InvalidRequest(f"{what} must be ids in [0, {vocab}), got {array.min()}..{array.max()}")
    return array


def _first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else None


# ---------------------------------------------------------------------------- save
@dataclass(frozen=True)
class Saved:
    """What :func:`save` did.

    Attributes
    ----------
    info : the session after the append
    appended : records written by this call (0 when the session already held every row)
    computed : tokens whose rows ``save`` computed itself (given tokens past the cache's rows)
    """

    info: "SessionInfo"
    appended: int
    computed: int

    @property
    def n_records(self) -> int:
        return self.info.n_records


def _session_for_save(store, session_id, *, owner, model, tier, model_info_, tags, override) -> "SessionInfo":
    """The session to append to: created with the expected fingerprint, or checked against it."""
    try:
        info = store.get(session_id, owner=owner)
    except SessionNotFound:
        expected = _expected(model, parse_tier(tier), model_info_)
        try:
            return store.create(owner, expected.geometry, expected.tier, expected.model, session_id=session_id, tags=tags)
        except SessionExists:  # created meanwhile by another writer: check it like any other
            info = store.get(session_id, owner=owner)
    expected = _expected(model, parse_tier(tier) if tier is not None else info.tier, model_info_)
    refuse_mismatch(info, expected, override)
    return info


def _stored_tokens(store, info: "SessionInfo", owner: str | None) -> np.ndarray:
    """The session's first ``info.n_records`` tokens: the token column only, read under its read lock."""
    n = info.n_records
    if n == 0:
        return np.empty(0, np.int32)
    with store.reader(info.id, owner=owner):  # nothing shrinks or replaces the journal meanwhile
        path = store.journal_path(info.id)
        body = np.memmap(path, dtype=np.uint8, mode="r", offset=coli_kv.HEADER_BYTES, shape=(n * info.record_bytes,))
        try:
            return np.ndarray((n,), "<i4", body, 0, (info.record_bytes,)).astype(np.int32)
        finally:
            del body


def _check_continuation(stored: np.ndarray, tokens: np.ndarray, rows: int, session_id: str) -> None:
    n = stored.shape[0]
    if n > rows:
        raise ConversationMismatch(
            f"session {session_id!r} holds {n} records but the cache only {rows} rows: it is not this "
            f"conversation's cache (a prefix restore continues in a new session: fork it first)"
        )
    at = _first_difference(stored, tokens[:n])
    if at is not None:
        raise ConversationMismatch(
            f"session {session_id!r} holds another conversation: token {at} is {int(stored[at])} there, "
            f"{int(tokens[at])} here; save it under another session id"
        )


def _extend(model, cache, tail: torch.Tensor, attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None:
    """Run ``tail`` [batch, k] through the model once so that the cache holds its rows too."""
    kwargs: dict[str, Any] = {"use_cache": True, **cache_kwargs(model, cache)}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1  # the logits are not wanted, only the rows
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
        kwargs["position_ids"] = positions
    with torch.no_grad():
        model(input_ids=tail.to(model.device), **kwargs)


def save(
    store: "SessionStore",
    session_id: str,
    model,
    cache,
    tokens,
    *,
    owner: str,
    tier: Tier | str | None = None,
    complete_turn: bool = True,
    extend: bool = True,
    model_info: "ModelInfo | dict | None" = None,
    override: Iterable[str] = (),
    tags: Iterable[str] = (),
) -> Saved:
    """Append the rows of a transformers cache that the session does not hold yet.

    Call it after every turn: only the rows past the session's record count are encoded and
    appended (the stored tokens are checked to be a prefix of ``tokens`` first).

    Parameters
    ----------
    store : the session store
    session_id : created (with this model's fingerprint and ``tier``) when missing
    model : the transformers model the cache belongs to
    cache : its ``DynamicCache``, batch 1: rows ``[1, 1, T, kv_lora]`` / ``[1, 1, T, qk_rope]``
    tokens : int[S] — the conversation so far, ``S >= T`` (e.g. ``generate``'s output row)
    tier : ``v1``/``f32`` (default for a new session), ``v2``/``fp8``, ``v3``/``int4``, ``polar``;
        for an existing session, None means its own tier and anything else must equal it
    complete_turn : the rows end a turn (the session's watermark moves: resumes serve them)
    extend : tokens past the cache's rows (the last generated token has none yet) are run through
        the model once, in place on ``cache``, so every token is stored; False stores ``T`` only
    model_info : the fingerprint's model part (default :func:`model_info` of ``model``)
    override : fingerprint fields not to compare (see the module docstring)

    Raises
    ------
    FingerprintMismatch, ConversationMismatch, CacheLayoutUnsupported, InvalidRequest,
    BudgetExceeded
    """
    layout = check_cache_layout(model)
    geometry = layout.geometry
    tokens = _token_array(tokens, geometry.vocab)
    layers = _cache_layers(cache, geometry.n_layers)
    rows = cache_length(cache)
    if rows and layers[0].keys.shape[0] != 1:
        raise InvalidRequest(f"the cache holds a batch of {layers[0].keys.shape[0]} sequences: use save_batch")
    if tokens.shape[0] < rows:
        raise ConversationMismatch(f"the cache holds {rows} rows but only {tokens.shape[0]} tokens were given")
    info = _session_for_save(store, session_id, owner=owner, model=model, tier=tier, model_info_=model_info, tags=tags, override=override)
    total = tokens.shape[0] if extend else rows
    _check_continuation(_stored_tokens(store, info, owner), tokens, total, session_id)
    computed = 0
    if total > rows:
        _extend(model, cache, torch.from_numpy(tokens[rows:])[None])
        computed = total - rows
    start = info.n_records
    L, R = cache_rows(model, cache, start, total)
    result = store.append(session_id, tokens[start:total].astype(np.int32), L, R, complete_turn=complete_turn, owner=owner)
    logger.info("hf save %s: appended %d records (%d held before, %d computed)", session_id, result.appended, start, computed)
    return Saved(result.info, result.appended, computed)


def save_batch(
    store: "SessionStore",
    session_ids: Sequence[str],
    model,
    cache,
    sequences,
    attention_mask,
    *,
    owner: str,
    tier: Tier | str | None = None,
    complete_turn: bool = True,
    extend: bool = True,
    model_info: "ModelInfo | dict | None" = None,
    override: Iterable[str] = (),
    tags: Iterable[str] = (),
) -> list[Saved]:
    """:func:`save` for a batched, padded cache: row ``b`` goes to ``session_ids[b]``.

    Parameters
    ----------
    sequences : int[B, S] — the padded token ids (e.g. ``generate``'s output)
    attention_mask : int/bool[B, S'] with ``S' <= S`` — 1 for real tokens; columns past ``S'`` (the
        generated ones) count as real
    (the rest as in :func:`save`)

    Every session is checked (fingerprint, stored tokens) before anything is computed or written;
    each session's append is then its own commit.
    """
    layout = check_cache_layout(model)
    geometry = layout.geometry
    sequences = torch.as_tensor(sequences).to("cpu", torch.int64)
    mask = torch.as_tensor(attention_mask).to("cpu", torch.int64)
    if sequences.ndim != 2 or mask.ndim != 2 or mask.shape[0] != sequences.shape[0] or mask.shape[1] > sequences.shape[1]:
        raise InvalidRequest(f"sequences [B, S] and attention_mask [B, S' <= S] expected, got {list(sequences.shape)} and {list(mask.shape)}")
    batch, width = sequences.shape
    if len(session_ids) != batch:
        raise InvalidRequest(f"{len(session_ids)} session ids for a batch of {batch}")
    mask = torch.cat([mask, torch.ones((batch, width - mask.shape[1]), dtype=torch.int64)], dim=1)
    layers = _cache_layers(cache, geometry.n_layers)
    rows = cache_length(cache)
    if rows and layers[0].keys.shape[0] != batch:
        raise InvalidRequest(f"the cache holds {layers[0].keys.shape[0]} sequences, {batch} were given")
    if width < rows:
        raise ConversationMismatch(f"the cache holds {rows} rows but the sequences only {width} columns")
    total = width if extend else rows
    real = mask[:, :total].bool()
    per_session = [_token_array(sequences[b, :total][real[b]], geometry.vocab, f"sequence {b}") for b in range(batch)]
    infos = []
    for b, session_id in enumerate(session_ids):
        info = _session_for_save(store, session_id, owner=owner, model=model, tier=tier, model_info_=model_info, tags=tags, override=override)
        _check_continuation(_stored_tokens(store, info, owner), per_session[b], per_session[b].shape[0], session_id)
        infos.append(info)
    computed = 0
    if total > rows:
        positions = (mask[:, :total].cumsum(-1) - 1).clamp_min(0)
        _extend(model, cache, sequences[:, rows:total], mask[:, :total].to(model.device), positions[:, rows:total].to(model.device))
        computed = total - rows
    saved = []
    for b, (session_id, info) in enumerate(zip(session_ids, infos)):
        start = info.n_records
        L, R = cache_rows(model, cache, start, None, batch_index=b, slots=real[b].to(layers[0].keys.device))
        result = store.append(session_id, per_session[b][start:].astype(np.int32), L, R, complete_turn=complete_turn, owner=owner)
        saved.append(Saved(result.info, result.appended, int(real[b, rows:].sum()) if computed else 0))
    return saved


# ---------------------------------------------------------------------------- restore
@dataclass
class Restored:
    """A session restored into a transformers cache. Unpacks as ``tokens, cache``.

    Attributes
    ----------
    tokens : int32[n] — the tokens whose rows the cache holds (the conversation so far)
    cache : ``DynamicCache`` with rows ``[1, 1, n, kv_lora]`` / ``[1, 1, n, qk_rope]``
    reused_tokens : n — the tokens the caller need not run through the model again
    session_id : the session restored (None when a prefix restore found nothing)
    info : its SessionInfo at restore time
    tier : the tier its rows were stored in (lossy unless v1)
    verified : whether the turn hashes were checked
    damaged_from : first record of the first damaged turn when ``verify`` found one (not served)
    """

    tokens: np.ndarray
    cache: Any
    reused_tokens: int
    session_id: str | None = None
    info: "SessionInfo | None" = None
    tier: Tier | None = None
    verified: bool = False
    damaged_from: int | None = None

    def __iter__(self):
        return iter((self.tokens, self.cache))

    def prefilled_tokens(self, context_tokens: int) -> int:
        """Tokens a context of ``context_tokens`` still has to run through the model."""
        return context_tokens - self.reused_tokens

    def input_ids(self, new_tokens=(), device=None) -> torch.Tensor:
        """``int64[1, n + m]``: the stored tokens then ``new_tokens`` — what ``generate`` takes."""
        tail = torch.as_tensor(np.asarray(new_tokens, dtype=np.int64).reshape(-1))
        ids = torch.cat([torch.from_numpy(self.tokens.astype(np.int64)), tail])[None]
        return ids.to(device) if device is not None else ids


@dataclass
class BatchRestored:
    """Sessions restored into one left-padded batched cache.

    Row ``b`` of the cache is ``N - n_b`` padding rows (zeros, masked out) then the session's
    ``n_b`` rows, ``N = max n_b``; every row keeps the positions it was stored with (``0..n_b-1``).

    Attributes
    ----------
    tokens : list of int32[n_b]
    cache : ``DynamicCache`` with rows ``[B, 1, N, w]``
    attention_mask : int64[B, N] — 1 for a restored row, 0 for padding
    reused_tokens : list of n_b
    session_ids, infos, tiers, damaged_from : per session, as in :class:`Restored`
    """

    tokens: list[np.ndarray]
    cache: Any
    attention_mask: torch.Tensor
    reused_tokens: list[int]
    session_ids: list[str]
    infos: list["SessionInfo"]
    tiers: list[Tier]
    damaged_from: list[int | None]

    def inputs(self, new_tokens: Sequence[Sequence[int]], pad_token_id: int = 0, device=None) -> dict[str, torch.Tensor]:
        """The batch's next inputs: ``{"input_ids", "attention_mask", "position_ids"}``, each ``[B, N + M]``.

        Row ``b`` is ``[pad | stored tokens | pad | new_tokens[b]]`` with ``M = max len(new_tokens[b])``
        (every row needs at least one new token: its last one gives the next token's logits); the
        mask is 0 on both paddings and ``position_ids`` count real tokens only, so each sequence
        continues at position ``n_b``. Pass ``input_ids`` and ``attention_mask`` to ``generate`` (it
        derives the same positions from the mask); ``position_ids`` is for a hand-written loop.
        """
        batch, cached = self.attention_mask.shape
        if len(new_tokens) != batch:
            raise InvalidRequest(f"{len(new_tokens)} new turns for a batch of {batch}")
        turns = [np.asarray(turn, dtype=np.int64).reshape(-1) for turn in new_tokens]
        if any(turn.size == 0 for turn in turns):
            raise InvalidRequest("every sequence needs at least one new token (the last one gives the next token's logits)")
        width = max(turn.size for turn in turns)
        ids = torch.full((batch, cached + width), pad_token_id, dtype=torch.int64)
        mask = torch.zeros((batch, cached + width), dtype=torch.int64)
        mask[:, :cached] = self.attention_mask.cpu()
        for b, (stored, turn) in enumerate(zip(self.tokens, turns)):
            ids[b, cached - stored.size : cached] = torch.from_numpy(stored.astype(np.int64))
            ids[b, cached + width - turn.size :] = torch.from_numpy(turn)
            mask[b, cached + width - turn.size :] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        return {k: v.to(device) for k, v in out.items()} if device is not None else out


@dataclass
class _Read:
    """One session's served records, read (and the fingerprint checked) before anything is built."""

    records: KVRecords
    tokens: np.ndarray
    info: "SessionInfo"
    verified: bool
    damaged_from: int | None

    @property
    def n(self) -> int:
        return self.records.n


def _read_session(store, session_id, model, *, owner, upto, verify, tier, override, model_info_) -> _Read:
    if upto is not None and (not isinstance(upto, (int, np.integer)) or isinstance(upto, bool) or upto < 0):
        raise InvalidRequest(f"upto must be a non-negative number of tokens, got {upto!r}")
    info = store.get(session_id, owner=owner)
    expected = _expected(model, parse_tier(tier) if tier is not None else info.tier, model_info_)
    refuse_mismatch(info, expected, override)
    # The reader re-checks under its lock (the session may have been migrated meanwhile).
    with store.reader(session_id, owner=owner, verify=verify, expect=expected, override=override) as reader:
        n = reader.n_records if upto is None else min(int(upto), reader.n_records)
        if n:
            records = next(reader.iter_batches(n))
        else:
            records = KVRecords(coli_kv.Header(reader.info.geometry, reader.info.tier, 0), np.empty(0, coli_kv.record_dtype(reader.info.geometry, reader.info.tier)), coli_kv.HEADER_BYTES)
        return _Read(records, records.tokens.copy(), reader.info, reader.verified, reader.damaged_from)


def restore(
    store: "SessionStore",
    session_id: str,
    model,
    device=None,
    dtype=None,
    *,
    owner: str,
    upto: int | None = None,
    verify: bool = False,
    tier: Tier | str | None = None,
    override: Iterable[str] = (),
    model_info: "ModelInfo | dict | None" = None,
) -> Restored:
    """Rebuild a session's cache for ``model`` — all of it, or nothing.

    Parameters
    ----------
    device, dtype : where the cache lives (default: the model's device and dtype)
    upto : serve at most this many records (a prefix); default: up to the session's watermark
    verify : re-hash the turns first; a damaged tail is not served (``damaged_from`` says where)
    tier : require the session to be stored in this tier (default: accept its own, reported in
        ``Restored.tier``)
    override : fingerprint fields not to compare (see the module docstring)
    model_info : the fingerprint's model part (default :func:`model_info` of ``model``)

    Returns
    -------
    Restored — unpacks as ``(tokens int32[n], DynamicCache)``; ``reused_tokens`` is ``n``.

    Raises
    ------
    SessionNotFound, FingerprintMismatch (naming the fields), IntegrityError / SessionDamaged
    (journal missing or shorter than its index), CacheLayoutUnsupported, InvalidRequest
    """
    device, dtype = _target(model, device, dtype)
    read = _read_session(store, session_id, model, owner=owner, upto=upto, verify=verify, tier=tier, override=override, model_info_=model_info)
    cache, _ = _build(model, device_restore.MemoryBody(read.records), check_cache_layout(model).geometry, device, dtype)
    logger.info("hf restore %s: reused %d tokens (%s)", session_id, read.n, read.info.tier.describe())
    return Restored(read.tokens, cache, read.n, session_id, read.info, read.info.tier, read.verified, read.damaged_from)


def restore_batch(
    store: "SessionStore",
    session_ids: Sequence[str],
    model,
    device=None,
    dtype=None,
    *,
    owner: str,
    upto: int | Sequence[int | None] | None = None,
    verify: bool = False,
    tier: Tier | str | None = None,
    override: Iterable[str] = (),
    model_info: "ModelInfo | dict | None" = None,
) -> BatchRestored:
    """Restore several sessions into one left-padded batched cache (all of them, or nothing).

    Every session is read and checked before the cache is built; one failure (not found,
    fingerprint, damaged journal) raises and nothing is returned. ``upto`` is one cap for all or
    one per session. See :class:`BatchRestored` for the layout and :meth:`BatchRestored.inputs`
    for the next inputs.
    """
    if not session_ids:
        raise InvalidRequest("restore_batch needs at least one session id")
    caps = list(upto) if isinstance(upto, (list, tuple)) else [upto] * len(session_ids)
    if len(caps) != len(session_ids):
        raise InvalidRequest(f"{len(caps)} upto values for {len(session_ids)} sessions")
    device, dtype = _target(model, device, dtype)
    geometry = check_cache_layout(model).geometry
    reads = [
        _read_session(store, sid, model, owner=owner, upto=cap, verify=verify, tier=tier, override=override, model_info_=model_info)
        for sid, cap in zip(session_ids, caps)
    ]
    lengths = [read.n for read in reads]
    batch, width = len(reads), max(lengths)
    mask = torch.zeros((batch, width), dtype=torch.int64)
    for b, n in enumerate(lengths):
        mask[b, width - n :] = 1
    cache = new_cache(model)
    if width:
        # Every session's records go straight into its left-padded slot of one buffer per row kind
        # (zeros elsewhere), decoded on the device; each layer is then handed to the cache.
        keys = torch.zeros((geometry.n_layers, batch, 1, width, geometry.kv_lora), device=device, dtype=dtype)
        values = torch.zeros((geometry.n_layers, batch, 1, width, geometry.qk_rope), device=device, dtype=dtype)
        for b, read in enumerate(reads):
            if read.n:
                slot = {"lc": keys[:, b, 0, width - read.n :], "rc": values[:, b, 0, width - read.n :]}
                device_restore.fill(device_restore.MemoryBody(read.records), slot, _placement(geometry, read.records.tier), device)
        for layer in range(geometry.n_layers):
            cache.update(keys[layer], values[layer], layer)
    logger.info("hf restore_batch %s: reused %s tokens", list(session_ids), lengths)
    return BatchRestored(
        tokens=[read.tokens for read in reads],
        cache=cache,
        attention_mask=mask,
        reused_tokens=lengths,
        session_ids=list(session_ids),
        infos=[read.info for read in reads],
        tiers=[read.info.tier for read in reads],
        damaged_from=[read.damaged_from for read in reads],
    )


def restore_prefix(
    store: "SessionStore",
    model,
    prompt,
    device=None,
    dtype=None,
    *,
    owner: str,
    tier: Tier | str | None = None,
    verify: bool = False,
    override: Iterable[str] = (),
    model_info: "ModelInfo | dict | None" = None,
) -> Restored:
    """Restore the owner's stored conversation sharing the longest prefix with ``prompt``.

    The store's prefix lookup finds the session (same fingerprint, stored in ``tier``, default v1;
    at least one 64-token block in common); its rows for the common prefix are restored, capped
    at ``len(prompt) - 1`` so the prompt's last token still runs and gives the next token's logits.
    When nothing matches, the cache is empty and ``reused_tokens`` is 0.

    Returns
    -------
    Restored — ``tokens`` is ``prompt[:reused_tokens]``; pass ``prompt`` itself to ``generate``.
    """
    geometry = check_cache_layout(model).geometry
    prompt = _token_array(prompt, geometry.vocab, "prompt")
    expected = _expected(model, parse_tier(tier), model_info)
    limit = prompt.shape[0] - 1
    hit = store.lookup(owner, expected, prompt) if limit > 0 else None
    if hit is None or min(hit.matched_tokens, limit) <= 0:
        logger.info("hf restore_prefix: no stored prefix (reused 0 tokens)")
        return Restored(np.empty(0, np.int32), new_cache(model), 0, tier=expected.tier)
    upto = min(hit.matched_tokens, limit)
    restored = restore(store, hit.session_id, model, device, dtype, owner=owner, upto=upto, verify=verify, tier=expected.tier, override=override, model_info=expected.model)
    common = _first_difference(restored.tokens, prompt)
    if common is not None:  # the session changed between the lookup and the read: serve what still matches
        restored = restore(store, hit.session_id, model, device, dtype, owner=owner, upto=common, verify=verify, tier=expected.tier, override=override, model_info=expected.model)
    return restored
