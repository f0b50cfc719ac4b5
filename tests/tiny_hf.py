"""Tiny transformers DeepSeek-V3 models of the engine's presets, shared by the oracle (tests/engine)
and the interop (tests/hf) suites.

transformers initializes norms to 1 and the score-correction biases to 0; both are perturbed so
that a misplaced norm weight, an ignored bias or a misplaced cache row changes the logits.
"""

from __future__ import annotations

import torch

from kvstore.engine.config import preset


def hf_config(name: str = "tiny", **changes):
    """The transformers ``DeepseekV3Config`` of one of our presets, with ``changes`` applied."""
    from transformers import DeepseekV3Config

    fields = preset(name).to_hf_dict()
    for key in ("architectures", "model_type", "dtype"):
        fields.pop(key)
    fields.update(changes)
    return DeepseekV3Config(**fields)


def build_hf_model(name: str = "tiny", seed: int = 0, **changes):
    """A transformers DeepseekV3ForCausalLM of preset ``name`` with deterministic random weights,
    norms and routing biases (eval mode, f32)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(name, **changes)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * 0.1)
    return model
