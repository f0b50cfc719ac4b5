"""Readers for the golden vectors (tests/vectors, written by an independent implementation)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore.formats.coli_kv import Geometry

# The two geometries of tests/vectors/README.md.
GEOMETRIES = {
    "small": (Geometry(3, 64, 16, 0, 0, 1000), 7),
    "glm": (Geometry(2, 512, 64, 32, 1, 151552), 6),
}
V3_VARIANTS = ["v3c1b4", "v3c0b2", "v3c0b3", "v3c0b4", "v3c0b6"]


def read_src(directory: Path, name: str):
    """tokens int32[n], L f32[n_layers,n,kv_lora], R f32[n_layers,n,qk_rope], I f32[nic,n,index_hd] | None."""
    g, n = GEOMETRIES[name]
    raw = (directory / f"{name}.src.f32").read_bytes()
    tokens = np.frombuffer(raw, "<i4", n, 0)
    offset = 4 * n
    L = np.frombuffer(raw, "<f4", g.n_layers * n * g.kv_lora, offset).reshape(g.n_layers, n, g.kv_lora)
    offset += L.nbytes
    R = np.frombuffer(raw, "<f4", g.n_layers * n * g.qk_rope, offset).reshape(g.n_layers, n, g.qk_rope)
    offset += R.nbytes
    I = None
    if g.nic:
        I = np.frombuffer(raw, "<f4", g.nic * n * g.index_hd, offset).reshape(g.nic, n, g.index_hd)
        offset += I.nbytes
    if offset != len(raw):
        raise AssertionError(f"{name}.src.f32 has {len(raw) - offset} unexpected trailing bytes")
    return tokens, L, R, I


def read_expect(directory: Path, name: str, variant: str):
    """What a reader must return after dequantization: L then R."""
    g, n = GEOMETRIES[name]
    raw = (directory / f"{name}.{variant}.expect.f32").read_bytes()
    L = np.frombuffer(raw, "<f4", g.n_layers * n * g.kv_lora).reshape(g.n_layers, n, g.kv_lora)
    R = np.frombuffer(raw, "<f4", offset=L.nbytes).reshape(g.n_layers, n, g.qk_rope)
    return L, R
