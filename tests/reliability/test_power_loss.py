"""Lost page cache: power fails after the last fsync, and the un-synced bytes are cut or zeroed.

For an append of k records after n committed ones, every prefix of the data write (cut, or
zero-filled to the full length) is tried with the old counter, and every byte of the counter
is tried half-written over fully synced data. The loader must never raise anything but a typed
error and never return unacknowledged or garbage rows.
"""

import struct

import pytest

from kvstore import tiers
from kvstore.errors import KVStoreError
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Header
from reliability.workload import GEOMETRY, expected_records

TIERS = [tiers.F32, tiers.FP8, tiers.INT4, tiers.polar(5)]


def states(tier):
    committed = expected_records(7, 2, tier)
    appended = expected_records(7, 3, tier)[committed.shape[0] :]
    if appended.shape[0] > 3:
        appended = appended[:3]  # keep the byte sweep short: three records cover every boundary
    base = Header(GEOMETRY, tier, committed.shape[0]).to_bytes() + committed.tobytes()
    return committed, appended, base


def loaded_prefix(blob: bytes, allowed: bytes, rec_bytes: int) -> int:
    """Load ``blob``; assert it is a prefix of ``allowed`` records; return how many."""
    try:
        records = coli_kv.parse(blob)
    except KVStoreError:
        return -1
    body = records.records.tobytes()
    assert body == allowed[: len(body)], "loaded rows that were never written"
    return records.n


@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.describe())
def test_unsynced_data_is_never_loaded(figures, tier):
    committed, appended, base = states(tier)
    rec = committed.dtype.itemsize
    data = appended.tobytes()
    n = committed.shape[0]
    for cut in range(len(data) + 1):
        for tail in (data[:cut], data[:cut] + bytes(len(data) - cut)):
            got = loaded_prefix(base + tail, committed.tobytes(), rec)
            assert got == n  # the old counter still rules: exactly the acknowledged records
            figures.add("power_loss", "unsynced_tail_cut_or_zeroed", states=1, garbage_loaded=0)


@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.describe())
def test_torn_counter_over_synced_data(figures, tier):
    committed, appended, base = states(tier)
    n, k = committed.shape[0], appended.shape[0]
    full = base + appended.tobytes()
    allowed = committed.tobytes() + appended.tobytes()
    old = struct.pack("<i", n)
    new = struct.pack("<i", n + k)
    for j in range(5):
        for filler in (new, bytes(4), b"\xff" * 4):
            counter = new[:j] + (old if filler is new else filler)[j:]
            blob = bytearray(full)
            blob[32:36] = counter
            got = loaded_prefix(bytes(blob), allowed, committed.dtype.itemsize)
            figures.add("power_loss", "torn_counter", states=1, garbage_loaded=0)
            if struct.unpack("<i", counter)[0] < 0:
                assert got == -1  # a negative count is refused with a typed BadHeader
            else:
                assert 0 <= got <= n + k


@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.describe())
def test_every_truncation_of_a_file(figures, tier):
    committed, appended, base = states(tier)
    full = (
        Header(GEOMETRY, tier, committed.shape[0] + appended.shape[0]).to_bytes()
        + committed.tobytes()
        + appended.tobytes()
    )
    allowed = full[40:]
    rec = committed.dtype.itemsize
    for size in range(len(full) + 1):
        got = loaded_prefix(full[:size], allowed, rec)
        figures.add("power_loss", "every_truncation", states=1, garbage_loaded=0)
        if size < 40:
            assert got == -1  # TruncatedHeader: a typed error
        else:
            assert got == (size - 40) // rec
