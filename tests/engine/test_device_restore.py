"""The device restore (engine/restore.py) against the host path it replaces.

The host path — ``StoredRows.from_records`` (layer-major copies, sanitized codes) then
``LatentCache.restore`` — is the reference. The device path uploads the records as stored and splits
them into the cache's fields with torch ops; run here with ``device="cpu"`` so CI exercises the same
code: the record views, the word/byte copies, the in-place sanitizing, the per-chunk conversions,
the ring of read buffers with reads on threads. Every tier pairing must give the host path's cache
byte for byte — capacity buffers, tokens, length — on damaged files too (NaN codes, bad scales and
radii, non-finite f32 rows, torn tails, overclaimed and uncommitted counts), and a restore that
fails part way must leave the cache as it was.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstore import tiers
from kvstore.engine import Engine, hf, make_cache
from kvstore.engine.errors import CodecMismatch, GenerationError, GeometryMismatch
from kvstore.engine.restore import FileBody, MemoryBody, RecordLayout, RowsBody
from kvstore.engine.rows import StoredRows
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header
from kvstore.gpu import codecs
from kvstore.tiers import Tier

GEOMETRY = Geometry(3, 64, 32, 0, 0, 100)
N = 41
# Small chunks: many of them, so the ring of read buffers is reused several times over.
CHUNK = 3 * 1000

FILES = {  # name -> (version, codec, bits)
    "v1": (1, None, None),
    "v2": (2, None, None),
    "v3-int4": (3, 1, 4),
    "v3-polar4": (3, 0, 4),
    "v3-polar3": (3, 0, 3),  # 3-bit rows: the radii sit at unaligned offsets (byte copies)
    "v4": (4, None, None),  # bf16 rows: placed as bf16 (a bf16 cache) or widened (the others)
}
CACHE_TIERS = ["f32", "bf16", "fp8", "int4", "polar4", "polar3", "q8"]


def _records(geometry: Geometry, tier: Tier, seed: int) -> np.ndarray:
    """N records of random rows, with every kind of damage the loader must neutralize."""
    rng = np.random.default_rng(seed)
    L = (rng.standard_normal((geometry.n_layers, N, geometry.kv_lora)) * 3).astype(np.float32)
    R = (rng.standard_normal((geometry.n_layers, N, geometry.qk_rope)) * 3).astype(np.float32)
    L[:, 1] = 0.0  # an all-zero row: stored inert in every quantized version
    if tier.holds_values:  # v1, v4: non-finite values stored (a damaged file)
        L[0, 3, 5], R[1, 4, 2], L[-1, 5, 0] = np.nan, np.inf, -np.inf
    tokens = rng.integers(0, geometry.vocab, N).astype(np.int32)
    records = coli_kv.encode_records(geometry, tier, tokens, L, R)
    layers = records["layers"]
    if tier.version == 2:
        layers["Lc"][6, 0, :3] = 0x7F  # NaN codes read as 0
        layers["Rc"][7, 1, 1] = 0xFF
        layers["Ls"][8, 0] = 0.0  # bad scales: the row is inert (codes 0, scale 1)
        layers["Ls"][9, 1] = -2.0
        layers["Rs"][10, -1] = np.nan
        layers["Rs"][11, 0] = np.inf
        layers["Ls"][12, -1] = 1e37  # above 3.4e38/448: no encoder writes it
    elif tier.version == 3:
        layers["Ls"][8, 0] = -1.0  # bad radii: 0, codes 0
        layers["Rs"][9, 1] = np.nan
        layers["Ls"][10, -1] = np.inf
        layers["Rs"][11, 0] = np.float32(3.4e38)
        layers["Ls"][12, 1] = np.float32(3.0e38)  # valid, but overflows on decode: reads as zeros
        layers["Lc"][12, 1] = 0xFF
    return records


def _write(path, geometry: Geometry, tier: Tier, records: np.ndarray, *, nrec: int, tail: int = 0) -> None:
    body = records.tobytes()
    with open(path, "wb") as f:
        f.write(Header(geometry, tier, nrec).to_bytes() + body + body[:tail])


def _damaged_file(tmp_path, name: str, geometry: Geometry = GEOMETRY, *, committed: bool = False):
    """A file of N records with an overclaimed nrec and a torn tail (or, ``committed``, with
    records past a short nrec)."""
    version, codec, bits = FILES[name]
    tier = tiers.from_file(version, codec, bits)
    records = _records(geometry, tier, seed=list(FILES).index(name))
    path = tmp_path / f"{name}{'.committed' if committed else ''}.coli_kv"
    if committed:
        _write(path, geometry, tier, records, nrec=N - 4)
    else:
        _write(path, geometry, tier, records, nrec=N + 3, tail=records.dtype.itemsize // 2)
    return path


def _state(cache) -> tuple:
    """Everything a restore sets: every byte of the capacity buffers, the tokens, the sizes."""
    fields = {name: t.detach().cpu().contiguous().view(torch.uint8).clone() for name, t in cache._fields.items()}
    return fields, cache._tokens.copy(), cache.capacity, cache.length


def _assert_same(a: tuple, b: tuple) -> None:
    assert a[2:] == b[2:]
    np.testing.assert_array_equal(a[1], b[1])
    assert a[0].keys() == b[0].keys()
    for name in a[0]:
        assert torch.equal(a[0][name], b[0][name]), name


def _cache(tier_name: str, geometry: Geometry = GEOMETRY):
    return make_cache(tier_name, geometry, "cpu")


def _host(tier_name: str, path, geometry: Geometry = GEOMETRY):
    cache = _cache(tier_name, geometry)
    cache.restore(StoredRows.from_records(coli_kv.load(path)), allow_requantize=True)
    return cache


@pytest.mark.parametrize("tier_name", CACHE_TIERS)
@pytest.mark.parametrize("file_name", list(FILES))
def test_device_restore_gives_the_host_path_bytes_for_every_tier_pairing(tmp_path, file_name, tier_name):
    for committed in (False, True):
        path = _damaged_file(tmp_path, file_name, committed=committed)
        want = _state(_host(tier_name, path))
        assert want[3] == (N - 4 if committed else N)

        from_records = _cache(tier_name)
        from_records.restore_records(coli_kv.load(path), allow_requantize=True)
        _assert_same(_state(from_records), want)

        from_file = _cache(tier_name)
        with FileBody(path) as body:
            from_file.restore_body(body, allow_requantize=True, chunk_bytes=CHUNK)
        _assert_same(_state(from_file), want)


@pytest.mark.parametrize("tier_name", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("file_name", ["v1", "v2", "v4"])
def test_unaligned_record_layouts_restore_byte_for_byte(tmp_path, file_name, tier_name):
    """kv_lora 36 / qk_rope 6: the v2 scales and the second layer's rows sit at offsets that are no
    multiple of 4, so the split copies bytes instead of words."""
    odd = Geometry(2, 36, 6, 0, 0, 50)
    version = FILES[file_name][0]
    layout = RecordLayout.of(odd, tiers.from_file(version))
    if version == 2:
        assert (layout.layers_offset + layout.fields["Rs"][0]) % 4 and layout.layer_bytes % 4
    path = _damaged_file(tmp_path, file_name, odd)
    want = _state(_host(tier_name, path, odd))
    got = _cache(tier_name, odd)
    with FileBody(path) as body:
        got.restore_body(body, chunk_bytes=CHUNK)
    _assert_same(_state(got), want)


def test_records_handed_over_in_memory_are_never_written(tmp_path):
    """Sanitizing happens in the new buffers: the caller's (possibly read-only) body is untouched."""
    path = _damaged_file(tmp_path, "v2")
    records = coli_kv.load(path)
    before = records.record_bytes()
    for tier_name in ("fp8", "f32"):
        _cache(tier_name).restore_records(records)
    assert records.record_bytes() == before
    readonly = coli_kv.parse(path.read_bytes())  # a bytes body: read-only
    cache = _cache("fp8")
    cache.restore_records(readonly)
    _assert_same(_state(cache), _state(_host("fp8", path)))


