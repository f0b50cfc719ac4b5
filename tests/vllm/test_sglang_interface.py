"""kvstore's SGLang backend made and called through SGLang's own classes (SGLang 0.5.23).

Each run is a new process of vLLM's venv's Python with SGLang's package on its path
(tests/vllm/setup_venv.sh unpacks it): SGLang's ``StorageBackendFactory`` makes the backend as
``--hicache-storage-backend dynamic`` does, from a real ``HiCacheStorageConfig``; keys are SGLang's
own page hashes of a token sequence; the calls are the cache controller's (tests/vllm/run_sglang.py).

1. ``write``: the generic path (``batch_set`` of flat host pages, ``batch_exists``, ``batch_get``)
   on a ``layer_first`` pool: every page stored and read back bit for bit.
2. ``reload``: a new process, ``interface_v1`` (pages by host index) on a ``page_first`` pool: the
   first process's pages are found and land in the new layout bit for bit.
3. ``other``: a new process of another model over the same store: nothing found, refusals counted.

Without vLLM's venv or SGLang's package these tests skip, except in CI (``KVSTORE_CI=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvstore import config

ROOT = Path(__file__).resolve().parents[2]
VENV = config.VLLM_VENV.get() or ROOT / ".vllm-venv"
PYTHON = VENV / "bin" / "python"
SGLANG = VENV / "sglang-0.5.23"
RUNNER = Path(__file__).resolve().parent / "run_sglang.py"

if not (PYTHON.exists() and (SGLANG / ".kvstore-sglang").exists()):
    if config.CI.get():
        raise RuntimeError(f"SGLang's package is missing at {SGLANG}: tests/vllm/setup_venv.sh unpacks it")
    pytest.skip("vLLM's venv with SGLang's package is missing (tests/vllm/setup_venv.sh)", allow_module_level=True)

TOKENS = np.random.default_rng(21).integers(0, 50_000, size=160).tolist()  # 10 pages of 16


def run(tmp: Path, **spec) -> dict:
    spec_path, out_path = tmp / "spec.json", tmp / "out.json"
    spec_path.write_text(json.dumps({"tokens": TOKENS, "seed": 4, **spec}))
    env = dict(os.environ, PYTHONPATH=str(SGLANG), TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [str(PYTHON), str(RUNNER), str(spec_path), str(out_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
        env=env,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-store") / "kv"


@pytest.fixture(scope="module")
def write(tmp_path_factory, store) -> dict:
    extra = {"store": str(store), "weights_hash": "sampled-blake2b:one"}
    return run(
        tmp_path_factory.mktemp("write"),
        extra=extra,
        model_name="tiny-mla",
        layout="layer_first",
        write=True,
        interface_v1=False,
    )


def test_sglangs_factory_makes_the_backend_and_pages_round_trip_bit_for_bit(write):
    assert write["base_is_sglangs"] and write["class"] == "kvstore.connectors.sglang.KVStoreHiCacheStorage"
    assert write["written"] is True and write["pages"] == 10
    assert write["hits"] == 10 and write["read"] == [True] * 10 and write["equal"] == [True] * 10
    counters = write["counters"]
    assert (counters["saves"], counters["saved_tokens"], counters["loads"]) == (10, 160, 10)
    assert counters["lookups"] == counters["hits"] + counters["misses"] == 10


def test_a_new_process_loads_the_pages_through_interface_v1_into_another_layout(tmp_path, store, write):
    extra = {"store": str(store), "weights_hash": "sampled-blake2b:one"}
    reload = run(tmp_path, extra=extra, model_name="tiny-mla", layout="page_first", write=False, interface_v1=True)
    assert reload["hits"] == 10 and reload["read"] == [True] * 10 and reload["equal"] == [True] * 10
    assert reload["counters"]["saves"] == 0 and reload["counters"]["loaded_tokens"] == 160


def test_another_models_process_finds_nothing_and_counts_the_refusal(tmp_path, store, write):
    extra = {"store": str(store), "weights_hash": "sampled-blake2b:two"}
    other = run(tmp_path, extra=extra, model_name="tiny-mla", layout="layer_first", write=False, interface_v1=False)
    assert other["hits"] == 0 and other["read"] == []
    counters = other["counters"]
    assert (counters["lookups"], counters["misses"], counters["refused"], counters["loads"]) == (1, 1, 1, 0)
