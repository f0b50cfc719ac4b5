"""Rows as a journal stores them: :class:`StoredRows`, the host-side form caches export and restore.

``LatentCache.export_rows`` produces them (the tier's ``file_tier``: codes and scales as stored, no
round trip) and ``LatentCache.restore`` takes them back; ``record_array``/``encode_file`` turn them
into ``.coli_kv`` records and files, ``from_records`` reads them out of a loaded file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore import tiers

__all__ = ["StoredRows"]


@dataclass
class StoredRows:
    """Rows in a ``.coli_kv`` version, layer-major, on the host.

    ``version`` 1: ``lc`` f32[n_layers, n, kv_lora], ``rc`` f32[n_layers, n, qk_rope], no scales.
    ``version`` 2: fp8 codes u8[n_layers, n, width] and per-row scales f32[n_layers, n].
    ``version`` 3: packed TQ codes u8[n_layers, n, rb(width)] and radii f32[n_layers, n]
    (``codec`` 0 polar / 1 int4, ``bits``).
    ``version`` 4: bf16 bit patterns u16[n_layers, n, width], no scales.
    """

    tokens: np.ndarray
    version: int
    lc: np.ndarray
    rc: np.ndarray
    lc_scales: np.ndarray | None = None
    rc_scales: np.ndarray | None = None
    codec: int | None = None
    bits: int | None = None

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.lc.shape[0])

    @property
    def tier(self) -> tiers.Tier:
        """The file tier of these rows (``f32``, ``bf16``, ``fp8``, ``int4``, ``polarB``)."""
        return tiers.from_file(self.version, self.codec, self.bits)

    @classmethod
    def from_records(cls, records) -> "StoredRows":
        """The rows of a loaded ``.coli_kv`` file (``KVRecords``), sanitized, without decoding codes."""
        tier = records.tier
        tokens = np.ascontiguousarray(records.tokens, dtype=np.int32)
        if tier is tiers.F32:
            lc, rc, _ = records.dequantize()
            return cls(tokens, 1, lc, rc)
        lc, lc_scales = records.quantized("L")
        rc, rc_scales = records.quantized("R")
        return cls(tokens, tier.version, lc, rc, lc_scales, rc_scales, tier.codec, tier.bits)

    def dequantize(self, kv_lora: int, qk_rope: int) -> tuple[np.ndarray, np.ndarray]:
        """f32 rows (L [n_layers, n, kv_lora], R [n_layers, n, qk_rope]) through the format codecs.

        A row whose stored scale or radius no encoder writes (``Tier.corrupt_scales``, the one bound
        of every reader) reads as zeros, as the file loader, the device restore and a cache of the
        rows' own tier read it: rows handed over in memory have no file or session to name, so they
        are made inert rather than refused (the strict readers refuse such a row where they can say
        where it is stored).
        """
        tier = self.tier
        if tier is tiers.F32:
            return np.asarray(self.lc, np.float32), np.asarray(self.rc, np.float32)
        out = []
        for codes, scales, width in ((self.lc, self.lc_scales, kv_lora), (self.rc, self.rc_scales, qk_rope)):
            with np.errstate(over="ignore", invalid="ignore"):
                rows = tier.dequantize(codes, scales, width)
            corrupt = tier.corrupt_scales(scales) if scales is not None else None
            if corrupt is not None and corrupt.any():  # e.g. an fp8 scale of 1e37 on code 0x7E: 448 * 1e37 is inf
                rows[corrupt] = 0.0
            if tier.rotated:
                # A radius near the f32 limit (only a damaged file has one) overflows on the way back:
                # such a row reads as zeros, as KVRecords.dequantize reads it.
                rows[~np.isfinite(rows).all(axis=-1)] = 0.0
            out.append(rows)
        return out[0], out[1]

    def record_array(self, geometry) -> np.ndarray:
        """The rows as ``.coli_kv`` records (structured array; ``.tobytes()`` is a file body).

        Codes and scales are copied as they are: no dequantize/requantize round trip.
        """
        from kvstore.formats import coli_kv

        records = np.zeros(self.n, dtype=coli_kv.record_dtype(geometry, self.tier))
        records["token"] = self.tokens
        layers = records["layers"]
        layers["Lc"] = self.lc.transpose(1, 0, 2)
        layers["Rc"] = self.rc.transpose(1, 0, 2)
        if self.lc_scales is not None and self.rc_scales is not None:  # v2, v3: a scale per row (not v4)
            layers["Ls"] = self.lc_scales.T
            layers["Rs"] = self.rc_scales.T
        return records

    def encode_file(self, geometry) -> bytes:
        """A complete ``.coli_kv`` image (header with ``nrec = n`` + records) for ``geometry``."""
        from kvstore.formats import coli_kv

        records = self.record_array(geometry)
        return coli_kv.Header(geometry, self.tier, self.n).to_bytes() + records.tobytes()
