"""Records for the shared backend's tests: real ``.coli_kv`` records whose bytes say who wrote them.

Record ``j`` of append ``seq`` by writer ``w`` has token ``w * 1_000_000 + seq * 1_000 + j`` and
rows drawn from a generator seeded by the same three numbers, so any process can rebuild the exact
bytes an acknowledgement promised.
"""

from __future__ import annotations

import numpy as np

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry

GEOMETRY = Geometry(n_layers=2, kv_lora=16, qk_rope=8, index_hd=0, nic=0, vocab=1 << 24)
TIER = tiers.get("fp8")


def records(writer: int, seq: int, n: int, geometry: Geometry = GEOMETRY, tier=TIER) -> bytes:
    """The bytes of ``n`` records of append ``seq`` by ``writer`` (deterministic)."""
    rng = np.random.default_rng([writer, seq, n])
    tokens = writer * 1_000_000 + seq * 1_000 + np.arange(n, dtype=np.int32)
    L = rng.standard_normal((geometry.n_layers, n, geometry.kv_lora), dtype=np.float32)
    R = rng.standard_normal((geometry.n_layers, n, geometry.qk_rope), dtype=np.float32)
    return coli_kv.encode_records(geometry, tier, tokens, L, R).tobytes()


def rec_bytes(geometry: Geometry = GEOMETRY, tier=TIER) -> int:
    return coli_kv.record_bytes(geometry, tier)


def fingerprint_fields(model: str = "m") -> dict:
    """The model, geometry and tier of a JSON body (``POST /sessions``, ``POST /lookup``) for sessions
    of these rows."""
    return {
        "model": {"name": model, "revision": "1"},
        "geometry": {
            "n_layers": GEOMETRY.n_layers,
            "kv_lora": GEOMETRY.kv_lora,
            "qk_rope": GEOMETRY.qk_rope,
            "vocab": GEOMETRY.vocab,
        },
        "tier": TIER.name,
    }
