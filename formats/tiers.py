"""The tier vocabulary: every way kvstore holds a latent row, as data, under one name each.

A *tier* is one word used everywhere — the CLI's ``--tier``, the API's JSON field ``tier``, the
engine's caches, the GPU uploads and the docs:

=========  =====  =====  ====  ==========================  =====  ======================================
name       file   codec  bits  bytes of a row of n values  lossy  what a row holds
=========  =====  =====  ====  ==========================  =====  ======================================
``f32``    v1     -      -     ``4n``                      no     f32 values
``bf16``   v4     -      -     ``2n``                      yes    bf16 values (exact for a bf16 cache)
``fp8``    v2     -      -     ``n + 4``                   yes    e4m3 codes + one f32 scale
``int4``   v3     1      4     ``n/2 + 4``                 yes    rotated int4 codes + one f32 radius
``polarB`` v3     0      B     ``rb(n) + 4``               yes    PolarQuant codes (B = 2..6) + radius
``q8``     (v1)   -      -     ``n + 2n/32``               yes    Q8_0 int8 codes + an f16 delta per 32
=========  =====  =====  ====  ==========================  =====  ======================================

``q8`` is a cache tier with no ``.coli_kv`` version of its own: its journals hold f32 rows
(:attr:`Tier.file_tier`). ``bf16`` (v4) is a kvstore extension of the C engine's family: that
engine, and kvstore before it, refuse its magic as unknown (docs/FORMAT.md section 1).

Each tier is the name of one registered row codec (:mod:`kvstore.formats.codecs`: one frozen class
per family — ``F32Codec``, ``BF16Codec``, ``FP8Codec``, ``Int4Codec``, ``PolarCodec``, ``Q8Codec`` —
registered at the bottom of the module that owns its arithmetic), and the table below is built
from that registry. A :class:`Tier` holds its codec (:attr:`Tier.row_codec`) and delegates to it
everything that differs between tiers: sizes, codes and scales, the stored bytes of a row (codes,
then the little-endian scale or radius), the scale bound every reader applies. It is a codec in
the numcodecs manner too: an id (its name), ``encode``/``decode`` over arrays and a config that
round-trips through JSON (:func:`get_codec`); ``quantize``/``dequantize`` give the same rows split
into codes and scales, as caches and record fields hold them. Every constant a codec needs — the
fp8 scale bounds, the TQ rotation seed and int4 levels — is defined once, in its module; torch
twins and kernels derive theirs from those modules.

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
['f32', 'bf16', 'fp8', 'int4', 'polar2', 'polar3', 'polar4', 'polar5', 'polar6']
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.formats import tq
from kvstore.formats.codecs import RowCodec, registered_codecs
from kvstore.formats.errors import BadHeader, UnknownTier

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
POLAR_BITS = tq.POLAR_BITS


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
    version : the ``.coli_kv`` version a journal of this tier holds (1, 2, 3 or 4)
    codec : v3 codec id (``tq.CODEC_POLAR`` 0 / ``tq.CODEC_INT4`` 1), else None
    bits : v3 bits, else None
    in_file : rows are stored in a file exactly as this tier holds them (False for ``q8``, whose
        journals hold f32 rows)
    lossy : encoding can change a value
    label : what a row holds, for people
    row_codec : the registered codec (:mod:`kvstore.formats.codecs`) every method below delegates to
    """

    name: str
    version: int
    codec: int | None = None
    bits: int | None = None
    in_file: bool = True
    lossy: bool = True
    label: str = field(default="", compare=False)
    row_codec: RowCodec = field(compare=False, repr=False, kw_only=True)

    @classmethod
    def of(cls, row_codec: RowCodec) -> Tier:
        """The tier that names a registered codec."""
        return cls(
            row_codec.name,
            row_codec.version,
            row_codec.tq_codec,
            row_codec.bits,
            row_codec.in_file,
            row_codec.lossy,
            row_codec.label,
            row_codec=row_codec,
        )

    def __repr__(self) -> str:
        return f"Tier({self.name!r})"

    # ---- the file side --------------------------------------------------------------------------
    @property
    def tag(self) -> int:
        """Header word h7 of this tier's journal: v1 -> 0, v2 -> 1, v3 -> ``(codec << 8) | bits``, v4 -> 16."""
        return self.file_tier.row_codec.header_tag

    @property
    def file_tier(self) -> Tier:
        """The tier a journal of this tier holds: itself, or ``f32`` for ``q8``."""
        return self if self.in_file else F32

    @property
    def holds_values(self) -> bool:
        """A journal of this tier stores float values (f32, bf16), not codes with a scale: a
        non-finite value is written as 0, and one stored is damage (``nan_values``)."""
        return self.file_tier.row_codec.holds_values

    @property
    def codec_name(self) -> str | None:
        """The v3 codec's name as the old API spelled it (``int4``/``polar``), else None."""
        return self.row_codec.codec_name

    @property
    def rotated(self) -> bool:
        """TQ tiers store rows in the rotated domain (attention can stay there)."""
        return self.row_codec.rotated

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
        return self.row_codec.payload_bytes(width)

    def scale_bytes(self, width: int) -> int:
        """Bytes of one row's scale part: the f32 scale/radius (v2, v3), the f16 deltas (q8), else 0."""
        return self.row_codec.scale_bytes(width)

    def row_bytes(self, width: int) -> int:
        """Bytes one row of ``width`` values takes in this tier (inside a record, for file tiers)."""
        return self.row_codec.row_bytes(width)

    def width_problem(self, width: int) -> str | None:
        """Why this tier cannot hold rows of ``width`` values, or None when it can."""
        return self.row_codec.width_problem(width)

    # ---- codes and scales -----------------------------------------------------------------------
    def corrupt_scales(self, scales: np.ndarray) -> np.ndarray:
        """Mask of stored per-row scales (fp8) or radii (int4, polarB) that no encoder writes.

        The one bound every reader applies (docs/FORMAT.md section 4): fp8 ``fp8.bad_scales`` (not in
        ``(0, 3.4e38/448]``, NaN included, so ``lut[0x7E] * scale`` stays finite), TQ
        ``tq.sanitize_radii`` (not in ``[0, 3.4e38)``). The file loader makes those rows inert,
        ``gpu.codecs.sanitize_fp8_``/``sanitize_tq_`` do the same on a device, and strict readers
        refuse them (``coli_kv.check_scales``). All False for tiers without a per-row scale (and
        for ``q8``, whose journals hold f32 rows).

        >>> FP8.corrupt_scales(np.array([1.0, 1e37, 0.0, np.nan], np.float32)).tolist()
        [False, True, True, True]
        """
        return self.file_tier.row_codec.corrupt_scales(np.asarray(scales, dtype=np.float32))

    @property
    def scale_range(self) -> str:
        """The stored scales/radii :meth:`corrupt_scales` accepts, for messages (``(0, 7.589e+35]``)."""
        return self.file_tier.row_codec.scale_range

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
        return self.row_codec.quantize(rows)

    def dequantize(
        self,
        codes: np.ndarray,
        scales: np.ndarray | None = None,
        width: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Inverse of :meth:`quantize`: f32[..., n] (``width`` = n is needed for the TQ tiers)."""
        return self.row_codec.dequantize(codes, scales, width, out=out)

    # ---- a codec over stored row bytes (numcodecs style) ----------------------------------------
    @property
    def codec_id(self) -> str:
        return self.name

    def get_config(self) -> dict[str, Any]:
        """The JSON-able config :func:`get_codec` rebuilds this tier from."""
        return {"id": self.name}

    def encode(self, rows: np.ndarray) -> np.ndarray:
        """f32[..., n] -> u8[..., row_bytes(n)]: the bytes each row takes (codes, then scale part)."""
        return self.row_codec.encode(rows)

    def decode(self, stored: np.ndarray, width: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """u8[..., row_bytes(n)] -> f32[..., n]; ``width`` is needed only where bytes do not fix it (TQ)."""
        return self.row_codec.decode(stored, width, out=out)


# ---- the table: one tier per registered codec ------------------------------------------------------
#: Every tier by its canonical name, in the order the docs list them.
TIERS: dict[str, Tier] = {name: Tier.of(codec) for name, codec in registered_codecs().items()}
F32 = TIERS["f32"]
BF16 = TIERS["bf16"]
FP8 = TIERS["fp8"]
INT4 = TIERS["int4"]
Q8 = TIERS["q8"]
_POLAR = {t.bits: t for t in TIERS.values() if t.codec == tq.CODEC_POLAR}
#: File tiers by (version, codec, bits) and by (version, header tag); the versions whose tag carries
#: a codec and bits (v3), and each such codec id's old name.
_BY_FILE = {(t.version, t.codec, t.bits): t for t in TIERS.values() if t.in_file}
_BY_HEADER = {(t.version, t.tag): t for t in _BY_FILE.values()}
_CODED_VERSIONS = frozenset(t.version for t in _BY_FILE.values() if t.codec is not None)
_CODEC_NAMES = {t.codec: t.codec_name for t in _BY_FILE.values() if t.codec is not None}
#: The TQ families by their old codec name (``int4``, ``polar``): their tiers by bits.
_BY_CODEC_NAME: dict[str, dict[int, Tier]] = {}
for _tier in _BY_FILE.values():
    if _tier.codec_name is not None and _tier.bits is not None:
        _BY_CODEC_NAME.setdefault(_tier.codec_name, {})[_tier.bits] = _tier


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
    tier = _BY_FILE.get((version, codec, bits))
    if tier is not None:
        return tier
    versions = sorted({t.version for t in _BY_FILE.values()})
    if version not in versions:
        raise UnknownTier(f"unknown .coli_kv version {version} (known: {', '.join(map(str, versions))})")
    if version not in _CODED_VERSIONS:
        raise UnknownTier(f"codec/bits only apply to v3 files, got version {version}")
    if codec not in _CODEC_NAMES:
        known = ", ".join(f"{number} = {name}" for number, name in sorted(_CODEC_NAMES.items()))
        raise UnknownTier(f"unknown TQ codec {codec} ({known})")
    allowed = tuple(sorted(b for (v, c, b) in _BY_FILE if v == version and c == codec and b is not None))
    raise UnknownTier(f"{_CODEC_NAMES[codec]} takes bits {allowed}, got {bits}")


def from_header(version: int, tag: int) -> Tier:
    """The tier of a header's magic version and h7 tag; raises BadHeader when they name none."""
    try:
        if version in _CODED_VERSIONS:
            return from_file(version, tag >> 8, tag & 0xFF)
        tier = from_file(version)
    except UnknownTier as exc:
        raise BadHeader(exc.reason) from None
    if tag != tier.tag:
        raise BadHeader(f"v{version} header has tag {tag}, expected {tier.tag}")
    return tier


# ---- old spellings -------------------------------------------------------------------------------
# Accepted for one release with a TierSpellingDeprecated warning: `v1`/`v2`/`v3` (+ `--codec`,
# `--bits`), the engine's `tq-int4`/`tq-polar`/`int8`, the API's `polar-3`, and `v3:polar:3`.
_OLD_NAMES = {"tq-int4": "int4", "tq": "int4", "int8": "q8"}
_OLD_VERSIONS = {"v1": "f32", "1": "f32", "v2": "fp8", "2": "fp8"}
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
            if tier.codec == tq.CODEC_POLAR:
                raise UnknownTier(f"tier {text!r} has {tier.bits} bits, not {bits}: name polar{bits} instead")
            raise UnknownTier(f"--bits does not apply to tier {text!r}")
        return tier, None
    old_name, old_version = _OLD_NAMES.get(key), _OLD_VERSIONS.get(key)
    if old_name is not None:
        tier = TIERS[old_name]
        if codec is not None or (bits is not None and bits != tier.bits):
            raise UnknownTier(f"codec/bits do not apply to tier {text!r}")
    elif old_version is not None:
        if codec is not None or bits is not None:
            raise UnknownTier(f"codec/bits only apply to v3, not {text!r}")
        tier = TIERS[old_version]
    else:
        tier, bits = _resolve_v3(text, key, codec, bits)
    return tier, _note(text, codec, bits, tier)


def _resolve_v3(text: str, key: str, codec: str | None, bits: int | None) -> tuple[Tier, int | None]:
    """The old v3 spellings: ``v3`` (+ ``--codec``/``--bits``), ``v3:polar:3``, ``tq-polar``, ``polar-3``;
    returns the tier and the bits named (in the text or by ``bits``)."""
    match = _OLD_PATTERN.match(key)
    if match is None:
        raise UnknownTier(f"unknown tier {text!r} (known: {', '.join(TIERS)})")
    name = match.group("codec") or ("polar" if match.group("pbits") is not None or "polar" in key else None)
    named_bits = match.group("bits") or match.group("pbits")
    if codec is not None:
        if name is not None and codec != name:
            raise UnknownTier(f"tier {text!r} is not codec {codec!r}")
        name = codec
    name = name or "int4"  # a bare `v3` was rotated int4
    if named_bits is not None:
        if bits is not None and bits != int(named_bits):
            raise UnknownTier(f"tier {text!r} has {named_bits} bits, not {bits}")
        bits = int(named_bits)
    family = _BY_CODEC_NAME.get(name)
    if family is None:
        raise UnknownTier(f"unknown codec {name!r}: use {' or '.join(sorted(_BY_CODEC_NAME, reverse=True))}")
    wanted = 4 if bits is None else bits  # both families took 4 bits when none were named
    tier = family.get(wanted) if isinstance(wanted, (int, np.integer)) and not isinstance(wanted, bool) else None
    if tier is None:
        allowed = sorted(family)
        span = f"{allowed[0]}..{allowed[-1]}" if len(allowed) > 1 else f"{allowed[0]}"
        raise UnknownTier(f"{name} takes bits {span}, got {bits!r}")
    return tier, bits


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
