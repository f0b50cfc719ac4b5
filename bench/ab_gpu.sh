#!/usr/bin/env bash
# Issue 43: a candidate switch of the compiled decode step checked and measured in one device call:
# the GPU tests that select it (-k TESTS_K), with GEMV=1 the projection kernel's own bench
# (bench/engine_gemv.py --sweep), then bench/engine_ab.py against the defaults, one session at 1k
# and 32k per tier and BATCH sessions together (lengths spread over 1k..32k).
#   OUT=... [VARIANT="model.COMBO_KERNELS=1"] [TESTS_K="combo"] [TIERS="fp8 int4"] [BATCH="16 64"] \
#     [MORE='--variant "inductor.aggressive_fusion=1"'] [GEMV=1] bash bench/ab_gpu.sh
# e.g. the projection kernels: TESTS_K=gemv GEMV=1 VARIANT=products.GEMV_KERNELS=1 BATCH= TIERS=fp8
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
        tests/engine/test_graphs.py tests/engine/test_gemv_kernels.py -k "${TESTS_K:-combo}" 2>&1 \
        | tee "$OUT/tests.log" | tail -n 6
fi
if [ -n "${GEMV:-}" ]; then
    echo "== the projection kernel against inductor's reduction and cuBLAS ($(date +%T))"
    timeout "${GEMV_S:-150}" python3 bench/engine_gemv.py --sweep 2>&1 | quiet | tee "$OUT/gemv.log"
fi
echo "== A/B ($(date +%T))"
eval "timeout ${AB_S:-400} python3 bench/engine_ab.py --device cuda --preset v2-lite --tiers ${TIERS:-fp8 int4} \
    --lengths ${LENGTHS:-1024 32768} --batch ${BATCH-16 64} --rounds ${ROUNDS:-7} --tokens ${TOKENS:-64} \
    --skip-unknown --variant '' --variant '${VARIANT:-model.COMBO_KERNELS=1}' ${MORE:-}" 2>&1 | quiet | tee "$OUT/ab.log"
echo "== done ($(date +%T))"
