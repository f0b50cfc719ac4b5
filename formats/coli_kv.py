"""The ``.coli_kv`` layouts (docs/FORMAT.md sections 1, 2, 4): header, records, load, write.

One module to import for the whole format; its parts live by concern: the header and record layout
in :mod:`~kvstore.formats.layout` (``Geometry``, ``Header``, ``parse_header``, ``record_dtype``), the
loaded records in :mod:`~kvstore.formats.records` (``KVRecords``, ``Problems``, ``check_scales``), and
parsing, loading and encoding here. Every name is importable from here.

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

import os

import numpy as np

from kvstore.formats import fp8, nonfinite, tiers  # noqa: F401  (fp8, tiers: part of this module's namespace)
from kvstore.formats.errors import (  # noqa: F401  (re-exported)
    BadHeader,
    BadMagic,
    BadScale,
    CodecMismatch,
    FormatError,
    GeometryMismatch,
    TruncatedHeader,
)
from kvstore.formats.layout import (  # noqa: F401  (re-exported)
    HEADER_BYTES,
    HEADER_DTYPE,
    HEADER_WORDS,
    MAGIC_OF,
    MAGICS,
    MAX_LAYERS,
    MAX_RECORD_BYTES,
    MAX_WIDTH,
    NREC_OFFSET,
    Geometry,
    Header,
    check_geometry,
    field_problem,
    parse_header,
    read_header,
    record_bytes,
    record_dtype,
)
from kvstore.formats.nonfinite import Sanitized
from kvstore.formats.records import (  # noqa: F401  (re-exported)
    FILE_ADVICE,
    KVRecords,
    Problems,
    check_row_scales,
    check_scales,
)
from kvstore.formats.tiers import Tier

__all__ = [
    "FILE_ADVICE",
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
    "KVRecords",
    "Problems",
    "Sanitized",
    "Tier",
    "check_geometry",
    "check_row_scales",
    "check_scales",
    "encode_bf16_records",
    "encode_file",
    "encode_records",
    "encode_records_counted",
    "field_problem",
    "load",
    "parse",
    "parse_header",
    "read_header",
    "record_bytes",
    "record_dtype",
    "write",
]


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


def load(
    path: str | os.PathLike, *, expect: Geometry | None = None, tier: Tier | None = None, strict: bool = False
) -> KVRecords:
    """Load a ``.coli_kv`` file with one read and array operations.

    See :func:`parse` for ``expect``/``tier`` and what ``n`` means. By default a row whose stored
    scale/radius no encoder writes is made inert and counted (sanitize-on-load, docs/FORMAT.md section
    4); ``strict`` refuses the file instead (:class:`BadScale`, naming the file and the record).
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = np.empty(size, dtype=np.uint8)  # not bytearray(size): that zero-fills first
        view = buf.data
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


def _checked_tokens(geometry: Geometry, tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise FormatError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= geometry.vocab):
        raise FormatError(f"token ids must be in [0, {geometry.vocab}), got {tokens.min()}..{tokens.max()}")
    return tokens


def _encode(geometry: Geometry, tier: Tier, tokens, L, R, I, *, zero_f32: bool) -> tuple[np.ndarray, Sanitized]:
    tokens = _checked_tokens(geometry, tokens)
    n = tokens.shape[0]
    g = geometry
    L = np.asarray(L, dtype=np.float32)
    R = np.asarray(R, dtype=np.float32)
    if L.shape != (g.n_layers, n, g.kv_lora):
        raise GeometryMismatch(f"L has shape {L.shape}, expected {(g.n_layers, n, g.kv_lora)}")
    if R.shape != (g.n_layers, n, g.qk_rope):
        raise GeometryMismatch(f"R has shape {R.shape}, expected {(g.n_layers, n, g.qk_rope)}")
    index = None
    if g.nic:
        if I is None:
            raise GeometryMismatch(f"the model has {g.nic} indexer layers: I rows are required")
        index = np.asarray(I, dtype=np.float32)
        if index.shape != (g.nic, n, g.index_hd):
            raise GeometryMismatch(f"I has shape {index.shape}, expected {(g.nic, n, g.index_hd)}")
    elif I is not None and np.size(I):
        raise GeometryMismatch("the model has no indexer layers (nic = 0) but I rows were given")
    tier = tier.file_tier
    records = np.zeros(n, dtype=record_dtype(g, tier))
    records["token"] = tokens
    layers = records["layers"]
    # a slice of tokens at a time (records are independent): the masks and the codecs' temporaries
    # stay a slice's size whatever the upload's
    step = nonfinite.slice_rows(g.n_layers * (g.kv_lora + g.qk_rope) + g.nic * g.index_hd)
    parts = []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        # [n_layers, n, w] -> [n, n_layers, w]: the record order
        fields = {"L": L[:, lo:hi].transpose(1, 0, 2), "R": R[:, lo:hi].transpose(1, 0, 2)}
        if index is not None:
            fields["I"] = index[:, lo:hi].transpose(1, 0, 2)
        found, masks = nonfinite.count(tier, fields)
        parts.append((lo, found))
        for field, bad in masks.items() if zero_f32 else ():
            if field == "I" or tier.holds_values:  # value fields: the value becomes 0 (the codecs have their own rule)
                fields[field] = np.where(bad, np.float32(0.0), fields[field])
        for which in ("L", "R"):
            codes, scales = tier.quantize(fields[which])
            layers[which + "c"][lo:hi] = codes
            if scales is not None:
                layers[which + "s"][lo:hi] = scales
        if g.nic:
            records["index"][lo:hi] = fields["I"]
    return records, nonfinite.combined(parts)


def encode_bf16_records(geometry: Geometry, tokens, L: np.ndarray, R: np.ndarray) -> np.ndarray:
    """Records of the bf16 tier (v4) from rows already in bf16 — ``L`` u16[n_layers, n, kv_lora]
    and ``R`` u16[n_layers, n, qk_rope] bit patterns, a bf16 cache's own bits — with no widening to
    f32 and back: the values are copied as they are, and one that is not finite (exponent all
    ones) is stored as 0, so the records equal :func:`encode_records_counted`'s of the f32 rows these
    bits widen to (exactly)."""
    g = geometry
    if g.nic:
        raise GeometryMismatch(f"the model has {g.nic} indexer layers: encode its rows with encode_records")
    tokens = _checked_tokens(g, tokens)
    n = tokens.shape[0]
    for name, rows, width in (("L", L, g.kv_lora), ("R", R, g.qk_rope)):
        if rows.dtype != np.uint16 or rows.shape != (g.n_layers, n, width):
            raise GeometryMismatch(
                f"{name} must be u16 bf16 bits of shape {(g.n_layers, n, width)}, got {rows.dtype} {rows.shape}"
            )
    records = np.empty(n, dtype=record_dtype(g, tiers.BF16))
    records["token"] = tokens
    layers = records["layers"]
    codec = tiers.BF16.row_codec
    for which, rows in (("Lc", L), ("Rc", R)):
        codes = layers[which]  # [n, n_layers, width], a view into the records
        codes[...] = rows.transpose(1, 0, 2)  # the record order, one strided copy
        codes[codec.bad_codes(codes)] = 0  # inf and NaN, as the journal stores them
    return records


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
    nic, index_hd = (0, 0) if I is None else (np.shape(I)[0], np.shape(I)[2])
    geometry = Geometry(L.shape[0], L.shape[2], R.shape[2], int(index_hd), int(nic), vocab)
    blob = encode_file(geometry, tokens, L, R, I, version=version, codec=codec, bits=bits)
    with open(path, "wb") as f:
        f.write(blob)
