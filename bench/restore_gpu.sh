#!/usr/bin/env bash
# Issue 41 on a CUDA machine, in one call: the device restore's CUDA tests, the reads and restores
# of a plaintext and an encrypted session by thread count (bench/sealed_read.py), and the first
# token after a resume at 32k through a plaintext and an encrypted store, ROUNDS rounds in one engine
# (each round: the plaintext store with its default reading threads, then the encrypted one with each
# of THREADS; the ratio is taken within a round, its median printed per column).
#   OUT=... [ROUNDS=5] [THREADS="4 8 16"] [TIERS="fp8 int4 f32"] [STAGES=8] bash bench/restore_gpu.sh
#   (needs .whl carried: bench/device_wheels.sh; STAGES: also the plaintext restore's parts apart,
#   with that many reading threads; READS=0 skips bench/sealed_read.py)
set -u
source bench/device_wheels.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_device_restore.py 2>&1 | tail -3
if [ "${READS:-1}" != 0 ]; then
    timeout "${READS_S:-150}" python3 bench/sealed_read.py --tokens 32768 --threads 8 16 --device cuda ${STAGES:+--stages $STAGES}
fi
timeout "${RESUME_S:-330}" python3 bench/engine_resume.py --device cuda --preset v2-lite --lengths 32768 \
    --tiers ${TIERS:-fp8 int4 f32} --store --encrypt --rounds "${ROUNDS:-5}" --sealed-threads ${THREADS:-4 8 16} |
    sed -n "/Resume through a session store/,/^Decode after/p"
