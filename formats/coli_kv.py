# Over 500 lines: header, record layout, sanitize-on-load and writer follow FORMAT.md sections 1, 2 and 4 in one place, in validation order.
"""The ``.coli_kv`` layouts (FORMAT.md sections 1, 2, 4): header, records, load, write.

A file is a 40-byte header followed by fixed-size records. A record layout is a numpy
structured dtype built from the parsed header (:func:`record_dtype`); a body is parsed with one
``np.frombuffer`` — never a per-record loop. Validation happens in a fixed order before anything is
sized from the file: length, magic, header fields, record size, then the body extent.

This module holds no file *policy*: :func:`write` is a plain write for tools and tests; durable
appends, truncation and atomic rewrites belong to ``kvstore.journal``.

Examples
--------
>>> import numpy as np
>>> geometry = Geometry(n_layers=1, kv_lora=4, qk_rope=2, index_hd=0, nic=0, vocab=100)
>>> L = np.ones((1, 3, 4), np.float32); R = np.zeros((1, 3, 2), np.float32)
>>> blob = encode_file(geometry, np.array([5, 6, 7], np.int32), L, R, version=2)
>>> records = parse(blob)
>>> records.n, records.header.version, records.tokens.tolist()
(3, 2, [5, 6, 7])
>>> records.dequantize()[0][0, 2].tolist()
[1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from kvstore.formats import fp8, nonfinite, tiers
from kvstore.formats.errors import (
    BadHeader,
    BadMagic,
    BadScale,
    CodecMismatch,
    FormatError,
    GeometryMismatch,
    TruncatedHeader,
)
from kvstore.formats.nonfinite import Sanitized
from kvstore.formats.tiers import Tier

HEADER_BYTES = 40
MAGICS = {b"COLIKV1\0": 1, b"COLIKV2\0": 2, b"COLIKV3\0": 3}
MAGIC_OF = {version: magic for magic, version in MAGICS.items()}
NREC_OFFSET = 32  # h6: the commit point (FORMAT.md section 4)
# Widths bigger than this are not a model; refusing them early keeps a hostile header from
# sizing anything (STYLE rule 2). nrec is bounded by the file size instead.
MAX_WIDTH = 1 << 20
MAX_LAYERS = 1 << 12
# Each word may be in range while their product is not: numpy cannot describe a record type of
# 2 GiB or more (found by the long hostile-file fuzz: n_layers 512 x kv_lora 2^20 of f32 raised an
# untyped ValueError), so such a header is refused as BadHeader too.
MAX_RECORD_BYTES = (1 << 31) - 1
HEADER_DTYPE = np.dtype([("magic", "S8"), ("words", "<i4", (8,))])


@dataclass(frozen=True)
class Geometry:
    """The model fingerprint h0..h5: a file is for a model only if all six match."""

    n_layers: int
    kv_lora: int
    qk_rope: int
    index_hd: int
    nic: int
    vocab: int

    def words(self) -> tuple[int, ...]:
        return (self.n_layers, self.kv_lora, self.qk_rope, self.index_hd, self.nic, self.vocab)

    def mismatches(self, other: "Geometry") -> list[str]:
        """Field-by-field differences, as ``name: file X, expected Y`` strings."""
        return [
            f"{field.name}: file {getattr(self, field.name)}, expected {getattr(other, field.name)}"
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(other, field.name)
        ]


@dataclass(frozen=True)
class Header:
    """The parsed 40-byte header."""

    geometry: Geometry
    tier: Tier
    nrec: int

    # Flat accessors named as in DESIGN.md.
    n_layers = property(lambda self: self.geometry.n_layers)
    kv_lora = property(lambda self: self.geometry.kv_lora)
    qk_rope = property(lambda self: self.geometry.qk_rope)
    index_hd = property(lambda self: self.geometry.index_hd)
    nic = property(lambda self: self.geometry.nic)
    vocab = property(lambda self: self.geometry.vocab)
    version = property(lambda self: self.tier.version)
    codec = property(lambda self: self.tier.codec)
    bits = property(lambda self: self.tier.bits)
    tag = property(lambda self: self.tier.tag)

    @property
    def magic(self) -> bytes:
        return MAGIC_OF[self.tier.version]

    @property
    def rec_bytes(self) -> int:
        return record_bytes(self.geometry, self.tier)

    def to_bytes(self) -> bytes:
        words = np.array([*self.geometry.words(), self.nrec, self.tier.tag], dtype="<i4")
        return self.magic + words.tobytes()

    def with_nrec(self, nrec: int) -> "Header":
        return dataclasses.replace(self, nrec=nrec)


def record_bytes(geometry: Geometry, tier: Tier) -> int:
    """``4 + n_layers * (row(kv_lora) + row(qk_rope)) + nic * index_hd * 4`` (rows include scales)."""
    tier = tier.file_tier
    per_layer = tier.row_bytes(geometry.kv_lora) + tier.row_bytes(geometry.qk_rope)
    return 4 + geometry.n_layers * per_layer + geometry.nic * geometry.index_hd * 4


#: The header's int32 words h0..h7 in order; word ``i`` is at bytes ``8 + 4 * i``.
HEADER_WORDS = ("n_layers", "kv_lora", "qk_rope", "index_hd", "nic", "vocab", "nrec", "tag")


def field_problem(name: str, value: object, expected: str) -> str:
    """``kv_lora (h1, header bytes 12..15) is -5, expected 1..1048576``: one header word at fault.

    Every header refusal names the word, where it is and what it may hold, so a damaged file can
    be judged (and a hand-written header fixed) from the message alone.
    """
    word = HEADER_WORDS.index(name)
    start = 8 + 4 * word
    return f"{name} (h{word}, header bytes {start}..{start + 3}) is {value}, expected {expected}"


def check_geometry(geometry: Geometry, tier: Tier) -> None:
    """Refuse header words no model has, before anything is sized from them."""
    g = geometry
    if not 1 <= g.n_layers <= MAX_LAYERS:
        raise BadHeader(field_problem("n_layers", g.n_layers, f"1..{MAX_LAYERS}"))
    for name in ("kv_lora", "qk_rope"):
        width = getattr(g, name)
        if not 1 <= width <= MAX_WIDTH:
            raise BadHeader(field_problem(name, width, f"1..{MAX_WIDTH}"))
    if not 0 <= g.nic <= g.n_layers:
        raise BadHeader(field_problem("nic", g.nic, f"0..n_layers ({g.n_layers})"))
    if not 0 <= g.index_hd <= MAX_WIDTH:
        raise BadHeader(field_problem("index_hd", g.index_hd, f"0..{MAX_WIDTH}"))
    if g.nic > 0 and g.index_hd == 0:
        raise BadHeader(field_problem("index_hd", 0, f"1..{MAX_WIDTH} when nic is {g.nic} (the indexer rows' width)"))
    if g.nic == 0 and g.index_hd > 0:
        raise BadHeader(field_problem("index_hd", g.index_hd, "0 when nic is 0 (no indexer rows)"))
    if g.vocab < 1:
        raise BadHeader(field_problem("vocab", g.vocab, "1 or more"))
    if tier.file_tier.version == 3:
        for name in ("kv_lora", "qk_rope"):
            if getattr(g, name) < 2:
                raise BadHeader(field_problem(name, getattr(g, name), f"2..{MAX_WIDTH} in a v3 (TurboQuant) file"))
    if record_bytes(g, tier) > MAX_RECORD_BYTES:
        raise BadHeader(
            f"n_layers, kv_lora, qk_rope, index_hd and nic (h0..h4, header bytes 8..27) give records of "
            f"{record_bytes(g, tier)} bytes, expected at most {MAX_RECORD_BYTES} (the format's records are under 2 GiB)"
        )


def record_dtype(geometry: Geometry, tier: Tier) -> np.dtype:
    """The packed structured dtype of one record.

    Fields: ``token`` <i4; ``layers`` [n_layers] of (``Lc``, ``Ls``, ``Rc``, ``Rs``) where the codes
    are f32 (v1, and no ``Ls``/``Rs``), u8 fp8 codes (v2) or packed TQ bytes (v3) and the
    ``Ls``/``Rs`` floats are the per-row scale (v2) or radius (v3); ``index`` <f4[nic, index_hd]
    when nic > 0. No padding: scale floats are unaligned, numpy reads them as such.
    """
    tier = tier.file_tier
    if tier.version == 1:
        layer = [("Lc", "<f4", (geometry.kv_lora,)), ("Rc", "<f4", (geometry.qk_rope,))]
    else:
        lw, rw = tier.payload_bytes(geometry.kv_lora), tier.payload_bytes(geometry.qk_rope)
        layer = [("Lc", "u1", (lw,)), ("Ls", "<f4"), ("Rc", "u1", (rw,)), ("Rs", "<f4")]
    fields: list[Any] = [("token", "<i4"), ("layers", np.dtype(layer), (geometry.n_layers,))]
    if geometry.nic:
        fields.append(("index", "<f4", (geometry.nic, geometry.index_hd)))
    dtype = np.dtype(fields)
    if dtype.itemsize != record_bytes(geometry, tier):
        raise AssertionError("record dtype disagrees with the record-size formula")  # a bug, not input
    return dtype


def parse_header(buf: bytes | bytearray | memoryview | np.ndarray) -> Header:
    """Parse and validate the 40-byte header at the start of ``buf``.

    Raises
    ------
    TruncatedHeader, BadMagic, BadHeader
    """
    view = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else memoryview(buf.reshape(-1).view(np.uint8))
    if len(view) < HEADER_BYTES:
        raise TruncatedHeader(
            f"file is {len(view)} bytes, shorter than the 40-byte .coli_kv header (expected 40 header bytes, then records)"
        )
    raw = np.frombuffer(view, dtype=HEADER_DTYPE, count=1)[0]
    magic = bytes(view[:8])  # not raw["magic"]: numpy's S8 strips the trailing NUL
    if magic not in MAGICS:
        raise BadMagic(
            f"not a .coli_kv file: magic (header bytes 0..7) is {magic!r}, expected "
            + ", ".join(repr(m) for m in MAGICS)
        )
    words = [int(w) for w in raw["words"]]
    version = MAGICS[magic]
    try:
        tier = tiers.from_header(version, words[7])
    except BadHeader as exc:
        detail = f" ({exc.reason})" if version == 3 else ""  # which of codec and bits is wrong
        raise BadHeader(field_problem("tag", _tag_text(version, words[7]), _TAG_EXPECTED[version]) + detail) from None
    geometry = Geometry(*words[:6])
    check_geometry(geometry, tier)
    if words[6] < 0:
        raise BadHeader(field_problem("nrec", words[6], "0 or more (the committed record count)"))
    return Header(geometry, tier, words[6])


_TAG_EXPECTED = {
    1: "0 in a v1 file",
    2: "1 in a v2 file",
    3: "(codec << 8) | bits in a v3 file: 0x104 (int4) or 0x002..0x006 (polar2..polar6)",
}


def _tag_text(version: int, tag: int) -> str:
    """A v3 tag in hex (its codec and bits show), other tags in decimal."""
    return f"{tag:#x}" if version == 3 and tag >= 0 else str(tag)


@dataclass
class Problems:
    """What a loader found and neutralized (sanitize-on-load, FORMAT.md section 4).

    Everything but ``uncommitted`` is *damage* (:attr:`damaged`): the committed records are not all
    there or not all valid (``overclaim``, bad scales/radii, NaN codes, non-finite values), or the
    file ends in bytes that are not a whole record (``torn_tail_bytes``: a write cut mid-record, or a
    file cut short). Whole records past the commit point (``uncommitted``) are not damage: the
    durability protocol itself leaves them (an append killed after its data fsync, before the count;
    a truncate killed after publishing the lower count), every committed record is whole, and the
    next append overwrites them — they are reported as a note (:meth:`notes`).
    """

    torn_tail_bytes: int = 0
    overclaim: int = 0  # records the header claims beyond what is physically present
    uncommitted: int = 0  # complete records past nrec (an append that crashed before its commit)
    bad_scales: int = 0  # v2 rows with a scale not in (0, 3.4e38): the whole row made inert
    bad_radii: int = 0  # v3 rows with a radius not in [0, 3.4e38): the row decodes to zeros
    nan_codes: int = 0  # v2 code bytes 0x7F/0xFF, read as 0
    nan_values: int = 0  # v1 f32 elements (and index rows) that are NaN or infinite

    @property
    def damaged(self) -> bool:
        """Any damage (everything counted here but ``uncommitted``)."""
        return bool(
            self.overclaim
            or self.torn_tail_bytes
            or self.bad_scales
            or self.bad_radii
            or self.nan_codes
            or self.nan_values
        )

    def damage(self) -> list[str]:
        """One line per kind of damage (:meth:`messages` without the uncommitted-records note)."""
        note = self.notes()
        return [line for line in self.messages() if line not in note]

    def notes(self) -> list[str]:
        """What is found but is not damage: whole records past the commit point."""
        if not self.uncommitted:
            return []
        return [f"{self.uncommitted} complete records past the commit point (nrec) are not loaded"]

    def messages(self) -> list[str]:
        """Every finding, one line each (damage and notes)."""
        out = []
        if self.overclaim:
            out.append(f"header claims {self.overclaim} more records than the file holds; they are not loaded")
        if self.uncommitted:
            out.append(f"{self.uncommitted} complete records past the commit point (nrec) are not loaded")
        if self.torn_tail_bytes:
            out.append(f"{self.torn_tail_bytes} bytes past the last complete record (torn tail) are ignored")
        if self.bad_scales:
            out.append(f"{self.bad_scales} rows with a bad fp8 scale were made inert (zeros)")
        if self.bad_radii:
            out.append(f"{self.bad_radii} rows with a bad TQ radius decode to zeros")
        if self.nan_codes:
            out.append(f"{self.nan_codes} fp8 NaN codes read as 0")
        if self.nan_values:
            out.append(f"{self.nan_values} non-finite f32 values in the rows")
        return out


class KVRecords:
    """The records of a ``.coli_kv`` file that are safe to resume.

    Attributes
    ----------
    header : Header (``header.nrec`` as stored; ``n`` is what is safe)
    n : int — ``min(nrec, complete records physically present)``
    records : structured array [n] of :func:`record_dtype` (a view of the loaded bytes)
    file_size : int
    """

    def __init__(self, header: Header, records: np.ndarray, file_size: int):
        self.header = header
        self.records = records
        self.n = int(records.shape[0])
        self.file_size = file_size

    @property
    def geometry(self) -> Geometry:
        return self.header.geometry

    @property
    def tier(self) -> Tier:
        return self.header.tier

    @property
    def complete_records(self) -> int:
        return (self.file_size - HEADER_BYTES) // self.header.rec_bytes if self.file_size >= HEADER_BYTES else 0

    @cached_property
    def tokens(self) -> np.ndarray:
        """int32[n], contiguous."""
        return np.ascontiguousarray(self.records["token"])

    def _layer_field(self, name: str) -> np.ndarray:
        return self.records["layers"][name]  # [n, n_layers, ...] strided view

    @cached_property
    def _bad_row_masks(self) -> tuple[np.ndarray, np.ndarray] | None:
        """[n, n_layers] masks of rows whose scale/radius is corrupt (L, R); None for v1."""
        if self.tier.version == 1:
            return None
        check = self.tier.corrupt_scales  # the one bound every reader applies
        return check(self._layer_field("Ls")), check(self._layer_field("Rs"))

    @cached_property
    def problems(self) -> Problems:
        """Counts of what sanitize-on-load neutralizes. Scales/radii are checked on load; the
        full scan of code bytes happens the first time this is read (inspect, repair)."""
        h = self.header
        found = Problems()
        complete = self.complete_records
        found.overclaim = max(0, h.nrec - complete)
        found.uncommitted = max(0, complete - h.nrec)
        found.torn_tail_bytes = max(0, self.file_size - HEADER_BYTES - complete * h.rec_bytes)
        masks = self._bad_row_masks
        if h.version == 2:
            found.bad_scales = int(masks[0].sum() + masks[1].sum())
            for name in ("Lc", "Rc"):
                found.nan_codes += int(np.count_nonzero(fp8.nan_codes(self._layer_field(name))))
        elif h.version == 3:
            found.bad_radii = int(masks[0].sum() + masks[1].sum())
        else:
            for name in ("Lc", "Rc"):
                found.nan_values += int(np.count_nonzero(~np.isfinite(self._layer_field(name))))
        if h.nic:
            found.nan_values += int(np.count_nonzero(~np.isfinite(self.records["index"])))
        return found

    def damaged_records(self) -> dict[str, np.ndarray]:
        """Which of the ``n`` records hold each kind of row damage :attr:`problems` counts.

        Returns
        -------
        dict
            ``bad_scales`` (v2), ``bad_radii`` (v3), ``nan_codes`` (v2), ``nan_values`` (v1 rows,
            and indexer rows of any version) -> bool[n]: the record holds at least one. Kinds the
            tier cannot hold are absent. A full scan of the rows, like :attr:`problems`.
        """
        found: dict[str, np.ndarray] = {}
        version = self.tier.version
        masks = self._bad_row_masks
        if masks is not None:
            found["bad_scales" if version == 2 else "bad_radii"] = masks[0].any(axis=1) | masks[1].any(axis=1)
        if version == 2:
            found["nan_codes"] = fp8.nan_codes(self._layer_field("Lc")).any(axis=(1, 2)) | fp8.nan_codes(
                self._layer_field("Rc")
            ).any(axis=(1, 2))
        nonfinite = np.zeros(self.n, dtype=bool)
        if version == 1:
            for name in ("Lc", "Rc"):
                nonfinite |= ~np.isfinite(self._layer_field(name)).all(axis=(1, 2))
        if self.geometry.nic:
            nonfinite |= ~np.isfinite(self.records["index"]).all(axis=(1, 2))
        if version == 1 or self.geometry.nic:
            found["nan_values"] = nonfinite
        return found

    def quantized(self, which: str) -> tuple[np.ndarray, np.ndarray]:
        """Raw stored rows of ``which`` (``"L"`` or ``"R"``), sanitized, layer-major.

        Returns
        -------
        codes : u8[n_layers, n, row] (fp8 codes for v2, packed TQ bytes for v3)
        scales : f32[n_layers, n] (fp8 scales for v2, radii for v3)

        Corrupt rows come back inert (codes 0, scale 1 / radius 0) and NaN codes as 0, so a
        consumer that decodes in hardware sees what the LUT decoder sees.
        """
        if self.tier.version == 1:
            raise CodecMismatch("a v1 file stores f32 rows, not codes: use dequantize()")
        if which not in ("L", "R"):
            raise ValueError("which must be 'L' or 'R'")
        # Always copies (never a view of the loaded bytes): sanitizing below must not write
        # through to the buffer, which may be read-only or shared.
        codes = self._layer_field(which + "c").transpose(1, 0, 2).copy()
        scales = self._layer_field(which + "s").T.copy()
        bad = self._bad_row_masks[0 if which == "L" else 1].T
        if self.tier.version == 2:
            codes[fp8.nan_codes(codes)] = 0
            if bad.any():
                codes[bad] = 0
                scales[bad] = 1.0
        elif bad.any():
            codes[bad] = 0
            scales[bad] = 0.0
        return codes, scales

    def _dequantize_field(self, which: str, width: int) -> np.ndarray:
        n_layers = self.geometry.n_layers
        out = np.empty((n_layers, self.n, width), dtype=np.float32)
        version = self.tier.version
        if version == 1:
            rows = self._layer_field(which + "c")
            for layer in range(n_layers):
                out[layer] = rows[:, layer]
            return out
        codes = self._layer_field(which + "c")
        scales = self._layer_field(which + "s")
        bad = self._bad_row_masks[0 if which == "L" else 1]
        for layer in range(n_layers):
            layer_scales = np.ascontiguousarray(scales[:, layer])
            layer_codes = codes[:, layer]
            if bad[:, layer].any():
                # A corrupt row is inert: zero codes and a neutral scale/radius (on copies: the
                # loaded bytes may be read-only or shared).
                layer_scales = layer_scales.copy()
                layer_codes = layer_codes.copy()
                layer_codes[bad[:, layer]] = 0
                layer_scales[bad[:, layer]] = 1.0 if version == 2 else 0.0
            with np.errstate(over="ignore", invalid="ignore"):
                self.tier.dequantize(layer_codes, layer_scales, width, out=out[layer])
            if version == 3:
                # A radius near the f32 limit (only a damaged file has one) can overflow on the
                # way back; such a row reads as zeros, like a bad radius.
                overflowed = ~np.isfinite(out[layer]).all(axis=-1)
                if overflowed.any():
                    out[layer][overflowed] = 0.0
        return out

    def dequantize(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Decode every safe record, sanitized.

        Returns
        -------
        L : f32[n_layers, n, kv_lora]
        R : f32[n_layers, n, qk_rope]
        I : f32[nic, n, index_hd] or None when nic == 0
        """
        g = self.geometry
        L = self._dequantize_field("L", g.kv_lora)
        R = self._dequantize_field("R", g.qk_rope)
        index = None
        if g.nic:
            index = np.ascontiguousarray(self.records["index"].transpose(1, 0, 2))
        return L, R, index

    def slice(self, start: int, stop: int) -> "KVRecords":
        """Records ``start .. stop`` as their own KVRecords (a view, no copy)."""
        part = self.records[start:stop]
        return KVRecords(self.header.with_nrec(part.shape[0]), part, HEADER_BYTES + part.nbytes)

    def check_scales(self, source: str) -> None:
        """Refuse these records if one holds a scale/radius no encoder writes (:func:`check_scales`).

        For callers that want strictness; without it the loader makes such rows inert and counts
        them (:attr:`problems`, ``damaged_records()``). ``source`` names the file in the reason.
        """
        check_scales(self.records, self.tier, source=source)

    def record_bytes(self, start: int = 0, stop: int | None = None) -> bytes:
        """The raw bytes of records ``start .. stop`` (no header), as stored."""
        return self.records[start:stop].tobytes()


