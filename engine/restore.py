# Over 700 lines: the record layout, the four bodies (memory, file, rows, reader), the placement and the ring that reads them share one contract (read_into into ring slots of whole records or split blocks) and are reviewed together.
"""Device restore: ``.coli_kv`` records into a cache's buffers with one read and one upload.

The host path (``StoredRows.from_records`` + ``LatentCache.restore``) re-lays the token-major
records out layer-major on the host, copies codes to sanitize them, uploads pageable memory and
copies once more into the capacity buffers: four passes over the rows on the host. Here the
records stay as they are stored until they reach the device:

1. the body is read in record-aligned chunks straight into a ring of host buffers, pinned on CUDA
   (several chunks read at once by threads, since one ``pread`` from the page cache runs at one
   core's copy speed); records already in memory are copied into the ring instead, or on the CPU
   used where they lie;
2. each chunk is uploaded once (``non_blocking``, from pinned memory) while the next chunks are
   being read — on CUDA into one of two device stages, on a copy stream of its own, so a chunk's
   upload runs beside the previous chunk's placement;
3. on the device every field of every layer is a strided view of the chunk — ``[rows, n_layers,
   field bytes]`` at the field's offset in the record dtype — copied by one torch op per field into
   the target's buffers (``[n_layers, capacity, ...]``, seen transposed), as 4-byte words where the
   layout is aligned;
4. v2/v3 rows are sanitized in place there, exactly as ``KVRecords.quantized`` does on the host
   (docs/FORMAT.md section 4), by the one sanitize of :mod:`kvstore.gpu.codecs`: a v2 scale that
   ``fp8.bad_scales`` calls corrupt makes the row inert (codes 0, scale 1) and NaN codes read 0; a
   v3 radius not in [0, 3.4e38) becomes 0 with codes 0. A body opened with ``strict=True`` is
   refused instead: that sanitize counts the corrupt rows on the device (no host pass over the
   rows, no sync until the end); a count above zero fails the restore before anything is swapped
   in, and the first such row is then found on the host by the format's own check
   (``coli_kv.check_scales``, or the body's: :class:`~kvstore.formats.errors.BadScale` naming the
   file and the record, ``SessionDamaged`` for a session), so a scale of 1e37 on code 0x7E never
   restores as inf either way.

Rows of another representation are converted per chunk on the device: v1 rows into a quantized
tier through the device codecs (``kvstore.gpu.codecs.encode_tier``, which on the CPU is the
reference codec itself), v2/v3 rows into a float target by dequantization (on the CPU with the
``kvstore.formats`` codecs, so the result is the host path's to the byte).

The caller owns all-or-nothing: :func:`fill` writes only into the buffers it is given, which the
cache (``LatentCache.restore_body``) or the transformers interop allocates fresh and swaps in
after everything is in.

Why not ``kvstore.gpu.upload``: ``PinnedUploader`` copies a host *array* through its ring on one
thread and ``restore_quantized_rows`` takes one layer's layer-major codes — the very re-layout this
module avoids. Here the pinned ring is filled by reads of the file itself, by several threads, and
each chunk is split on the device as it lands.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kvstore.engine.errors import GeometryMismatch
from kvstore.formats import coli_kv
from kvstore.formats import tq as tq_format
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header, KVRecords
from kvstore.formats.errors import BadScale
from kvstore.gpu import codecs
from kvstore.tiers import Tier

__all__ = [
    "CHUNK_BYTES",
    "FileBody",
    "MemoryBody",
    "Placement",
    "RecordLayout",
    "RowsBody",
    "fill",
    "split_blocks",
    "split_bytes",
    "read_threads",
    "reserve_buffers",
]

# Big enough that the per-chunk device ops (a few per field) are noise next to the copy, small
# enough that several chunks in flight cost little pinned memory.
CHUNK_BYTES = 16 << 20

# Device staging buffers of a CUDA restore. With one, a chunk's upload and the placement of the
# chunk before it queue on one stream, one after the other (the restore ran at 1 / (1/upload +
# 1/placement)); with two, uploads run on a copy stream beside the placement. 1 is the old
# pipeline, kept for the benchmark's side-by-side (bench/sealed_read.py --stages).
DEVICE_STAGES = 2

# The format decoder reads rows of a radius not above this as zeros (the device twins would give
# subnormals).
_RADIUS_FLOOR = float(tq_format.RADIUS_FLOOR)


def read_threads(*, decrypting: bool = False) -> int:
    """Chunks read at once: page-cache reads scale with cores up to about four; reads that also
    decrypt (a store encrypted at rest) are bound by AES-GCM on the CPU and scale further."""
    return max(1, min(8 if decrypting else 4, os.cpu_count() or 1))


# ---------------------------------------------------------------------------- the record layout


@dataclass(frozen=True)
class RecordLayout:
    """Byte offsets of a record's fields (from ``coli_kv.record_dtype``, the format's own layout).

    ``fields`` maps ``Lc``/``Ls``/``Rc``/``Rs`` to (offset inside one layer, bytes); ``stored``
    to the element dtype the file holds them in.
    """

    rec_bytes: int
    layers_offset: int
    layer_bytes: int
    n_layers: int
    fields: dict[str, tuple[int, int]]
    stored: dict[str, torch.dtype]

    @classmethod
    def of(cls, geometry: Geometry, tier: Tier) -> "RecordLayout":
        dtype = coli_kv.record_dtype(geometry, tier)
        layers_dtype, layers_offset = (dtype.fields or {})["layers"][:2]  # a record dtype is structured
        one = layers_dtype.base
        fields, stored = {}, {}
        for name, (sub, offset, *_) in (one.fields or {}).items():
            fields[name] = (offset, sub.itemsize)
            stored[name] = _STORED_DTYPES.get(sub.base, torch.uint8)
        return cls(dtype.itemsize, layers_offset, one.itemsize, geometry.n_layers, fields, stored)

    def field(self, raw: torch.Tensor, name: str) -> torch.Tensor:
        """Field ``name`` of every layer of ``raw`` (u8[rows, rec_bytes]) as a u8[rows, n_layers, bytes]
        view, in record order (transpose it for the layer-major [n_layers, rows, bytes])."""
        offset, size = self.fields[name]
        layers = raw[:, self.layers_offset : self.layers_offset + self.n_layers * self.layer_bytes]
        return layers.unflatten(1, (self.n_layers, self.layer_bytes))[:, :, offset : offset + size]


#: Record element types placed as torch types: f32 values (v1), bf16 bit patterns (v4); codes and
#: scales of the other tiers move as bytes.
_STORED_DTYPES = {np.dtype("<f4"): torch.float32, np.dtype("<u2"): torch.bfloat16}


def _aligned(t: torch.Tensor, size: int) -> bool:
    """Whether ``t`` (u8) can be seen as elements of ``size`` bytes: its last dimension, its offset
    and every stride that moves a multiple of ``size``."""
    if t.dim() == 0 or t.shape[-1] % size or t.stride(-1) != 1 or t.storage_offset() % size:
        return False
    return not any(stride % size for n, stride in zip(t.shape[:-1], t.stride()[:-1]) if n > 1)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` (u8) seen as int32 words when every offset and stride is a multiple of 4, else None.

    A word copy moves a quarter of the elements a byte copy does; v1 records and most v2/v3
    geometries (kv_lora 512, qk_rope 64) are aligned, odd widths fall back to bytes.
    """
    return t.view(torch.int32) if _aligned(t, 4) else None


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A target slice ([rows, n_layers] scalars or [rows, n_layers, w]) as u8[rows, n_layers, bytes]."""
    if t.dtype == torch.uint8:
        return t
    return t.unsqueeze(-1).view(torch.uint8) if t.dim() == 2 else t.view(torch.uint8)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst_words, src_words = _words(dst), _words(src)
    if dst_words is not None and src_words is not None:
        dst_words.copy_(src_words)
    else:
        dst.copy_(src)


def _as(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A u8 field as ``dtype`` elements (a view when aligned to their size; else one copy to
    aligned memory)."""
    return (src if _aligned(src, dtype.itemsize) else src.contiguous()).view(dtype)


