#!/usr/bin/env bash
# This round's H200 figures in one device call (run with carry [".whl"]: the service's wheels):
#   1. the device-restore tests on CUDA;
#   2. resume from rows in host memory beside restore_file, every tier, 1k/8k/32k (issue 43 target 4),
#      and through a plaintext and an encrypted store (issue 41: first token at 32k, encrypted vs not);
#   3. the HTTP figures of issue 37 (bench/serve_h200.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
# the service's wheels; the clients' (anyio, httpx, click, ...) only where the machine lacks them
common="anyio h11 click httpx httpcore sniffio idna certifi"
wheels=$(ls .whl/*.whl | grep -v -E "/($(echo $common | tr ' ' '|'))-")
for m in $common; do python3 -c "import $m" 2>/dev/null || wheels="$wheels $(ls .whl/$m-*.whl)"; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/kvstore-h200}"
mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_device_restore.py 2>&1 | tail -n 3
timeout "${RESUME_S:-220}" python3 bench/engine_resume.py --device cuda --preset v2-lite --workdir /tmp/kv-engine \
    --lengths ${LENGTHS:-1024 8192 32768} --tiers f32 fp8 int4 --rows --store --encrypt > "$OUT/engine.log" 2>&1
sed -n '/^Resume through a session/,$p' "$OUT/engine.log" | head -n 40; tail -n 3 "$OUT/engine.log"
rm -rf /tmp/kv-engine
[ "${SERVE:-1}" = 1 ] && timeout "${SERVE_S:-330}" bench/serve_h200.sh
