#!/usr/bin/env bash
# Issue 43: a candidate switch of the compiled decode step checked and measured in one device call:
# the GPU tests that select it (-k TESTS_K), then bench/engine_ab.py against the defaults, one
# session at 1k and 32k per tier and BATCH sessions together (lengths spread over 1k..32k; with 64,
# each variant's engine's own batch pool does not fit an 80 GB card beside the other's: time them
# with bench/engine_decode.py --batch 64 --batch-only, runs alternated).
#   OUT=... [VARIANT="model.COMBO_KERNELS=0"] [TESTS_K="combo"] [TIERS="fp8 int4"] [BATCH="16"] \
#     [MORE='--variant "inductor.aggressive_fusion=1"'] bash bench/ab_gpu.sh
# (needs .whl carried: bench/device_wheels.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_wheels.sh
OUT="${OUT:-/tmp/kvstore-ab}"
mkdir -p "$OUT"
quiet() { grep -v "^USDT\|^STAGE\|^\[W\|UserWarning\|_warn_once\|warnings.warn"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [ -n "${TESTS_K-combo}" ]; then
    echo "== gpu tests -k ${TESTS_K:-combo} ($(date +%T))"
    timeout "${TESTS_S:-170}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu.py \
        tests/engine/test_graphs.py -k "${TESTS_K:-combo}" 2>&1 \
        | tee "$OUT/tests.log" | tail -n 6
fi
echo "== A/B ($(date +%T))"
eval "timeout ${AB_S:-400} python3 bench/engine_ab.py --device cuda --preset v2-lite --tiers ${TIERS:-fp8 int4} \
    --lengths ${LENGTHS:-1024 32768} --batch ${BATCH-16} --rounds ${ROUNDS:-7} --tokens ${TOKENS:-64} \
    --skip-unknown --variant '' --variant '${VARIANT:-model.COMBO_KERNELS=0}' ${MORE:-}" 2>&1 | quiet | tee "$OUT/ab.log"
echo "== done ($(date +%T))"
