#!/usr/bin/env bash
# Everything measured on an NVIDIA H200 in one call (the device machine has torch + cupy +
# transformers but not lmdb/fastapi/zstandard, and the project is not installed there):
#   1. the gpu-marked tests (kernels vs float64, engine on CUDA vs CPU token for token);
#   2. the kernel table (bench/gpu_attention.py), where the kernel's time goes (bench/gpu_stages.py)
#      and the f32/bf16 Triton kernels against the torch path (bench/gpu_dense.py);
#      the routed experts' Triton kernels against the grouped GEMM (bench/engine_experts.py);
#   3. engine resume vs re-prefill on a random-weight DeepSeek-V2-Lite-geometry model, and a resume from
#      rows in host memory (Engine.restore) beside restore_file;
#   4. transformers restore + first token vs re-running the prompt, same geometry;
#   5. decode speed: plain vs CUDA-graph steps per tier and context, 16 sessions batched, peak memory
#      (DECODE_ARGS=--breakdown adds where each row's step time goes: weight reads, attention, the
#      rest, gaps).
# Usage: OUT=/some/dir bench/run_h200.sh [engine-tiers...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/kvstore-h200}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"

STEPS="${STEPS:-tests kernels stages dense experts engine hf decode}"  # a subset fits one call's time limit
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo; echo "== $1 ($(date +%T))"; }

if want tests; then
step "gpu tests"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/engine/test_gpu.py tests/engine/test_graphs.py \
    tests/engine/test_batch.py tests/engine/test_device_restore.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
fi

if want kernels; then
step "kernel table"
python3 bench/gpu_attention.py --out "$OUT/kernels" 2>&1 | tee "$OUT/kernels.log" | tail -n 60
fi

if want stages; then
step "kernel stages (16 heads)"
python3 bench/gpu_stages.py --rows 32768,131072,1048576 2>&1 | tee "$OUT/stages.log"
fi

if want dense; then
step "f32 / bf16 kernels (Triton) vs the torch path"
python3 bench/gpu_dense.py 2>&1 | tee "$OUT/dense.log" | tail -n 16
fi

if want experts; then
step "routed experts: Triton decode kernels vs the grouped GEMM (V2-Lite and V3 geometry)"
python3 bench/engine_experts.py 2>&1 | tee "$OUT/experts.log" | tail -n 12
fi

if want engine; then
step "engine resume vs re-prefill (v2-lite, bf16)"
python3 bench/engine_resume.py --device cuda --preset v2-lite --workdir /tmp/kv-engine \
    --tiers ${ENGINE_TIERS:-f32 fp8 int4} --rows 2>&1 | tee "$OUT/engine.log" | tail -n 40
rm -rf /tmp/kv-engine
fi

if want hf; then
step "transformers restore vs re-run (v2-lite, bf16)"
python3 bench/hf_resume.py --device cuda --preset v2-lite --tiers v1,v2,int4 2>&1 | tee "$OUT/hf.log" | tail -n 30
fi
if want decode; then
step "engine decode: plain vs graphs, 1k/32k/128k, 16 sessions batched (v2-lite, bf16)"
python3 bench/engine_decode.py --device cuda --preset v2-lite --lengths 1024 32768 131072 \
    --tiers ${ENGINE_TIERS:-fp8 int4 f32} --tokens 32 --batch 16 ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" | tail -n 60
fi
step "done"
