"""The ``.coli_kv`` header and record layout (docs/FORMAT.md sections 1 and 2), validated in a fixed order.

A file is a 40-byte header followed by fixed-size records. :func:`parse_header` validates the header
before anything is sized from it — length, magic, the tag (which names the tier), the geometry
words, the record size — and :func:`record_dtype` turns a parsed header into the numpy structured
dtype of one record, built from the tier's codec (codes, then the per-row scale or radius, for
every layer; the indexer rows after them). :mod:`kvstore.formats.coli_kv` re-exports every name.

Examples
--------
>>> from kvstore.formats import tiers
>>> geometry = Geometry(n_layers=2, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=1000)
>>> header = Header(geometry, tiers.FP8, nrec=3)
>>> header.rec_bytes, parse_header(header.to_bytes()) == header
(1172, True)
>>> record_dtype(geometry, tiers.FP8)["layers"].base.names
('Lc', 'Ls', 'Rc', 'Rs')
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.formats import tiers
from kvstore.formats.errors import BadHeader, BadMagic, EncryptedJournal, TruncatedHeader
from kvstore.formats.tiers import Tier

__all__ = [
    "HEADER_BYTES",
    "HEADER_DTYPE",
    "HEADER_WORDS",
    "MAGICS",
    "MAGIC_OF",
    "MAX_LAYERS",
    "MAX_RECORD_BYTES",
    "MAX_WIDTH",
    "NREC_OFFSET",
    "Geometry",
    "Header",
    "check_geometry",
    "field_problem",
    "parse_header",
    "read_header",
    "record_bytes",
    "record_dtype",
]

HEADER_BYTES = 40
# v4 (bf16 rows) is kvstore's extension: the C engine, and kvstore before it, refuse its magic as
# unknown rather than misread it (docs/FORMAT.md section 1)
MAGICS = {b"COLIKV1\0": 1, b"COLIKV2\0": 2, b"COLIKV3\0": 3, b"COLIKV4\0": 4}
MAGIC_OF = {version: magic for magic, version in MAGICS.items()}
SEALED_MAGIC = b"COLIKVE\0"  # a journal encrypted at rest (docs/SECURITY.md): never read as rows here
NREC_OFFSET = 32  # h6: the commit point (docs/FORMAT.md section 4)
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
    are f32 (v1, and no ``Ls``/``Rs``), u8 fp8 codes (v2), packed TQ bytes (v3) or u16 bf16 bit
    patterns (v4, no ``Ls``/``Rs``) and the
    ``Ls``/``Rs`` floats are the per-row scale (v2) or radius (v3); ``index`` <f4[nic, index_hd]
    when nic > 0. No padding: scale floats are unaligned, numpy reads them as such.
    """
    tier = tier.file_tier
    codec = tier.row_codec
    layer: list[Any] = []
    for which, width in (("L", geometry.kv_lora), ("R", geometry.qk_rope)):
        layer.append((which + "c", codec.codes_dtype, (codec.code_width(width),)))
        if codec.scales_dtype is not None:  # one per-row scale in every file tier that has one
            layer.append((which + "s", codec.scales_dtype))
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
    view = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8).data
    if len(view) < HEADER_BYTES:
        raise TruncatedHeader(
            f"file is {len(view)} bytes, shorter than the 40-byte .coli_kv header (expected 40 header bytes, then records)"
        )
    raw = np.frombuffer(view, dtype=HEADER_DTYPE, count=1)[0]
    magic = bytes(view[:8])  # not raw["magic"]: numpy's S8 strips the trailing NUL
    if magic == SEALED_MAGIC:
        raise EncryptedJournal(
            "this journal is encrypted at rest (magic COLIKVE); its rows need its owner's key: "
            "export it through the service (kvstore export --data DIR ..., or the HTTP resume download)"
        )
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
    4: "16 in a v4 (bf16) file",
}


def _tag_text(version: int, tag: int) -> str:
    """A v3 tag in hex (its codec and bits show), other tags in decimal."""
    return f"{tag:#x}" if version == 3 and tag >= 0 else str(tag)


def read_header(path: str | os.PathLike) -> tuple[Header, int]:
    """Read and validate just the header of ``path``; returns (header, file size)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return parse_header(f.read(HEADER_BYTES)), size
