"""Crash consistency of the session store: a child is killed with SIGKILL inside store calls.

One store per workload lives through every trial. Each trial starts a child on it
(``store_child.py``), lets it acknowledge a few calls, and kills it at a random instant after it
announced the next call of the operation under test. The parent then opens the store (which
reconciles) and checks it against the acknowledged calls, replayed on a model:

- the index and the journals (or archives) agree exactly: counts, sizes, no torn tail, no
  temporary file, disk usage equal to the files' sizes, no reservation left;
- every session holds exactly the model's bytes, watermark, tier and state, where the call in
  flight has either happened entirely or not at all (nothing unwritten appears, nothing
  acknowledged is missing); the watermark never exceeds the rows;
- every turn re-hashes (verify) and resume serves exactly the rows up to the watermark.

The next child continues on the same store, so every trial also checks that the calls after a
crash complete. ``KVSTORE_LONG=1`` runs 200 trials per operation.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.store import SessionStore
from reliability.store_checks import check_served, describe, listing, set_aside_image, snapshot
from reliability.store_workload import (
    MAIN,
    SOURCE,
    StoreModel,
    completes_turn,
    perform,
)

CHILD = Path(__file__).with_name("store_child.py")
WORKLOADS = ["append", "fork", "park", "unpark", "truncate", "migrate", "delete"]
KEEP = "keep"  # a session no workload touches: it must never change
MAX_RECORDS = 1500  # the parent cuts the main session back past this (bounds each check's reading)


# ---------------------------------------------------------------------------- the parent's own calls
def prepare(data: Path, workload: str, seed: int) -> StoreModel:
    model = StoreModel(seed)
    with SessionStore(data) as store:
        model = perform(store, model, "create", [KEEP, "v2"])
        for step in (90_001, 90_002):  # setup turns are numbered far from the children's steps
            model = perform(store, model, "append", [KEEP, str(step), "1"])
        if workload == "fork":
            model = perform(store, model, "create", [SOURCE, "v2"])
            for step in range(90_010, 90_016):
                model = perform(store, model, "append", [SOURCE, str(step), str(int(step != 90_015))])
        elif workload != "delete":
            model = perform(store, model, "create", [MAIN, "v2"])
            model = perform(store, model, "append", [MAIN, "90020", "1"])
    return model


def housekeeping(data: Path, model: StoreModel) -> StoreModel:
    """Between trials: drop the forks made so far, cut an overgrown main session back."""
    with SessionStore(data) as store:
        for sid in [s for s in model.sessions if s.startswith("f")]:
            model = perform(store, model, "delete", [sid])
        main = model.sessions.get(MAIN)
        if main is not None and main.state == "active" and main.n_records > MAX_RECORDS:
            model = perform(store, model, "truncate", [MAIN, "7"])
    return model


# ---------------------------------------------------------------------------- one trial
class Killer:
    """Starts a child, waits for the call to kill it in, kills it at a random instant inside."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.durations: dict[str, list[float]] = {}

    def estimate(self, kind: str) -> float:
        seen = self.durations.get(kind, [])
        return statistics.median(seen[-25:]) if seen else 0.02

    def run(self, workload: str, target: str, data: Path, seed: int, step: int) -> list[list[str]]:
        skip = int(self.rng.integers(0, 3))  # let this many calls of the target kind finish first
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), workload, str(data), str(seed), str(step)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[list[str]] = []
        begun: tuple[str, float] | None = None
        targets = 0
        try:
            while True:
                line = proc.stdout.readline()
                if not line:
                    break  # the child died on its own: reported below
                fields = line.split()
                lines.append(fields)
                now = time.monotonic()
                if fields[0] == "ACK" and begun is not None and begun[0] == fields[1]:
                    self.durations.setdefault(fields[1], []).append(now - begun[1])
                if fields[0] == "BEGIN":
                    begun = (fields[1], now)
                    if fields[1] == target:
                        if targets == skip:
                            time.sleep(float(self.rng.uniform(0, 1.3 * self.estimate(target))))
                            break
                        targets += 1
        finally:
            proc.send_signal(signal.SIGKILL)
            # Read on through the same buffered stream: lines readline() already buffered come
            # first (communicate() would read the pipe underneath and skip them).
            rest = proc.stdout.read()
            err = proc.stderr.read()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL, f"the child failed on its own:\n{err}"
        lines += [line.split() for line in rest.splitlines()]
        return lines