def parse(
    buf: bytes | bytearray | memoryview, *, expect: Geometry | None = None, tier: Tier | None = None
) -> KVRecords:
    """Parse a whole file image.

    Parameters
    ----------
    buf : the file's bytes
    expect : Geometry, optional — refuse a file for another model (:class:`GeometryMismatch`)
    tier : Tier, optional — refuse a file of another version/codec/bits (:class:`CodecMismatch`)

    Returns
    -------
    KVRecords with ``n = min(nrec, complete records present)``: a short body stops at the last
    complete record; it is never an error and never yields garbage.
    """
    header = parse_header(buf)
    if expect is not None and header.geometry != expect:
        raise GeometryMismatch("file is for another model: " + "; ".join(header.geometry.mismatches(expect)))
    if tier is not None and header.tier != tier:
        raise CodecMismatch(f"file is {header.tier.describe()}, the active tier is {tier.describe()}")
    size = len(memoryview(buf).cast("B")) if not isinstance(buf, np.ndarray) else buf.nbytes
    dtype = record_dtype(header.geometry, header.tier)
    complete = (size - HEADER_BYTES) // dtype.itemsize
    n = min(header.nrec, complete)
    records = np.frombuffer(buf, dtype=dtype, count=n, offset=HEADER_BYTES)
    return KVRecords(header, records, size)


