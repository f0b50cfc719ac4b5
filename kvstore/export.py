"""Export the rows of a ``.coli_kv`` file as ``.npz``, Arrow IPC (``.arrow``) or Parquet.

Rows are dequantized and sanitized, and only the ``n`` records that are safe to resume are
exported. The npz holds ``tokens`` int32[n], ``L`` f32[n_layers, n, kv_lora],
``R`` f32[n_layers, n, qk_rope] and, when the model has indexer layers, ``I`` f32[nic, n, index_hd].

The Arrow/Parquet table has one row per (token position, layer), position-major:

============  =====================================  ==========================================
column        type                                   holds
============  =====================================  ==========================================
position      int32                                  record index
token         int32                                  token id
layer         int16                                  layer index
L             fixed_size_list<float32>[kv_lora]      the latent row Lc
R             fixed_size_list<float32>[qk_rope]      the rope-key row Rc
I             fixed_size_list<float32>[index_hd]     indexer row k on layer rows k < nic (else
                                                     null); only present when nic > 0
============  =====================================  ==========================================

The file's header (version, geometry, tier) is kept in the schema metadata.

An export streams: records are read and decoded a batch at a time (:data:`BATCH_BYTES` of decoded
rows), each batch written as an Arrow record batch or a Parquet row group before the next is read,
so what an export holds does not grow with the file. The npz arrays are layer-major while records
are position-major: each batch's rows are put at their place in a scratch file beside the output
(unnamed, gone when the export ends), which is then copied into the archive in order.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from kvstore.durable import AtomicFile, write_errors
from kvstore.errors import FormatError, InvalidRequest
from kvstore.filetools import SourceFile, check_output, repaired
from kvstore.formats.coli_kv import Geometry, Header, KVRecords

SUFFIXES = (".npz", ".arrow", ".parquet")
#: Decoded rows (f32 bytes) per batch an export holds at once.
BATCH_BYTES = 16 << 20
#: Bytes copied at a time from the npz scratch file into the archive.
COPY_BYTES = 4 << 20

Progress = Callable[[int, int], None]


def arrow_schema(header: Header, n: int):
    """The ``pyarrow.Schema`` of an export of ``n`` records of ``header``'s file (the module
    docstring has the columns), with the header in its metadata."""
    import pyarrow as pa

    g = header.geometry
    fields = [
        pa.field("position", pa.int32()),
        pa.field("token", pa.int32()),
        pa.field("layer", pa.int16()),
        pa.field("L", pa.list_(pa.float32(), g.kv_lora)),
        pa.field("R", pa.list_(pa.float32(), g.qk_rope)),
    ]
    if g.nic:
        fields.append(pa.field("I", pa.list_(pa.float32(), g.index_hd)))
    tier = header.tier
    metadata = {
        "coli_kv": json.dumps(
            {
                "version": tier.version,
                "codec": tier.codec,
                "bits": tier.bits,
                "geometry": list(g.words()),
                "n_records": n,
            }
        )
    }
    return pa.schema(fields, metadata=metadata)


def arrow_batch(records: KVRecords, first: int, schema, rows: tuple | None = None):
    """Records ``first .. first + records.n`` of a file as a ``pyarrow.RecordBatch`` of ``schema``
    (:func:`arrow_schema`): ``records.n * n_layers`` rows, position-major.

    Parameters
    ----------
    records : the records of the batch
    first : the position of ``records``' first record in its file
    schema : the export's schema
    rows : ``records.dequantize()`` when the caller already has it
    """
    import pyarrow as pa

    g = records.geometry
    L, R, index = rows if rows is not None else records.dequantize()
    n, n_layers = records.n, g.n_layers
    columns = [
        pa.array(np.repeat(np.arange(first, first + n, dtype=np.int32), n_layers)),
        pa.array(np.repeat(records.tokens, n_layers)),
        pa.array(np.tile(np.arange(n_layers, dtype=np.int16), n)),
        # [n_layers, n, w] -> [n, n_layers, w]: position-major rows
        pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(L.transpose(1, 0, 2)).reshape(-1)), g.kv_lora),
        pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(R.transpose(1, 0, 2)).reshape(-1)), g.qk_rope),
    ]
    if index is not None:  # nic > 0: indexer rows on the first nic layer rows
        padded = np.zeros((n, n_layers, g.index_hd), dtype=np.float32)
        padded[:, : g.nic] = index.transpose(1, 0, 2)
        valid = np.zeros((n, n_layers), dtype=bool)
        valid[:, : g.nic] = True
        values = pa.array(padded.reshape(-1))
        mask = pa.array(~valid.reshape(-1))
        columns.append(pa.FixedSizeListArray.from_arrays(values, g.index_hd, mask=mask))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def to_arrow_table(records: KVRecords, rows: tuple | None = None):
    """The records as a ``pyarrow.Table`` (see the module docstring for the schema), in memory.

    Parameters
    ----------
    records : the safe records of a file
    rows : ``records.dequantize()`` when the caller already has it: (L f32[n_layers, n, kv_lora],
        R f32[n_layers, n, qk_rope], I f32[nic, n, index_hd] or None)

    Returns
    -------
    pyarrow.Table
        ``n * n_layers`` rows, position-major, with the header in the schema metadata.
    """
    import pyarrow as pa

    schema = arrow_schema(records.header, records.n)
    return pa.Table.from_batches([arrow_batch(records, 0, schema, rows)], schema=schema)


def _decoded_bytes(g: Geometry) -> int:
    """f32 bytes one record decodes to in an export (the Arrow indexer column pads to every layer)."""
    return 4 * g.n_layers * (g.kv_lora + g.qk_rope + (g.index_hd if g.nic else 0)) + 16


def _batches(
    source: KVRecords | SourceFile, repair: bool, progress: Progress | None
) -> Iterator[tuple[int, KVRecords]]:
    """``(first position, records)`` of ``source`` in batches of about :data:`BATCH_BYTES` decoded,
    each sanitized as ``repair`` would leave it when ``repair``; ``progress(bytes read, bytes)``."""
    header = source.header
    rec_bytes = header.rec_bytes
    step = max(1, BATCH_BYTES // _decoded_bytes(header.geometry))
    total = source.n * rec_bytes
    if progress is not None:
        progress(0, total)
    if isinstance(source, SourceFile):
        pieces: Iterator[KVRecords] = source.chunks(step * rec_bytes, repair=repair)
    else:
        pieces = (
            repaired(piece) if repair else piece
            for piece in (source.slice(start, min(start + step, source.n)) for start in range(0, source.n, step))
        )
    first = 0
    for piece in pieces:
        yield first, piece
        first += piece.n
        if progress is not None:
            progress(first * rec_bytes, total)


def _write_npz(sink: BinaryIO, source: KVRecords | SourceFile, folder: Path, repair: bool, progress: Progress | None):
    """The npz archive (``np.savez``'s members and layout, uncompressed) of ``source`` into ``sink``.

    The rows of each batch go to their place in a scratch file (layer-major, as the arrays are),
    which is then copied member by member into the archive.
    """
    g, n = source.geometry, source.n
    shapes = {"L": (g.n_layers, n, g.kv_lora), "R": (g.n_layers, n, g.qk_rope)}
    if g.nic:
        shapes["I"] = (g.nic, n, g.index_hd)
    starts, offset = {}, 0
    for name, shape in shapes.items():
        starts[name] = offset
        offset += 4 * int(np.prod(shape))
    tokens = np.empty(n, dtype=np.int32)
    with tempfile.TemporaryFile(dir=folder, prefix=".kvstore-export-") as scratch:
        fd = scratch.fileno()
        for first, records in _batches(source, repair, progress):
            tokens[first : first + records.n] = records.tokens
            L, R, index = records.dequantize()
            for name, rows in (("L", L), ("R", R), ("I", index)):
                if rows is None:
                    continue
                width = shapes[name][2]
                for layer in range(rows.shape[0]):  # each layer's rows at their place: [layer, first .. ]
                    at = starts[name] + 4 * (layer * n + first) * width
                    payload = np.ascontiguousarray(rows[layer]).data.cast("B")
                    while len(payload):
                        written = os.pwrite(fd, payload, at)
                        payload, at = payload[written:], at + written
        with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            with archive.open("tokens.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, tokens, allow_pickle=False)
            for name, shape in shapes.items():
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    header = {
                        "descr": np.lib.format.dtype_to_descr(np.dtype("<f4")),
                        "fortran_order": False,
                        "shape": shape,
                    }
                    np.lib.format.write_array_header_1_0(member, header)
                    left, at = 4 * int(np.prod(shape)), starts[name]
                    while left:
                        piece = os.pread(fd, min(COPY_BYTES, left), at)
                        if not piece:
                            raise OSError(f"the export's scratch file ended {left} bytes early")
                        member.write(piece)
                        left, at = left - len(piece), at + len(piece)


def export(
    records: KVRecords | SourceFile,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    repair: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Write ``records`` to ``out`` (format by suffix), atomically, a batch at a time; returns the
    path written (``out``, or the file a link at ``out`` leads to).

    Parameters
    ----------
    records : the safe records of a file, loaded or open (:class:`~kvstore.filetools.SourceFile`:
        read a batch at a time), dequantized and sanitized on the way out
    out : ``OUT.npz`` (``tokens`` int32[n], ``L``, ``R``, ``I``), ``OUT.arrow`` or ``OUT.parquet``
    overwrite : replace an existing ``out`` (otherwise it is refused, even when it appears while
        the export runs: the file is published with a link that never clobbers)
    repair : export the records as ``kvstore repair`` would leave them (``--allow-damaged``)
    progress : ``progress(bytes_done, bytes_total)`` of the records read, called after each batch

    Raises
    ------
    FormatError
        Another suffix.
    InvalidRequest
        ``out`` exists (without ``overwrite``), is a folder, or its folder does not exist; checked
        before any row is decoded.
    JournalWriteError
        The file could not be written (no partial export is left).
    """
    suffix = Path(out).suffix.lower()
    if suffix not in SUFFIXES:
        raise FormatError(
            f"{out}: cannot export to a {suffix or 'suffix-less'} file; expected one of {', '.join(SUFFIXES)}"
        )
    target = check_output(out, overwrite=overwrite, what="the export")
    try:
        with write_errors(f"writing {out}", "no partial export was left"):
            with AtomicFile(target, replace=overwrite) as handle, handle.stream() as sink:
                if suffix == ".npz":
                    _write_npz(sink, records, target.parent, repair, progress)
                elif suffix == ".arrow":
                    import pyarrow as pa

                    schema = arrow_schema(records.header, records.n)
                    with pa.ipc.new_file(sink, schema) as writer:
                        for first, batch in _batches(records, repair, progress):
                            writer.write_batch(arrow_batch(batch, first, schema))
                else:
                    import pyarrow.parquet as pq

                    schema = arrow_schema(records.header, records.n)
                    # a row group per batch: a dictionary per row group would only grow the float
                    # columns (their values hardly repeat), so only the integer columns keep one
                    # (a list of columns is what pyarrow documents; its type stubs say bool only)
                    options: dict[str, Any] = {"use_dictionary": ["position", "token", "layer"]}
                    with pq.ParquetWriter(sink, schema, **options) as writer:
                        for first, batch in _batches(records, repair, progress):
                            writer.write_batch(arrow_batch(batch, first, schema))
    except FileExistsError:  # created by someone else while the rows were encoded
        raise InvalidRequest(f"{out}: exists; pass --force to replace it (nothing was written)") from None
    return target