def _f32(src: torch.Tensor) -> torch.Tensor:
    """A u8[..., 4k] field as f32[..., k]: the v1 rows, the v2/v3 scales."""
    return _as(src, torch.float32)


def _values(tier: Tier, src: torch.Tensor) -> torch.Tensor:
    """A value tier's field (u8 bytes of f32 or bf16 values) as the values it holds."""
    return _as(src, _STORED_DTYPES[tier.row_codec.codes_dtype])


# ---------------------------------------------------------------------------- sanitize and decode


def dequantize(tier: Tier, codes: torch.Tensor, scales: torch.Tensor, width: int) -> torch.Tensor:
    """Sanitized v2/v3 rows (codes u8[..., w], scales/radii f32[...]) -> f32[..., width] on their device.

    On the CPU through the ``kvstore.formats`` codecs (``Tier.dequantize``: the host path's decoder,
    so CPU results are its bytes); elsewhere through the device twins (``kvstore.gpu.codecs``).
    Either way a v3 row that overflows on the way back (a radius near f32's limit, only in a damaged
    file) reads as zeros, as ``KVRecords.dequantize`` does.
    """
    if codes.device.type == "cpu":
        with np.errstate(over="ignore", invalid="ignore"):
            rows = tier.dequantize(codes.numpy(), scales.numpy(), width)
        if tier.rotated:
            rows[~np.isfinite(rows).all(axis=-1)] = 0.0
        return torch.from_numpy(rows)
    rows = codecs.decode_tier(tier, codes, scales, width)
    if not tier.rotated:
        return rows
    dead = ~torch.isfinite(rows).all(dim=-1) | ~(scales > _RADIUS_FLOOR)
    return rows.masked_fill(dead.unsqueeze(-1), 0.0)


