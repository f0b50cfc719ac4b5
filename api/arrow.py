"""Rows as Arrow IPC streams (``application/vnd.apache.arrow.stream``), one row per token.

Schema (exact types; uploads with other types or widths are refused):

====== ================================================ =========================================
column type                                             holds
====== ================================================ =========================================
token  int32, not null                                  the token id
L      fixed_size_list<float32>[n_layers * kv_lora]     the latent rows of every layer, layer-major:
                                                        ``L[t] = concat(L[0, t], L[1, t], ...)``
R      fixed_size_list<float32>[n_layers * qk_rope]     the rope-key rows, layer-major
I      fixed_size_list<float32>[nic * index_hd]         indexer rows (only when nic > 0)
====== ================================================ =========================================

Downloads carry schema metadata ``kvstore.geometry`` (the six words, comma-separated) and
``kvstore.tier``, and hold the rows as the session's tier decodes them (dequantized, sanitized);
uploads are encoded into the session's tier (quantized) on arrival.
"""

from __future__ import annotations

import struct
from typing import Iterator, NamedTuple

import numpy as np
import pyarrow as pa

from kvstore.api.errors import BodyTooLarge
from kvstore.errors import GeometryMismatch, InvalidRequest, KVStoreError
from kvstore.formats import coli_kv, nonfinite
from kvstore.formats.coli_kv import Geometry, KVRecords, Tier
from kvstore.formats.nonfinite import Sanitized

END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def schema_for(geometry: Geometry, tier: Tier | None = None) -> pa.Schema:
    g = geometry
    fields = [
        pa.field("token", pa.int32(), nullable=False),
        pa.field("L", pa.list_(pa.float32(), g.n_layers * g.kv_lora), nullable=False),
        pa.field("R", pa.list_(pa.float32(), g.n_layers * g.qk_rope), nullable=False),
    ]
    if g.nic:
        fields.append(pa.field("I", pa.list_(pa.float32(), g.nic * g.index_hd), nullable=False))
    metadata = {"kvstore.geometry": ",".join(str(w) for w in g.words())}
    if tier is not None:
        metadata["kvstore.tier"] = tier.describe()
    return pa.schema(fields, metadata=metadata)


def _token_major(rows: np.ndarray) -> pa.FixedSizeListArray:
    """[layers, n, width] -> n lists of layers*width values."""
    layers, n, width = rows.shape
    flat = np.ascontiguousarray(rows.transpose(1, 0, 2)).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.float32()), layers * width)


def batch_message(records: KVRecords, schema: pa.Schema) -> bytes:
    """One record batch of ``records`` as an encapsulated IPC message."""
    L, R, I = records.dequantize()
    columns = [pa.array(records.tokens, type=pa.int32()), _token_major(L), _token_major(R)]
    if I is not None:
        columns.append(_token_major(I))
    return pa.record_batch(columns, schema=schema).serialize().to_pybytes()


def stream_messages(geometry: Geometry, tier: Tier, batches: Iterator[KVRecords]) -> Iterator[bytes]:
    """A whole IPC stream: the schema, one message per batch, the end-of-stream marker."""
    schema = schema_for(geometry, tier)
    yield schema.serialize().to_pybytes()
    for records in batches:
        yield batch_message(records, schema)
    yield END_OF_STREAM


# ---- the upload's bounds, read from each message's metadata before its body is decoded --------
# An IPC message is a flatbuffer (format/Message.fbs) and a body; a compressed body buffer starts
# with its decoded length (int64). pyarrow decompresses when it reads a batch, so the lengths are
# read here first, from the flatbuffer: a 25 KB zstd body can declare 1 GB of rows.
_RECORD_BATCH = 3  # MessageHeader union: Schema = 1, DictionaryBatch = 2, RecordBatch = 3
_ALIGN = 64  # writers may pad each buffer to 64 bytes
_NOT_COMPRESSED = -1  # a compressed stream's buffer stored as is
# Each record batch costs the server ~3 KB of Python and Arrow objects however few rows it holds:
# 100,000 empty batches (34 MiB of body) took 300 MiB and 6 s of CPU to read. Writers put a turn,
# or a few thousand rows, in one batch.
MAX_BATCHES = 4096


