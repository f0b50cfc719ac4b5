"""Deterministic workloads shared by the crash child and the checking parent.

Turn ``i`` of a workload is regenerated from ``(seed, i)`` alone, so the parent knows exactly
which bytes every acknowledged call wrote without talking to the child.
"""

from __future__ import annotations

import numpy as np

from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Tier

GEOMETRY = Geometry(n_layers=2, kv_lora=64, qk_rope=16, index_hd=8, nic=1, vocab=1000)
MAX_TURN = 40


def turn_rows(seed: int, turn: int):
    rng = np.random.default_rng([seed, turn])
    k = int(rng.integers(1, MAX_TURN + 1))
    g = GEOMETRY
    tokens = rng.integers(0, g.vocab, k).astype(np.int32)
    L = rng.standard_normal((g.n_layers, k, g.kv_lora), dtype=np.float32)
    R = rng.standard_normal((g.n_layers, k, g.qk_rope), dtype=np.float32)
    I = rng.standard_normal((g.nic, k, g.index_hd), dtype=np.float32)
    return tokens, L, R, I


def turn_records(seed: int, turn: int, tier: Tier) -> np.ndarray:
    return coli_kv.encode_records(GEOMETRY, tier, *turn_rows(seed, turn))


def expected_records(seed: int, turns: int, tier: Tier, first_turn: int = 0) -> np.ndarray:
    parts = [turn_records(seed, t, tier) for t in range(first_turn, first_turn + turns)]
    if not parts:
        return np.zeros(0, dtype=coli_kv.record_dtype(GEOMETRY, tier))
    return np.concatenate(parts)
