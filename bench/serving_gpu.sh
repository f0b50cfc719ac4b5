#!/usr/bin/env bash
# Issue 37's GPU figures that packing prompts left to measure, in one device call (carry [".whl"]):
#   1. the CUDA tests of the packed prefill, the scheduler and the connector's step gather;
#   2. bench/packed_prefill.py: prompts one after another vs packed, with the yardstick of a
#      prompt prefilled in one chunk vs two (what rounding alone moves on bf16 random layers), and
#      a short message after 32k cached rows, first call vs again per size (the routed experts'
#      kernel builds; a server's start now runs them, Scheduler.warm);
#   3. bench/serve_h200.sh with the long session first: the HTTP figures with the server's CPU per
#      token, and the 32k resume's first token after the prefill warm-up.
# Usage: OUT=/some/dir bash bench/serving_gpu.sh      (about 8 minutes on an H100)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_wheels.sh
OUT="${OUT:-/tmp/kvstore-gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_packed_prefill.py \
    tests/engine/test_scheduler.py tests/vllm/test_paged_worker.py -k "packed or share or joining or padded or saved or prompt" \
    2>&1 | tail -n 2
timeout 120 python3 bench/packed_prefill.py --device cuda --preset v2-lite --sessions 1 4 16 64 --prompt 32 \
    --after 32768 2>&1 | tee "$OUT/packed.log" | tail -n 14
LONG_FIRST=1 timeout "${SERVE_S:-330}" bash bench/serve_h200.sh 2>&1 | grep -v "^INFO\|^WARNING\|warn" | tail -n 12
