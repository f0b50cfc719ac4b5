#!/usr/bin/env bash
# Issue 41 on a CUDA machine, in one call: the device restore's CUDA tests, the reads and restores
# of a plaintext and an encrypted session by thread count (bench/sealed_read.py), and
# the first token after a resume through a plaintext and an encrypted store, with the encrypted
# journal's ranges mapped (the default) and read into a buffer first (kvstore/sealed.py MAP_BYTES).
#   OUT=... [STAGES=8] [THREADS="12 16"] bash bench/restore_gpu.sh   (needs .whl carried: bench/device_wheels.sh;
#   THREADS: the first token again with those reading threads; STAGES:
#   also the plaintext restore's parts apart, with that many reading threads)
set -u
source bench/device_wheels.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_device_restore.py 2>&1 | tail -3
timeout "${READS_S:-150}" python3 bench/sealed_read.py --tokens 32768 --threads 8 16 --device cuda ${STAGES:+--stages $STAGES}
for mapped in 1 0; do  # encrypted ranges decrypted from a mapping of the journal (the default), or read first
    echo "## kvstore/sealed.py: ranges mapped = $mapped"
    timeout "${RESUME_S:-120}" python3 -c "import sys; sys.path.insert(0, 'bench'); import kvstore.sealed as s; s.MAP_BYTES = s.MAP_BYTES if $mapped else 1 << 62
import engine_resume; sys.exit(engine_resume.main(sys.argv[1:]))" \
        --device cuda --preset v2-lite --lengths 32768 --tiers fp8 --store --encrypt |
        sed -n "/Resume through a session store/,/^Decode after/p"
done
for threads in ${THREADS:-16}; do  # the same run with other reading-thread counts (default: 8 when decrypting)
    echo "## read threads = $threads"
    timeout "${RESUME_S:-120}" python3 bench/engine_resume.py --device cuda --preset v2-lite --lengths 32768 \
        --tiers fp8 --store --encrypt --read-threads "$threads" | sed -n "/Resume through a session store/,/^Decode after/p"
done
