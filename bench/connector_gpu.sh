#!/usr/bin/env bash
# Issue 38 item 6 on a GPU machine without vLLM: the connector's worker side on real CUDA tensors
# in vLLM's MLA paged layout (tests/vllm/test_paged_worker.py: rows saved from CUDA are the CPU
# path's bytes and load back exactly), then the synthetic V2-Lite-shaped step with and without the
# connector's calls (bench/vllm_gpu_step.py): steps back to back as a busy server runs them (the
# writer saving beside them) with the cache's bf16 bits handed to the writer, the same with the
# rows widened to f32 first (the connector before), and with the writer settled before each step.
# Run from a device call with carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_wheels.sh
python3 -m pytest -q -p no:cacheprovider tests/vllm/test_paged_worker.py 2>&1 | tail -n 4
step() { timeout 240 python3 bench/vllm_gpu_step.py --tokens ${TOKENS:-512 2048} --steps ${STEPS:-30} --where /tmp "$@" 2>&1; }
echo "## back to back, bf16 bits to the writer"; step --load ${LOAD:-2048 8192} | tail -n +2
echo "## back to back, rows widened to f32 (before)"; step --load --widen | tail -n 2
echo "## the writer settled before each step"; step --load --settle | tail -n 2