def _filled(tier_name: str):
    """A cache holding rows of its own (the state a failed restore must keep)."""
    cache = _cache(tier_name)
    rng = np.random.default_rng(7)
    rows = StoredRows(
        rng.integers(0, 100, 9).astype(np.int32),
        1,
        *(rng.standard_normal((3, 9, w)).astype(np.float32) for w in (64, 32)),
    )
    cache.restore(rows)
    return cache


def test_quantized_rows_of_another_kind_are_refused_unless_requantize_is_allowed(tmp_path):
    path = _damaged_file(tmp_path, "v2")
    cache = _filled("int4")
    before = _state(cache)
    with pytest.raises(CodecMismatch, match="quantized again"):
        cache.restore_records(coli_kv.load(path))
    with FileBody(path) as body, pytest.raises(CodecMismatch, match="quantized again"):
        cache.restore_body(body)
    _assert_same(_state(cache), before)


def test_a_file_cut_while_it_is_read_keeps_the_complete_records(tmp_path):
    """The body is sized at open; a file that shrinks before its chunks are read stops at the last
    complete record (as ``coli_kv.load`` of the shorter file), never an error or a torn row."""
    path = _damaged_file(tmp_path, "v2")
    rec = RecordLayout.of(GEOMETRY, tiers.FP8).rec_bytes
    cache = _cache("fp8")
    with FileBody(path) as body:
        assert body.n == N
        os.truncate(path, HEADER_BYTES + 29 * rec + rec // 3)  # inside record 29, a later chunk
        cache.restore_body(body, chunk_bytes=CHUNK)
    assert cache.length == 29
    # The capacity was sized for the 41 records seen at open; past the 29 rows read it is zeros.
    got, want = _state(cache), _state(_host("fp8", path))
    assert got[3] == want[3] and got[2] > want[2]
    np.testing.assert_array_equal(got[1][: want[2]], want[1])
    assert not got[1][want[2] :].any()
    for name, rows in want[0].items():
        per_row = rows.shape[1] // want[2]
        assert torch.equal(got[0][name][:, : rows.shape[1]], rows)
        assert not got[0][name][:, want[2] * per_row :].any()


def test_a_failure_in_a_later_chunk_leaves_the_cache_unchanged(tmp_path, monkeypatch):
    """v1 rows are quantized chunk by chunk into new buffers: a failure in the third chunk's encode,
    or a read error in a later chunk, raises with the live rows exactly as they were."""
    path = _damaged_file(tmp_path, "v1")
    cache = _filled("fp8")
    before = _state(cache)
    real_encode = codecs.encode_tier
    calls = []

    def encode_failing_on_the_third_chunk(tier, rows):
        calls.append(rows.shape)
        if len(calls) > 4:  # L and R rows per chunk: the fifth call is the third chunk's L rows
            raise RuntimeError("fp8 encode failed (injected)")
        return real_encode(tier, rows)

    monkeypatch.setattr(codecs, "encode_tier", encode_failing_on_the_third_chunk)
    with FileBody(path) as body, pytest.raises(RuntimeError, match="injected"):
        cache.restore_body(body, chunk_bytes=CHUNK)
    _assert_same(_state(cache), before)
    monkeypatch.undo()

    real_read = FileBody.read_into
    reads = []

    def read_failing_later(self, out, start, count):
        reads.append(start)
        if len(reads) == 5:
            raise OSError(5, "Input/output error (injected)")
        return real_read(self, out, start, count)

    monkeypatch.setattr(FileBody, "read_into", read_failing_later)
    with FileBody(path) as body, pytest.raises(OSError, match="injected"):
        cache.restore_body(body, chunk_bytes=CHUNK)
    _assert_same(_state(cache), before)
    monkeypatch.undo()
    with FileBody(path) as body:  # and the same restore then succeeds
        cache.restore_body(body, chunk_bytes=CHUNK)
    _assert_same(_state(cache), _state(_host("fp8", path)))


def test_engine_restore_file_checks_tokens_before_the_rows_replace_the_cache(tmp_path):
    """A token id outside the vocabulary in the last record is found after every row is uploaded:
    the engine's cache keeps its rows and a later good file restores normally."""
    engine = Engine.from_preset("tiny", seed=0)
    engine.generate([5, 6, 7, 8], max_new_tokens=3, stop_tokens=())
    before = _state(engine.cache)
    rows = engine.export_rows()
    geometry = engine.config.coli_geometry()
    records = rows.record_array(geometry)
    records["token"][-1] = geometry.vocab + 5
    bad = tmp_path / "bad.coli_kv"
    bad.write_bytes(Header(geometry, tiers.F32, records.shape[0]).to_bytes() + records.tobytes())
    with pytest.raises(GenerationError, match="token ids must be in"):
        engine.restore_file(bad)
    _assert_same(_state(engine.cache), before)
    good = tmp_path / "good.coli_kv"
    good.write_bytes(rows.encode_file(geometry))
    fresh = Engine(engine.model, tier="f32")
    assert fresh.restore_file(good) == rows.n
    np.testing.assert_array_equal(fresh.cache.tokens, rows.tokens)
    _, L, R = fresh.cache.export_f32()
    np.testing.assert_array_equal(L, rows.lc)
    np.testing.assert_array_equal(R, rows.rc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("file_name", list(FILES))
def test_transformers_restore_on_the_device_decodes_as_the_format_codecs(hf_models, tmp_path, file_name, dtype):
    """``hf.cache_from_records`` / ``hf.cache_from_file`` build the DynamicCache the host decoder's
    rows (``KVRecords.dequantize``, sanitized) give through ``hf.build_cache``, bit for bit."""
    model = hf_models["tiny"][0]
    geometry = hf.check_cache_layout(model).geometry
    path = _damaged_file(tmp_path, file_name, geometry)
    records = coli_kv.load(path)
    L, R, _ = records.dequantize()
    want = hf.build_cache(model, L[:, None], R[:, None], dtype=dtype)
    from_records = hf.cache_from_records(model, records, dtype=dtype)
    restored = hf.cache_from_file(model, path, dtype=dtype)
    assert restored.reused_tokens == records.n and restored.tier == records.tier
    np.testing.assert_array_equal(restored.tokens, records.tokens)
    for built in (from_records, restored.cache):
        assert hf.cache_length(built) == records.n
        for got_layer, want_layer in zip(built.layers, want.layers):
            assert got_layer.keys.dtype == dtype
            assert _same_bits(got_layer.keys, want_layer.keys)  # bits: v1/v4 rows hold NaNs
            assert _same_bits(got_layer.values, want_layer.values)
    prefix = hf.cache_from_file(model, path, upto=5, dtype=dtype)
    assert hf.cache_length(prefix.cache) == 5
    assert _same_bits(prefix.cache.layers[0].keys, want.layers[0].keys[:, :, :5])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, but for the payload of a NaN: a v4 row placed into bf16 keeps its stored NaN
    pattern where a conversion from f32 writes torch's own."""
    nan = want.isnan()
    zero = torch.zeros((), dtype=want.dtype)
    return torch.equal(got.isnan(), nan) and torch.equal(
        _bits(torch.where(nan, zero, got)), _bits(torch.where(nan, zero, want))
    )


def test_memory_body_limit_and_layout_views_agree_with_numpy(tmp_path):
    """The torch field views read the bytes numpy's record dtype assigns to each field."""
    path = _damaged_file(tmp_path, "v3-polar3")
    records = coli_kv.load(path)
    body = MemoryBody(records)
    raw = torch.from_numpy(np.array(body.host_rows()))
    for name in ("Lc", "Ls", "Rc", "Rs"):
        got = body.layout.field(raw, name).numpy()  # [rows, n_layers, bytes]
        want = np.ascontiguousarray(records.records["layers"][name])
        np.testing.assert_array_equal(got, want.view(np.uint8).reshape(got.shape))
    body.limit(7)
    assert body.n == 7 and body.host_rows().shape[0] == 7


def _raw_rows(records: np.ndarray, tier: Tier) -> StoredRows:
    """The records' rows handed over as they are (layer-major, damage and all, nothing sanitized):
    what a caller of ``Engine.restore`` may hold."""
    layers = records["layers"]
    rows = [np.ascontiguousarray(layers[name].swapaxes(0, 1)) for name in ("Lc", "Rc")]
    scales = [None, None]
    if tier.row_codec.scaled:
        scales = [np.ascontiguousarray(layers[name].T) for name in ("Ls", "Rs")]
    return StoredRows(records["token"].copy(), tier.version, *rows, *scales, tier.codec, tier.bits)


@pytest.mark.parametrize("tier_name", CACHE_TIERS)
@pytest.mark.parametrize("file_name", list(FILES))
def test_rows_in_memory_take_the_ring_and_give_the_host_path_bytes(file_name, tier_name):
    """``RowsBody``: StoredRows laid out as records into the ring by the reading threads, then split
    on the device as a file is — the same cache, byte for byte, as ``LatentCache.restore``'s
    placing of the same rows, damaged ones included (NaN codes, corrupt scales and radii)."""
    version, codec, bits = FILES[file_name]
    tier = tiers.from_file(version, codec, bits)
    rows = _raw_rows(_records(GEOMETRY, tier, seed=7), tier)
    host = _cache(tier_name)
    host.restore(rows, allow_requantize=True)
    ring = _cache(tier_name)
    ring.restore_body(RowsBody(rows, GEOMETRY), allow_requantize=True, chunk_bytes=CHUNK)
    _assert_same(_state(ring), _state(host))


def test_rows_that_do_not_fit_the_models_records_are_refused_before_anything_is_read():
    rows = _raw_rows(_records(GEOMETRY, tiers.FP8, seed=1), tiers.FP8)
    for bad in (
        StoredRows(rows.tokens, 2, rows.lc[:2], rows.rc[:2], rows.lc_scales[:2], rows.rc_scales[:2]),  # layers
        StoredRows(rows.tokens, 2, rows.lc[..., :-1], rows.rc, rows.lc_scales, rows.rc_scales),  # width
        StoredRows(rows.tokens[:-1], 2, rows.lc, rows.rc, rows.lc_scales, rows.rc_scales),  # tokens
        StoredRows(rows.tokens, 2, rows.lc, rows.rc, None, rows.rc_scales),  # a scale missing
    ):
        with pytest.raises(GeometryMismatch):
            RowsBody(bad, GEOMETRY)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, except that NaNs need only sit in the same places: the f32 -> bf16 conversion of a
    NaN keeps a payload that depends on where it ran."""
    if a.dtype.is_floating_point:
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("tier_name", ["f32", "bf16", "fp8", "int4", "polar4", "q8"])
@pytest.mark.parametrize("file_name", ["v1", "v2", "v3-int4", "v3-polar4"])
def test_cuda_restore_gives_the_host_path_rows(tmp_path, file_name, tier_name):
    """On CUDA: the pinned ring, the asynchronous uploads, the per-slot events, the device split.
    Against the host path on the same device (which decodes v2/v3 with the format codecs on the
    host and encodes with the device twins): equal bits, save PolarQuant rows decoded for another
    tier, where the twins' cos/sin may differ in the last place."""
    path = _damaged_file(tmp_path, file_name)
    host = make_cache(tier_name, GEOMETRY, "cuda")
    host.restore(StoredRows.from_records(coli_kv.load(path)), allow_requantize=True)
    for restore in ("records", "rows", "file"):
        cache = make_cache(tier_name, GEOMETRY, "cuda")
        if restore == "records":
            cache.restore_records(coli_kv.load(path), allow_requantize=True)
        elif restore == "rows":  # Engine.restore's path: StoredRows through the pinned ring
            rows = StoredRows.from_records(coli_kv.load(path))
            cache.restore_body(RowsBody(rows, GEOMETRY), allow_requantize=True, chunk_bytes=CHUNK)
        else:
            with FileBody(path) as body:
                cache.restore_body(body, allow_requantize=True, chunk_bytes=CHUNK)
        assert (cache.length, cache.capacity) == (host.length, host.capacity)
        np.testing.assert_array_equal(cache._tokens, host._tokens)
        if file_name == "v3-polar4" and tier_name != "polar4":
            _, got_l, got_r = cache.export_f32()
            _, want_l, want_r = host.export_f32()
            np.testing.assert_allclose(got_l, want_l, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(got_r, want_r, rtol=1e-4, atol=1e-5)
            continue
        for name, field in host._fields.items():
            assert _same_values(cache._fields[name], field), (restore, name)


@pytest.mark.gpu
@pytest.mark.parametrize("tier_name", ["fp8", "bf16"])
def test_cuda_restore_of_large_chunks_gives_the_cpu_restores_bytes(tier_name):
    """Chunks of 32 MiB, as a long session's are: each takes the copy engine long enough that a
    placement not waiting for its own upload (the uploads run on a stream of their own, two device
    stages in turn) would read a stage before it is written, or one being rewritten."""
    geometry = Geometry(27, 512, 64, 0, 0, 102400)  # DeepSeek-V2-Lite's latent rows
    tier = tiers.get(tier_name)
    rng = np.random.default_rng(11)
    n = 6000  # 95 MB of fp8 records (3 chunks), 186 MB of bf16 ones (6)
    L = rng.standard_normal((geometry.n_layers, n, geometry.kv_lora)).astype(np.float32)
    R = rng.standard_normal((geometry.n_layers, n, geometry.qk_rope)).astype(np.float32)
    tokens = rng.integers(0, geometry.vocab, n).astype(np.int32)
    records = coli_kv.encode_records(geometry, tier, tokens, L, R)
    loaded = coli_kv.KVRecords(Header(geometry, tier, n), records, HEADER_BYTES + records.nbytes)
    want = make_cache(tier_name, geometry, "cpu")
    want.restore_body(MemoryBody(loaded))
    for _ in range(2):  # the second restore finds the stages holding the first one's last chunks
        got = make_cache(tier_name, geometry, "cuda")
        got.restore_body(MemoryBody(loaded), chunk_bytes=32 << 20)
        assert got.length == n
        for name, field in want._fields.items():
            assert torch.equal(got._fields[name][:, :n].cpu(), field[:, :n]), name


@pytest.mark.gpu
@pytest.mark.parametrize("file_name", ["v1", "v2", "v3-int4"])
def test_cuda_transformers_restore_matches_the_format_decoder(hf_models, tmp_path, file_name):
    import copy

    model = copy.deepcopy(hf_models["tiny"][0]).to("cuda")
    geometry = hf.check_cache_layout(model).geometry
    path = _damaged_file(tmp_path, file_name, geometry)
    records = coli_kv.load(path)
    L, R, _ = records.dequantize()
    want = hf.build_cache(model, L[:, None], R[:, None], dtype=torch.bfloat16)
    restored = hf.cache_from_file(model, path, dtype=torch.bfloat16)
    np.testing.assert_array_equal(restored.tokens, records.tokens)
    for got_layer, want_layer in zip(restored.cache.layers, want.layers):
        assert got_layer.keys.device.type == "cuda"
        assert _same_values(got_layer.keys, want_layer.keys)
        assert _same_values(got_layer.values, want_layer.values)


@pytest.mark.parametrize("tier_name", ["f32", "fp8", "int4"])
@pytest.mark.parametrize("file_name", ["v1", "v2", "v3-int4"])
def test_a_session_reader_restores_straight_into_the_ring(tmp_path, file_name, tier_name):
    """What a resume does (``SessionEngine`` -> ``Engine.restore_reader``): the reader's served
    records read chunk by chunk into the ring, by several threads, with no whole-body copy first —
    the same cache, byte for byte, as restoring the records the reader loads; the incomplete tail
    past the watermark is not served; a corrupt scale in the journal is SessionDamaged (the
    reader's own check, naming the session) and leaves the cache as it was."""
    from kvstore.engine.restore import ReaderBody
    from kvstore.errors import SessionDamaged
    from kvstore.store import SessionStore

    version, codec, bits = FILES[file_name]
    stored_tier = tiers.from_file(version, codec, bits)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, GEOMETRY.vocab, N).astype(np.int32)
    L = rng.standard_normal((GEOMETRY.n_layers, N, GEOMETRY.kv_lora)).astype(np.float32)
    R = rng.standard_normal((GEOMETRY.n_layers, N, GEOMETRY.qk_rope)).astype(np.float32)
    with SessionStore(tmp_path / "data") as store:
        store.create("alice", GEOMETRY, stored_tier, {"name": "m", "revision": "1"}, session_id="chat")
        store.append("chat", tokens[:30], L[:, :30], R[:, :30])
        store.append("chat", tokens[30:], L[:, 30:], R[:, 30:], complete_turn=False)  # not served
        with store.reader("chat") as reader:
            want = _cache(tier_name)
            want.restore_records(reader.load(), allow_requantize=True)
        with store.reader("chat") as reader:
            got = _cache(tier_name)
            got.restore_body(ReaderBody(reader), allow_requantize=True, chunk_bytes=CHUNK)
        assert got.length == 30
        _assert_same(_state(got), _state(want))
        if version == 1:
            return  # f32 rows have no scale to corrupt
        rec = coli_kv.record_bytes(GEOMETRY, stored_tier)
        scale_at = 4 + (GEOMETRY.kv_lora if version == 2 else GEOMETRY.kv_lora // 2)  # layer 0's L scale/radius
        with open(store.journal_path("chat"), "r+b") as journal:  # record 12, behind the store's back
            journal.seek(HEADER_BYTES + 12 * rec + scale_at)
            journal.write(np.float32(np.nan).tobytes())
        before = _state(got)
        with store.reader("chat") as reader, pytest.raises(SessionDamaged, match="chat"):
            got.restore_body(ReaderBody(reader), allow_requantize=True, chunk_bytes=CHUNK)
        _assert_same(_state(got), before)
