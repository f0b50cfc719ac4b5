"""Text in and out: load a model folder's tokenizer, or write a byte-level one for a random model.

A random model has no trained vocabulary, but a byte-level tokenizer (one token per UTF-8 byte,
plus the config's special tokens at their ids) still gives it a text interface: any string
encodes, any id sequence decodes. ``transformers.AutoTokenizer`` loads the folder as usual.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvstore.engine.config import ModelConfig
from kvstore.engine.errors import ModelConfigError

__all__ = ["load_tokenizer", "write_byte_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(folder: str | os.PathLike):
    """``transformers.AutoTokenizer`` for the folder, or None when the folder carries no tokenizer."""
    if not has_tokenizer(folder):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def write_byte_tokenizer(folder: str | os.PathLike, cfg: ModelConfig) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json``: 256 byte tokens and ``<bos>``/``<eos>``.

    Byte tokens take the lowest ids not used by the config's special tokens.

    Raises
    ------
    ModelConfigError
        When the vocabulary is too small to hold 256 bytes and the special tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials: dict[str, int] = {}
    if cfg.bos_token_id is not None:
        specials["<bos>"] = cfg.bos_token_id
    for i, eos in enumerate(cfg.eos_token_id):
        specials["<eos>" if i == 0 else f"<eos{i}>"] = eos
    taken = set(specials.values())
    if cfg.vocab_size < 256 + len(taken):
        raise ModelConfigError(f"a byte tokenizer needs {256 + len(taken)} ids, the vocabulary has {cfg.vocab_size}")
    free = (i for i in range(cfg.vocab_size) if i not in taken)
    vocab = {symbol: next(free) for symbol in sorted(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update(specials)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in specials])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings}
    if "<bos>" in specials:
        config["bos_token"] = "<bos>"
    if "<eos>" in specials:
        config["eos_token"] = "<eos>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder
