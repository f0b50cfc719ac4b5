#!/usr/bin/env bash
# Where an encrypted restore's reading threads lose their time (issue 41): py-spy samples
# bench/sealed_read.py reading a 32k-token session with 8 threads on the device's host, once with
# every sample and once with only the samples holding the GIL, as collapsed stacks in $OUT
# (sealed-all.txt, sealed-gil.txt) beside the bench's own table. Run from a device call with
# carry [".whl"]: py-spy's wheel travels there with the service's.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_wheels.sh
OUT="${OUT:-/tmp/kvstore-h200}"
mkdir -p "$OUT"
for mode in all gil; do
    flags=(record -r 250 -f raw --threads -o "$OUT/sealed-$mode.txt")
    [ "$mode" = gil ] && flags+=(--gil)
    /tmp/site/bin/py-spy "${flags[@]}" -- python3 bench/sealed_read.py --tokens 32768 --threads 8 --where /tmp \
        > "$OUT/sealed-$mode.log" 2>&1
    tail -n 6 "$OUT/sealed-$mode.log"
done
