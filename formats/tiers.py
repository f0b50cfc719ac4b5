"""The tier vocabulary: every way kvstore holds a latent row, as data, under one name each.

A *tier* is one word used everywhere — the CLI's ``--tier``, the API's JSON field ``tier``, the
engine's caches, the GPU uploads and the docs:

=========  =====  =====  ====  ==========================  =====  ======================================
name       file   codec  bits  bytes of a row of n values  lossy  what a row holds
=========  =====  =====  ====  ==========================  =====  ======================================
``f32``    v1     -      -     ``4n``                      no     f32 values
``bf16``   (v1)   -      -     ``2n``                      yes    bf16 values; journals as f32 (exact)
``fp8``    v2     -      -     ``n + 4``                   yes    e4m3 codes + one f32 scale
``int4``   v3     1      4     ``n/2 + 4``                 yes    rotated int4 codes + one f32 radius
``polarB`` v3     0      B     ``rb(n) + 4``               yes    PolarQuant codes (B = 2..6) + radius
``q8``     (v1)   -      -     ``n + 2n/32``               yes    Q8_0 int8 codes + an f16 delta per 32
=========  =====  =====  ====  ==========================  =====  ======================================

``bf16`` and ``q8`` are cache tiers with no ``.coli_kv`` version of their own: their journals hold
f32 rows (:attr:`Tier.file_tier`). Every constant a tier needs — the fp8 scale bounds, the TQ
rotation seed and int4 levels — is defined once, in :mod:`~kvstore.formats.fp8` and
:mod:`~kvstore.formats.tq`; torch twins and kernels derive theirs from those modules.

Each tier is also a row codec in the numcodecs manner: an id (its name), ``encode``/``decode`` over
arrays (the bytes one row takes inside a record: codes, then the little-endian scale or radius),
and a config that round-trips through JSON (:func:`get_codec`). ``quantize``/``dequantize`` give the
same rows split into codes and scales, as caches and record fields hold them.

This module lives in ``formats`` (numpy only) because the file layouts name tiers; ``kvstore.tiers``
is the same module under the name the rest of the project uses.

Examples
--------
>>> import numpy as np
>>> tier = parse("fp8")
>>> tier.version, tier.row_bytes(512), tier.lossy
(2, 516, True)
>>> stored = tier.encode(np.array([[1.0, -2.0, 0.5, 4.0]], np.float32))
>>> stored.shape, tier.decode(stored).tolist()
((1, 8), [[1.0, -2.0, 0.5, 4.0]])
>>> get("polar3").describe()
'polar3 (v3, PolarQuant 3-bit codes + radius)'
>>> get_codec(get("polar3").get_config()) is get("polar3")
True
>>> resolve("tq-polar", bits=3)
(Tier('polar3'), "tier 'tq-polar' (bits 3) is deprecated: use 'polar3'")
>>> [t.name for t in TIERS.values() if t.in_file]
['f32', 'fp8', 'int4', 'polar2', 'polar3', 'polar4', 'polar5', 'polar6']
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.formats import fp8, q8, tq
from kvstore.formats.errors import BadHeader, FormatError, UnknownTier

__all__ = [
    "BF16",
    "F32",
    "FP8",
    "INT4",
    "POLAR_BITS",
    "Q8",
    "TIERS",
    "Tier",
    "TierSpellingDeprecated",
    "UnknownTier",
    "from_file",
    "from_header",
    "get",
    "get_codec",
    "names",
    "parse",
    "polar",
    "resolve",
]

#: Bit widths PolarQuant takes (codec 0); rotated int4 (codec 1) always takes 4.
POLAR_BITS = (2, 3, 4, 5, 6)
#: Header tags of v1 and v2 (h7); v3 tags are ``(codec << 8) | bits``.
_PLAIN_TAGS = {1: 0, 2: 1}


class TierSpellingDeprecated(FutureWarning):
    """A tier was named with an old spelling (``tq-int4``, ``v3:polar:3``, ``--codec``/``--bits``, ...).

    A FutureWarning (shown to end users by default) rather than a DeprecationWarning (hidden
    outside ``__main__``): the people who must change a spelling are the ones typing it.
    """


@dataclass(frozen=True)
class Tier:
    """One tier of the vocabulary. Instances are the singletons of :data:`TIERS` (compare with ``==``).

    Attributes
    ----------
    name : the canonical spelling (``f32``, ``bf16``, ``fp8``, ``int4``, ``polar2`` .. ``polar6``, ``q8``)
    version : the ``.coli_kv`` version a journal of this tier holds (1, 2 or 3)
    codec : v3 codec id (``tq.CODEC_POLAR`` 0 / ``tq.CODEC_INT4`` 1), else None
    bits : v3 bits, else None
    in_file : rows are stored in a file exactly as this tier holds them (False for ``bf16``/``q8``,
        whose journals hold f32 rows)
    lossy : encoding can change a value
    label : what a row holds, for people
    """

    name: str
    version: int
    codec: int | None = None
    bits: int | None = None
    in_file: bool = True
    lossy: bool = True
    label: str = field(default="", compare=False)

    def __repr__(self) -> str:
        return f"Tier({self.name!r})"

    # ---- the file side --------------------------------------------------------------------------
    @property
    def tag(self) -> int:
        """Header word h7 of this tier's journal: v1 -> 0, v2 -> 1, v3 -> ``(codec << 8) | bits``."""
        tier = self.file_tier
        if tier.version == 3:
            return ((tier.codec or 0) << 8) | (tier.bits or 0)
        return _PLAIN_TAGS[tier.version]

    @property
    def file_tier(self) -> "Tier":
        """The tier a journal of this tier holds: itself, or ``f32`` for ``bf16``/``q8``."""
        return self if self.in_file else F32

    @property
    def codec_name(self) -> str | None:
        """The v3 codec's name as the old API spelled it (``int4``/``polar``), else None."""
        if self.version != 3 or not self.in_file:
            return None
        return "int4" if self.codec == tq.CODEC_INT4 else "polar"

    @property
    def rotated(self) -> bool:
        """TQ tiers store rows in the rotated domain (attention can stay there)."""
        return self.version == 3 and self.in_file

    def describe(self) -> str:
        """``fp8 (v2, e4m3 codes + f32 scale)``: the name, the file version and what a row holds."""
        if self.in_file:
            return f"{self.name} (v{self.version}, {self.label})"
        return f"{self.name} ({self.label}; journals as v1 f32)"

    def to_dict(self) -> dict[str, Any]:
        """``{"name", "version", "codec", "bits", "description"}``: the tier in JSON reports (API, CLI).

        ``codec`` is the v3 codec's old name (``int4``/``polar``) and ``bits`` the v3 bits, as
        reports showed them before tiers had names.
        """
        return {
            "name": self.name,
            "version": self.version,
            "codec": self.codec_name,
            "bits": self.bits,
            "description": self.describe(),
        }

    # ---- sizes ----------------------------------------------------------------------------------
    def payload_bytes(self, width: int) -> int:
        """Bytes of one row's codes or values, without its trailing scale/radius float (if any)."""
        if self.name == "f32":
            return 4 * width
        if self.name == "bf16":
            return 2 * width
        if self.name == "fp8":
            return width
        if self.name == "q8":
            return width
        return tq.row_bytes(width, self.codec, self.bits)

    def scale_bytes(self, width: int) -> int:
        """Bytes of one row's scale part: the f32 scale/radius (v2, v3), the f16 deltas (q8), else 0."""
        if self.name == "q8":
            return 2 * (width // q8.BLOCK)
        return 4 if self.version in (2, 3) and self.in_file else 0

    def row_bytes(self, width: int) -> int:
        """Bytes one row of ``width`` values takes in this tier (inside a record, for file tiers)."""
        return self.payload_bytes(width) + self.scale_bytes(width)

    def width_problem(self, width: int) -> str | None:
        """Why this tier cannot hold rows of ``width`` values, or None when it can."""
        if self.version == 3 and self.in_file and not tq.encodable(width):
            return f"{self.name} needs power-of-two row widths in {tq.MIN_WIDTH}..{tq.MAX_WIDTH}, got {width}"
        if self.name == "q8" and width % q8.BLOCK:
            return f"q8 (Q8_0) needs row widths that are multiples of {q8.BLOCK}, got {width}"
        return None

    # ---- codes and scales -----------------------------------------------------------------------
    def corrupt_scales(self, scales: np.ndarray) -> np.ndarray:
        """Mask of stored per-row scales (fp8) or radii (int4, polarB) that no encoder writes.

        The one bound every reader applies (FORMAT.md section 4): fp8 ``fp8.bad_scales`` (not in
        ``(0, 3.4e38/448]``, NaN included, so ``lut[0x7E] * scale`` stays finite), TQ
        ``tq.sanitize_radii`` (not in ``[0, 3.4e38)``). The file loader makes those rows inert,
        ``gpu.codecs.sanitize_fp8_``/``sanitize_tq_`` do the same on a device, and strict readers
        refuse them (``coli_kv.check_scales``). All False for tiers without a per-row scale.

        >>> FP8.corrupt_scales(np.array([1.0, 1e37, 0.0, np.nan], np.float32)).tolist()
        [False, True, True, True]
        """
        scales = np.asarray(scales, dtype=np.float32)
        tier = self.file_tier
        if tier.version == 2:
            return fp8.bad_scales(scales)
        if tier.version == 3:
            return tq.sanitize_radii(scales)[1]
        return np.zeros(scales.shape, dtype=bool)

    @property
    def scale_range(self) -> str:
        """The stored scales/radii :meth:`corrupt_scales` accepts, for messages (``(0, 7.589e+35]``)."""
        if self.file_tier.version == 2:
            return f"(0, {float(fp8.MAX_SCALE):.4g}]"
        if self.file_tier.version == 3:
            return f"[0, {float(tq.RADIUS_CEIL):.4g})"
        return "none (no per-row scale)"

    def quantize(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Encode f32 rows into this tier's fields.

        Parameters
        ----------
        rows : f32[..., n]

        Returns
        -------
        codes : f32[..., n] (f32), u16[..., n] (bf16 bit patterns), u8[..., n] (fp8),
            u8[..., payload_bytes(n)] (TQ), int8[..., n] (q8)
        scales : None (f32, bf16), f32[...] (fp8 scales, TQ radii), f16[..., n/32] (q8 deltas)
        """
        if self.name == "f32":
            return np.ascontiguousarray(rows, dtype=np.float32), None
        if self.name == "bf16":
            return _bf16_encode(np.asarray(rows, dtype=np.float32)), None
        if self.name == "fp8":
            return fp8.quantize_rows(rows)
        if self.name == "q8":
            return q8.quantize_blocks(rows)
        return tq.quantize_rows(rows, self.codec, self.bits)

    def dequantize(
        self,
        codes: np.ndarray,
        scales: np.ndarray | None = None,
        width: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Inverse of :meth:`quantize`: f32[..., n] (``width`` = n is needed for the TQ tiers)."""
        if self.name == "f32":
            rows = np.asarray(codes, dtype=np.float32)
        elif self.name == "bf16":
            rows = _bf16_decode(np.asarray(codes))
        elif self.name == "fp8":
            return fp8.dequantize_rows(codes, scales, out=out)
        elif self.name == "q8":
            return q8.dequantize_blocks(codes, scales, out=out)
        else:
            if width is None:
                raise FormatError(f"{self.name} needs the row width to decode")
            return tq.dequantize_rows(codes, scales, width, self.codec, self.bits, out=out)
        if out is None:
            return rows.copy() if rows is codes else rows
        out[...] = rows
        return out

    # ---- a codec over stored row bytes (numcodecs style) ----------------------------------------
    @property
    def codec_id(self) -> str:
        return self.name

    def get_config(self) -> dict[str, Any]:
        """The JSON-able config :func:`get_codec` rebuilds this tier from."""
        return {"id": self.name}

    def encode(self, rows: np.ndarray) -> np.ndarray:
        """f32[..., n] -> u8[..., row_bytes(n)]: the bytes each row takes (codes, then scale part)."""
        codes, scales = self.quantize(rows)
        codes = np.ascontiguousarray(codes)
        lead = codes.shape[:-1]
        payload = codes.view(np.uint8).reshape(*lead, -1)
        if scales is None:
            return payload
        scale_bytes = np.ascontiguousarray(scales, dtype=scales.dtype.newbyteorder("<")).view(np.uint8)
        stored = np.empty(
            (*lead, payload.shape[-1] + scale_bytes.size // max(1, int(np.prod(lead, dtype=np.int64)))), np.uint8
        )
        stored[..., : payload.shape[-1]] = payload
        stored[..., payload.shape[-1] :] = scale_bytes.reshape(*lead, -1)
        return stored

    def decode(self, stored: np.ndarray, width: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """u8[..., row_bytes(n)] -> f32[..., n]; ``width`` is needed only where bytes do not fix it (TQ)."""
        stored = np.asarray(stored)
        if stored.dtype != np.uint8 or stored.ndim == 0:
            raise FormatError(f"stored rows must be u8[..., bytes], got {stored.dtype}{stored.shape}")
        total = stored.shape[-1]
        if width is None:
            width = self._width_of(total)
        if self.row_bytes(width) != total:
            raise FormatError(f"{self.name} rows of {width} values take {self.row_bytes(width)} bytes, got {total}")
        payload = np.ascontiguousarray(stored[..., : self.payload_bytes(width)])
        tail = np.ascontiguousarray(stored[..., self.payload_bytes(width) :])
        if self.name == "f32":
            return self.dequantize(payload.view("<f4"), out=out)
        if self.name == "bf16":
            return self.dequantize(payload.view("<u2"), out=out)
        if self.name == "q8":
            return self.dequantize(payload.view(np.int8), tail.view("<f2"), out=out)
        return self.dequantize(payload, tail.view("<f4")[..., 0], width, out=out)

    def _width_of(self, total: int) -> int:
        if self.name == "f32":
            return total // 4
        if self.name == "bf16":
            return total // 2
        if self.name == "fp8":
            return total - 4
        if self.name == "q8":
            return total * q8.BLOCK // (q8.BLOCK + 2)
        raise FormatError(f"{self.name} needs the row width n to decode")


# ---- bf16 on the host: round to nearest even, as torch's conversion does ---------------------------
def _bf16_encode(rows: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (bits >> np.uint32(16)) | np.uint32(0x40)  # a NaN stays a NaN (rounding could make it inf)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def _bf16_decode(codes: np.ndarray) -> np.ndarray:
    return (codes.astype(np.uint32) << np.uint32(16)).view(np.float32)


# ---- the table -----------------------------------------------------------------------------------
F32 = Tier("f32", 1, lossy=False, label="f32 values")
BF16 = Tier("bf16", 1, in_file=False, label="bf16 values")
FP8 = Tier("fp8", 2, label="e4m3 codes + f32 scale")
INT4 = Tier("int4", 3, tq.CODEC_INT4, 4, label="rotated int4 codes + radius")
Q8 = Tier("q8", 1, in_file=False, label="Q8_0 int8 blocks + f16 deltas")
_POLAR = {
    bits: Tier(f"polar{bits}", 3, tq.CODEC_POLAR, bits, label=f"PolarQuant {bits}-bit codes + radius")
    for bits in POLAR_BITS
}

#: Every tier by its canonical name, in the order the docs list them.
TIERS: dict[str, Tier] = {t.name: t for t in (F32, BF16, FP8, INT4, *_POLAR.values(), Q8)}
_BY_FILE = {(t.version, t.codec, t.bits): t for t in TIERS.values() if t.in_file}


def names(*, in_file: bool | None = None) -> list[str]:
    """Canonical names, optionally only the file tiers (``in_file=True``) or the cache-only ones."""
    return [name for name, t in TIERS.items() if in_file is None or t.in_file == in_file]


def get(name: str) -> Tier:
    """The tier of a canonical name (no old spellings: see :func:`parse`)."""
    tier = TIERS.get(name)
    if tier is None:
        raise UnknownTier(f"unknown tier {name!r} (known: {', '.join(TIERS)})")
    return tier


def polar(bits: int) -> Tier:
    """PolarQuant at ``bits`` (2..6)."""
    tier = _POLAR.get(bits) if isinstance(bits, (int, np.integer)) and not isinstance(bits, bool) else None
    if tier is None:
        raise UnknownTier(f"PolarQuant takes bits {POLAR_BITS[0]}..{POLAR_BITS[-1]}, got {bits!r}")
    return tier


def from_file(version: int, codec: int | None = None, bits: int | None = None) -> Tier:
    """The file tier stored as ``.coli_kv`` ``version`` (and, for v3, ``codec``/``bits``)."""
    if version in (1, 2):
        if codec is not None or bits is not None:
            raise UnknownTier(f"codec/bits only apply to v3 files, got version {version}")
        return F32 if version == 1 else FP8
    if version != 3:
        raise UnknownTier(f"unknown .coli_kv version {version} (known: 1, 2, 3)")
    tier = _BY_FILE.get((3, codec, bits))
    if tier is None:
        if codec not in (tq.CODEC_POLAR, tq.CODEC_INT4):
            raise UnknownTier(f"unknown TQ codec {codec} (0 = polar, 1 = int4)")
        allowed = (4,) if codec == tq.CODEC_INT4 else POLAR_BITS
        raise UnknownTier(f"{'int4' if codec == tq.CODEC_INT4 else 'polar'} takes bits {allowed}, got {bits}")
    return tier


def from_header(version: int, tag: int) -> Tier:
    """The tier of a header's magic version and h7 tag; raises BadHeader when they name none."""
    try:
        if version == 3:
            return from_file(3, tag >> 8, tag & 0xFF)
        tier = from_file(version)
    except UnknownTier as exc:
        raise BadHeader(exc.reason) from None
    if tag != tier.tag:
        raise BadHeader(f"v{version} header has tag {tag}, expected {tier.tag}")
    return tier


# ---- old spellings -------------------------------------------------------------------------------
# Accepted for one release with a TierSpellingDeprecated warning: `v1`/`v2`/`v3` (+ `--codec`,
# `--bits`), the engine's `tq-int4`/`tq-polar`/`int8`, the API's `polar-3`, and `v3:polar:3`.
_OLD_NAMES = {"v1": "f32", "1": "f32", "v2": "fp8", "2": "fp8", "tq-int4": "int4", "tq": "int4", "int8": "q8"}
_OLD_PATTERN = re.compile(
    r"^(?:v3|3)(?::(?P<codec>polar|int4)(?::(?P<bits>\d+))?)?$|^(?:tq-)?polar(?:-(?P<pbits>\d+))?$"
)


def resolve(text: str, *, codec: str | None = None, bits: int | None = None) -> tuple[Tier, str | None]:
    """The tier ``text`` names, and a deprecation note when it is an old spelling (else None).

    Parameters
    ----------
    text : a canonical name, or an old spelling (``v2``, ``tq-int4``, ``tq-polar``, ``polar-3``,
        ``v3:polar:3``, ``int8``, ...)
    codec, bits : the old ``--codec``/``--bits`` options; with a canonical name, ``bits`` may only
        repeat what the name says

    Raises
    ------
    UnknownTier
    """
    if not isinstance(text, str):
        raise UnknownTier(f"a tier is named by a string, got {type(text).__name__}")
    key = text.strip().lower()
    if key in TIERS and codec is None:
        tier = TIERS[key]
        if bits is not None and bits != tier.bits:
            if tier.codec == tq.CODEC_POLAR or key == "polar":
                raise UnknownTier(f"tier {text!r} has {tier.bits} bits, not {bits}: name polar{bits} instead")
            raise UnknownTier(f"--bits does not apply to tier {text!r}")
        return tier, None
    if key in _OLD_NAMES and key not in ("v1", "1", "v2", "2"):
        tier = TIERS[_OLD_NAMES[key]]
        if codec is not None or (bits is not None and bits != tier.bits):
            raise UnknownTier(f"codec/bits do not apply to tier {text!r}")
    elif key in ("v1", "1", "v2", "2"):
        if codec is not None or bits is not None:
            raise UnknownTier(f"codec/bits only apply to v3, not {text!r}")
        tier = TIERS[_OLD_NAMES[key]]
    else:
        match = _OLD_PATTERN.match(key)
        if match is None:
            raise UnknownTier(f"unknown tier {text!r} (known: {', '.join(TIERS)})")
        name = match.group("codec") or ("polar" if match.group("pbits") is not None or "polar" in key else None)
        named_bits = match.group("bits") or match.group("pbits")
        if codec is not None:
            if name is not None and codec != name:
                raise UnknownTier(f"tier {text!r} is not codec {codec!r}")
            name = codec
        name = name or "int4"
        if named_bits is not None:
            if bits is not None and bits != int(named_bits):
                raise UnknownTier(f"tier {text!r} has {named_bits} bits, not {bits}")
            bits = int(named_bits)
        if name == "int4":
            if bits not in (None, 4):
                raise UnknownTier(f"int4 takes 4 bits, got {bits}")
            tier = INT4
        elif name == "polar":
            tier = polar(4 if bits is None else bits)
        else:
            raise UnknownTier(f"unknown codec {name!r}: use polar or int4")
    return tier, _note(text, codec, bits, tier)


def _note(text: str, codec: str | None, bits: int | None, tier: Tier) -> str:
    extra = ", ".join(
        part for part in (f"codec {codec}" if codec else "", f"bits {bits}" if bits is not None else "") if part
    )
    return f"tier {text!r}{f' ({extra})' if extra else ''} is deprecated: use {tier.name!r}"


def parse(text: str, *, codec: str | None = None, bits: int | None = None) -> Tier:
    """:func:`resolve`, warning (:class:`TierSpellingDeprecated`) when an old spelling was used.

    >>> parse("int4") is INT4
    True
    """
    tier, note = resolve(text, codec=codec, bits=bits)
    if note is not None:
        warnings.warn(note, TierSpellingDeprecated, stacklevel=2)
    return tier


def get_codec(config: dict[str, Any] | str) -> Tier:
    """The tier a codec config (``{"id": name}``, or a bare name) describes.

    Old configs (``{"id": "tq-polar", "bits": 3}``, ``{"id": "int8"}``) are read with a warning.
    """
    if isinstance(config, str):
        config = {"id": config}
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise UnknownTier(f"a codec config is a dict with a string 'id', got {config!r}")
    extra = set(config) - {"id", "bits"}
    if extra:
        raise UnknownTier(f"unknown codec config keys {sorted(extra)}")
    return parse(config["id"], bits=config.get("bits"))
