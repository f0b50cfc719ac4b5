"""Conversions between ``.coli_kv`` versions, as named, registered steps.

Every step turns the records of one tier into records of another, in chunks (so a progress
callback can report and memory stays bounded). A step is *lossy* when the target cannot hold the
source's values exactly (f32 -> fp8, anything -> TQ or bf16); steps to v1 are exact: they store
exactly the values a reader of the source sees.

>>> [step.name for step in plan(tiers.F32, tiers.INT4)]
['v1-to-v3']
>>> plan(tiers.INT4, tiers.FP8)[0].lossy
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from kvstore.formats import tiers  # noqa: F401  (the doctests above name tiers)
from kvstore.formats.coli_kv import KVRecords, Tier, encode_records
from kvstore.migrations.errors import NoMigrationPath

Progress = Callable[[int, int], None]  # (records done, records total)
CHUNK_RECORDS = 512


@dataclass(frozen=True)
class Step:
    name: str
    source: int  # version
    target: int  # version
    lossy: bool
    description: str


REGISTRY: dict[tuple[int, int], Step] = {}


def register(step: Step) -> Step:
    REGISTRY[(step.source, step.target)] = step
    return step


register(Step("v1-to-v2", 1, 2, True, "quantize f32 rows to fp8 e4m3 with a per-row scale"))
register(Step("v2-to-v1", 2, 1, False, "store the dequantized (sanitized) fp8 rows as f32"))
register(Step("v1-to-v3", 1, 3, True, "quantize f32 rows with TurboQuant (polar or int4)"))
register(Step("v2-to-v3", 2, 3, True, "re-quantize the dequantized fp8 rows with TurboQuant"))
register(Step("v3-to-v1", 3, 1, False, "store the dequantized (sanitized) TQ rows as f32"))
register(Step("v3-to-v2", 3, 2, True, "re-quantize the dequantized TQ rows to fp8"))
register(Step("v3-to-v3", 3, 3, True, "re-quantize TQ rows with another codec or bit width"))
# v4 (bf16 values): to v1 exact (a bf16 value widens to f32 exactly); into v4 one rounding to bf16,
# which changes nothing for rows that came from a bf16 cache but is lossy in general
register(Step("v4-to-v1", 4, 1, False, "store the bf16 rows as f32"))
register(Step("v1-to-v4", 1, 4, True, "round f32 rows to bf16 (exact for rows of a bf16 cache)"))
register(Step("v2-to-v4", 2, 4, True, "round the dequantized fp8 rows to bf16"))
register(Step("v3-to-v4", 3, 4, True, "round the dequantized TQ rows to bf16"))
register(Step("v4-to-v2", 4, 2, True, "quantize bf16 rows to fp8 e4m3 with a per-row scale"))
register(Step("v4-to-v3", 4, 3, True, "quantize bf16 rows with TurboQuant (polar or int4)"))


def plan(source: Tier, target: Tier) -> list[Step]:
    """The steps from ``source`` to ``target`` (empty when they are the same tier)."""
    if source == target:
        return []
    step = REGISTRY.get((source.version, target.version))
    if step is None:
        raise NoMigrationPath(f"no migration from {source.describe()} to {target.describe()}")
    return [step]


def is_lossy(source: Tier, target: Tier) -> bool:
    return any(step.lossy for step in plan(source, target))


def conversion(source: Tier, target: Tier) -> str:
    """What converting ``source`` to ``target`` does to the values, in one line.

    The one description of a conversion: ``kvstore migrate`` prints it, its report carries it and
    the journal's refusal of a file in another tier quotes it, so a step is never called lossy in
    one place and exact in another.

    >>> conversion(tiers.FP8, tiers.F32)
    'fp8 -> f32, exact: the values a reader of the fp8 file sees are stored as f32 (store the dequantized (sanitized) fp8 rows as f32)'
    >>> conversion(tiers.F32, tiers.INT4).split(" (")[0]
    'f32 -> int4, lossy: the values are re-quantized'
    """
    steps = plan(source, target)
    if not steps:
        return f"{source.name} -> {target.name}: the same tier, the records are copied unchanged"
    if any(step.lossy for step in steps):
        kind = "lossy: the values are re-quantized"
    else:
        kind = f"exact: the values a reader of the {source.name} file sees are stored as f32"
    return f"{source.name} -> {target.name}, {kind} ({'; '.join(step.description for step in steps)})"


def convert_chunks(records: KVRecords, target: Tier, progress: Progress | None = None) -> Iterator[np.ndarray]:
    """Yield the records of ``records`` re-encoded in ``target``, ``CHUNK_RECORDS`` at a time.

    Rows are dequantized (which sanitizes them) and encoded again; tokens and indexer rows are
    copied unchanged. Same tier: the stored bytes are passed through untouched.
    """
    total = records.n
    steps = plan(records.tier, target)
    for start in range(0, max(total, 1), CHUNK_RECORDS):
        part = records.slice(start, min(start + CHUNK_RECORDS, total))
        if not steps:
            yield part.records
        else:
            L, R, index = part.dequantize()
            yield encode_records(records.geometry, target, part.tokens, L, R, index)
        if progress is not None:
            progress(part.n, total)
        if total == 0:
            break


def convert(records: KVRecords, target: Tier, progress: Progress | None = None) -> np.ndarray:
    """All of ``records`` in ``target`` as one structured array (see :func:`convert_chunks`)."""
    parts = list(convert_chunks(records, target, progress))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]
