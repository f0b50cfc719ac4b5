"""Row codecs as objects, and the registry that holds them by tier name (numcodecs / zarr v3 style).

A row codec turns f32 rows ``[..., n]`` into what one tier stores and back. Each family is one
frozen dataclass, defined and registered at the bottom of the module that owns its arithmetic:

===============================  ==============  ==================================================
class                            module          tiers (registry ids)
===============================  ==============  ==================================================
:class:`~.floats.F32Codec`       ``floats``      ``f32``
:class:`~.floats.BF16Codec`      ``floats``      ``bf16``
:class:`~.fp8.FP8Codec`          ``fp8``         ``fp8``
:class:`~.tq.Int4Codec`          ``tq``          ``int4``
:class:`~.tq.PolarCodec`         ``tq``          ``polar2`` .. ``polar6`` (one instance per bit width)
:class:`~.q8.Q8Codec`            ``q8``          ``q8``
===============================  ==============  ==================================================

A codec owns everything that differs between tiers: its sizes (:meth:`RowCodec.payload_bytes`,
:meth:`~RowCodec.scale_bytes`, :meth:`~RowCodec.width_of`, :meth:`~RowCodec.width_problem`), its
codes and scales (:meth:`~RowCodec.quantize`/:meth:`~RowCodec.dequantize`), the bytes a row takes
inside a record (:meth:`~RowCodec.encode`/:meth:`~RowCodec.decode`), the bound on stored scales
every reader applies (:meth:`~RowCodec.corrupt_scales`) and its config. ``kvstore.tiers`` names
each registered codec as a :class:`~kvstore.formats.tiers.Tier`; the torch twins in
``kvstore.gpu.codecs`` register against these classes. Adding a tier is adding one class here and
its twin there: no caller branches on which tier it holds.

Examples
--------
>>> from kvstore.formats.codecs import codec_for, codec_from_config, registered_codecs
>>> codec = codec_for("polar3")
>>> codec, codec.family, codec.row_bytes(512)
(PolarCodec(bits=3), 'polar', 164)
>>> codec_from_config(codec.get_config()) is codec
True
>>> list(registered_codecs())
['f32', 'bf16', 'fp8', 'int4', 'polar2', 'polar3', 'polar4', 'polar5', 'polar6', 'q8']
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np

from kvstore.formats.errors import FormatError, UnknownTier

__all__ = [
    "RowCodec",
    "codec_for",
    "codec_from_config",
    "register_codec",
    "registered_codecs",
]


@dataclass(frozen=True)
class RowCodec(ABC):
    """One tier's row codec: sizes, codes and scales, stored bytes, scale bound and config.

    Attributes
    ----------
    bits : the v3 bits (a field of the TQ families), None for codecs without a bit width
    family : the family id (``f32``, ``bf16``, ``fp8``, ``int4``, ``polar``, ``q8``)
    version : the ``.coli_kv`` version a journal of this tier holds (1, 2, 3 or 4)
    in_file : rows are stored in a file exactly as this codec holds them (False for cache-only
        codecs, whose journals hold f32 rows)
    lossy : encoding can change a value
    holds_values : the stored codes are floats (f32, bf16), not codes with a scale: a non-finite
        value is written as 0 and counted, and a stored one is damage
    rotated : rows are stored in the rotated domain of docs/FORMAT.md section 5 (attention can stay there)
    codes_dtype : the element type of the stored codes (little-endian)
    scales_dtype : the element type of the stored scale part, or None when a row has none
    scale_kind : what a stored per-row scale is called in messages (``scale``, ``radius``), or None
    scale_damage, code_damage : the ``coli_kv.Problems`` count a corrupt stored scale / a stored code
        no encoder writes adds to, or None where the codec has no such damage
    inert_scale : the scale a row made inert on load is given (its codes are all zero)
    decode_can_overflow : a valid stored row can decode to infinities (a radius near f32's limit)
    codec_name : the v3 codec's old name (``int4``/``polar``), else None

    Everything but ``bits`` is a class attribute, set once by each family.
    """

    bits: int | None = field(default=None, repr=False)
    family: ClassVar[str]
    version: ClassVar[int]
    in_file: ClassVar[bool] = True
    lossy: ClassVar[bool] = True
    holds_values: ClassVar[bool] = False
    rotated: ClassVar[bool] = False
    codes_dtype: ClassVar[np.dtype]
    scales_dtype: ClassVar[np.dtype | None] = None
    scale_kind: ClassVar[str | None] = None
    scale_damage: ClassVar[str | None] = None
    code_damage: ClassVar[str | None] = None
    inert_scale: ClassVar[float] = 0.0
    decode_can_overflow: ClassVar[bool] = False
    codec_name: ClassVar[str | None] = None

    # ---- identity ---------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if self.bits is not None:
            raise FormatError(f"{self.family} takes no bits, got {self.bits!r}")

    @property
    def name(self) -> str:
        """The tier name, which is also the registry id (``polar3`` for ``PolarCodec(bits=3)``)."""
        return self.family

    @property
    def tq_codec(self) -> int | None:
        """The v3 codec id (``tq.CODEC_POLAR`` 0 / ``tq.CODEC_INT4`` 1), or None."""
        return None

    @property
    @abstractmethod
    def label(self) -> str:
        """What a row holds, for people (``e4m3 codes + f32 scale``)."""

    @property
    def header_tag(self) -> int:
        """Header word h7 of a file of this codec's rows (docs/FORMAT.md section 1)."""
        raise FormatError(f"{self.name} rows have no .coli_kv version of their own (they journal as f32)")

    @classmethod
    def variants(cls) -> tuple[RowCodec, ...]:
        """The instances of this family the registry holds (one per tier)."""
        return (cls(),)

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def scaled(self) -> bool:
        """Whether a row carries a scale part (scales, radii or deltas) beside its codes."""
        return self.scales_dtype is not None

    @abstractmethod
    def payload_bytes(self, width: int) -> int:
        """Bytes of one row's codes or values, without its scale part."""

    def scale_shape(self, width: int) -> tuple[int, ...]:
        """Trailing shape of one row's scales: ``()`` (one per row) or ``(width // 32,)`` (q8)."""
        return ()

    def scale_bytes(self, width: int) -> int:
        """Bytes of one row's scale part (0 for codecs without one)."""
        if self.scales_dtype is None:
            return 0
        return math.prod(self.scale_shape(width)) * self.scales_dtype.itemsize

    def row_bytes(self, width: int) -> int:
        """Bytes one row of ``width`` values takes (codes, then the scale part)."""
        return self.payload_bytes(width) + self.scale_bytes(width)

    def code_width(self, width: int) -> int:
        """Code elements (of :attr:`codes_dtype`) in one row of ``width`` values."""
        return self.payload_bytes(width) // self.codes_dtype.itemsize

    def width_of(self, total: int) -> int | None:
        """The row width ``total`` stored bytes per row hold, or None when the bytes do not fix it."""
        return None

    def width_problem(self, width: int) -> str | None:
        """Why this codec cannot hold rows of ``width`` values, or None when it can."""
        return None

    # ---- codes and scales -------------------------------------------------------------------------
    @abstractmethod
    def quantize(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """f32 rows ``[..., n]`` -> (codes ``[..., code_width(n)]``, scales ``[..., *scale_shape(n)]`` or None)."""

    @abstractmethod
    def dequantize(
        self,
        codes: np.ndarray,
        scales: np.ndarray | None = None,
        width: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Inverse of :meth:`quantize`: f32 ``[..., n]`` (written into ``out`` when given)."""

    def corrupt_scales(self, scales: np.ndarray) -> np.ndarray:
        """Mask of stored per-row scales no encoder writes (all False without a per-row scale)."""
        return np.zeros(np.shape(scales), dtype=bool)

    @property
    def scale_range(self) -> str:
        """The stored scales :meth:`corrupt_scales` accepts, for messages."""
        return "none (no per-row scale)"

    def bad_codes(self, codes: np.ndarray) -> np.ndarray | None:
        """Mask of stored codes no encoder writes (fp8 NaN codes, non-finite f32 values), or None
        where every code is valid."""
        return None

    def zeroed_rows(self, rows: np.ndarray, nonfinite: np.ndarray) -> int:
        """How many rows of ``rows`` f32[..., n] this codec stores as all zeros because of their
        non-finite values (``nonfinite`` is their mask); 0 where it stores such values otherwise."""
        return 0

    def _need_scales(self, scales: np.ndarray | None) -> np.ndarray:
        if scales is None:
            raise FormatError(f"{self.name} rows need their scales to decode")
        return scales

    # ---- stored bytes (numcodecs style) -----------------------------------------------------------
    @property
    def codec_id(self) -> str:
        return self.name

    def get_config(self) -> dict[str, Any]:
        """The JSON-able config :func:`codec_from_config` rebuilds this codec from."""
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
        per_row = scale_bytes.size // max(1, int(np.prod(lead, dtype=np.int64)))
        stored = np.empty((*lead, payload.shape[-1] + per_row), np.uint8)
        stored[..., : payload.shape[-1]] = payload
        stored[..., payload.shape[-1] :] = scale_bytes.reshape(*lead, -1)
        return stored

    def decode(self, stored: np.ndarray, width: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """u8[..., row_bytes(n)] -> f32[..., n]; ``width`` is needed only where bytes do not fix it."""
        stored = np.asarray(stored)
        if stored.dtype != np.uint8 or stored.ndim == 0:
            raise FormatError(f"stored rows must be u8[..., bytes], got {stored.dtype}{stored.shape}")
        total = stored.shape[-1]
        if width is None:
            width = self.width_of(total)
            if width is None:
                raise FormatError(f"{self.name} needs the row width n to decode")
        if self.row_bytes(width) != total:
            raise FormatError(f"{self.name} rows of {width} values take {self.row_bytes(width)} bytes, got {total}")
        split = self.payload_bytes(width)
        codes = np.ascontiguousarray(stored[..., :split]).view(self.codes_dtype)
        scales = None
        if self.scales_dtype is not None:
            tail = np.ascontiguousarray(stored[..., split:]).view(self.scales_dtype)
            scales = tail.reshape((*tail.shape[:-1], *self.scale_shape(width)))
        return self.dequantize(codes, scales, width, out=out)


# ---- the registry ----------------------------------------------------------------------------------

#: Tier name -> codec, in registration order.
_REGISTRY: dict[str, RowCodec] = {}
#: The built-in families' modules, in the order the docs list their tiers; each registers its
#: codecs when imported, and :func:`registered_codecs` lists them in this order whatever imported
#: them first.
_BUILTIN_MODULES = ("kvstore.formats.floats", "kvstore.formats.fp8", "kvstore.formats.tq", "kvstore.formats.q8")

C = TypeVar("C", bound=type[RowCodec])


def register_codec(family: C) -> C:
    """Register every codec of ``family`` (``family.variants()``) under its tier name; returns ``family``.

    A family's module registers it at its bottom, once. The same module executed again under
    another name (a doctest collector importing ``formats/fp8.py`` by path) registers a class of
    the same name: the first registration stays.

    Raises
    ------
    FormatError
        A tier name that another family already holds.
    """
    for codec in family.variants():
        held = _REGISTRY.get(codec.name)
        if held is None:
            _REGISTRY[codec.name] = codec
        elif type(held).__qualname__ != family.__qualname__:
            raise FormatError(f"codec {codec.name!r} is already registered, by {type(held).__qualname__}")
    return family


def _order(codec: RowCodec) -> int:
    module = type(codec).__module__
    return _BUILTIN_MODULES.index(module) if module in _BUILTIN_MODULES else len(_BUILTIN_MODULES)


def registered_codecs() -> dict[str, RowCodec]:
    """Every registered codec by tier name: the built-in families first, in the docs' order."""
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    codecs = list(_REGISTRY.values())
    return {codec.name: codec for codec in sorted(codecs, key=_order)}  # sorted() is stable


def codec_for(name: str) -> RowCodec:
    """The codec registered under tier name ``name``.

    Raises
    ------
    UnknownTier
    """
    codecs = registered_codecs()
    codec = codecs.get(name)
    if codec is None:
        raise UnknownTier(f"unknown codec {name!r} (known: {', '.join(codecs)})")
    return codec


def codec_from_config(config: dict[str, Any]) -> RowCodec:
    """The codec a config from :meth:`RowCodec.get_config` describes (``{"id": name}``)."""
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise UnknownTier(f"a codec config is a dict with a string 'id', got {config!r}")
    extra = set(config) - {"id"}
    if extra:
        raise UnknownTier(f"unknown codec config keys {sorted(extra)}")
    return codec_for(config["id"])
