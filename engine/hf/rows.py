"""Latent rows in and out of a transformers cache: as f32 arrays, or straight from ``.coli_kv`` records.

Records go to the device through ``kvstore.engine.restore``: uploaded as stored (a file is read
straight into pinned memory), split and decoded on the cache's device, into buffers that become a
cache only once every layer is in.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kvstore.engine import restore as device_restore
from kvstore.engine.errors import CacheLayoutUnsupported, GeometryMismatch
from kvstore.engine.hf.layout import cache_layers, check_cache_layout, new_cache
from kvstore.engine.hf.results import Restored
from kvstore.errors import InvalidRequest
from kvstore.formats.coli_kv import Geometry, KVRecords
from kvstore.tiers import Tier

__all__ = ["build_cache", "cache_from_file", "cache_from_records", "cache_rows"]


def cache_rows(
    model, cache, start: int = 0, stop: int | None = None, *, batch_index: int = 0, slots=None
) -> tuple[np.ndarray, np.ndarray]:
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
    layers = cache_layers(cache, geometry.n_layers)
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
        raise CacheLayoutUnsupported(
            f"the cache rows are {L.shape[2]}/{R.shape[2]} wide, the model's latent {geometry.kv_lora}/{geometry.qk_rope}"
        )
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
    device, dtype = target(model, device, dtype)
    L, R = torch.as_tensor(L), torch.as_tensor(R)
    if L.ndim != 4 or tuple(L.shape[::3]) != (geometry.n_layers, geometry.kv_lora):
        raise InvalidRequest(
            f"L must be [n_layers={geometry.n_layers}, batch, T, {geometry.kv_lora}], got {list(L.shape)}"
        )
    if tuple(R.shape) != (*L.shape[:3], geometry.qk_rope):
        raise InvalidRequest(f"R must be {[*L.shape[:3], geometry.qk_rope]}, got {list(R.shape)}")
    cache = new_cache(model)
    if L.shape[2] == 0:
        return cache
    for layer in range(geometry.n_layers):
        cache.update(
            L[layer, :, None].to(device=device, dtype=dtype), R[layer, :, None].to(device=device, dtype=dtype), layer
        )
    return cache


def target(model, device, dtype) -> tuple[torch.device, torch.dtype]:
    """Where a cache lives: the given device and dtype, else the model's."""
    return torch.device(device) if device is not None else model.device, dtype if dtype is not None else model.dtype


def placement(geometry: Geometry, tier: Tier) -> device_restore.Placement:
    """Records -> latent rows of the cache's dtype, on the device: f32 rows by a (converting) copy
    of the stored field, fp8/TQ rows sanitized and decoded (engine/restore.py)."""
    if tier.holds_values:  # f32 (v1) and bf16 (v4) rows: copied, converting where the dtype differs
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
    device, dtype = target(model, device, dtype)
    return build_from_body(model, device_restore.MemoryBody(records), geometry, device, dtype)[0]


def cache_from_file(model, path: str | os.PathLike, *, upto: int | None = None, device=None, dtype=None) -> Restored:
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
    device, dtype = target(model, device, dtype)
    with device_restore.FileBody(path, expect=geometry) as body:
        if upto is not None:
            body.limit(upto)
        cache, tokens = build_from_body(model, body, geometry, device, dtype)
        return Restored(tokens, cache, int(tokens.shape[0]), tier=body.tier)


def build_from_body(model, body, geometry: Geometry, device: torch.device, dtype: torch.dtype):
    """(DynamicCache, tokens int32[n]) of ``body``'s records; nothing escapes on a failure."""
    cache = new_cache(model)  # local until every layer is in: a failure on the way returns nothing
    if body.n == 0:
        return cache, np.zeros(0, dtype=np.int32)
    # All layers in one buffer per row kind, filled chunk by chunk on the device; each layer is
    # then handed to the cache (DynamicCache.update concatenates, a device-side copy).
    keys = torch.empty((geometry.n_layers, 1, 1, body.n, geometry.kv_lora), dtype=dtype, device=device)
    values = torch.empty((geometry.n_layers, 1, 1, body.n, geometry.qk_rope), dtype=dtype, device=device)
    n, tokens = device_restore.fill(
        body, {"lc": keys[:, 0, 0], "rc": values[:, 0, 0]}, placement(body.geometry, body.tier), device
    )
    for layer in range(geometry.n_layers if n else 0):
        cache.update(keys[layer, :, :, :n], values[layer, :, :, :n], layer)
    return cache, tokens
