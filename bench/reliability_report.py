"""Run the reliability suites and print their measured figures as Markdown (for RELIABILITY.md).

    .venv/bin/python bench/reliability_report.py            # the CI counts (about a minute)
    .venv/bin/python bench/reliability_report.py --long     # KVSTORE_LONG=1: 200+ trials per operation
    .venv/bin/python bench/reliability_report.py --from FILE.json   # render a run already made

The suites count what they do (``tests/reliability/conftest.py`` writes ``reliability.json``):
this script runs pytest with ``KVSTORE_RELIABILITY_JSON`` pointing at a file, then renders it —
one table per suite, a totals line (trials, kills mid-call, faults, inputs, data lost) and the
wall time pytest spent in each suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOSS_KEYS = ("lost", "data_lost", "lost_or_inconsistent", "lost_or_duplicated", "garbage_loaded", "interleaved",
             "inconsistent_reads", "changed", "leaked", "escaped", "accepted", "server_errors")
TOTAL_KEYS = {
    "trials": "crash trials (SIGKILL)",
    "kills_mid_call": "kills inside a store call",
    "faults_injected": "faults injected",
    "inputs": "hostile inputs / requests",
    "states": "power-loss states",
    "appends": "concurrent appends",
}


def run(long: bool, target: Path) -> tuple[int, float]:
    env = {**os.environ, "KVSTORE_RELIABILITY_JSON": str(target)}
    if long:
        env["KVSTORE_LONG"] = "1"
    else:
        env.pop("KVSTORE_LONG", None)
    started = time.monotonic()
    code = subprocess.call([str(ROOT / ".venv" / "bin" / "pytest"), "-q", "tests/reliability"], cwd=ROOT, env=env)
    return code, time.monotonic() - started


def render(document: dict, wall: float | None = None) -> str:
    lines = [f"Run: {'KVSTORE_LONG=1' if document['long'] else 'CI counts'}"
             + (f", {wall / 60:.1f} min in all" if wall is not None else "")]
    totals: dict[str, int] = {}
    lost = 0
    for suite, operations in document["suites"].items():
        columns = sorted({key for counts in operations.values() for key in counts})
        lines += ["", f"**{suite}**", "",
                  "| operation | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for operation, counts in operations.items():
            lines.append(f"| {operation} | " + " | ".join(str(counts.get(c, "")) for c in columns) + " |")
            for key, value in counts.items():
                totals[key] = totals.get(key, 0) + value
                if key in LOSS_KEYS:
                    lost += value
    lines += ["", "Totals: " + ", ".join(f"{label} {totals[key]}" for key, label in TOTAL_KEYS.items() if key in totals)
              + f"; data lost, inconsistencies or 5xx: {lost}"]
    walls = ", ".join(f"{module} {seconds:.0f} s" for module, seconds in document["wall_s"].items())
    lines.append(f"Wall time per suite: {walls}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="run with KVSTORE_LONG=1")
    parser.add_argument("--from", dest="source", help="render this reliability.json instead of running")
    args = parser.parse_args()
    if args.source:
        print(render(json.loads(Path(args.source).read_text())))
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "reliability.json"
        code, wall = run(args.long, target)
        if not target.exists():
            print("the suites wrote no figures", file=sys.stderr)
            return code or 1
        print(render(json.loads(target.read_text()), wall))
    return code


if __name__ == "__main__":
    sys.exit(main())
