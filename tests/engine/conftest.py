"""Engine fixtures: tiny DeepSeek-V3 models built and saved by the real ``transformers``."""

from __future__ import annotations

import pytest
import torch

from kvstore.engine.config import preset

# One geometry without q LoRA and with plain rope, one with q LoRA and yarn rope (mscale), and the
# first at DeepSeek's latent widths (kv_lora 512, qk_rope 64: the CUDA kernels' widths).
ORACLE_PRESETS = ("tiny", "tiny-yarn", "tiny-512")


def hf_config(name: str):
    """The transformers ``DeepseekV3Config`` of one of our presets."""
    from transformers import DeepseekV3Config

    fields = preset(name).to_hf_dict()
    for key in ("architectures", "model_type", "dtype"):
        fields.pop(key)
    return DeepseekV3Config(**fields)


def build_hf_model(name: str, seed: int = 0):
    """A transformers DeepseekV3ForCausalLM with random weights, norms and routing biases.

    transformers initializes norms to 1 and the score-correction biases to 0; both are perturbed
    so that a misplaced norm weight or an ignored bias changes the logits.
    """
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(name)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * 0.1)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{preset: (transformers model, folder written by save_pretrained)}."""
    out = {}
    for name in ORACLE_PRESETS:
        model = build_hf_model(name)
        folder = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(folder)
        out[name] = (model, folder)
    return out


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models are dominated by per-op overhead: one intra-op thread is faster and steadier
    on a shared CI box. The previous setting is restored for the rest of the session."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
