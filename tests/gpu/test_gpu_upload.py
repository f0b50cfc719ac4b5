"""Restoring quantized rows from host arrays into a device cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.gpu import upload
from kvstore.gpu.errors import AttentionInputError


def _host_rows(n: int, seed: int, tier: str = "fp8"):
    """Rows as an encoder writes them (fp8: no NaN codes 0x7F/0xFF, which a reader would zero)."""
    rng = np.random.default_rng(seed)
    k, r = (512, 64) if tier == "fp8" else (256, 32)  # int4 codes: half the widths
    lc, rc = rng.integers(0, 256, (n, k), dtype=np.uint8), rng.integers(0, 256, (n, r), dtype=np.uint8)
    if tier == "fp8":
        lc[(lc & 0x7F) == 0x7F] = 0
        rc[(rc & 0x7F) == 0x7F] = 0
    return lc, rng.random(n, dtype=np.float32) + 0.5, rc, rng.random(n, dtype=np.float32) + 0.5


def _same(rows: upload.QuantizedRows, host) -> bool:
    n = rows.n_rows
    return all(np.array_equal(t[:n].cpu().numpy(), h) for t, h in zip(rows[:4], host))


def test_restore_on_cpu_copies_rows_and_reserves_capacity():
    host = _host_rows(37, 1)
    rows = upload.restore_quantized_rows("fp8", *host, "cpu", capacity=50)
    assert rows.n_rows == 37 and rows.lc_codes.shape == (50, 512) and rows.rc_scales.shape == (50,)
    assert _same(rows, host)


def test_restore_reads_memory_mapped_arrays(tmp_path):
    host = _host_rows(20, 2, "int4")
    path = tmp_path / "codes.u8"
    host[0].tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=host[0].shape)
    rows = upload.restore_quantized_rows("int4", mapped, *host[1:], "cpu")
    assert _same(rows, host)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda h: (h[0].astype(np.int16),) + h[1:], "lc_codes must be a uint8"),
        (lambda h: h[:3] + (h[3][:-1],), "rc_scales has 36 rows"),
        (lambda h: (h[0][0],) + h[1:], r"lc_codes must be a uint8\[N, width\]"),
    ],
)
def test_restore_refuses_bad_arrays(mutate, message):
    with pytest.raises(AttentionInputError, match=message):
        upload.restore_quantized_rows("fp8", *mutate(_host_rows(37, 3)), "cpu")


def test_restore_refuses_small_capacity_and_unknown_tier():
    host = _host_rows(10, 4)
    with pytest.raises(AttentionInputError, match="capacity 5 is below the 10 rows"):
        upload.restore_quantized_rows("fp8", *host, "cpu", capacity=5)
    with pytest.raises(AttentionInputError, match=r"tier must be one of \['fp8', 'int4', 'polar2'.*got 'q8'"):
        upload.restore_quantized_rows("q8", *host, "cpu")
    with pytest.raises(AttentionInputError, match="unknown tier 'fp4'"):
        upload.restore_quantized_rows("fp4", *host, "cpu")


def test_restore_takes_tiers_by_object_and_old_names_with_a_warning():
    from kvstore import tiers

    host = _host_rows(6, 7, "int4")
    assert _same(upload.restore_quantized_rows(tiers.INT4, *host, "cpu"), host)
    with pytest.warns(tiers.TierSpellingDeprecated, match="use 'int4'"):
        assert _same(upload.restore_quantized_rows("tq-int4", *host, "cpu"), host)


@pytest.mark.gpu
def test_restore_through_the_pinned_ring_on_cuda():
    host = _host_rows(3001, 5)
    # A 64 KiB ring forces many chunks per array, so buffers are reused while copies are in flight.
    uploader = upload.PinnedUploader("cuda", chunk_bytes=1 << 16, n_buffers=2)
    rows = upload.restore_quantized_rows("fp8", *host, "cuda", capacity=4000, uploader=uploader)
    assert rows.lc_codes.device.type == "cuda" and rows.lc_codes.shape == (4000, 512)
    assert all(t.is_pinned() for t in uploader._buffers)
    assert _same(rows, host)
    again = _host_rows(3001, 6)
    rows2 = upload.restore_quantized_rows("fp8", *again, "cuda", uploader=uploader)  # the ring is reused
    assert _same(rows2, again) and _same(rows, host)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_scale_no_encoder_writes_never_uploads_as_inf(device):
    """Issue 15 item 9: a stored fp8 scale of 1e37 on code 0x7E (448) would decode to inf."""
    from kvstore import tiers
    from kvstore.errors import BadScale
    from kvstore.gpu import codecs

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lc, ls, rc, rs = _host_rows(8, 9)
    lc[5, :] = 0x7E
    ls[5] = 1e37  # under the f32 limit, over fp8.MAX_SCALE = 3.4e38 / 448
    rc[7, 3] = 0xFF  # a NaN code
    rows = upload.restore_quantized_rows("fp8", lc, ls, rc, rs, device)
    decoded = codecs.decode_tier(tiers.FP8, rows.lc_codes, rows.lc_scales, 512)
    assert bool(torch.isfinite(decoded).all()) and not bool(decoded[5].any())  # the row is inert, not inf
    assert float(rows.lc_scales[5]) == 1.0 and int(rows.rc_codes[7, 3]) == 0
    assert _same(rows._replace(n_rows=5), tuple(h[:5] for h in (lc, ls, rc, rs)))  # the clean rows as sent
    with pytest.raises(BadScale, match=r"chat.coli_kv: record 45, layer 3: the L row's scale 1e\+37 is outside"):
        upload.restore_quantized_rows(
            "fp8", lc, ls, rc, rs, device, strict=True, source="chat.coli_kv", first_record=40, layer=3
        )
    radii = rs.copy()
    radii[1] = np.inf
    int4 = _host_rows(8, 10, "int4")
    tq_rows = upload.restore_quantized_rows("int4", int4[0], int4[1], int4[2], radii, device)
    assert float(tq_rows.rc_scales[1]) == 0 and not bool(tq_rows.rc_codes[1].any())
