"""Engine fixtures: tiny DeepSeek-V3 models built and saved by the real ``transformers``."""

from __future__ import annotations

import pytest

from tiny_hf import build_hf_model
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

# One geometry without q LoRA and with plain rope, one with q LoRA and yarn rope (mscale), and the
# first at DeepSeek's latent widths (kv_lora 512, qk_rope 64: the CUDA kernels' widths).
ORACLE_PRESETS = ("tiny", "tiny-yarn", "tiny-512")


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
