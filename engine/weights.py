"""Weights: load a Hugging Face model folder, initialize a random model, write a model folder.

A model folder is ``config.json`` + ``*.safetensors`` (one file, or shards listed in
``model.safetensors.index.json``) with transformers' parameter names. Routed experts are read
either per expert (``mlp.experts.7.gate_proj.weight``, what ``save_pretrained`` writes) or fused
(``mlp.experts.gate_up_proj`` [E, 2I, hidden] and ``mlp.experts.down_proj`` [E, hidden, I], the
in-memory layout of transformers >= 5), and stacked per layer.

Random initialization is deterministic: every tensor draws from its own generator, seeded from
``(seed, name)``, so a tensor's values do not depend on the others' shapes or order. The draw
runs on the target device; the same seed gives the same model on the same kind of device.

Examples
--------
>>> from kvstore.engine.config import preset
>>> model = random_model(preset("tiny"), seed=1)
>>> model.model.layers[1].mlp.experts.gate_proj.shape
torch.Size([8, 64, 128])
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

import torch

from kvstore.engine.config import ModelConfig, preset
from kvstore.engine.errors import WeightsError
from kvstore.engine.model import MLAForCausalLM
from kvstore.engine.rotary import Rotary

__all__ = ["load_model", "random_model", "save_model", "write_random_model"]

_EXPERT_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# Kept in f32 whatever the model dtype (transformers' _keep_in_fp32_modules_strict).
_F32_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise WeightsError(f"unknown dtype {dtype!r} (known: {', '.join(_DTYPES)})") from None


def _target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(_F32_SUFFIXES) else dtype


def _skeleton(cfg: ModelConfig) -> MLAForCausalLM:
    with torch.device("meta"):
        return MLAForCausalLM(cfg)


def _finish(model: MLAForCausalLM, device: torch.device) -> MLAForCausalLM:
    """Rebuild the non-persistent rope table on the device and re-tie the head."""
    model.model.rotary = Rotary(model.config).to(device)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


# -- loading -----------------------------------------------------------------------------------------


class _Checkpoint:
    """Name -> file index over the safetensors files of a folder, opened lazily."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self._safe_open = safe_open
        index_path = folder / "model.safetensors.index.json"
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise WeightsError(f"{index_path} is not a safetensors index: {exc}") from exc
            self.file_of = {name: folder / file for name, file in weight_map.items()}
            missing = sorted({str(p) for p in self.file_of.values() if not p.is_file()})
            if missing:
                raise WeightsError(f"the shard index names files that are missing: {', '.join(missing[:3])}")
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise WeightsError(f"no *.safetensors files in {folder}")
            self.file_of = {}
            for path in files:
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():
                        self.file_of[name] = path
        self._handles: dict[Path, Any] = {}  # open safetensors handles (safe_open's type is not exported)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> torch.Tensor:
        path = self.file_of[name]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._safe_open(str(path), framework="pt")
            handle.__enter__()
            self._handles[path] = handle
        return handle.get_tensor(name)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def _expert_tensor(ckpt: _Checkpoint, prefix: str, which: str, n_experts: int) -> torch.Tensor:
    """Stack one layer's routed-expert matrices: per-expert names, or the fused layout."""
    per_expert = [f"{prefix}.{e}.{which}.weight" for e in range(n_experts)]
    if all(name in ckpt for name in per_expert):
        return torch.stack([ckpt.get(name) for name in per_expert])
    if which in ("gate_proj", "up_proj") and f"{prefix}.gate_up_proj" in ckpt:
        fused = ckpt.get(f"{prefix}.gate_up_proj")  # [E, 2I, hidden]: gate rows first
        half = fused.shape[1] // 2
        return (fused[:, :half] if which == "gate_proj" else fused[:, half:]).contiguous()
    if which == "down_proj" and f"{prefix}.down_proj" in ckpt:
        return ckpt.get(f"{prefix}.down_proj")
    missing = [name for name in per_expert if name not in ckpt]
    raise WeightsError(f"routed experts of {prefix} are missing ({missing[0]} and {len(missing) - 1} more)")


