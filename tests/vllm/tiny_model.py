"""A tiny random DeepSeek-V3 model folder that vLLM's CPU backend serves, for the connector tests.

vLLM's CPU MLA kernel needs ``kv_lora_rank=512`` and ``qk_rope_head_dim=64`` (block size 16); the
rest is as small as loads fast. Weights are float32 (random bf16 weights give near-tied logits, so
two equal runs could pick different tokens). The tokenizer is a byte-level BPE trained with
``tokenizers`` on a fixed text, so the folder needs nothing from a hub.

Run as ``python tiny_model.py OUT [--seed N]`` (with transformers and tokenizers installed, e.g. in
vLLM's venv) or call :func:`make_model`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB_SIZE = 512
N_LAYERS = 2  # one dense layer, one MoE layer
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
MAX_POSITIONS = 4096

# Fixed training text for the tokenizer: any text works, the merges only need to be deterministic.
_TEXT = (
    "the quick brown fox jumps over the lazy dog. a store keeps the latent rows of every token "
    "so that a conversation resumes without reading its prompt again. "
) * 20


def model_config(seed: int) -> dict:
    """The DeepseekV3Config fields of the tiny model (``seed`` is not a field; it only names the weights)."""
    del seed
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "q_lora_rank": 64,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "max_position_embeddings": MAX_POSITIONS,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }


def make_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer of at most :data:`VOCAB_SIZE` ids, saved as transformers files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_TEXT], trainer=trainer)
    if tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"the tokenizer has {tokenizer.get_vocab_size()} ids, the model {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def make_model(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny model (config, float32 safetensors, tokenizer) to ``folder``; returns it."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = DeepseekV3Config(**model_config(seed))
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # transformers initializes norms to 1 and routing biases to 0: perturb them so every
        # weight matters, and widen the logits so greedy picks are far from ties
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    # vLLM reads the dtype from the config: keep float32 whatever the transformers version wrote
    config_path = folder / "config.json"
    saved = json.loads(config_path.read_text())
    saved["torch_dtype"] = "float32"
    saved["dtype"] = "float32"
    config_path.write_text(json.dumps(saved, indent=2))
    make_tokenizer(folder)
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_model(args.out, args.seed))
