"""A store whose index sits on a disk that fills (``test_index_faults.py`` runs this in a private
mount namespace, ``index/`` on a small tmpfs (128 KiB; 96 to 512 KiB in the long run), journals on
the test's own disk).

    python index_disk_child.py DATA

Appends turns until the index's disk is full, then checks: the refusal is ``IndexFull`` (507)
naming the disk, never LMDB's raw error; nothing the refused call wrote is visible; every session
still opens, lists and serves; the same call is refused again, cleanly; once the disk grows (the
tmpfs is remounted larger) it completes, and a reopened store agrees with its files exactly.
Prints one JSON line of counts; a failed check exits non-zero with its assertion.
"""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/

from kvstore.api.errors import http_status  # noqa: E402
from kvstore.errors import IndexFull  # noqa: E402
from kvstore.store import SessionStore  # noqa: E402
from reliability.store_checks import check_served, snapshot, visible  # noqa: E402
from reliability.store_workload import StoreModel, perform  # noqa: E402

SEED = 91


def main() -> None:
    data = Path(sys.argv[1])
    refused = 0
    with SessionStore(data) as store:
        model = perform(store, StoreModel(SEED), "create", ["s", "v2"])
        model = perform(store, model, "create", ["t", "int4"])
        acknowledged = 0
        step = 0
        while True:
            sid = "st"[step % 2]
            try:
                model = perform(store, model, "append", [sid, str(step), "1"])
            except IndexFull as exc:
                assert http_status(exc) == 507 and "disk" in exc.reason, exc.reason
                refused += 1
                break
            acknowledged += 1
            step += 1
            assert step < 100_000, "the index's disk never filled"
        assert visible(store) == model.sessions  # the refused turn is not visible
        for sid, session in model.sessions.items():  # reads need no index write
            assert store.resume(sid).records.record_bytes() == session.body[: session.watermark * session.record_bytes]
        try:  # the same call again: its unindexed records are rolled back first, then refused again
            model = perform(store, model, "append", [sid, str(step), "1"])
            step += 1
        except IndexFull:
            refused += 1
        assert visible(store) == model.sessions
        subprocess.run(["mount", "-o", "remount,size=4m", str(data / "index")], check=True)
        model = perform(store, model, "append", [sid, str(step), "1"])
        acknowledged += 1
    with SessionStore(data) as store:
        assert snapshot(store) == model.sessions
        check_served(store, model.sessions)
    print(json.dumps({"refused": refused, "acknowledged": acknowledged}))


if __name__ == "__main__":
    main()