def load_model(
    folder: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None
) -> MLAForCausalLM:
    """Load a DeepSeek-V3-architecture model folder onto ``device`` in ``dtype`` (default f32).

    Weights of layers past ``num_hidden_layers`` (multi-token-prediction modules) are not used;
    their names are kept in ``model.unused_weights``.

    Raises
    ------
    ModelConfigError
        The config is missing or describes a model the engine cannot run.
    WeightsError
        A tensor is missing or has the wrong shape.
    """
    folder = Path(folder)
    cfg = ModelConfig.from_file(folder)
    device = torch.device(device)
    dtype = _dtype(dtype)
    model = _skeleton(cfg)
    expected = model.state_dict()
    ckpt = _Checkpoint(folder)
    state: dict[str, torch.Tensor] = {}
    try:
        for name, meta in expected.items():
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the head
            stacked = _EXPERT_STACKED.match(name)
            if stacked:
                tensor = _expert_tensor(ckpt, stacked.group(1), stacked.group(2), cfg.n_routed_experts)
            elif name in ckpt:
                tensor = ckpt.get(name)
            else:
                raise WeightsError(f"tensor {name} is missing from {folder}")
            if tuple(tensor.shape) != tuple(meta.shape):
                raise WeightsError(
                    f"tensor {name} has shape {tuple(tensor.shape)}, the config implies {tuple(meta.shape)}"
                )
            state[name] = tensor.to(device=device, dtype=_target_dtype(name, dtype))
    finally:
        ckpt.close()
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    used = set(expected)
    model.unused_weights = sorted(
        name for name in ckpt.file_of if name not in used and not _is_expert_source(name, cfg.n_layers)
    )
    return _finish(model, device)


def _is_expert_source(name: str, n_layers: int) -> bool:
    """A per-expert or fused routed-expert tensor of a layer the model has (read into a stack)."""
    layer = _LAYER_INDEX.match(name)
    return ".mlp.experts." in name and layer is not None and int(layer.group(1)) < n_layers


# -- random initialization -------------------------------------------------------------------------------


def _tensor_seed(seed: int, name: str) -> int:
    return (int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) & 0x7FFFFFFFFFFFFFFF


def random_model(
    cfg: ModelConfig,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
) -> MLAForCausalLM:
    """A model with deterministic random weights.

    Matrices ~ N(0, ``initializer_range``); norm weights 1; router score-correction biases are
    drawn small (N(0, 0.01)) so the bias path of the routing is exercised.
    """
    device = torch.device(device)
    dtype = _dtype(dtype)
    model = _skeleton(cfg)
    state = {}
    for name, meta in model.state_dict().items():
        target = _target_dtype(name, dtype)
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            state[name] = torch.ones(meta.shape, dtype=target, device=device)
            continue
        generator = torch.Generator(device=device)
        generator.manual_seed(_tensor_seed(seed, name))
        std = 0.01 if name.endswith("e_score_correction_bias") else cfg.initializer_range
        values = torch.empty(meta.shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator)
        state[name] = values.to(target)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.unused_weights = []
    return _finish(model, device)


# -- writing ---------------------------------------------------------------------------------------------


def _hf_tensors(model: MLAForCausalLM, dtype: torch.dtype):
    """(name, tensor) in transformers' checkpoint layout: experts written one by one."""
    cfg = model.config
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        target = _target_dtype(name, dtype)
        stacked = _EXPERT_STACKED.match(name)
        if stacked:
            for expert in range(tensor.shape[0]):
                # clone: safetensors refuses tensors that share storage
                yield (
                    f"{stacked.group(1)}.{expert}.{stacked.group(2)}.weight",
                    tensor[expert].to(target).contiguous().clone(),
                )
        else:
            yield name, tensor.to(target).contiguous()


def save_model(
    model: MLAForCausalLM,
    folder: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Write ``model`` as a Hugging Face folder: ``config.json``, ``generation_config.json`` and
    safetensors (sharded with ``model.safetensors.index.json`` past ``max_shard_bytes``)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = _dtype(dtype) if dtype is not None else model.dtype
    dtype_name = {v: k for k, v in _DTYPES.items()}[dtype]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in _hf_tensors(model, dtype):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.cpu()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            for name, tensor in shard.items():
                weight_map[name] = file
                total += tensor.numel() * tensor.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    config = model.config.to_hf_dict()
    config["dtype"] = dtype_name
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    generation = {"bos_token_id": model.config.bos_token_id, "eos_token_id": list(model.config.eos_token_id)}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return folder


def write_random_model(
    folder: str | os.PathLike,
    config: ModelConfig | str = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    tokenizer: bool = True,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Create a model folder with random weights (loadable by ``transformers`` and by :func:`load_model`).

    Parameters
    ----------
    folder : where to write (created)
    config : a ModelConfig or a preset name (``tiny``, ``tiny-yarn``, ``v2-lite``)
    seed : weights seed
    dtype : stored dtype (default f32)
    tokenizer : also write a byte-level tokenizer, so the model takes and returns text
    """
    cfg = preset(config) if isinstance(config, str) else config
    model = random_model(cfg, seed=seed, dtype=_dtype(dtype))
    save_model(model, folder, dtype=_dtype(dtype), max_shard_bytes=max_shard_bytes)
    if tokenizer:
        from kvstore.engine.tokenizer import write_byte_tokenizer

        write_byte_tokenizer(folder, cfg)
    return Path(folder)