def replay(model: StoreModel, lines: list[list[str]]) -> tuple[StoreModel, list[str] | None, int]:
    """The model after the acknowledged calls, the call in flight (BEGIN fields) and the count acked.

    Each ACK's reported count and watermark must be the model's.
    """
    in_flight, acked = None, 0
    for fields in lines:
        if fields[0] == "BEGIN":
            in_flight = fields[1:]
        elif fields[0] == "ACK":
            kind, args = in_flight[0], in_flight[1:]
            assert fields[1] == kind, (fields, in_flight)
            model = model.apply(kind, args)
            if fields[2] != "-":
                sid = args[1] if kind == "fork" else args[0]
                got = model.sessions[sid]
                assert (int(fields[2]), int(fields[3])) == (got.n_records, got.watermark), (fields, in_flight)
            in_flight, acked = None, acked + 1
    return model, in_flight, acked


# ---------------------------------------------------------------------------- the checks
def check_store(data: Path, candidates: list[StoreModel], in_flight: list[str] | None) -> tuple[int, int]:
    """Open the store and match it to a candidate; returns (candidate index, files set aside)."""
    lost_before = listing(data / "lost+found")
    with SessionStore(data) as store:
        actual = snapshot(store)
        matches = [i for i, c in enumerate(candidates) if c.sessions == actual]
        assert matches, (
            f"the store matches neither the acknowledged state nor the call in flight {in_flight}:\n"
            f"store:    {describe(actual)}\nexpected: "
            + "\n      or: ".join(str(describe(c.sessions)) for c in candidates)
        )
        check_served(store, actual)
    set_aside = sorted(listing(data / "lost+found") - lost_before)
    if set_aside:
        # Only a fork whose copy was published but never indexed leaves a file there: its bytes.
        assert in_flight is not None and in_flight[0] == "fork" and matches[0] == 0, (set_aside, in_flight)
        fork = candidates[1].sessions[in_flight[2]]
        assert len(set_aside) == 1 and set_aside_image(data, set_aside[0]) == fork.file_image()
    return matches[0], len(set_aside)


# ---------------------------------------------------------------------------- the suite
@pytest.mark.parametrize("workload", WORKLOADS)
def test_store_survives_sigkill(tmp_path, trials, figures, workload):
    seed = 500 + WORKLOADS.index(workload)
    rng = np.random.default_rng(seed)
    data = tmp_path / "data"
    model = prepare(data, workload, seed)
    killer = Killer(rng)
    step = 0
    for _ in range(trials(6)):
        lines = killer.run(workload, workload, data, seed, step)
        acked_model, in_flight, acked = replay(model, lines)
        candidates = [acked_model] + ([acked_model.apply(in_flight[0], in_flight[1:])] if in_flight else [])
        begun = sum(1 for fields in lines if fields[0] == "BEGIN")
        try:
            matched, set_aside = check_store(data, candidates, in_flight)
        except AssertionError:
            figures.add("store_crash", workload, trials=1, lost_or_inconsistent=1)
            raise
        mid_call = in_flight is not None and in_flight[0] == workload
        figures.add(
            "store_crash",
            workload,
            trials=1,
            kills_mid_call=int(mid_call),
            in_flight_committed=int(mid_call and matched == 1),
            in_flight_rolled_back=int(mid_call and matched == 0),
            acked_calls=acked,
            set_aside_lost_found=set_aside,
            lost_or_inconsistent=0,
        )
        model = candidates[matched]
        step += begun - (1 if in_flight is not None and matched == 0 else 0)
        model = housekeeping(data, model)
    # The store still takes a whole turn after the last crash.
    with SessionStore(data) as store:
        sid = MAIN if MAIN in model.sessions else KEEP
        if model.sessions[sid].state == "parked":
            store.unpark(sid)
            model = model.apply("unpark", [sid])
        model = perform(store, model, "append", [sid, "99999", str(int(completes_turn(seed, 99999)))])
    matched, _ = check_store(data, [model], None)
    assert matched == 0
