"""Run the reliability suites and print their measured figures as Markdown (for RELIABILITY.md).

    .venv/bin/python bench/reliability_report.py            # the CI counts (about a minute)
    .venv/bin/python bench/reliability_report.py --long     # KVSTORE_LONG=1: 200+ trials per operation
    .venv/bin/python bench/reliability_report.py --from FILE.json   # render a run already made
    .venv/bin/python bench/reliability_report.py --compare CI.json LONG.json   # one table, both runs

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
LOSS_KEYS = (
    "lost",
    "data_lost",
    "lost_or_inconsistent",
    "lost_or_duplicated",
    "garbage_loaded",
    "interleaved",
    "inconsistent_reads",
    "changed",
    "leaked",
    "escaped",
    "accepted",
    "server_errors",
)
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
    lines = [
        f"Run: {'KVSTORE_LONG=1' if document['long'] else 'CI counts'}"
        + (f", {wall / 60:.1f} min in all" if wall is not None else "")
    ]
    totals: dict[str, int] = {}
    lost = 0
    for suite, operations in document["suites"].items():
        columns = sorted({key for counts in operations.values() for key in counts})
        lines += [
            "",
            f"**{suite}**",
            "",
            "| operation | " + " | ".join(columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for operation, counts in operations.items():
            lines.append(f"| {operation} | " + " | ".join(str(counts.get(c, "")) for c in columns) + " |")
            for key, value in counts.items():
                totals[key] = totals.get(key, 0) + value
                if key in LOSS_KEYS:
                    lost += value
    lines += [
        "",
        "Totals: "
        + ", ".join(f"{label} {totals[key]}" for key, label in TOTAL_KEYS.items() if key in totals)
        + f"; data lost, inconsistencies or 5xx: {lost}",
    ]
    walls = ", ".join(f"{module} {seconds:.0f} s" for module, seconds in document["wall_s"].items())
    lines.append(f"Wall time per suite: {walls}")
    return "\n".join(lines)


def _main_count(counts: dict) -> tuple[str, int]:
    for key in ("trials", "faults_injected", "inputs", "states", "appends"):
        if key in counts:
            return TOTAL_KEYS[key].split(" (")[0], counts[key]
    return "", 0


DETAIL_KEYS = {
    "kills_mid_call": "kills mid-call",
    "in_flight_committed": "in flight kept",
    "in_flight_rolled_back": "in flight undone",
    "acked_calls": "acknowledged calls",
    "set_aside_lost_found": "set aside in lost+found",
    "killed_before_rewrite": "killed before the rewrite",
    "typed_errors": "typed errors",
    "committed_then_reported": "took effect, error reported",
    "busy_answers": "busy answers",
    "reads": "reads",
    "verifies": "verifies racing them",
    "downloads": "downloads",
    "requests": "requests",
    "churn_rounds": "park/unpark/fork/delete rounds",
    "operations_modes": "operation × mode runs",
}


def compare(ci: dict, long: dict) -> str:
    """One table: each suite's operations with the CI and the long counts side by side."""
    lines = [
        "| suite | operation | counted | CI | long | what else the long run saw | lost |",
        "|---|---|---|---:|---:|---|---:|",
    ]
    for suite in sorted(set(ci["suites"]) | set(long["suites"])):
        operations = sorted(set(ci["suites"].get(suite, {})) | set(long["suites"].get(suite, {})))
        for operation in operations:
            short = ci["suites"].get(suite, {}).get(operation, {})
            full = long["suites"].get(suite, {}).get(operation, {})
            what, long_count = _main_count(full)
            what_ci, ci_count = _main_count(short)
            what = what or what_ci
            detail = ", ".join(f"{label} {full[key]}" for key, label in DETAIL_KEYS.items() if key in full)
            lost = sum(short.get(k, 0) for k in LOSS_KEYS) + sum(full.get(k, 0) for k in LOSS_KEYS)
            lines.append(f"| {suite} | {operation} | {what} | {ci_count} | {long_count} | {detail} | {lost} |")
    for name, document in (("CI", ci), ("long", long)):
        totals: dict[str, int] = {}
        for operations in document["suites"].values():
            for counts in operations.values():
                for key, value in counts.items():
                    totals[key] = totals.get(key, 0) + value
        lost = sum(totals.get(k, 0) for k in LOSS_KEYS)
        wall = sum(document["wall_s"].values())
        lines += [
            "",
            f"{name} run: "
            + ", ".join(f"{label} {totals[key]}" for key, label in TOTAL_KEYS.items() if key in totals)
            + f"; lost, inconsistent or 5xx: {lost}; {wall / 60:.1f} min of test time ("
            + ", ".join(f"{m.removeprefix('test_')} {v:.0f} s" for m, v in document["wall_s"].items())
            + ")",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="run with KVSTORE_LONG=1")
    parser.add_argument("--from", dest="source", help="render this reliability.json instead of running")
    parser.add_argument(
        "--compare", nargs=2, metavar=("CI.json", "LONG.json"), help="one table of a CI run and a long run"
    )
    args = parser.parse_args()
    if args.compare:
        ci, long = (json.loads(Path(p).read_text()) for p in args.compare)
        print(compare(ci, long))
        return 0
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
