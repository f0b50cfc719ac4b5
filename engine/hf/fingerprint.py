"""The fingerprint a transformers model gives its sessions: model part, geometry and tier.

The model part (:func:`model_info`) is computed from the model's folder — or, for a model that was
never saved, from its parameters — with the hashing and the comparison shared with the bundled
engine (:mod:`kvstore.engine.fingerprint`). :func:`session_tier` reads the ``tier=`` argument of
``save``/``restore`` through the one tier vocabulary (:mod:`kvstore.tiers`).
"""

from __future__ import annotations

import hashlib
import os
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvstore import tiers
from kvstore.engine.fingerprint import (
    ATTENTION_VARIANT,
    expected_fingerprint,
    tokenizer_hashes,
    weight_files,
    weights_hash,
)
from kvstore.engine.hf.layout import check_cache_layout
from kvstore.errors import InvalidRequest

if TYPE_CHECKING:  # the session store needs lmdb; the row helpers must import without it
    from kvstore.store import Fingerprint, ModelInfo

__all__ = ["model_info", "session_fingerprint", "session_tier"]

_tensor_hashes: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_model_infos: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def session_tier(tier: tiers.Tier | str | None) -> tiers.Tier | None:
    """The file tier named by ``tier`` (a Tier or a :mod:`kvstore.tiers` name), None for None.

    Old spellings (``v1``, ``v2``, ``v3``, ``tq-int4``, ``polar``, ``polar-3``, ...) are read with a
    ``TierSpellingDeprecated`` warning that points at the caller of ``save``/``restore``.

    Raises
    ------
    UnknownTier
        A name that is not in the vocabulary.
    InvalidRequest
        A cache-only tier (``bf16``, ``q8``): sessions hold file tiers.
    """
    if tier is None:
        return None
    if isinstance(tier, tiers.Tier):
        chosen = tier
    else:
        chosen, note = tiers.resolve(tier)
        if note is not None:
            warnings.warn(note, tiers.TierSpellingDeprecated, stacklevel=3)  # the caller of the public function
    if not chosen.in_file:
        raise InvalidRequest(
            f"tier {chosen.name!r} is a cache tier; a session stores a file tier: {', '.join(tiers.names(in_file=True))}"
        )
    return chosen


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


def model_info(model, *, tokenizer_folder: str | os.PathLike | None = None) -> "ModelInfo":
    """The model part of a session's fingerprint (memoized per model and tokenizer folder).

    Parameters
    ----------
    model : a transformers model (``from_pretrained`` folder, hub model, or built in memory)
    tokenizer_folder : where the tokenizer files are, when not beside the weights

    Returns
    -------
    ModelInfo — ``name``, ``revision``, ``weights_hash`` (``blake2b:`` over the folder's weight files,
    or ``tensors:blake2b:`` over the parameters), ``tokenizer_hash``, ``chat_template_hash`` and
    ``attention_variant`` :data:`~kvstore.engine.fingerprint.ATTENTION_VARIANT`.
    """
    from kvstore.store import ModelInfo

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


def session_fingerprint(model, tier: tiers.Tier, given: "ModelInfo | dict | None") -> "Fingerprint":
    """The fingerprint a session of ``model`` in ``tier`` must have (``given``: the model part to use,
    default :func:`model_info` of ``model``)."""
    from kvstore.store import ModelInfo

    info = ModelInfo.from_dict(given) if given is not None else model_info(model)
    return expected_fingerprint(info, check_cache_layout(model).geometry, tier)
