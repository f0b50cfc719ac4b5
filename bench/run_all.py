"""Run every CPU benchmark of BENCHMARKS.md in turn and print each one's table (``make bench``).

    python bench/run_all.py            # the figures as BENCHMARKS.md records them (tens of minutes)
    python bench/run_all.py --quick    # every script on small inputs: a few minutes, to see they run
    python bench/run_all.py --only formats,api_resume

Each benchmark runs in its own process with this interpreter, so one that fails does not stop the
others; the exit code is the number that failed. The GPU figures come from ``bench/run_h200.sh`` on
a CUDA machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: name -> (arguments for the recorded figures, arguments for a quick run)
BENCHMARKS = {
    "architecture": ([], []),
    "formats": (["--records", "4096"], ["--records", "256", "--repeat", "2"]),
    "api_resume": (["--repeat", "5"], ["--tokens", "2048", "--repeat", "2"]),
    "api_append": (["--turns", "20", "--clients", "8"], ["--turns", "3", "--clients", "2"]),
    "engine_resume": (["--threads", "1"], ["--threads", "1", "--lengths", "256", "1024", "--decode-tokens", "4"]),
    "hf_resume": (["--tiers", "v1,v2,int4,polar"], ["--lengths", "256,1024", "--repeat", "1"]),
    "reliability_report": ([], []),
}
SCRIPTS = {"formats": "formats_bench.py"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small inputs: check that every benchmark runs")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; known: {', '.join(BENCHMARKS)}")
    failed = []
    for name in names:
        full, quick = BENCHMARKS[name]
        script = HERE / SCRIPTS.get(name, f"{name}.py")
        command = [sys.executable, str(script), *(quick if args.quick else full)]
        print(f"\n== {name}: {' '.join(command[1:])}", flush=True)
        started = time.perf_counter()
        done = subprocess.run(command, cwd=HERE.parent)
        print(f"== {name}: exit {done.returncode} in {time.perf_counter() - started:.1f} s", flush=True)
        if done.returncode:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