def read_header(path: str | os.PathLike) -> tuple[Header, int]:
    """Read and validate just the header of ``path``; returns (header, file size)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return parse_header(f.read(HEADER_BYTES)), size


#: What :func:`check_scales` tells the reader of a damaged file to do (a store names its own tools).
FILE_ADVICE = (
    "the file is damaged: kvstore inspect shows where, kvstore repair neutralizes it, a load without strict "
    "reads such rows as zeros"
)


def check_scales(
    records: np.ndarray, tier: Tier, *, source: str, first_record: int = 0, advice: str = FILE_ADVICE
) -> None:
    """Raise :class:`BadScale` if a record holds a stored scale (fp8) or radius (int4, polarB) that
    :meth:`Tier.corrupt_scales` calls corrupt — the one bound of every reader, applied strictly.

    Parameters
    ----------
    records : structured array [n] of :func:`record_dtype` (``tier``'s)
    source : what the records are read from (a path), named in the reason
    first_record : the index of ``records[0]`` in its file (for a chunk of a longer file)
    advice : what the reason tells the user to do (default :data:`FILE_ADVICE`)

    >>> import numpy as np
    >>> g = Geometry(1, 4, 2, 0, 0, 10)
    >>> rows = encode_records(g, tiers.FP8, [1, 2], np.ones((1, 2, 4)), np.ones((1, 2, 2)))
    >>> rows["layers"]["Rs"][1, 0] = 1e37
    >>> check_scales(rows, tiers.FP8, source="chat.coli_kv", first_record=40)
    Traceback (most recent call last):
    ...
    kvstore.formats.errors.BadScale: chat.coli_kv: record 41 (token 2), layer 0: the R row's scale 1e+37 is outside (0, 7.589e+35], the range every encoder writes (1 of these 2 records holds one); the file is damaged: kvstore inspect shows where, kvstore repair neutralizes it, a load without strict reads such rows as zeros
    """
    if tier.file_tier.version == 1 or records.shape[0] == 0:
        return
    layers = records["layers"]
    check_row_scales(
        tier,
        layers["Ls"],
        layers["Rs"],
        source=source,
        first_record=first_record,
        tokens=records["token"],
        advice=advice,
    )


def check_row_scales(
    tier: Tier,
    l_scales: np.ndarray,
    r_scales: np.ndarray,
    *,
    source: str,
    first_record: int = 0,
    first_layer: int = 0,
    tokens: np.ndarray | None = None,
    advice: str = FILE_ADVICE,
) -> None:
    """:func:`check_scales` on the scales alone: ``l_scales``/``r_scales`` f32[n, layers] (record
    ``first_record + i``, layer ``first_layer + j``), as a device upload holds them."""
    tier = tier.file_tier
    bad = {"L": tier.corrupt_scales(l_scales), "R": tier.corrupt_scales(r_scales)}  # bool[n, layers]
    hit = bad["L"].any(axis=1) | bad["R"].any(axis=1)
    if not hit.any():
        return
    record = int(np.argmax(hit))
    which = "L" if bad["L"][record].any() else "R"
    layer = int(np.argmax(bad[which][record]))
    value = float((l_scales if which == "L" else r_scales)[record, layer])
    token = f" (token {int(tokens[record])})" if tokens is not None else ""
    kind = "scale" if tier.version == 2 else "radius"
    count = int(np.count_nonzero(hit))
    raise BadScale(
        f"{source}: record {first_record + record}{token}, layer {first_layer + layer}: the {which} row's {kind} "
        f"{value:g} is outside {tier.scale_range}, the range every encoder writes ({count} of these {hit.shape[0]} "
        f"records hold{'s' * (count == 1)} one); {advice}"
    )


def load(
    path: str | os.PathLike, *, expect: Geometry | None = None, tier: Tier | None = None, strict: bool = False
) -> KVRecords:
    """Load a ``.coli_kv`` file with one read and array operations.

    See :func:`parse` for ``expect``/``tier`` and what ``n`` means. By default a row whose stored
    scale/radius no encoder writes is made inert and counted (sanitize-on-load, FORMAT.md section
    4); ``strict`` refuses the file instead (:class:`BadScale`, naming the file and the record).
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = np.empty(size, dtype=np.uint8)  # not bytearray(size): that zero-fills first
        view = memoryview(buf)
        got = 0
        while got < size:  # one read per 2 GiB (the kernel's cap per call)
            n = f.readinto(view[got:])
            if not n:  # the file shrank under us: parse the prefix that was read
                break
            got += n
    records = parse(view[:got], expect=expect, tier=tier)
    if strict:
        records.check_scales(source=os.fspath(path))
    return records


def encode_records_counted(geometry: Geometry, tier: Tier, tokens, L, R, I=None) -> tuple[np.ndarray, Sanitized]:
    """:func:`encode_records`, and what it did with non-finite values (:class:`Sanitized`).

    f32 rows (a v1 tier's L and R, every tier's indexer rows) store a non-finite value as 0; the
    quantized tiers encode them by their codec's rule (see :class:`Sanitized`). This is what the
    journal and the store write: a row they acknowledge never loads as damaged.
    """
    return _encode(geometry, tier, tokens, L, R, I, zero_f32=True)


def encode_records(geometry: Geometry, tier: Tier, tokens, L, R, I=None) -> np.ndarray:
    """Encode rows into records.

    Parameters
    ----------
    tokens : int32[n]
    L : f32[n_layers, n, kv_lora]
    R : f32[n_layers, n, qk_rope]
    I : f32[nic, n, index_hd], required when nic > 0

    Returns
    -------
    structured array [n] of :func:`record_dtype` (``.tobytes()`` is the body). This is the spec's
    encoder, byte for byte with the C engine: f32 fields (v1 rows, indexer rows) keep their values,
    NaN included; the quantized codecs apply their own rule. The journal and the store write
    through :func:`encode_records_counted`, which stores a non-finite f32 value as 0 and counts it.
    """
    return _encode(geometry, tier, tokens, L, R, I, zero_f32=False)[0]


def _encode(geometry: Geometry, tier: Tier, tokens, L, R, I, *, zero_f32: bool) -> tuple[np.ndarray, Sanitized]:
    tokens = np.asarray(tokens)
    n = tokens.shape[0] if tokens.ndim == 1 else -1
    g = geometry
    if tokens.ndim != 1:
        raise FormatError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= g.vocab):
        raise FormatError(f"token ids must be in [0, {g.vocab}), got {tokens.min()}..{tokens.max()}")
    L = np.asarray(L, dtype=np.float32)
    R = np.asarray(R, dtype=np.float32)
    if L.shape != (g.n_layers, n, g.kv_lora):
        raise GeometryMismatch(f"L has shape {L.shape}, expected {(g.n_layers, n, g.kv_lora)}")
    if R.shape != (g.n_layers, n, g.qk_rope):
        raise GeometryMismatch(f"R has shape {R.shape}, expected {(g.n_layers, n, g.qk_rope)}")
    if g.nic:
        if I is None:
            raise GeometryMismatch(f"the model has {g.nic} indexer layers: I rows are required")
        I = np.asarray(I, dtype=np.float32)
        if I.shape != (g.nic, n, g.index_hd):
            raise GeometryMismatch(f"I has shape {I.shape}, expected {(g.nic, n, g.index_hd)}")
    elif I is not None and np.size(I):
        raise GeometryMismatch("the model has no indexer layers (nic = 0) but I rows were given")
    tier = tier.file_tier
    # [n_layers, n, w] -> [n, n_layers, w]: the record order
    fields = {"L": L.transpose(1, 0, 2), "R": R.transpose(1, 0, 2)}
    if g.nic:
        fields["I"] = I.transpose(1, 0, 2)
    found, masks = nonfinite.count(tier.version, fields)
    for field, bad in masks.items() if zero_f32 else ():
        if field == "I" or tier.version == 1:  # f32 fields: the value becomes 0 (the codecs have their own rule)
            fields[field] = np.where(bad, np.float32(0.0), fields[field])
    records = np.zeros(n, dtype=record_dtype(g, tier))
    records["token"] = tokens
    layers = records["layers"]
    for which in ("L", "R"):
        codes, scales = tier.quantize(fields[which])
        layers[which + "c"] = codes
        if scales is not None:
            layers[which + "s"] = scales
    if g.nic:
        records["index"] = fields["I"]
    return records, found


def encode_file(
    geometry: Geometry, tokens, L, R, I=None, *, version: int, codec: int | None = None, bits: int | None = None
) -> bytes:
    """A whole file image (header with ``nrec = n`` + records)."""
    tier = tiers.from_file(version, codec, bits)
    check_geometry(geometry, tier)
    records = encode_records(geometry, tier, tokens, L, R, I)
    return Header(geometry, tier, records.shape[0]).to_bytes() + records.tobytes()


def write(
    path, tokens, L, R, I=None, *, vocab: int, version: int, codec: int | None = None, bits: int | None = None
) -> None:
    """Write a complete file (geometry taken from the arrays' shapes).

    A plain write for tools and tests; for durable, crash-safe writes use ``kvstore.KVFile``.
    """
    L = np.asarray(L, dtype=np.float32)
    R = np.asarray(R, dtype=np.float32)
    nic, index_hd = (0, 0) if I is None else np.asarray(I).shape[0::2]
    geometry = Geometry(L.shape[0], L.shape[2], R.shape[2], int(index_hd), int(nic), vocab)
    blob = encode_file(geometry, tokens, L, R, I, version=version, codec=codec, bits=bits)
    with open(path, "wb") as f:
        f.write(blob)
