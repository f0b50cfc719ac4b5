"""Fault injection for the session store: ENOSPC/EIO at every write-path call of every operation.

The technique of ``test_faults.py``, one level up: each store call is run once cleanly to count
its ``write``/``pwrite``/``fsync``/``ftruncate``/``replace``/``link``/``rename``/``unlink`` calls,
then once per call and per errno with that call failing (a short write first, for writes). After
each fault:

- the call raised a typed error (a ``KVStoreError`` with a reason and an HTTP status) or
  completed; nothing untyped escapes;
- the store, read as it stands, holds exactly the state before the call or after it (committed
  data survives, nothing half-done is visible), and after it if no error was raised;
- the next calls complete: the same call again when it did not take effect, then a new turn;
- reopening the store (reconcile) leaves index and files in exact agreement.

LMDB's own writes do not go through ``os``; its failure mode, a full map, has its own test.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvstore.api.errors import http_status
from kvstore.errors import IndexFull, KVStoreError
from kvstore.store import SessionStore
from reliability.store_checks import check_served, snapshot, visible
from reliability.store_workload import StoreModel, perform
from reliability.test_faults import Faults
from reliability.workload import turn_rows

SEED = 77
# step numbers of the rows each call appends (rows are regenerated from (SEED, step))
SETUP_STEPS = {"s": (1, 2, 3), "p": (4, 5), "k": (6,)}


def build_template(root: Path) -> StoreModel:
    """s: active, three turns (the last one open); p: parked; k: untouched by every call."""
    model = StoreModel(SEED)
    with SessionStore(root) as store:
        for sid, steps in SETUP_STEPS.items():
            model = perform(store, model, "create", [sid, "v2"])
            for step in steps:
                model = perform(store, model, "append", [sid, str(step), str(int(step != 3))])
        model = perform(store, model, "park", ["p"])
    return model


def mid_turn(model: StoreModel) -> int:
    """A record inside the second turn of ``s`` (a cut there re-hashes that turn)."""
    first = turn_rows(SEED, 1)[0].shape[0]
    return first + max(1, turn_rows(SEED, 2)[0].shape[0] // 2)


CALLS = {
    "append": lambda m: ("append", ["s", "10", "1"]),
    "append_open_turn": lambda m: ("append", ["s", "11", "0"]),
    "fork": lambda m: ("fork", ["s", "f", str(mid_turn(m))]),
    "park": lambda m: ("park", ["s"]),
    "unpark": lambda m: ("unpark", ["p"]),
    "truncate": lambda m: ("truncate", ["s", str(mid_turn(m))]),
    "delete": lambda m: ("delete", ["s"]),
    "delete_parked": lambda m: ("delete", ["p"]),
    "create": lambda m: ("create", ["n", "v2"]),
    "migrate": lambda m: ("migrate", ["s", "int4"]),
}


def next_call(store: SessionStore, model: StoreModel, sid: str) -> StoreModel:
    """After the fault: one more turn on the session the call was about (re-created if deleted)."""
    if sid not in model.sessions:
        model = perform(store, model, "create", [sid, "v2"])
    return perform(store, model, "append", [sid, "20", "1"])


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults") / "template"
    return root, build_template(root)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_store_call_faults(tmp_path, monkeypatch, figures, template, name):
    root, before = template
    kind, args = CALLS[name](before)
    after = before.apply(kind, args)
    subject = args[1] if kind == "fork" else args[0]
    runs = iter(range(10**6))

    def fresh() -> Path:
        data = tmp_path / f"run-{next(runs)}"
        shutil.copytree(root, data)
        return data

    data = fresh()
    with SessionStore(data) as store:
        with monkeypatch.context() as m:
            faults = Faults(m)
            perform(store, before, kind, args)
        total = faults.calls
        assert snapshot(store) == after.sessions
    assert total > 0
    hits = set()
    for k in range(1, total + 1):
        for code in (errno.ENOSPC, errno.EIO):
            data = fresh()
            raised = None
            with SessionStore(data) as store:
                with monkeypatch.context() as m:
                    faults = Faults(m, fail_at=k, code=code)
                    try:
                        perform(store, before, kind, args)
                    except KVStoreError as exc:
                        raised = exc
                    except OSError as exc:
                        pytest.fail(
                            f"{name}: call {k} ({faults.hit}, {errno.errorcode[code]}) raised an untyped {exc!r}"
                        )
                hits.add(faults.hit)
                if raised is not None:
                    assert raised.reason and 400 <= http_status(raised) < 600
                now = visible(store)
                assert now in (before.sessions, after.sessions), (
                    f"{name}: call {k} ({faults.hit}) left a half-done state"
                )
                if raised is None:
                    assert now == after.sessions, f"{name}: call {k} ({faults.hit}) failed silently"
                model = after
                if now == before.sessions:
                    model = perform(store, before, kind, args)  # the call again, without the fault
                model = next_call(store, model, subject)
                assert visible(store) == model.sessions
            with SessionStore(data) as store:
                assert snapshot(store) == model.sessions
                check_served(store, model.sessions)
            figures.add(
                "store_faults",
                name,
                faults_injected=1,
                typed_errors=int(raised is not None),
                committed_then_reported=int(raised is not None and now == after.sessions),
                data_lost=0,
            )
            shutil.rmtree(data)
    assert {"pwrite", "fsync"} & hits, hits


# ---------------------------------------------------------------------------- LMDB map full
LONG_TURN_STEPS = 12


def long_turn(first_step: int):
    """The rows of steps ``first_step .. +12`` as one turn (each 64 tokens add a chain hash to the index)."""
    parts = [turn_rows(SEED, first_step + j) for j in range(LONG_TURN_STEPS)]
    tokens = np.concatenate([p[0] for p in parts])
    L, R, I = (np.concatenate([p[i] for p in parts], axis=1) for i in (1, 2, 3))
    return tokens, L, R, I


def add_long_turn(model: StoreModel, first_step: int) -> StoreModel:
    for j in range(LONG_TURN_STEPS):  # the same bytes as one turn per step, and the same watermark
        model = model.apply("append", ["s", str(first_step + j), "1"])
    return model


def test_index_map_full_is_typed_and_recoverable(tmp_path, figures):
    """Fill a small index: IndexFull (507) comes out, every acknowledged turn survives, and after
    reopening with a larger map the refused append completes."""
    data = tmp_path / "data"
    small = 256 << 10
    model = StoreModel(SEED)
    with SessionStore(data, map_size=small) as store:
        model = perform(store, model, "create", ["s", "v2"])
        step = 100
        while True:
            try:
                store.append("s", *long_turn(step))
            except IndexFull as exc:
                assert http_status(exc) == 507 and "map_size" in exc.reason
                break
            model = add_long_turn(model, step)
            step += LONG_TURN_STEPS
            assert step < 100 + LONG_TURN_STEPS * 2000, "the index never filled"
        assert visible(store) == model.sessions  # the refused turn is not visible
        assert store.resume("s").records.record_bytes() == model.sessions["s"].body  # reads still work
        # The refused turn's records wait unindexed in the journal; the same call again rolls them
        # back first, then is refused again or (pages freed meanwhile) completes.
        refused = 1
        try:
            store.append("s", *long_turn(step))
            model = add_long_turn(model, step)
            step += LONG_TURN_STEPS
        except IndexFull:
            refused += 1
        assert visible(store) == model.sessions
    with SessionStore(data, map_size=small * 8) as store:
        assert snapshot(store) == model.sessions
        store.append("s", *long_turn(step))
        model = add_long_turn(model, step)
        assert snapshot(store) == model.sessions
        check_served(store, model.sessions)
    figures.add("store_faults", "lmdb_map_full", faults_injected=refused, typed_errors=refused, data_lost=0)
