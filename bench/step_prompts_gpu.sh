#!/usr/bin/env bash
# Prompts in the step on a GPU, in one device call (carry [".whl"]): the CUDA test of prompts riding
# graph replays by default, then the HTTP figures of bench/serve_bench.py twice on one random
# V2-Lite-geometry model folder: the server's default on CUDA (prompts ride decode steps, 512
# tokens a step), with the 32k session's resume first, and with every prompt taking prefill
# forwards (--step-tokens 0). The GPU's memory in use is sampled every 4 s into $OUT/memory.txt.
# Usage: OUT=/some/dir bash bench/step_prompts_gpu.sh      (about 7 minutes on an H100)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_wheels.sh
OUT="${OUT:-/tmp/kvstore-gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_step_prompts.py -k cuda 2>&1 | tail -n 2
MODEL=/tmp/kvstore-v2-lite
timeout 120 python3 - "$MODEL" <<'PY'
import sys, time, torch
from pathlib import Path
from kvstore.engine.config import preset
from kvstore.engine.tokenizer import write_byte_tokenizer
from kvstore.engine.weights import random_model, save_model
began = time.perf_counter()
cfg = preset("v2-lite")
save_model(random_model(cfg, seed=0, device="cuda", dtype="bfloat16"), Path(sys.argv[1]), dtype="bfloat16")
write_byte_tokenizer(Path(sys.argv[1]), cfg)
print(f"a random v2-lite folder in {time.perf_counter() - began:.1f} s")
PY
run() {
    timeout "$1" python3 bench/serve_bench.py --model "$MODEL" --device cuda --dtype bfloat16 --tier fp8 \
        --clients ${CLIENTS:-16 64} --tokens 64 "${@:2}" 2>&1 | grep -v "^INFO\|^WARNING\|warn"
}
(while sleep 4; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' '; echo; done) \
    > "$OUT/memory.txt" 2>&1 &
sampler=$!
echo "## the default on CUDA: prompts riding decode steps (512 tokens a step)"
CLIENTS="${RIDING_CLIENTS:-1 4 16 64}" run 280 --long 32768 --long-first | tee "$OUT/riding.log"
echo "## every prompt in prefill forwards (--step-tokens 0)"
run 200 --long 0 --step-tokens 0 | tee "$OUT/forwards.log"
kill "$sampler"
