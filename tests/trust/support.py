"""Helpers of the trust suite (imported as ``trust.support``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from kvstore.engine.fingerprint import folder_model_info
from kvstore.engine.generate import Engine
from kvstore.engine.session import SessionEngine
from kvstore.store import SessionStore


def sibling(tiny_folder: Path, parent: Path) -> Path:
    """A byte-for-byte copy of the tiny folder at ``parent/tiny`` (same name, same hashes)."""
    target = parent / "tiny"
    shutil.copytree(tiny_folder, target)
    return target


def session_engine(
    store: SessionStore, folder: Path, loaded, tier: str = "f32", bits: int | None = None
) -> SessionEngine:
    """A SessionEngine on ``folder``'s fingerprint, sharing the loaded model, whose pool keeps one
    idle session resident (a budget of 0 bytes: a turn on another session restores it)."""
    model, tokenizer = loaded
    return SessionEngine(
        Engine(model, tokenizer=tokenizer, tier=tier, bits=bits),
        store,
        folder_model_info(folder),
        folder=folder,
        pool_bytes=0,
    )


def cache_state(chat: SessionEngine) -> dict:
    """A copy of everything the resident sessions hold: per session, tokens and every stored field,
    on the host."""
    state = {}
    for resident in chat.pool.resident():
        rows = resident.cache.export_rows(0)
        held = {"length": resident.cache.length, "tokens": rows.tokens.copy(), "lc": np.array(rows.lc)}
        held["rc"] = np.array(rows.rc)
        if rows.lc_scales is not None:
            held["lc_scales"], held["rc_scales"] = np.array(rows.lc_scales), np.array(rows.rc_scales)
        state[resident.key] = (resident.state, held)
    return state


def assert_same_cache(before: dict, after: dict) -> None:
    assert before.keys() == after.keys(), "the resident sessions changed"
    for key, (state, held) in before.items():
        assert after[key][0] == state, f"{key}: its state changed"
        for name, value in held.items():
            np.testing.assert_array_equal(value, after[key][1][name], err_msg=f"{key}: {name}")


def session_state(store: SessionStore, session_id: str) -> dict:
    """The index record (less last_used, which a read refreshes) and the journal's bytes."""
    info = store.get(session_id).to_dict()
    info.pop("last_used")
    path = store.journal_path(session_id)
    return {"info": info, "journal": path.read_bytes() if path.exists() else None}