# ---------------------------------------------------------------------------- placement


class Placement:
    """How a chunk of records becomes rows of a target's fields.

    Parameters
    ----------
    geometry, tier : what the records are
    native : target field -> record field (``Lc``/``Ls``/``Rc``/``Rs``) when the target stores the
        records' own representation (copied as bytes, then sanitized in place); None to convert
    encode : for conversions, ``encode(L f32[n_layers, rows, kv_lora], R f32[...]) -> {field: rows}``
    """

    def __init__(
        self, geometry: Geometry, tier: Tier, *, native: dict[str, str] | None = None, encode: Callable | None = None
    ):
        if (native is None) == (encode is None):
            raise ValueError("a placement either copies native fields or encodes decoded rows")
        self.geometry = geometry
        self.tier = tier
        self.layout = RecordLayout.of(geometry, tier)
        self.native = native
        self.encode = encode
        self.corrupt: torch.Tensor | None = None  # rows with a corrupt scale/radius, when counted

    def count_corrupt(self, device: torch.device) -> None:
        """Count the rows whose scale/radius no encoder writes as they are sanitized (on the device,
        no sync): a strict restore reads :attr:`corrupt` once, at the end."""
        self.corrupt = torch.zeros((), dtype=torch.int64, device=device)

    def apply(self, raw: torch.Tensor, fields: dict[str, torch.Tensor], start: int) -> None:
        """Place the records of ``raw`` (u8[rows, rec_bytes] on the target's device) at rows
        ``start .. start+rows-1`` of every target field ([n_layers, capacity, ...])."""
        # Both sides in record order ([rows, n_layers, ...]): torch's CPU copy walks the source's
        # rows sequentially then, several times faster than layer-major order.
        self._place(lambda name: self.layout.field(raw, name), raw.shape[0], fields, start, record_order=True)

    def apply_split(self, chunk: torch.Tensor, rows: int, fields: dict[str, torch.Tensor], start: int) -> None:
        """As :meth:`apply`, for a chunk already split by field (u8, :func:`split_blocks`'s layout:
        one layer-major ``[n_layers, rows, bytes]`` block per field, the record dtype's order)."""
        blocks = split_blocks(self.layout, chunk, rows)
        self._place(blocks.__getitem__, rows, fields, start, record_order=False)

    def _place(self, field_of: Callable, rows: int, fields: dict[str, torch.Tensor], start: int, *, record_order: bool):
        """``field_of(name)``: the chunk's field ``name`` as u8 ``[rows, n_layers, bytes]`` when
        ``record_order``, else ``[n_layers, rows, bytes]``."""

        def layer_major(name: str) -> torch.Tensor:
            return field_of(name).transpose(0, 1) if record_order else field_of(name)

        if self.encode is not None:  # (then native is None: one or the other, checked on creation)
            lc, rc = self._decode(layer_major)
            for name, value in self.encode(lc, rc).items():
                fields[name][:, start : start + rows] = value
            return
        placed = {}
        for target, source in (self.native or {}).items():
            dst = fields[target][:, start : start + rows]
            if record_order:
                dst = dst.transpose(0, 1)
            src = field_of(source)
            if dst.dtype == self.layout.stored[source]:
                _copy_bytes(_bytes_of(dst), src)
            else:  # v1/v4 rows into another float target: converted by the copy itself
                dst.copy_(_values(self.tier, src))
            placed[source] = dst
        if not self.tier.holds_values:
            codecs.sanitize_tier_(self.tier, placed["Lc"], placed["Ls"], self.corrupt)
            codecs.sanitize_tier_(self.tier, placed["Rc"], placed["Rs"], self.corrupt)

    def decode(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's rows as f32 (L [n_layers, rows, kv_lora], R [n_layers, rows, qk_rope]), sanitized."""
        return self._decode(lambda name: self.layout.field(raw, name).transpose(0, 1))

    def _decode(self, layer_major: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geometry
        if self.tier.holds_values:  # f32 (v1) or bf16 (v4) values: widened exactly
            lc, rc = (_values(self.tier, layer_major(name)).float().contiguous() for name in ("Lc", "Rc"))
            return lc, rc
        out = []
        for codes_name, scales_name, width in (("Lc", "Ls", g.kv_lora), ("Rc", "Rs", g.qk_rope)):
            # Copies (clone, never a view of the body, which may be read-only): sanitized below.
            codes = layer_major(codes_name).clone(memory_format=torch.contiguous_format)
            scales = _f32(layer_major(scales_name)).squeeze(-1).clone(memory_format=torch.contiguous_format)
            codecs.sanitize_tier_(self.tier, codes, scales, self.corrupt)
            out.append(dequantize(self.tier, codes, scales, width))
        return out[0], out[1]


_BLOCK_ALIGN = 16  # every block starts aligned, so f32 scales are viewed (not copied) as floats


def _block_offsets(layout: RecordLayout, rows: int) -> tuple[dict[str, tuple[int, int]], int]:
    offsets, offset = {}, 0
    for name, (_, size) in layout.fields.items():
        offsets[name] = (offset, size)
        offset += -(-layout.n_layers * rows * size // _BLOCK_ALIGN) * _BLOCK_ALIGN
    return offsets, offset


def split_bytes(layout: RecordLayout, rows: int) -> int:
    """Bytes of a split chunk of ``rows`` rows (:func:`split_blocks`)."""
    return _block_offsets(layout, rows)[1]


def split_blocks(layout: RecordLayout, chunk, rows: int) -> dict:
    """A split chunk's fields: ``chunk`` (u8, numpy or torch, at least :func:`split_bytes`) holds
    one ``[n_layers, rows, bytes]`` block per field, in the record dtype's field order, each at a
    16-byte-aligned offset — the layer-major layout a cache keeps, so a split chunk is placed by
    plain copies."""
    offsets, _ = _block_offsets(layout, rows)
    return {
        name: chunk[offset : offset + layout.n_layers * rows * size].reshape(layout.n_layers, rows, size)
        for name, (offset, size) in offsets.items()
    }


# ---------------------------------------------------------------------------- sources of records


class MemoryBody:
    """Records already in host memory (a loaded ``KVRecords``).

    ``strict``: refuse records holding a scale/radius no encoder writes (``source`` is named in the
    :class:`~kvstore.formats.errors.BadScale`) instead of sanitizing them on the device.
    """

    def __init__(self, records: KVRecords, *, strict: bool = False, source: str = "the loaded records"):
        self.strict = strict
        self.source = source
        self.header: Header = records.header
        self.n = records.n
        self.layout = RecordLayout.of(records.geometry, records.tier)
        body = records.records
        if not body.flags.c_contiguous:
            body = np.ascontiguousarray(body)
        self._raw = body.view(np.uint8).reshape(self.n, self.layout.rec_bytes)

    @property
    def geometry(self) -> Geometry:
        return self.header.geometry

    @property
    def tier(self) -> Tier:
        return self.header.tier

    def limit(self, n: int) -> None:
        """Serve at most the first ``n`` records."""
        self.n = min(self.n, max(0, int(n)))

    def read_into(self, out: np.ndarray, start: int, count: int) -> int:
        rec = self.layout.rec_bytes
        np.copyto(out[: count * rec], self._raw[start : start + count].reshape(-1))
        return count

    def host_rows(self) -> np.ndarray:
        return self._raw[: self.n]

    def close(self) -> None:
        pass


class FileBody:
    """The records of a ``.coli_kv`` file, read on demand (header checked on open).

    ``n = min(nrec, complete records present)``, as ``coli_kv.load``; a file that shrinks while it
    is read stops at the last complete record read, never an error and never garbage.

    ``strict``: refuse a file whose rows hold a scale/radius no encoder writes (:class:`BadScale`
    naming the file and the record, raised by :func:`fill`) instead of sanitizing them.

    Raises
    ------
    TruncatedHeader, BadMagic, BadHeader, GeometryMismatch (with ``expect``), OSError
    """

    def __init__(self, path: str | os.PathLike, *, expect: Geometry | None = None, strict: bool = False):
        self.path = os.fspath(path)
        self.strict = strict
        self.source = self.path
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(self._fd).st_size
            self.header: Header = coli_kv.parse_header(os.pread(self._fd, HEADER_BYTES, 0))
            if expect is not None and self.header.geometry != expect:
                raise GeometryMismatch(
                    "file is for another model: " + "; ".join(self.header.geometry.mismatches(expect))
                )
            self.layout = RecordLayout.of(self.header.geometry, self.header.tier)
            self.n = min(self.header.nrec, max(0, size - HEADER_BYTES) // self.layout.rec_bytes)
        except BaseException:
            os.close(self._fd)
            raise

    geometry = property(lambda self: self.header.geometry)
    tier = property(lambda self: self.header.tier)
    limit = MemoryBody.limit

    def read_into(self, out: np.ndarray, start: int, count: int) -> int:
        """Read records ``start .. start+count-1`` into ``out`` (u8); returns the complete ones read."""
        rec = self.layout.rec_bytes
        view = out.data[: count * rec]  # (out is u8[...], contiguous: its buffer is its bytes)
        got = 0
        while got < len(view):  # a read returns at most 2 GiB; 0 means the file ended early
            n = os.preadv(self._fd, [view[got:]], HEADER_BYTES + start * rec + got)
            if n == 0:
                break
            got += n
        return got // rec

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "FileBody":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReaderBody:
    """The served records of an open session reader (either store backend: ``read_into`` and
    ``check_scales``), read on demand straight into the restore's ring — no whole-body copy on
    the host first. Always strict: a row whose scale/radius no encoder writes is damage in a store,
    refused by the reader's own check (``SessionDamaged`` naming the session and the record).
    """

    strict = True

    def __init__(self, reader):
        self._reader = reader
        info = reader.info
        self.source = f"session {info.id!r}"
        self.header: Header = Header(info.geometry, info.tier, reader.n_records)
        self.n = reader.n_records
        self.layout = RecordLayout.of(info.geometry, info.tier)

    geometry = property(lambda self: self.header.geometry)
    tier = property(lambda self: self.header.tier)
    limit = MemoryBody.limit

    def read_into(self, out: np.ndarray, start: int, count: int) -> int:
        return self._reader.read_into(out, start, count)

    @property
    def decrypts(self) -> bool:
        """The reader decrypts what it reads (a store encrypted at rest): more threads pay."""
        return bool(getattr(self._reader, "decrypts", False))

    def chunk_starts(self, per_chunk: int) -> list[int] | None:
        """Where the reader would have the ring's chunks start (an encrypted journal: on its
        frames), or None."""
        starts = getattr(self._reader, "chunk_starts", None)
        return starts(per_chunk) if starts is not None else None

    def check_scales(self, records: np.ndarray, first_record: int) -> None:
        self._reader.check_scales(records, first_record)

    def close(self) -> None:
        pass  # the reader is its caller's to close


class RowsBody:
    """Rows already in host memory as a journal stores them (``StoredRows``, layer-major), taken by
    the path a file takes — the reading threads copy each chunk into the restore's ring (pinned on
    CUDA), it is uploaded once and placed on the device — but *split*: the rows are layer-major
    already, as the cache keeps them, so a chunk holds one ``[n_layers, rows, bytes]`` block per
    field (:func:`split_blocks`) filled by contiguous copies, and is placed by plain copies, with no
    interleaving into records on the host and no split on the device. Not strict: rows in memory
    have no file or session to name, so a corrupt scale is made inert, as ``LatentCache.restore``
    makes it.

    Raises
    ------
    GeometryMismatch : the rows' shapes are not those ``geometry``'s records hold for their tier
    """

    strict = False
    split = True  # read_into fills split_blocks' layout, not records

    def __init__(self, rows, geometry: Geometry, *, source: str = "the rows handed over"):
        tier = rows.tier
        self.source = source
        self.header: Header = Header(geometry, tier, rows.n)
        self.n = rows.n
        self.layout = RecordLayout.of(geometry, tier)
        one = (coli_kv.record_dtype(geometry, tier).fields or {})["layers"][0].base
        n_layers = geometry.n_layers
        arrays = {"Lc": rows.lc, "Rc": rows.rc}
        if tier.row_codec.scaled:
            arrays.update(Ls=rows.lc_scales, Rs=rows.rc_scales)
        # each field as the record dtype stores it (element dtype, elements per row)
        self._fields = {}
        wrong = []
        for name in self.layout.fields:
            sub = (one.fields or {})[name][0]
            shape = (n_layers, rows.n, *sub.shape)
            given = arrays.get(name)
            if given is None or given.shape != shape:
                wrong.append(f"{name} {None if given is None else given.shape} (expected {shape})")
                continue
            self._fields[name] = (given, sub.base, int(np.prod(sub.shape, dtype=np.int64)))
        if rows.tokens.shape != (rows.n,) or wrong:
            raise GeometryMismatch(f"the rows do not fit this model's {tier.name} records: " + "; ".join(wrong))
        self._tokens = rows.tokens

    geometry = property(lambda self: self.header.geometry)
    tier = property(lambda self: self.header.tier)
    limit = MemoryBody.limit

    def read_into(self, out: np.ndarray, start: int, count: int) -> int:
        """Rows ``start .. start+count-1`` into ``out`` (u8, contiguous, at least
        :func:`split_bytes`) in :func:`split_blocks`' layout; returns ``count``. Contiguous copies
        per layer, run by numpy without the GIL, so the ring's threads overlap."""
        blocks = split_blocks(self.layout, out, count)
        for name, (array, stored, elems) in self._fields.items():
            block = blocks[name].view(stored).reshape(self.layout.n_layers, count, elems)
            np.copyto(block, array[:, start : start + count].reshape(block.shape), casting="same_kind")
        return count

    def tokens(self, start: int, count: int) -> np.ndarray:
        return self._tokens[start : start + count]

    def close(self) -> None:
        pass


def _check_strict(body, host: np.ndarray, first_record: int) -> None:
    """For a strict body: refuse host rows (u8[rows, rec_bytes]) holding a corrupt scale/radius
    (by the body's own ``check_scales`` when it has one, else the format's, naming its source)."""
    if getattr(body, "strict", False) and body.tier.row_codec.scaled and host.shape[0]:
        records = host.reshape(-1).view(coli_kv.record_dtype(body.geometry, body.tier))
        check = getattr(body, "check_scales", None)
        if check is not None:
            check(records, first_record)
        else:
            coli_kv.check_scales(records, body.tier, source=body.source, first_record=first_record)


def _tokens_of(host: np.ndarray) -> np.ndarray:
    """int32[rows] from the first 4 bytes of each record of u8[rows, rec_bytes]."""
    return np.ascontiguousarray(host[:, :4]).view("<i4").reshape(-1).astype(np.int32, copy=False)


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    # Loaded bodies may be read-only (bytes from a reader); they are only read here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


# ---------------------------------------------------------------------------- the pipeline


def fill(
    body,
    fields: dict[str, torch.Tensor],
    placement: Placement,
    device: torch.device | str,
    *,
    chunk_bytes: int | None = None,
    threads: int | None = None,
) -> tuple[int, np.ndarray]:
    """Stream ``body``'s records into rows ``0 .. n-1`` of ``fields`` on ``device``.

    Parameters
    ----------
    body : :class:`FileBody`, :class:`MemoryBody` or :class:`ReaderBody`
    fields : target tensors [n_layers, >= body.n, ...] on ``device`` (written, never read)
    placement : what each chunk becomes (:class:`Placement`)
    chunk_bytes : bytes of records per chunk (default :data:`CHUNK_BYTES`; rounded down to whole
        records, at least one)
    threads : chunks read at once (default :func:`read_threads`)

    Returns
    -------
    (rows filled, tokens int32[rows]) — fewer rows than ``body.n`` only when the file ended early.

    Raises
    ------
    BadScale : a ``strict`` body holds a row whose scale/radius no encoder writes (counted on the
        device as the rows are sanitized, named from the host after; ``fields`` hold the rows: the
        caller drops them)
    """
    device = torch.device(device)
    rec = body.layout.rec_bytes
    if body.n == 0:
        return 0, np.zeros(0, dtype=np.int32)
    per_chunk = max(1, int(chunk_bytes or CHUNK_BYTES) // rec)
    strict = getattr(body, "strict", False) and body.tier.row_codec.scaled
    if strict:
        # counted by the sanitize that runs anyway, on the device: no host pass over the rows
        placement.count_corrupt(device)
    threads = threads or read_threads(decrypting=getattr(body, "decrypts", False))
    if device.type == "cpu" and isinstance(body, MemoryBody):
        # Records already in host memory are split where they lie: no ring, no copy.
        host = body.host_rows()
        whole = _from_numpy(host)
        for a in range(0, host.shape[0], per_chunk):
            placement.apply(whole[a : a + per_chunk], fields, a)
        filled, tokens = host.shape[0], _tokens_of(host)
    elif device.type == "cuda":
        with torch.cuda.device(device):
            filled, tokens = _pipeline(body, fields, placement, device, per_chunk, threads)
    else:
        filled, tokens = _pipeline(body, fields, placement, device, per_chunk, threads)
    if strict and placement.corrupt is not None and int(placement.corrupt):  # the one sync of the check
        _name_corrupt(body, filled, per_chunk)
    return filled, tokens


def _name_corrupt(body, n: int, per_chunk: int) -> None:
    """The device counted a corrupt scale/radius in ``body``'s first ``n`` records: find the first
    on the host, chunk by chunk, and raise the body's own error naming it (a rare, slow path)."""
    rec = body.layout.rec_bytes
    buffer = np.empty(min(per_chunk, n) * rec, dtype=np.uint8)
    for start in range(0, n, per_chunk):
        got = body.read_into(buffer, start, min(per_chunk, n - start))
        _check_strict(body, buffer[: got * rec].reshape(got, rec), start)
    raise BadScale(f"{body.source}: a row holds a scale no encoder writes (counted on the device)")


def reserve_buffers(rec_bytes: int, n: int, device: torch.device | str, *, threads: int | None = None) -> None:
    """Allocate, and free at once, the pinned ring and the device staging buffer a restore of ``n``
    records of ``rec_bytes`` uses on CUDA (a server's start-up): torch's caching allocators keep the
    blocks, so the first restore pays no ``cudaHostAlloc``/``cudaMalloc`` (tens of milliseconds at
    32k rows); every later restore reuses them. Elsewhere nothing is done."""
    device = torch.device(device)
    if device.type != "cuda" or n < 1:
        return
    per_chunk = max(1, CHUNK_BYTES // rec_bytes)
    slots = min(-(-n // per_chunk), 2 * (threads or read_threads()))
    slot_bytes = min(per_chunk, n) * rec_bytes
    ring = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
    with torch.cuda.device(device):
        stages = [
            torch.empty(slot_bytes, dtype=torch.uint8, device=torch.cuda.current_device()) for _ in range(DEVICE_STAGES)
        ]
    del ring, stages


class _DeviceStages:
    """The device side of a CUDA restore's pipeline: chunks uploaded in turn into ``count`` device
    stages. With more than one, uploads run on a copy stream of their own: the placement (current
    stream) waits for its chunk's upload, and an upload into a stage waits for the placement that
    last read that stage — so a chunk's upload overlaps the previous chunk's placement."""

    def __init__(self, size: int, count: int):
        device = torch.cuda.current_device()
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(max(1, count))]
        self.stream = torch.cuda.Stream() if len(self.buffers) > 1 else torch.cuda.current_stream()
        # the stages' memory may have been another tensor's, still read or written by work queued on
        # the current stream (the caching allocator orders reuse on that stream only)
        self.stream.wait_stream(torch.cuda.current_stream())
        # per stage, once used: the placement that last read it is done
        self.free: list[torch.cuda.Event | None] = [None] * len(self.buffers)
        self.turn = 0

    def upload(self, host: torch.Tensor, uploaded: torch.cuda.Event) -> torch.Tensor:
        """Queue ``host`` (pinned) into the next stage; ``uploaded`` is recorded once the copy engine
        is done with ``host``. Returns the stage's view, ready for the current stream to read."""
        k = self.turn % len(self.buffers)
        raw = self.buffers[k][: host.numel()]
        compute = torch.cuda.current_stream()
        if self.stream == compute:
            raw.copy_(host, non_blocking=True)
            uploaded.record()
            return raw
        free = self.free[k]
        if free is not None:
            self.stream.wait_event(free)
        with torch.cuda.stream(self.stream):
            raw.copy_(host, non_blocking=True)
            uploaded.record(self.stream)
        compute.wait_event(uploaded)
        return raw

    def placed(self) -> None:
        """The current stream has queued everything that reads the stage last handed out."""
        k = self.turn % len(self.buffers)
        if self.stream != torch.cuda.current_stream():
            free = self.free[k] = self.free[k] or torch.cuda.Event()
            free.record()
        self.turn += 1


def _pipeline(
    body, fields, placement: Placement, device: torch.device, per_chunk: int, threads: int
) -> tuple[int, np.ndarray]:
    """Chunks through a ring of host buffers: ``threads`` reads in flight while earlier chunks are
    uploaded (CUDA: from pinned memory, asynchronously) and split.

    On CUDA a slot is refilled only once the copy engine is done with it (an event per slot, waited
    on by the reading thread); elsewhere a chunk is consumed before its slot is handed out again.
    """
    n, rec = body.n, body.layout.rec_bytes
    cuda = device.type == "cuda"
    preferred = getattr(body, "chunk_starts", None)
    starts = (preferred(per_chunk) if preferred is not None else None) or list(range(0, n, per_chunk))
    counts = [b - a for a, b in zip(starts, [*starts[1:], n])]  # each at most per_chunk
    slots = min(len(starts), 2 * threads)
    slot_bytes = min(per_chunk, n) * rec
    split = getattr(body, "split", False)  # chunks in split_blocks' layout, tokens from the body
    if split:
        slot_bytes = max(slot_bytes, split_bytes(body.layout, min(per_chunk, n)))
    if cuda:
        ring = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        views = [buffer.numpy() for buffer in ring]
        uploaded = [torch.cuda.Event() for _ in range(slots)]  # the slot's last upload has finished
        copies = _DeviceStages(slot_bytes, min(DEVICE_STAGES, len(starts)))
    else:
        views = [np.empty(slot_bytes, dtype=np.uint8) for _ in range(slots)]
        ring = [torch.from_numpy(view) for view in views]
        uploaded, copies = [], None  # no copy engine to wait for, no device stage
    in_use = [False] * slots
    tokens = np.empty(n, dtype=np.int32)

    def read(i: int) -> int:
        slot = i % slots
        if cuda and in_use[slot]:
            uploaded[slot].synchronize()  # releases the GIL
        return body.read_into(views[slot], starts[i], counts[i])

    # One chunk (or one thread) is read where it is needed: a pool would only add its start-up.
    pool = (
        ThreadPoolExecutor(max_workers=min(threads, slots), thread_name_prefix="kv-restore")
        if slots > 1 and threads > 1
        else None
    )

    def submit(i: int):
        return pool.submit(read, i) if pool is not None else i

    def wait(handle) -> int:
        return handle.result() if pool is not None else read(handle)

    filled = 0
    try:
        pending = {i: submit(i) for i in range(slots)}
        for i, a in enumerate(starts):
            got = wait(pending.pop(i))
            slot = i % slots
            if got:
                size = split_bytes(body.layout, got) if split else got * rec
                if split:
                    tokens[a : a + got] = body.tokens(a, got)
                else:
                    tokens[a : a + got] = _tokens_of(views[slot][:size].reshape(got, rec))
                if copies is not None:  # CUDA
                    raw = copies.upload(ring[slot][:size], uploaded[slot])
                    in_use[slot] = True
                elif device.type == "cpu":
                    raw = ring[slot][:size]
                else:  # a blocking copy: the slot is free once it returns
                    raw = ring[slot][:size].to(device)
                if split:
                    placement.apply_split(raw, got, fields, a)
                else:
                    placement.apply(raw.view(got, rec), fields, a)
                if copies is not None:
                    copies.placed()
            filled = a + got
            if got < counts[i]:
                break  # the file ended early: keep the complete records before it
            if i + slots < len(starts):
                pending[i + slots] = submit(i + slots)
    finally:
        if pool is not None:  # reads still in flight write into the ring: wait for them before it goes
            pool.shutdown(wait=True, cancel_futures=True)
    return filled, tokens[:filled]
