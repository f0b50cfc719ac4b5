#!/usr/bin/env bash
# Where the launch-bound 512-token saving step loses its time to the vLLM connector (issue 38), in
# one device call (carry [".whl"]): bench/vllm_gpu_step.py as a busy server runs it (steps back to
# back, the writer saving beside them), then with the writer settled before each step (the
# connector's calls alone), then py-spy over the first form with only the samples holding the GIL,
# one stack per thread, as collapsed stacks in $OUT/connector-gil.txt: which thread the step's
# launches wait for, and what it does.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_wheels.sh
OUT="${OUT:-/tmp/kvstore-gpu}"
mkdir -p "$OUT"
step() { timeout 240 python3 bench/vllm_gpu_step.py --tokens 512 2048 --load --steps "${STEPS:-30}" --where /tmp "$@" 2>&1; }
echo "## steps back to back"; step | tail -n 3
echo "## the writer settled before each step"; step --settle | tail -n 2
/tmp/site/bin/py-spy record -r 500 -f raw --threads --gil -o "$OUT/connector-gil.txt" -- \
    python3 bench/vllm_gpu_step.py --tokens 512 --load --steps 60 --where /tmp > "$OUT/connector-gil.log" 2>&1
tail -n 1 "$OUT/connector-gil.log"
