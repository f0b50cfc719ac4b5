"""Row codecs as objects: an id, ``encode``/``decode`` over arrays, and a JSON-round-tripping config.

A codec turns f32 rows ``[..., n]`` into stored rows ``u8[..., row_bytes(n)]`` — exactly the bytes
one row occupies in a ``.coli_kv`` record (codes followed by the little-endian f32 scale or
radius; v1 rows are the raw f32 bytes) — and back. Codecs are frozen dataclasses registered by id,
so a tier can be named in a config file or an API call and rebuilt with :func:`get_codec`.

>>> codec = get_codec({"id": "fp8"})
>>> import numpy as np
>>> stored = codec.encode(np.array([[1.0, -2.0, 0.5, 4.0]], np.float32))
>>> stored.shape, codec.row_bytes(4)
((1, 8), 8)
>>> codec.decode(stored).tolist()
[[1.0, -2.0, 0.5, 4.0]]
>>> get_codec(get_codec({"id": "tq-polar", "bits": 3}).get_config())
TQPolar(bits=3)
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvstore.formats import fp8, q8, tq
from kvstore.formats.errors import FormatError


class Codec(abc.ABC):
    """A row codec. Subclasses are frozen dataclasses whose fields are their whole config."""

    codec_id: ClassVar[str]
    #: ``.coli_kv`` version and tag this codec stores as, or None for engine-only tiers.
    version: ClassVar[int | None] = None

    @abc.abstractmethod
    def row_bytes(self, n: int) -> int:
        """Stored bytes of one row of ``n`` values."""

    @abc.abstractmethod
    def encode(self, rows: np.ndarray) -> np.ndarray:
        """f32[..., n] -> u8[..., row_bytes(n)]."""

    @abc.abstractmethod
    def decode(self, stored: np.ndarray, n: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """u8[..., row_bytes(n)] -> f32[..., n] (``n`` is needed where row_bytes is not invertible)."""

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, **dataclasses.asdict(self)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Codec":
        fields = {k: v for k, v in config.items() if k != "id"}
        try:
            return cls(**fields)
        except TypeError as exc:
            raise FormatError(f"bad config for codec {cls.codec_id!r}: {exc}") from None


def _split(stored: np.ndarray, payload: int) -> tuple[np.ndarray, np.ndarray]:
    """Stored rows -> (codes u8[..., payload], trailing f32 scale/radius [...])."""
    stored = np.asarray(stored)
    if stored.dtype != np.uint8 or stored.shape[-1:] != (payload + 4,):
        raise FormatError(f"stored rows must be u8[..., {payload + 4}], got {stored.dtype}{stored.shape}")
    scales = np.ascontiguousarray(stored[..., payload:]).view("<f4")[..., 0]
    return stored[..., :payload], scales


def _join(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    stored = np.empty((*codes.shape[:-1], codes.shape[-1] + 4), dtype=np.uint8)
    stored[..., :-4] = codes
    stored[..., -4:] = np.ascontiguousarray(scales, dtype="<f4")[..., None].view(np.uint8)
    return stored


@dataclass(frozen=True)
class F32(Codec):
    """v1: raw little-endian f32."""

    codec_id: ClassVar[str] = "f32"
    version: ClassVar[int] = 1

    def row_bytes(self, n: int) -> int:
        return 4 * n

    def encode(self, rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows, dtype="<f4")
        return rows.view(np.uint8).reshape(*rows.shape[:-1], 4 * rows.shape[-1])

    def decode(self, stored, n=None, out=None):
        stored = np.ascontiguousarray(stored, dtype=np.uint8)
        rows = stored.view("<f4")
        if out is None:
            return rows.copy()
        out[...] = rows
        return out


@dataclass(frozen=True)
class Fp8(Codec):
    """v2: fp8 e4m3 codes + one f32 scale per row."""

    codec_id: ClassVar[str] = "fp8"
    version: ClassVar[int] = 2

    def row_bytes(self, n: int) -> int:
        return n + 4

    def encode(self, rows):
        return _join(*fp8.quantize_rows(rows))

    def decode(self, stored, n=None, out=None):
        codes, scales = _split(stored, np.shape(stored)[-1] - 4)
        return fp8.dequantize_rows(codes, scales, out=out)


@dataclass(frozen=True)
class _TQ(Codec):
    bits: int = 4
    tq_codec: ClassVar[int]
    version: ClassVar[int] = 3

    def __post_init__(self):
        tq.row_bytes(8, self.tq_codec, self.bits)  # validates codec/bits

    def row_bytes(self, n: int) -> int:
        return tq.row_bytes(n, self.tq_codec, self.bits) + 4

    def encode(self, rows):
        return _join(*tq.quantize_rows(rows, self.tq_codec, self.bits))

    def decode(self, stored, n=None, out=None):
        if n is None:
            raise FormatError(f"{self.codec_id} needs the row width n to decode")
        codes, radii = _split(stored, self.row_bytes(n) - 4)
        return tq.dequantize_rows(codes, radii, n, self.tq_codec, self.bits, out=out)


@dataclass(frozen=True)
class TQInt4(_TQ):
    """v3 codec 1: rotated int4 with the Lloyd-Max levels."""

    codec_id: ClassVar[str] = "tq-int4"
    tq_codec: ClassVar[int] = tq.CODEC_INT4


@dataclass(frozen=True)
class TQPolar(_TQ):
    """v3 codec 0: PolarQuant, 2..6 bits."""

    codec_id: ClassVar[str] = "tq-polar"
    tq_codec: ClassVar[int] = tq.CODEC_POLAR


@dataclass(frozen=True)
class Q8_0(Codec):
    """Engine tier only (no ``.coli_kv`` version): 32-value int8 blocks + an fp16 delta each.

    Stored row: the n int8 codes, then the n/32 fp16 deltas.
    """

    codec_id: ClassVar[str] = "int8"

    def row_bytes(self, n: int) -> int:
        return n + 2 * (n // q8.BLOCK)

    def encode(self, rows):
        codes, deltas = q8.quantize_blocks(rows)
        n = codes.shape[-1]
        stored = np.empty((*codes.shape[:-1], self.row_bytes(n)), dtype=np.uint8)
        stored[..., :n] = codes.view(np.uint8)
        stored[..., n:] = np.ascontiguousarray(deltas, dtype="<f2").view(np.uint8)
        return stored

    def decode(self, stored, n=None, out=None):
        stored = np.asarray(stored, dtype=np.uint8)
        total = stored.shape[-1]
        n = total * q8.BLOCK // (q8.BLOCK + 2)
        if self.row_bytes(n) != total:
            raise FormatError(f"{total} bytes is not a Q8_0 row")
        codes = np.ascontiguousarray(stored[..., :n]).view(np.int8)
        deltas = np.ascontiguousarray(stored[..., n:]).view("<f2")
        return q8.dequantize_blocks(codes, deltas, out=out)


REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    REGISTRY[cls.codec_id] = cls
    return cls


def get_codec(config: dict[str, Any] | str) -> Codec:
    """Build a codec from its config (``{"id": ..., **fields}``) or bare id."""
    if isinstance(config, str):
        config = {"id": config}
    codec_id = config.get("id")
    if codec_id not in REGISTRY:
        raise FormatError(f"unknown codec {codec_id!r} (known: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[codec_id].from_config(config)


for _cls in (F32, Fp8, TQInt4, TQPolar, Q8_0):
    register_codec(_cls)
