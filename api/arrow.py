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

from typing import Iterator

import numpy as np
import pyarrow as pa

from kvstore.errors import GeometryMismatch, InvalidRequest
from kvstore.formats.coli_kv import Geometry, KVRecords, Tier

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


def _rows(table: pa.Table, name: str, layers: int, width: int, what: str) -> np.ndarray:
    column = table.column(name)
    expected = pa.list_(pa.float32(), layers * width)
    if column.type != expected:
        raise GeometryMismatch(
            f"column {name} is {column.type}; this session needs {expected} ({what} = {layers} x {width} values per token)"
        )
    values = column.combine_chunks().flatten()
    if column.null_count or values.null_count:
        raise InvalidRequest(f"column {name} holds nulls")
    n = table.num_rows
    return values.to_numpy(zero_copy_only=False).reshape(n, layers, width).transpose(1, 0, 2)


def rows_from_stream(body: bytes | memoryview, geometry: Geometry):
    """Parse an uploaded IPC stream into ``(tokens int32[n], L, R, I | None)`` for ``encode_records``."""
    try:
        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise InvalidRequest(f"the body is not a valid Arrow IPC stream ({exc})") from None
    g = geometry
    wanted = {"token", "L", "R"} | ({"I"} if g.nic else set())
    names = set(table.column_names)
    if names != wanted or len(table.column_names) != len(wanted):
        raise InvalidRequest(f"the stream must have exactly the columns {sorted(wanted)}, it has {table.column_names}")
    token_column = table.column("token")
    if token_column.type != pa.int32():
        raise InvalidRequest(f"column token is {token_column.type}; it must be int32")
    if token_column.null_count:
        raise InvalidRequest("column token holds nulls")
    tokens = token_column.to_numpy()
    L = _rows(table, "L", g.n_layers, g.kv_lora, "n_layers x kv_lora")
    R = _rows(table, "R", g.n_layers, g.qk_rope, "n_layers x qk_rope")
    I = _rows(table, "I", g.nic, g.index_hd, "nic x index_hd") if g.nic else None
    return tokens, L, R, I