class _Table:
    """One flatbuffer table of a message's metadata, every offset checked against the metadata's size."""

    def __init__(self, data: bytes, pos: int):
        self.data = data
        self.pos = pos
        self.vtable = pos - self._unpack("<i", pos)
        self.vtable_size = self._unpack("<H", self.vtable)

    def _unpack(self, fmt: str, pos: int) -> int:
        if pos < 0 or pos + struct.calcsize(fmt) > len(self.data):
            raise InvalidRequest("the Arrow stream's message metadata is malformed (an offset points outside it)")
        return struct.unpack_from(fmt, self.data, pos)[0]

    def _field(self, slot: int) -> int | None:
        entry = 4 + 2 * slot
        if entry + 2 > self.vtable_size:
            return None
        offset = self._unpack("<H", self.vtable + entry)
        return self.pos + offset if offset else None

    def scalar(self, slot: int, fmt: str, default: int = 0) -> int:
        at = self._field(slot)
        return default if at is None else self._unpack(fmt, at)

    def table(self, slot: int) -> "_Table | None":
        at = self._field(slot)
        return None if at is None else _Table(self.data, at + self._unpack("<I", at))

    def pairs(self, slot: int, what: str, expected: int) -> list[tuple[int, int]]:
        """A vector of two-int64 structs (FieldNode, Buffer), refused unless it has ``expected`` items."""
        at = self._field(slot)
        if at is None:
            count, start = 0, 0
        else:
            start = at + self._unpack("<I", at)
            count = self._unpack("<I", start)
        if count != expected:
            raise InvalidRequest(f"a record batch has {count} {what}; this session's schema has {expected}")
        end = start + 4 + 16 * count
        if end > len(self.data):
            raise InvalidRequest("the Arrow stream's message metadata is malformed (a vector runs past it)")
        flat = struct.unpack_from(f"<{2 * count}q", self.data, start + 4)
        return list(zip(flat[0::2], flat[1::2]))


def _layout(schema: pa.Schema, geometry: Geometry) -> list[tuple[str, int]]:
    """Each column's (name, values per token), in the stream's order."""
    g = geometry
    widths = {"token": 1, "L": g.n_layers * g.kv_lora, "R": g.n_layers * g.qk_rope, "I": g.nic * g.index_hd}
    return [(name, widths[name]) for name in schema.names]


def _check_schema(schema: pa.Schema, geometry: Geometry) -> None:
    g = geometry
    wanted = {"token", "L", "R"} | ({"I"} if g.nic else set())
    if set(schema.names) != wanted or len(schema.names) != len(wanted):
        raise InvalidRequest(f"the stream must have exactly the columns {sorted(wanted)}, it has {schema.names}")
    if schema.field("token").type != pa.int32():
        raise InvalidRequest(f"column token is {schema.field('token').type}; it must be int32")
    shapes = {
        "L": (g.n_layers, g.kv_lora, "n_layers x kv_lora"),
        "R": (g.n_layers, g.qk_rope, "n_layers x qk_rope"),
        "I": (g.nic, g.index_hd, "nic x index_hd"),
    }
    for name in schema.names:
        if name == "token":
            continue
        layers, width, what = shapes[name]
        expected = pa.list_(pa.float32(), layers * width)
        if schema.field(name).type != expected:
            raise GeometryMismatch(
                f"column {name} is {schema.field(name).type}; this session needs {expected} "
                f"({what} = {layers} x {width} values per token)"
            )


