#!/usr/bin/env bash
# Issue 38 item 6 on a GPU machine without vLLM: the connector's worker side on real CUDA tensors
# in vLLM's MLA paged layout (tests/vllm/test_paged_worker.py: rows saved from CUDA are the CPU
# path's bytes and load back exactly), then the synthetic V2-Lite-shaped step with and without the
# connector's calls (bench/vllm_gpu_step.py). Run from a device call with carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_wheels.sh
python3 -m pytest -q -p no:cacheprovider tests/vllm/test_paged_worker.py 2>&1 | tail -n 4
python3 bench/vllm_gpu_step.py --tokens ${TOKENS:-512 2048} --load ${LOAD:-2048 8192} --steps ${STEPS:-30} --where /tmp
