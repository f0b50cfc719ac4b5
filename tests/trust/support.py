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
    """A SessionEngine on ``folder``'s fingerprint, sharing the loaded model (a fresh cache)."""
    model, tokenizer = loaded
    return SessionEngine(
        Engine(model, tokenizer=tokenizer, tier=tier, bits=bits), store, folder_model_info(folder), folder=folder
    )


def cache_state(chat: SessionEngine) -> dict:
    """A copy of everything the live cache holds: tokens and every stored field, on the host."""
    rows = chat.engine.export_rows(0)
    state = {
        "length": chat.engine.cache.length,
        "tokens": rows.tokens.copy(),
        "lc": np.array(rows.lc),
        "rc": np.array(rows.rc),
    }
    if rows.lc_scales is not None:
        state["lc_scales"], state["rc_scales"] = np.array(rows.lc_scales), np.array(rows.rc_scales)
    return state


def assert_same_cache(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    assert before["length"] == after["length"]
    for name in before:
        if name != "length":
            np.testing.assert_array_equal(before[name], after[name], err_msg=name)


def session_state(store: SessionStore, session_id: str) -> dict:
    """The index record (less last_used, which a read refreshes) and the journal's bytes."""
    info = store.get(session_id).to_dict()
    info.pop("last_used")
    path = store.journal_path(session_id)
    return {"info": info, "journal": path.read_bytes() if path.exists() else None}