def _decoded_sizes(batch: _Table, body: memoryview, compressed: bool, count: int) -> list[int]:
    """The size each body buffer of a record batch decodes to, from the metadata (nothing is decoded)."""
    sizes = []
    for offset, length in batch.pairs(2, "buffers", count):
        if offset < 0 or length < 0 or offset + length > len(body):
            raise InvalidRequest("a record batch names a buffer outside its message body")
        if not compressed or length == 0:
            sizes.append(length)
            continue
        if length < 8:
            raise InvalidRequest("a compressed buffer is shorter than its 8-byte length prefix")
        declared = struct.unpack_from("<q", body, offset)[0]
        if declared == _NOT_COMPRESSED:
            sizes.append(length - 8)
        elif declared < 0:
            raise InvalidRequest(f"a compressed buffer declares a negative decoded length ({declared})")
        else:
            sizes.append(declared)
    return sizes


def _check_batch(
    message: pa.ipc.Message, layout: list[tuple[str, int]], rows_before: int, max_decoded_bytes: int
) -> int:
    """Check one record batch's declared rows and buffer sizes against the geometry and the limit.

    Returns the batch's rows. Raises :class:`BodyTooLarge` when the rows (at 4 bytes per value) or a
    buffer's decoded size would take the upload past ``max_decoded_bytes``, or a buffer declares
    more bytes than its rows need; :class:`InvalidRequest` when the metadata disagrees with the schema.
    """
    metadata = message.metadata.to_pybytes()
    if len(metadata) < 4:
        raise InvalidRequest("the Arrow stream's message metadata is malformed (too short)")
    root = _Table(metadata, struct.unpack_from("<I", metadata, 0)[0])
    if root.scalar(1, "<B") != _RECORD_BATCH:
        raise InvalidRequest(f"the stream holds a {message.type} message; uploads hold one schema, then record batches")
    batch = root.table(2)
    if batch is None:
        raise InvalidRequest("a record batch message has no header")
    rows = batch.scalar(0, "<q")
    if rows < 0:
        raise InvalidRequest(f"a record batch declares {rows} rows")
    row_bytes = 4 * sum(width for _, width in layout)
    if (rows_before + rows) * row_bytes > max_decoded_bytes:
        raise BodyTooLarge(
            f"the Arrow stream declares {rows_before + rows} rows of {row_bytes} bytes decoded, more than "
            f"{max_decoded_bytes} bytes: this service accepts at most {max_decoded_bytes} bytes per upload, "
            "compressed or not (--max-body); send the rows in smaller appends"
        )
    expected_nodes, expected_sizes = [], []
    for name, width in layout:
        values = rows * width
        if name == "token":
            expected_nodes.append(rows)
            expected_sizes += [(f"{name} validity", (rows + 7) // 8), (name, 4 * rows)]
        else:
            expected_nodes += [rows, values]
            expected_sizes += [
                (f"{name} validity", (rows + 7) // 8),
                (f"{name} values validity", (values + 7) // 8),
                (f"{name} values", 4 * values),
            ]
    for (length, _nulls), expected in zip(batch.pairs(1, "field nodes", len(expected_nodes)), expected_nodes):
        if length != expected:
            raise InvalidRequest(
                f"a record batch of {rows} rows has a column of {length} values; this session's schema needs {expected}"
            )
    compression = batch.table(3)
    body = memoryview(message.body) if message.body is not None else memoryview(b"")
    sizes = _decoded_sizes(batch, body, compression is not None, len(expected_sizes))
    for size, (what, needed) in zip(sizes, expected_sizes):
        allowed = -(-needed // _ALIGN) * _ALIGN
        if size > allowed:
            raise BodyTooLarge(
                f"a record batch of {rows} rows declares {size} decoded bytes for its {what}, which needs at most "
                f"{allowed}; this service accepts at most {max_decoded_bytes} bytes per upload, decoded (--max-body)"
            )
    return rows


def _checked_batches(body: bytes | bytearray | memoryview, geometry: Geometry, max_decoded_bytes: int):
    """The upload's record batches, every bound checked before any is decoded (see
    :func:`records_from_stream`); each batch's buffers are views of ``body`` unless compressed."""
    try:
        messages = pa.ipc.MessageReader.open_stream(pa.py_buffer(body))
        first = messages.read_next_message()
        if first.type != "schema":
            raise InvalidRequest(f"the stream starts with a {first.type} message; it must start with its schema")
        schema = pa.ipc.read_schema(first)
        _check_schema(schema, geometry)
        layout = _layout(schema, geometry)
        checked, rows = [], 0
        for message in messages:  # metadata only: nothing is decompressed in this loop
            if len(checked) == MAX_BATCHES:
                raise BodyTooLarge(
                    f"the Arrow stream holds more than {MAX_BATCHES} record batches, the most this service reads "
                    "in one upload; write the rows in fewer, larger batches"
                )
            rows += _check_batch(message, layout, rows, max_decoded_bytes)
            checked.append(message)
        batches = [pa.ipc.read_record_batch(m, schema) for m in checked]
        for batch in batches:
            batch.validate(full=True)
    except (pa.ArrowException, OSError, ValueError, StopIteration) as exc:
        if isinstance(exc, KVStoreError):
            raise
        raise InvalidRequest(f"the body is not a valid Arrow IPC stream ({str(exc) or 'it holds no schema'})") from None
    return batches, rows


class BatchRows(NamedTuple):
    """One record batch's rows: views of its buffers, layer-major (``encode_records``' arguments)."""

    tokens: np.ndarray
    L: np.ndarray
    R: np.ndarray
    I: np.ndarray | None


def _batch_rows(batch: pa.RecordBatch, geometry: Geometry) -> BatchRows:
    g = geometry
    token_column = batch.column("token")
    if token_column.null_count:
        raise InvalidRequest("column token holds nulls")

    def rows(name: str, layers: int, width: int) -> np.ndarray:
        column = batch.column(name)
        values = column.flatten()
        if column.null_count or values.null_count:
            raise InvalidRequest(f"column {name} holds nulls")
        return values.to_numpy(zero_copy_only=False).reshape(batch.num_rows, layers, width).transpose(1, 0, 2)

    return BatchRows(
        token_column.to_numpy(),
        rows("L", g.n_layers, g.kv_lora),
        rows("R", g.n_layers, g.qk_rope),
        rows("I", g.nic, g.index_hd) if g.nic else None,
    )


def records_from_stream(
    body: bytes | bytearray | memoryview, geometry: Geometry, tier: Tier, *, max_decoded_bytes: int
) -> tuple[np.ndarray, Sanitized]:
    """An uploaded IPC stream encoded into ``tier``'s records, a record batch at a time: the rows are
    never copied out of ``body`` (uncompressed batches are views of it), so an upload holds its body,
    its records and one batch's work. Non-finite values are stored by the tier's rule and counted
    (``coli_kv.encode_records_counted``).

    The stream is read message by message: its schema is checked against ``geometry`` and every
    record batch's rows and buffer sizes against the geometry and ``max_decoded_bytes`` *before*
    any batch is decompressed (the messages are views of ``body``), so what a body decodes to is
    bounded like the body itself and a refused one costs no more memory than its own bytes.

    Raises
    ------
    BodyTooLarge : the rows would decode to more than ``max_decoded_bytes``, or the stream holds
        more than :data:`MAX_BATCHES` record batches (413)
    GeometryMismatch : a row column of another width (409)
    InvalidRequest : not an IPC stream of this session's schema (400)
    """
    batches, n = _checked_batches(body, geometry, max_decoded_bytes)
    records = np.zeros(n, dtype=coli_kv.record_dtype(geometry, tier))
    parts, at = [], 0
    for batch in batches:
        tokens, L, R, I = _batch_rows(batch, geometry)
        encoded, found = coli_kv.encode_records_counted(geometry, tier, tokens, L, R, I)
        records[at : at + batch.num_rows] = encoded
        parts.append((at, found))
        at += batch.num_rows
    return records, nonfinite.combined(parts)
