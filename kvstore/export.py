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
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore.errors import FormatError, InvalidRequest
from kvstore.filetools import check_output
from kvstore.formats.coli_kv import KVRecords
from kvstore.journal import AtomicFile, write_errors

SUFFIXES = (".npz", ".arrow", ".parquet")
EXPORT_WRITE_BYTES = 4 << 20


def to_arrow_table(records: KVRecords, rows: tuple | None = None):
    """The records as a ``pyarrow.Table`` (see the module docstring for the schema).

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

    g = records.geometry
    L, R, index = rows if rows is not None else records.dequantize()
    n, n_layers = records.n, g.n_layers
    columns = {
        "position": pa.array(np.repeat(np.arange(n, dtype=np.int32), n_layers)),
        "token": pa.array(np.repeat(records.tokens, n_layers)),
        "layer": pa.array(np.tile(np.arange(n_layers, dtype=np.int16), n)),
        # [n_layers, n, w] -> [n, n_layers, w]: position-major rows
        "L": pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(L.transpose(1, 0, 2)).reshape(-1)), g.kv_lora
        ),
        "R": pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(R.transpose(1, 0, 2)).reshape(-1)), g.qk_rope
        ),
    }
    if index is not None:  # nic > 0: indexer rows on the first nic layer rows
        padded = np.zeros((n, n_layers, g.index_hd), dtype=np.float32)
        padded[:, : g.nic] = index.transpose(1, 0, 2)
        valid = np.zeros((n, n_layers), dtype=bool)
        valid[:, : g.nic] = True
        values = pa.array(padded.reshape(-1))
        mask = pa.array(~valid.reshape(-1))
        columns["I"] = pa.FixedSizeListArray.from_arrays(values, g.index_hd, mask=mask)
    metadata = {
        "coli_kv": json.dumps(
            {
                "version": records.tier.version,
                "codec": records.tier.codec,
                "bits": records.tier.bits,
                "geometry": list(g.words()),
                "n_records": n,
            }
        )
    }
    return pa.table(columns).replace_schema_metadata(metadata)


def export(
    records: KVRecords,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write ``records`` to ``out`` (format by suffix), atomically; returns the path.

    Parameters
    ----------
    records : the safe records of a file (dequantized and sanitized on the way out)
    out : ``OUT.npz`` (``tokens`` int32[n], ``L``, ``R``, ``I``), ``OUT.arrow`` or ``OUT.parquet``
    overwrite : replace an existing ``out`` (otherwise it is refused, even when it appears while
        the export runs: the file is published with a link that never clobbers)
    progress : ``progress(bytes_written, bytes_total)`` of the output file, called as it is written

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
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in SUFFIXES:
        raise FormatError(
            f"{out}: cannot export to a {suffix or 'suffix-less'} file; expected one of {', '.join(SUFFIXES)}"
        )
    check_output(out, overwrite=overwrite, what="the export")
    L, R, index = records.dequantize()
    sink = io.BytesIO()
    if suffix == ".npz":
        if index is None:
            np.savez(sink, tokens=records.tokens, L=L, R=R)
        else:
            np.savez(sink, tokens=records.tokens, L=L, R=R, I=index)
    else:
        table = to_arrow_table(records, (L, R, index))
        if suffix == ".arrow":
            import pyarrow as pa

            with pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, sink)
    try:
        with write_errors(f"writing {out}", "no partial export was left"):
            with AtomicFile(out, replace=overwrite) as handle:
                encoded = sink.getbuffer()
                # written in pieces only so that a progress bar moves; one fsync at the end as before
                for start in range(0, max(len(encoded), 1), EXPORT_WRITE_BYTES):
                    handle.write(encoded[start : start + EXPORT_WRITE_BYTES])
                    if progress is not None:
                        progress(min(start + EXPORT_WRITE_BYTES, len(encoded)), len(encoded))
    except FileExistsError:  # created by someone else while the rows were encoded
        raise InvalidRequest(f"{out}: exists; pass --force to replace it (nothing was written)") from None
    return out
