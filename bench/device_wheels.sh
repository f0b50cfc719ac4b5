#!/usr/bin/env bash
# Install the service's wheels from .whl/ into /tmp/site on the device machine (it reaches no
# registry; docs/GPU.md says how to fetch them); the clients' (anyio, httpx, click, ...) only where
# the machine lacks them, so its own packages (transformers' httpx) are left as they are.
# Sourced by bench/h200_round.sh and bench/serve_h200.sh; sets PYTHONPATH.
common="anyio h11 click httpx httpcore sniffio idna certifi"
wheels=$(ls .whl/*.whl | grep -v -E "/($(echo $common | tr ' ' '|'))-")
for m in $common; do python3 -c "import $m" 2>/dev/null || wheels="$wheels $(ls .whl/$m-*.whl)"; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
