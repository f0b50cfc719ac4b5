"""One scale bound for every reader (issue 15, item 9): a stored fp8 scale no encoder writes.

A v2 row whose scale is 1e37 — under f32's limit, over ``fp8.MAX_SCALE`` (3.4e38 / 448) — with its
codes at 0x7E (448) would decode to 448 * 1e37 = inf. Every reader applies ``Tier.corrupt_scales``:
the file loader, the engine's device restore and the GPU upload make such a row inert (zeros) and
never restore inf; asked to be strict, each refuses with :class:`BadScale` naming the file and the
record. The default load reports the record (``KVRecords.damaged_records``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore import tiers
from kvstore.engine import Engine, make_cache
from kvstore.engine.restore import FileBody, MemoryBody
from kvstore.engine.rows import StoredRows
from kvstore.errors import BadScale, FormatError
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Header
from kvstore.gpu import upload

GEOMETRY = Geometry(n_layers=2, kv_lora=64, qk_rope=32, index_hd=0, nic=0, vocab=100)
N, BAD = 24, 17
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
MESSAGE = r"record 17 \(token \d+\), layer 1: the L row's scale 1e\+37 is outside \(0, 7.589e\+35\]"


def damaged(tmp_path, geometry: Geometry = GEOMETRY, name: str = "chat.coli_kv"):
    """A v2 file whose record 17, layer 1 holds codes 0x7E under a scale of 1e37."""
    rng = np.random.default_rng(3)
    L = rng.standard_normal((geometry.n_layers, N, geometry.kv_lora)).astype(np.float32)
    R = rng.standard_normal((geometry.n_layers, N, geometry.qk_rope)).astype(np.float32)
    records = coli_kv.encode_records(geometry, tiers.FP8, rng.integers(0, geometry.vocab, N), L, R)
    records["layers"]["Lc"][BAD, 1, :] = 0x7E
    records["layers"]["Ls"][BAD, 1] = np.float32(1e37)
    path = tmp_path / name
    path.write_bytes(Header(geometry, tiers.FP8, N).to_bytes() + records.tobytes())
    return path, records


def test_the_file_loader_reads_the_row_as_zeros_reports_the_record_and_refuses_when_strict(tmp_path):
    path, _ = damaged(tmp_path)
    loaded = coli_kv.load(path)
    L, R, _ = loaded.dequantize()
    assert np.isfinite(L).all() and np.isfinite(R).all() and not L[1, BAD].any()
    assert loaded.problems.bad_scales == 1
    assert np.flatnonzero(loaded.damaged_records()["bad_scales"]).tolist() == [BAD]
    with pytest.raises(BadScale, match=f"{path}: {MESSAGE}"):
        coli_kv.load(path, strict=True)
    with pytest.raises(BadScale, match=MESSAGE):
        loaded.check_scales(source=str(path))
    # the same bound on a TurboQuant radius
    tq = coli_kv.encode_records(GEOMETRY, tiers.INT4, np.arange(3), np.ones((2, 3, 64)), np.ones((2, 3, 32)))
    tq["layers"]["Rs"][2, 0] = np.inf
    tq_path = tmp_path / "tq.coli_kv"
    tq_path.write_bytes(Header(GEOMETRY, tiers.INT4, 3).to_bytes() + tq.tobytes())
    assert not coli_kv.load(tq_path).dequantize()[1][0, 2].any()
    with pytest.raises(
        BadScale, match=r"record 2 \(token 2\), layer 0: the R row's radius inf is outside \[0, 3.4e\+38\)"
    ):
        coli_kv.load(tq_path, strict=True)


@pytest.mark.parametrize("device", DEVICES)
def test_the_engine_restore_makes_the_row_inert_and_refuses_it_when_strict(tmp_path, device):
    path, records = damaged(tmp_path)
    for tier_name in ("fp8", "f32"):  # as stored, and decoded into a float cache
        cache = make_cache(tier_name, GEOMETRY, device)
        with FileBody(path) as body:
            cache.restore_body(body, chunk_bytes=5 * records.dtype.itemsize)  # several chunks
        _, L, R = cache.export_f32()
        assert cache.length == N and np.isfinite(L).all() and np.isfinite(R).all() and not L[1, BAD].any()
        before = cache.export_f32()
        with FileBody(path, strict=True) as body, pytest.raises(BadScale, match=f"{path}: {MESSAGE}"):
            cache.restore_body(body, chunk_bytes=5 * records.dtype.itemsize)
        with pytest.raises(BadScale, match=f"session 'chat': {MESSAGE}"):
            cache.restore_body(MemoryBody(coli_kv.load(path), strict=True, source="session 'chat'"))
        after = cache.export_f32()
        assert all(np.array_equal(a, b) for a, b in zip(before, after))  # all or nothing
    engine = Engine.from_preset("tiny", seed=0, tier="fp8", device=device)
    engine_file, _ = damaged(tmp_path, engine.config.coli_geometry(), "engine.coli_kv")
    assert engine.restore_file(engine_file) == N
    assert bool(torch.isfinite(torch.from_numpy(engine.cache.export_f32()[1])).all())
    with pytest.raises(BadScale, match=f"{engine_file}: {MESSAGE}"):
        engine.restore_file(engine_file, strict=True)
    assert engine.cache.length == N


@pytest.mark.parametrize("device", DEVICES)
def test_the_gpu_upload_makes_the_row_inert_and_refuses_it_when_strict(tmp_path, device):
    path, _ = damaged(tmp_path)
    loaded = coli_kv.load(path)
    layers = loaded.records["layers"]
    host = [np.ascontiguousarray(layers[name][:, 1]) for name in ("Lc", "Ls", "Rc", "Rs")]  # layer 1, as stored
    rows = upload.restore_quantized_rows("fp8", *host, device)
    decoded = tiers.FP8.dequantize(rows.lc_codes.cpu().numpy(), rows.lc_scales.cpu().numpy())
    assert np.isfinite(decoded).all() and not decoded[BAD].any()
    with pytest.raises(BadScale, match=MESSAGE.replace(r" \(token \d+\)", "")):
        upload.restore_quantized_rows("fp8", *host, device, strict=True, source=str(path), layer=1)


def test_a_session_restore_refuses_a_corrupt_scale_naming_the_session_journal_and_record(tmp_path, tiny_folder, tiny):
    # The store validated every row it acknowledged, so a scale no encoder writes in a journal is
    # damage on disk: restoring the session into a cache refuses it (naming the journal and the
    # record) instead of running on a row of zeros; verify serves the turns before it.
    from kvstore.errors import SessionDamaged
    from kvstore.store import SessionStore
    from trust.support import session_engine

    with SessionStore(tmp_path / "data") as store:
        chat = session_engine(store, tiny_folder, tiny, tier="fp8")
        first = chat.run("s", list(range(5, 15)), create=True, max_new_tokens=3, stop_tokens=())
        chat.run("s", list(range(20, 30)), max_new_tokens=3, stop_tokens=())
        info = store.get("s")
        bad = first.session.n_records + 4  # in the second turn
        journal = np.memmap(
            store.journal_path("s"),
            dtype=coli_kv.record_dtype(info.geometry, info.tier),
            mode="r+",
            offset=coli_kv.HEADER_BYTES,
            shape=(info.n_records,),
        )
        journal["layers"]["Lc"][bad, 1, :] = 0x7E
        journal["layers"]["Ls"][bad, 1] = np.float32(1e37)
        journal.flush()
        del journal
        where = rf"session 's' \(journals/s~default.coli_kv\): record {bad} \(token \d+\), layer 1: the L row's scale"
        fresh = session_engine(store, tiny_folder, tiny, tier="fp8")  # nothing live: it must read the journal
        with pytest.raises(SessionDamaged, match=where + r".*`kvstore verify` names the turn"):
            fresh.resume("s")
        assert fresh.resident_cache("s") is None
        report = fresh.resume("s", verify=True)
        assert (report.reused_tokens, report.damaged_from) == (first.session.n_records, first.session.n_records)
        with store.reader("s") as reader:
            assert reader.load().n == info.n_records  # byte streams serve the records as stored
            with pytest.raises(SessionDamaged, match=where):
                list(reader.iter_batches(8, strict=True))


def test_an_append_of_raw_records_is_refused_by_the_same_bound_naming_the_record(tmp_path):
    # 1e37 is finite and positive, yet over fp8.MAX_SCALE: the journal's check is the readers' one.
    from kvstore.store import SessionStore

    rng = np.random.default_rng(4)
    L, R = rng.standard_normal((2, 3, 64)), rng.standard_normal((2, 3, 32))
    rows = coli_kv.encode_records(GEOMETRY, tiers.FP8, [1, 2, 3], L, R)
    with SessionStore(tmp_path / "data") as store:
        store.create("alice", GEOMETRY, tiers.FP8, {"name": "m", "revision": "r"}, session_id="s")
        tampered = rows.copy()
        tampered["layers"]["Rs"][1, 0] = np.float32(1e37)
        where = r"the rows to append: record 1 \(token 2\), layer 0: the R row's scale 1e\+37 is outside"
        with pytest.raises(FormatError, match=where) as refused:
            store.append_records("s", tampered.tobytes())
        assert refused.type is FormatError  # the API's name for refused bytes (422 FormatError), as before
        assert store.get("s").n_records == 0
        assert store.append_records("s", rows.tobytes()).appended == 3


@pytest.mark.parametrize("cache_tier", ["f32", "bf16", "q8", "fp8"])
def test_stored_rows_handed_to_the_engine_restore_inert_in_every_cache(tmp_path, cache_tier):
    # Issue 42, item 9: StoredRows built in memory (not read from a file, so never sanitized by a
    # loader) restored into a cache of another representation went through StoredRows.dequantize,
    # which decoded 448 * 1e37 = inf: inf rows, NaN logits. The rows' own tier (fp8) sanitized them.
    # Every cache now reads the row as zeros, as the file loader and the device restore do.
    engine = Engine.from_preset("tiny", seed=0, tier=cache_tier)
    geometry = engine.config.coli_geometry()
    _, records = damaged(tmp_path, geometry, "engine.coli_kv")
    layers = records["layers"]
    rows = StoredRows(
        np.ascontiguousarray(records["token"]),
        2,
        np.ascontiguousarray(layers["Lc"].transpose(1, 0, 2)),
        np.ascontiguousarray(layers["Rc"].transpose(1, 0, 2)),
        np.ascontiguousarray(layers["Ls"].T),
        np.ascontiguousarray(layers["Rs"].T),
    )
    L, _ = rows.dequantize(geometry.kv_lora, geometry.qk_rope)
    assert np.isfinite(L).all() and not L[1, BAD].any()
    engine.restore(rows, allow_requantize=True)
    _, restored, _ = engine.cache.export_f32()
    assert engine.cache.length == N and np.isfinite(restored).all() and not restored[1, BAD].any()
    # the same rows read from the file through the device restore: the same cache, value for value
    reference = Engine.from_preset("tiny", seed=0, tier=cache_tier)
    reference.restore_file(tmp_path / "engine.coli_kv", allow_requantize=True)
    assert all(np.array_equal(a, b) for a, b in zip(engine.cache.export_f32(), reference.cache.export_f32()))
    logits, _, reused = engine.prefill(np.append(rows.tokens, 7))
    assert reused == N and bool(torch.isfinite(logits).all())
