"""Shared by the session store, conformance and API suites: a small MLA geometry with an indexer, row makers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Tier
from kvstore.store import SessionStore

GEOMETRY = Geometry(n_layers=2, kv_lora=32, qk_rope=8, index_hd=4, nic=1, vocab=1000)
MODEL = {"name": "tiny-mla", "revision": "r1"}


class Rows:
    """Deterministic random rows for GEOMETRY; ``encode`` gives the records a journal must hold."""

    def __init__(self, seed: int = 0, geometry: Geometry = GEOMETRY):
        self.rng = np.random.default_rng(seed)
        self.geometry = geometry

    def make(self, n: int, tokens=None):
        g = self.geometry
        if tokens is None:
            tokens = self.rng.integers(0, g.vocab, n)
        tokens = np.asarray(tokens, dtype=np.int32)
        L = self.rng.standard_normal((g.n_layers, n, g.kv_lora)).astype(np.float32)
        R = self.rng.standard_normal((g.n_layers, n, g.qk_rope)).astype(np.float32)
        I = self.rng.standard_normal((g.nic, n, g.index_hd)).astype(np.float32) if g.nic else None
        return tokens, L, R, I

    def encode(self, tier: Tier, *chunks) -> bytes:
        return b"".join(coli_kv.encode_records(self.geometry, tier, *chunk).tobytes() for chunk in chunks)


def new_session(store: SessionStore, session_id: str = "chat", owner: str = "alice", tier: Tier = tiers.FP8, **kw):
    return store.create(owner, GEOMETRY, tier, MODEL, session_id=session_id, **kw)


def files_bytes(data: Path) -> int:
    """Bytes of the journals and archives in a store's folder (lock sidecars excluded)."""
    return sum(
        p.stat().st_size
        for folder in ("journals", "archive")
        for p in (data / folder).glob("*.coli_kv*")
        if not p.name.endswith(".lock")
    )


def journal_body(store: SessionStore, session_id: str) -> bytes:
    """The records of a session's journal as stored (header stripped)."""
    return store.journal_path(session_id).read_bytes()[coli_kv.HEADER_BYTES :]
