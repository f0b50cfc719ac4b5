"""Non-finite values (NaN, ±inf) in rows to store: what each tier does with them, counted.

docs/FORMAT.md's encoders never store a non-finite value: the fp8 and TurboQuant codecs have their own
rule (sections 3 and 5), and the store writes a non-finite f32 value (v1 rows, indexer rows) as 0.
This module counts them and names the first, so an upload can say what was changed
(``AppendResult.sanitized``) or be refused (``--reject-nonfinite``). The spec encoder itself,
``coli_kv.encode_records``, keeps f32 values as given (byte for byte with the C engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.formats.tiers import Tier

__all__ = ["SLICE_VALUES", "Sanitized", "combined", "count", "sanitize_records", "slice_rows"]

#: f32 values judged at a time: the masks and temporaries of a large upload stay this size.
SLICE_VALUES = 1 << 20


@dataclass(frozen=True)
class Sanitized:
    """Non-finite values (NaN, +inf, -inf) in rows to store, and what storing them does.

    No tier stores them as given: f32 rows (v1) and the indexer's f32 rows (every version) store
    each as 0, the other values of its row kept; fp8 (docs/FORMAT.md section 3) stores a NaN as code 0
    but a row holding an infinity as all zeros (inert, scale 1); int4/polar (section 5) store a row
    holding either as all zeros (radius 0).

    Attributes
    ----------
    values : the non-finite values
    rows_zeroed : L/R rows (one layer of one token) stored as all zeros because they held one
    first : ``(record, field, layer, element)`` of the first one in record order (``field`` is
        ``"L"``, ``"R"`` or ``"I"``; ``layer`` counts indexer layers for ``"I"``), or None

    >>> Sanitized(3, 1, (0, "L", 1, 5)).describe()
    '3 non-finite values (NaN or infinity), the first at record 0, L layer 1, element 5; 1 row stored as zeros'
    """

    values: int = 0
    rows_zeroed: int = 0
    first: tuple[int, str, int, int] | None = None

    def describe(self) -> str:
        if not self.values or self.first is None:
            return "no non-finite values"
        record, field, layer, element = self.first
        text = (
            f"{self.values} non-finite value{'s' * (self.values != 1)} (NaN or infinity), the first at record "
            f"{record}, {field} layer {layer}, element {element}"
        )
        if self.rows_zeroed:
            text += f"; {self.rows_zeroed} row{'s' * (self.rows_zeroed != 1)} stored as zeros"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"values": self.values, "rows_zeroed": self.rows_zeroed}


def combined(parts: list[tuple[int, Sanitized]]) -> Sanitized:
    """The count of consecutive slices of records: ``(first record of the slice, its count)``,
    in record order."""
    first = next(((at + part.first[0], *part.first[1:]) for at, part in parts if part.first is not None), None)
    return Sanitized(
        sum(part.values for _, part in parts),
        sum(part.rows_zeroed for _, part in parts),
        first,  # type: ignore[arg-type]
    )


def slice_rows(values_per_record: int) -> int:
    """Records judged at a time when each holds ``values_per_record`` values (:data:`SLICE_VALUES`)."""
    return max(1, SLICE_VALUES // max(1, values_per_record))


def count(tier: Tier, fields: dict[str, np.ndarray]) -> tuple[Sanitized, dict[str, np.ndarray]]:
    """Count the non-finite values of f32 fields in record order (``field -> [n, layers, width]``),
    and the L/R rows ``tier``'s codec stores as zeros because of them (the indexer rows ``"I"`` are
    always f32).

    Returns the count and, for each field holding any, its mask (same shape).
    """
    codec = tier.file_tier.row_codec
    masks: dict[str, np.ndarray] = {}
    values = zeroed = 0
    first: tuple[int, str, int, int] | None = None
    for field, rows in fields.items():
        # f32 values, or a value tier's stored codes (bf16 bit patterns) in already-encoded records
        coded = None if rows.dtype.kind == "f" else codec.bad_codes(rows)
        bad = ~np.isfinite(rows) if coded is None else coded
        hits = int(np.count_nonzero(bad))
        if not hits:
            continue
        masks[field] = bad
        values += hits
        if field != "I":
            zeroed += codec.zeroed_rows(rows, bad)
        record, layer, element = (int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))
        if first is None or record < first[0]:
            first = (record, field, layer, element)
    return Sanitized(values, zeroed, first), masks


def sanitize_records(records: np.ndarray, tier: Tier) -> tuple[np.ndarray, Sanitized]:
    """Already-encoded records with their non-finite values (v1 and v4 rows, indexer rows) set to 0.

    The codes of the quantized tiers are not values (a corrupt scale or NaN code is refused by the
    journal, never guessed); ``records`` is returned as is when it holds no non-finite value, else
    a copy. Judged a slice of records at a time (:data:`SLICE_VALUES`): the masks stay small.

    Returns
    -------
    (records, :class:`Sanitized`)
    """
    names = []
    if tier.holds_values:
        names = [("L", "Lc"), ("R", "Rc")]
    if records.dtype.names is not None and "index" in records.dtype.names:
        names.append(("I", "index"))
    if not names or records.shape[0] == 0:
        return records, Sanitized()

    def field(rows: np.ndarray, column: str) -> np.ndarray:
        return rows[column] if column == "index" else rows["layers"][column]

    step = slice_rows(sum(int(np.prod(field(records[:1], column).shape[1:])) for _, column in names))
    fixed, parts = records, []
    for lo in range(0, records.shape[0], step):
        part = fixed[lo : lo + step]
        found, masks = count(tier, {name: field(part, column) for name, column in names})
        parts.append((lo, found))
        if masks and fixed is records:  # the first non-finite value: from here on, a copy is fixed
            fixed = np.array(records, copy=True)
            part = fixed[lo : lo + part.shape[0]]
        for name, bad in masks.items():
            field(part, dict(names)[name])[bad] = 0.0
    return fixed, combined(parts)
