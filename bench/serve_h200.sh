#!/usr/bin/env bash
# Issue 37's HTTP figures on the H200 in one call: a real `kvstore serve --model` on a random
# V2-Lite-geometry model (bf16 weights drawn on the GPU, written as a model folder), fp8 cache,
# 1/4/16/64 streaming clients against Engine.generate_batch in process, and a 32k-row session
# resumed from its journal while 15 others decode (bench/serve_bench.py).
# The device machine lacks the service's packages (fastapi, uvicorn, pydantic, lmdb, zstandard,
# ...) and reaches no registry: their wheels travel in .whl/ (docs/GPU.md says how to fetch them).
# Usage: OUT=/some/dir bench/serve_h200.sh     (run from the device call with carry [".whl"])
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_wheels.sh
OUT="${OUT:-/tmp/kvstore-h200}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 bench/serve_bench.py --preset v2-lite --device cuda --dtype bfloat16 --tier fp8 \
    --clients ${CLIENTS:-1 4 16 64} --tokens ${TOKENS:-64} --long ${LONG:-32768} ${LONG_FIRST:+--long-first} 2>&1 | tee "$OUT/serve.log"
