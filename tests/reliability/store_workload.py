"""The session store's crash workloads: what a child does at each step, and what it leaves.

A workload is a cycle of store calls numbered by a global step. The child runs steps from a
given number on and prints ``BEGIN <kind> <args>`` before each call and ``ACK <kind> <results>``
after it returns; the parent replays those lines on :class:`StoreModel` (the store it expects)
without talking to the child. Rows of step ``i`` are ``workload.turn_rows(seed, i)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Header, Tier
from kvstore.migrations import formats as format_migrations
from reliability.workload import GEOMETRY, turn_rows

MODEL = {"name": "crash-mla", "revision": "r1"}
OWNER = "crash"
TIER_NAMES = {"v1": tiers.F32, "v2": tiers.FP8, "int4": tiers.INT4}
MIGRATE_NEXT = {"v2": "int4", "int4": "v1", "v1": "v2"}

#: The steps of each workload; the parent kills the child inside the named operation.
CYCLES = {
    "append": ("append",),
    "fork": ("fork",),
    "park": ("park", "unpark", "append"),
    "unpark": ("park", "unpark", "append"),
    "truncate": ("append", "append", "truncate"),
    "migrate": ("append", "migrate"),
    "delete": ("create", "append", "delete"),
}
MAIN = "s"  # the session the workloads change
SOURCE = "src"  # fork's source


def tier_name(tier: Tier) -> str:
    return next(name for name, t in TIER_NAMES.items() if t == tier)


def step_kind(workload: str, step: int) -> str:
    cycle = CYCLES[workload]
    return cycle[step % len(cycle)]


def step_rng(seed: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, 7])


def completes_turn(seed: int, step: int) -> bool:
    """Whether the append of ``step`` ends a turn (three in four do)."""
    return bool(step_rng(seed, step).random() < 0.75)


def delete_target(step: int) -> str:
    """The session the create/append/delete cycle around ``step`` works on."""
    return f"d{step - step % 3}"


def encode_turn(seed: int, step: int, tier: Tier) -> bytes:
    return coli_kv.encode_records(GEOMETRY, tier, *turn_rows(seed, step)).tobytes()


@dataclasses.dataclass(frozen=True)
class Session:
    """What a session must hold: its tier, record bytes, watermark and state."""

    tier: Tier
    body: bytes = b""
    watermark: int = 0
    state: str = "active"

    @property
    def record_bytes(self) -> int:
        return coli_kv.record_bytes(GEOMETRY, self.tier)

    @property
    def n_records(self) -> int:
        return len(self.body) // self.record_bytes

    def file_image(self) -> bytes:
        return Header(GEOMETRY, self.tier, self.n_records).to_bytes() + self.body


class StoreModel:
    """The sessions a store must hold after a sequence of acknowledged calls."""

    def __init__(self, seed: int, sessions: dict[str, Session] | None = None):
        self.seed = seed
        self.sessions: dict[str, Session] = dict(sessions or {})

    def copy(self) -> "StoreModel":
        return StoreModel(self.seed, self.sessions)

    def apply(self, kind: str, args: list[str]) -> "StoreModel":
        """The model after one call ``kind`` with the arguments its BEGIN line printed."""
        out = self.copy()
        s = out.sessions
        if kind == "create":
            s[args[0]] = Session(TIER_NAMES[args[1]])
        elif kind == "append":
            sid, step, complete = args[0], int(args[1]), args[2] == "1"
            old = s[sid]
            body = old.body + encode_turn(self.seed, step, old.tier)
            wm = len(body) // old.record_bytes if complete else old.watermark
            s[sid] = dataclasses.replace(old, body=body, watermark=wm, state="active")
        elif kind == "truncate":
            sid, keep = args[0], int(args[1])
            old = s[sid]
            s[sid] = dataclasses.replace(
                old, body=old.body[: keep * old.record_bytes], watermark=min(old.watermark, keep), state="active"
            )
        elif kind == "fork":
            source, new_id, at = args[0], args[1], int(args[2])
            old = s[source]
            s[new_id] = Session(old.tier, old.body[: at * old.record_bytes], min(old.watermark, at))
        elif kind == "park":
            s[args[0]] = dataclasses.replace(s[args[0]], state="parked")
        elif kind == "unpark":
            s[args[0]] = dataclasses.replace(s[args[0]], state="active")
        elif kind == "migrate":
            sid, target = args[0], TIER_NAMES[args[1]]
            old = s[sid]
            records = coli_kv.parse(old.file_image())
            converted = format_migrations.convert(records, target).tobytes() if records.n else b""
            s[sid] = Session(target, converted, old.watermark, "active")
        elif kind == "delete":
            del s[args[0]]
        else:
            raise ValueError(f"unknown step kind {kind}")
        return out


def perform(store, model: StoreModel, kind: str, args: list[str]) -> StoreModel:
    """Make one call (as a BEGIN line would describe it) on ``store`` and on ``model``."""
    if kind == "create":
        store.create(OWNER, GEOMETRY, TIER_NAMES[args[1]], MODEL, session_id=args[0])
    elif kind == "append":
        store.append(args[0], *turn_rows(model.seed, int(args[1])), complete_turn=args[2] == "1")
    elif kind == "truncate":
        store.truncate(args[0], int(args[1]))
    elif kind == "fork":
        store.fork(args[0], at=int(args[2]), new_id=args[1])
    elif kind == "park":
        store.park(args[0])
    elif kind == "unpark":
        store.unpark(args[0])
    elif kind == "migrate":
        store.migrate(args[0], TIER_NAMES[args[1]])
    elif kind == "delete":
        store.delete(args[0])
    else:
        raise ValueError(f"unknown step kind {kind}")
    return model.apply(kind, args)
