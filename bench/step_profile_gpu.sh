#!/usr/bin/env bash
# Issue 43's decode figures in one device call: the CUDA tests the step's kernels touch; the experts'
# kernels with the shared experts in them against apart (and their tiles); with ENCODE=1 a layer's cache
# write, one kernel against the torch twins; the compiled step per tier (once per VARIANTS entry)
# at 1k and 32k and 16 sessions (tok/s, the HBM bound, where each step's device time goes, the
# profiler's top kernels); with BASE=dir, the same for fp8 on another tree (a checkout of the
# commit before, `git archive`d into an ignored folder and carried) in the same call.
# Usage (device machine, wheels in .whl/): OUT=/some/dir [BASE=.base] bash bench/step_profile_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_wheels.sh
OUT="${OUT:-/tmp/kvstore-step}"
mkdir -p "$OUT"
quiet() { grep -v "^USDT\|^STAGE\|^\[W\|SyncActivityProfiler"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [ -n "${TESTS-x}" ]; then
echo "== gpu tests ($(date +%T))"
timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/engine/test_graphs.py \
    tests/engine/test_expert_kernels.py tests/vllm/test_paged_worker.py tests/vllm/test_hot_tier.py \
    tests/engine/test_device_restore.py} 2>&1 | tee "$OUT/tests.log" | tail -n 8
fi
if [ -n "${EXPERTS-x}" ]; then
echo "== experts: shared in the kernels vs apart ($(date +%T))"
timeout "${EXPERTS_S:-150}" python3 bench/engine_experts.py --shared ${EXPERTS:---sweep} 2>&1 | tee "$OUT/experts.log"
fi
if [ -n "${ENCODE:-}" ]; then
echo "== a layer's cache write: one kernel vs the twins ($(date +%T))"
timeout "${ENCODE_S:-120}" python3 bench/engine_encode.py 2>&1 | tee "$OUT/encode.log" | quiet
fi
# VARIANTS: ';'-separated sets of extra engine_decode arguments, each its own decode rows in this call
# (e.g. VARIANTS=";--torch-encode;--torch-encode --reduced-tokens 0 --layer-regions": the default,
# one switch off, all of them off)
IFS=';' read -r -a variants <<< "${VARIANTS:-}"
[ ${#variants[@]} -eq 0 ] && variants=("")
[[ "${VARIANTS:-}" == *";" ]] && variants+=("")
i=0
for variant in "${variants[@]}"; do
echo "== decode, one session and 16 [${variant:-default}] ($(date +%T))"
timeout "${DECODE_S:-300}" python3 bench/engine_decode.py --device cuda --preset v2-lite --lengths ${LENGTHS:-1024 32768} \
    --tiers ${TIERS:-fp8 int4 f32} --tokens 32 --batch 16 --modes compiled --breakdown $variant \
    ${PROFILE---profile --profile-rows 30} ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode_$i.log" | quiet
i=$((i + 1))
done
if [ -n "${BASE:-}" ]; then
echo "== decode on $BASE, fp8 ($(date +%T))"
PYTHONPATH="$PWD/$BASE:/tmp/site" timeout "${BASE_S:-150}" python3 "$BASE/bench/engine_decode.py" --device cuda \
    --preset v2-lite --lengths ${LENGTHS:-1024 32768} --tiers ${BASE_TIERS:-fp8} --tokens 32 --batch 16 --modes compiled \
    --breakdown 2>&1 | tee "$OUT/decode_base.log" | quiet
fi
if [ -n "${BATCH64:-}" ]; then
for tree in . ${BASE:-}; do
echo "== decode on $tree, 64 sessions, 1k..32k ($(date +%T))"
PYTHONPATH="$PWD/$tree:/tmp/site" timeout "${BATCH64_S:-150}" python3 "$tree/bench/engine_decode.py" --device cuda \
    --preset v2-lite --tiers fp8 --tokens ${BATCH64_TOKENS:-16} --batch 64 --batch-only --modes compiled --breakdown 2>&1 \
    | tee "$OUT/decode64_$(basename "$tree" | tr -d .).log" | quiet
done
fi
echo "== done ($(date +%T))"
