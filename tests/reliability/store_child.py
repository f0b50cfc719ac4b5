"""A child that works on a session store and prints a line before and after each call.

    python store_child.py WORKLOAD DATA SEED FIRST_STEP

Runs the steps of ``store_workload.CYCLES[WORKLOAD]`` from ``FIRST_STEP`` on, forever:
``BEGIN <kind> <args>`` just before a call, ``ACK <kind> <n_records> <watermark>`` after it
returns. The parent kills it with SIGKILL and checks the store against the acknowledged calls.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/

from kvstore.store import SessionStore  # noqa: E402
from reliability.store_workload import (  # noqa: E402
    MAIN,
    MIGRATE_NEXT,
    MODEL,
    OWNER,
    SOURCE,
    TIER_NAMES,
    completes_turn,
    delete_target,
    step_kind,
    step_rng,
    tier_name,
)
from reliability.workload import GEOMETRY, turn_rows  # noqa: E402


def say(*fields) -> None:
    sys.stdout.write(" ".join(map(str, fields)) + "\n")
    sys.stdout.flush()


def main() -> None:
    workload, data, seed, step = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    store = SessionStore(data)  # reconciles what the previous child left
    say("OPEN", step)
    while True:
        kind = step_kind(workload, step)
        sid = delete_target(step) if workload == "delete" else MAIN
        if kind == "append":
            complete = completes_turn(seed, step)
            say("BEGIN", kind, sid, step, int(complete))
            info = store.append(sid, *turn_rows(seed, step), complete_turn=complete).info
        elif kind == "truncate":
            current = store.get(sid)
            keep = int(step_rng(seed, step).integers(0, current.n_records + 1))
            say("BEGIN", kind, sid, keep)
            info = store.truncate(sid, keep)
        elif kind == "fork":
            source = store.get(SOURCE)
            at = int(step_rng(seed, step).integers(0, source.n_records + 1))
            say("BEGIN", kind, SOURCE, f"f{step}", at)
            info = store.fork(SOURCE, at=at, new_id=f"f{step}")
        elif kind == "park":
            say("BEGIN", kind, sid)
            info = store.park(sid)
        elif kind == "unpark":
            say("BEGIN", kind, sid)
            info = store.unpark(sid)
        elif kind == "migrate":
            target = MIGRATE_NEXT[tier_name(store.get(sid).tier)]
            say("BEGIN", kind, sid, target)
            info = store.migrate(sid, TIER_NAMES[target])
        elif kind == "create":
            say("BEGIN", kind, sid, "v2")
            info = store.create(OWNER, GEOMETRY, TIER_NAMES["v2"], MODEL, session_id=sid)
        elif kind == "delete":
            say("BEGIN", kind, sid)
            store.delete(sid)
            info = None
        else:
            raise SystemExit(f"unknown step kind {kind}")
        say("ACK", kind, info.n_records if info else "-", info.watermark if info else "-")
        step += 1


if __name__ == "__main__":
    main()
