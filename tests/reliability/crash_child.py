"""A child that works on a journal and prints an acknowledgement after each call returns.

    python crash_child.py append  PATH SEED TIER      # create, then append turns forever
    python crash_child.py upgrade PATH SEED TIER      # open a v1 file under TIER, append turns
    python crash_child.py migrate SRC  DSTDIR TIER    # migrate SRC to DSTDIR/out-<i> forever
    python crash_child.py repair  DIR                 # repair DIR/r-<i>.coli_kv, i = 0, 1, ...

The parent kills it with SIGKILL at a random instant and checks what survived.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/

from kvstore import tiers
from kvstore.filerewrite import migrate_file, repair_file  # noqa: E402
from kvstore.formats.coli_kv import Tier  # noqa: E402
from kvstore.journal import KVFile  # noqa: E402
from reliability.workload import GEOMETRY, turn_rows  # noqa: E402


def ack(*fields) -> None:
    sys.stdout.write(" ".join(map(str, ("ACK", *fields))) + "\n")
    sys.stdout.flush()


def parse_tier(name: str) -> Tier:
    return {"v1": tiers.F32, "v2": tiers.FP8, "int4": tiers.INT4, "polar3": tiers.polar(3)}[name]


def main() -> None:
    op = sys.argv[1]
    if op in ("append", "upgrade"):
        path, seed, tier = Path(sys.argv[2]), int(sys.argv[3]), parse_tier(sys.argv[4])
        if op == "append":
            journal = KVFile.create(path, GEOMETRY, tier)
        else:
            journal = KVFile.open(path, geometry=GEOMETRY, tier=tier, writable=True)
        ack("open", journal.n_records)
        turn = 0
        while True:
            count = journal.append(*turn_rows(seed, turn))
            ack(turn, count)
            turn += 1
    elif op == "migrate":
        src, out_dir, tier = Path(sys.argv[2]), Path(sys.argv[3]), parse_tier(sys.argv[4])
        ack("open", 0)
        i = 0
        while True:
            migrate_file(src, out_dir / f"out-{i}.coli_kv", tier)
            ack(i, 0)
            i += 1
    elif op == "repair":
        directory = Path(sys.argv[2])
        ack("open", 0)
        i = 0
        while (directory / f"r-{i}.coli_kv").exists():
            repair_file(directory / f"r-{i}.coli_kv")
            ack(i, 0)
            i += 1
        sys.stdout.write("DONE\n")
        sys.stdout.flush()
    else:
        raise SystemExit(f"unknown op {op}")


if __name__ == "__main__":
    main()
