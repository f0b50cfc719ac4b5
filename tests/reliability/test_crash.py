"""Crash consistency: a child works on a journal and is killed with SIGKILL at random instants.

After every kill the file opens, what loads is exactly a prefix of what was written, every
acknowledged call is there, and nothing unwritten appears. Short runs in CI; ``KVSTORE_LONG=1``
runs 200 trials per operation.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Header
from kvstore.journal import KVFile
from reliability.workload import GEOMETRY, expected_records, turn_records, turn_rows

CHILD = Path(__file__).with_name("crash_child.py")
TIERS = {"v1": tiers.F32, "v2": tiers.FP8, "int4": tiers.INT4, "polar3": tiers.polar(3)}


def run_and_kill(args, rng, max_acks=6):
    """Start the child, let it acknowledge a random number of calls, SIGKILL it at a random instant.

    Returns every acknowledgement the child wrote before it died (also those still in the pipe).
    """
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    acks = []
    target = int(rng.integers(0, max_acks + 1))
    try:
        while len(acks) < target + 1:  # +1: the "open" acknowledgement
            line = proc.stdout.readline()
            if not line or line.startswith("DONE"):
                break
            acks.append(line.split()[1:])
        time.sleep(float(rng.uniform(0, 0.004)))
        proc.send_signal(signal.SIGKILL)
    finally:
        # Read on through the same buffered stream: communicate() reads the pipe underneath and
        # would drop the lines readline() already buffered (acknowledgements lost mid-list).
        rest, err = proc.stdout.read(), proc.stderr.read()
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode in (-signal.SIGKILL, 0), err
    acks += [line.split()[1:] for line in rest.splitlines() if line.startswith("ACK")]
    return acks


@pytest.mark.parametrize("tier_name", ["v2", "int4", "v1"])
def test_append_survives_sigkill(tmp_path, trials, figures, tier_name):
    tier = TIERS[tier_name]
    rng = np.random.default_rng(1000 + len(tier_name))
    for trial in range(trials(8)):
        path = tmp_path / f"a-{trial}.coli_kv"
        seed = 10_000 + trial
        acks = run_and_kill(["append", path, seed, tier_name], rng)
        if not path.exists():
            assert not acks, "create was acknowledged but the file is missing"
            continue
        records = coli_kv.load(path)  # opens: never a torn header
        acked_turns = [a for a in acks if a[0] != "open"]
        acked = int(acked_turns[-1][1]) if acked_turns else 0
        in_flight = turn_records(seed, len(acked_turns), tier).shape[0]
        assert records.n in (acked, acked + in_flight), (records.n, acked, in_flight)
        figures.add(
            "journal_crash",
            f"append_{tier_name}",
            trials=1,
            acked_calls=len(acked_turns),
            in_flight_committed=int(records.n == acked + in_flight),
            lost=0,
        )
        want = expected_records(seed, len(acked_turns) + 1, tier)[: records.n]
        assert records.records.tobytes() == want.tobytes()
        # The lock died with the child: a new writer appends right after the committed prefix.
        with KVFile.open(path, writable=True, lock_timeout=1.0) as journal:
            k = journal.append(*turn_rows(seed, 999))
        assert coli_kv.load(path).n == k == records.n + turn_records(seed, 999, tier).shape[0]


@pytest.mark.parametrize("tier_name", ["v2", "int4"])
def test_lazy_upgrade_survives_sigkill(tmp_path, trials, figures, tier_name):
    tier = TIERS[tier_name]
    rng = np.random.default_rng(2000)
    for trial in range(trials(8)):
        seed = 20_000 + trial
        path = tmp_path / f"u-{trial}.coli_kv"
        old = expected_records(seed, 3, tiers.F32)
        path.write_bytes(Header(GEOMETRY, tiers.F32, old.shape[0]).to_bytes() + old.tobytes())
        original = path.read_bytes()
        acks = run_and_kill(["upgrade", path, seed, tier_name], rng, max_acks=3)
        records = coli_kv.load(path)
        acked_turns = [a for a in acks if a[0] != "open"]
        figures.add(
            "journal_crash",
            f"lazy_upgrade_{tier_name}",
            trials=1,
            acked_calls=len(acked_turns),
            killed_before_rewrite=int(records.tier == tiers.F32),
            lost=0,
        )
        if records.tier == tiers.F32:
            assert not acked_turns and path.read_bytes() == original
            continue
        assert records.tier == tier
        # The child numbers its turns from 0 with the same seed: expected = old rows + new turns.
        new = expected_records(seed, len(acked_turns) + 1, tier)
        want = np.concatenate([expected_records(seed, 3, tier), new])
        acked = int(acked_turns[-1][1]) if acked_turns else old.shape[0]
        assert records.n >= acked and records.n <= want.shape[0]
        assert records.records.tobytes() == want[: records.n].tobytes()


def test_migrate_survives_sigkill(tmp_path, trials, figures):
    rng = np.random.default_rng(3000)
    seed = 30_000
    src = tmp_path / "src.coli_kv"
    rows = expected_records(seed, 6, tiers.F32)
    src.write_bytes(Header(GEOMETRY, tiers.F32, rows.shape[0]).to_bytes() + rows.tobytes())
    original = src.read_bytes()
    target = expected_records(seed, 6, tiers.FP8)
    want = Header(GEOMETRY, tiers.FP8, target.shape[0]).to_bytes() + target.tobytes()
    for trial in range(trials(6)):
        out_dir = tmp_path / f"m-{trial}"
        out_dir.mkdir()
        acks = run_and_kill(["migrate", src, out_dir, "v2"], rng, max_acks=4)
        assert src.read_bytes() == original
        done = [int(a[0]) for a in acks if a[0] != "open"]
        figures.add("journal_crash", "migrate", trials=1, acked_calls=len(done), lost=0)
        for i in range(len(done) + 1):
            out = out_dir / f"out-{i}.coli_kv"
            if i < len(done):
                assert out.read_bytes() == want
            elif out.exists():  # the in-flight one: all or nothing
                assert out.read_bytes() == want


def damaged_file() -> bytes:
    seed = 40_000
    rows = expected_records(seed, 4, tiers.FP8)
    blob = bytearray(Header(GEOMETRY, tiers.FP8, rows.shape[0] + 5).to_bytes() + rows.tobytes())
    rec = rows.dtype.itemsize
    blob[40 + 4 + 2] = 0x7F  # a NaN code in record 0
    blob += rows[:1].tobytes()[: rec // 3]  # a torn tail
    return bytes(blob)


def test_repair_survives_sigkill(tmp_path, trials, figures):
    rng = np.random.default_rng(4000)
    damaged = damaged_file()
    reference = tmp_path / "reference.coli_kv"
    reference.write_bytes(damaged)
    from kvstore.filerewrite import repair_file

    repair_file(reference, backup=False)
    repaired = reference.read_bytes()
    for trial in range(trials(6)):
        directory = tmp_path / f"r-{trial}"
        directory.mkdir()
        copies = 8
        for i in range(copies):
            (directory / f"r-{i}.coli_kv").write_bytes(damaged)
        acks = run_and_kill(["repair", directory], rng, max_acks=4)
        done = len([a for a in acks if a[0] != "open"])
        figures.add("journal_crash", "repair", trials=1, acked_calls=done, lost=0)
        for i in range(copies):
            path = directory / f"r-{i}.coli_kv"
            backup = directory / f"r-{i}.coli_kv.bak"
            if i < done:
                assert path.read_bytes() == repaired and backup.read_bytes() == damaged
            elif i == done:
                assert path.read_bytes() in (damaged, repaired)
                assert not backup.exists() or backup.read_bytes() == damaged
                if path.read_bytes() == repaired:
                    assert backup.read_bytes() == damaged  # the backup is written first
            else:
                assert path.read_bytes() == damaged and not backup.exists()
            coli_kv.load(path)
