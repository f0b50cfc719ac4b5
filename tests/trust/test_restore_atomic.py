"""All-or-nothing restore: a restore that fails at any step leaves the engine's live cache, the
session and the journal exactly as they were, and says why.

The engine holds session ``a`` live; a turn on session ``b`` must restore ``b`` and fails at one
step (the journal cut behind the store's back, a header that no longer matches, the journal gone,
the record decode, the device upload, the cache allocation, the fp8 quantization of v1 rows).
Afterwards the cache holds ``a``'s rows bit for bit, the next turn on ``a`` reuses them without a
restore (``source == "live"``), and ``b``'s index record and file bytes are unchanged — a naive
restore that clears the cache first, fills it in place, forgets which session it holds, or upgrades
the file before the rows are in, fails here.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvstore import tiers
from kvstore.api.errors import http_status
from kvstore.engine import cache as cache_module
from kvstore.engine import restore as restore_module
from kvstore.engine.errors import RestoreFailed
from kvstore.errors import IntegrityError, SessionDamaged
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Header
from kvstore.gpu import codecs
from trust.support import assert_same_cache, cache_state, session_engine, session_state

TURN = dict(max_new_tokens=3, stop_tokens=())


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def _truncate(store, monkeypatch):
    path = store.journal_path("b")
    os.truncate(path, path.stat().st_size - store.get("b").record_bytes // 2)  # cut inside the last record


def _other_header(store, monkeypatch):
    path = store.journal_path("b")
    info = store.get("b")
    g = info.geometry
    other = Header(
        Geometry(g.n_layers, g.kv_lora, g.qk_rope, g.index_hd, g.nic, g.vocab + 8), info.tier, info.n_records
    )
    with open(path, "r+b") as f:
        f.write(other.to_bytes())


def _unlink(store, monkeypatch):
    store.journal_path("b").unlink()


def _decode(store, monkeypatch):
    def broken(self, raw, fields, start):
        raise ValueError("records could not be decoded (injected)")

    monkeypatch.setattr(restore_module.Placement, "apply", broken)


def _upload(store, monkeypatch):
    monkeypatch.setattr(restore_module, "fill", _oom)


def _allocate(store, monkeypatch):
    monkeypatch.setattr(cache_module.LatentCache, "_allocate", _oom)


FAILURES = {
    "truncated journal": (_truncate, IntegrityError, "ended at record"),
    "header of another model": (_other_header, IntegrityError, "no longer matches its index entry"),
    "journal missing": (_unlink, SessionDamaged, "missing"),
    "decode": (_decode, RestoreFailed, "could not be decoded"),
    "device upload out of memory": (_upload, RestoreFailed, "OutOfMemoryError"),
    "allocation out of memory": (_allocate, RestoreFailed, "OutOfMemoryError"),
}


def _two_sessions(chat):
    chat.run("a", [5, 6, 7, 8], create=True, **TURN)
    chat.run("b", [9, 10, 11], create=True, **TURN)
    chat.run("b", [12, 13], **TURN)
    held = chat.run("a", [14, 15], **TURN)  # the live cache is a's again
    assert chat.live_session == "a"
    return held.session.n_records


def _check_untouched(chat, store, inject, monkeypatch, error, reason):
    inject(store, monkeypatch)
    cache_before, b_before, a_before = cache_state(chat), session_state(store, "b"), session_state(store, "a")
    with pytest.raises(error, match=reason) as failed:
        chat.run("b", [20, 21], **TURN)
    assert_same_cache(cache_before, cache_state(chat))
    assert chat.live_session == "a"
    assert session_state(store, "b") == b_before
    assert session_state(store, "a") == a_before
    monkeypatch.undo()
    return failed.value


@pytest.mark.parametrize("step", list(FAILURES))
def test_a_failed_restore_leaves_the_live_cache_and_the_session_as_they_were(chat, store, monkeypatch, step):
    inject, error, reason = FAILURES[step]
    a_records = _two_sessions(chat)
    failure = _check_untouched(chat, store, inject, monkeypatch, error, reason)
    if isinstance(failure, RestoreFailed):
        assert "the resident sessions and the session are unchanged" in failure.reason
    again = chat.run("a", [30], **TURN)
    assert (again.source, again.reused_tokens, again.prefilled_tokens) == ("live", a_records, 1)


def test_a_failed_quantization_of_v1_rows_leaves_the_fp8_cache_and_the_v1_file(store, tiny_folder, tiny, monkeypatch):
    f32 = session_engine(store, tiny_folder, tiny, "f32")
    fp8 = session_engine(store, tiny_folder, tiny, "fp8")
    f32.run("b", [9, 10, 11], create=True, **TURN)  # a v1 session
    held = fp8.run("a", [5, 6, 7, 8], create=True, **TURN)
    assert store.get("b").tier == tiers.F32 and fp8.live_session == "a"

    def broken(tier, rows):
        raise RuntimeError("fp8 encode kernel failed (injected)")

    monkeypatch.setattr(codecs, "encode_tier", broken)
    cache_before, b_before = cache_state(fp8), session_state(store, "b")
    with pytest.raises(RestoreFailed, match="fp8 encode kernel failed"):
        fp8.run("b", [20], **TURN)
    assert_same_cache(cache_before, cache_state(fp8))
    after = session_state(store, "b")
    assert after == b_before and after["info"]["tier"]["version"] == 1  # not upgraded before the rows were in
    monkeypatch.undo()
    again = fp8.run("a", [30], **TURN)
    assert (again.source, again.reused_tokens) == ("live", held.session.n_records)
    upgraded = fp8.run("b", [20], **TURN)
    assert (
        upgraded.source == "journal" and upgraded.upgraded == "f32 (v1, f32 values) -> fp8 (v2, e4m3 codes + f32 scale)"
    )


def test_a_failed_restore_is_reported_with_its_reason_through_the_typed_error(chat, store, monkeypatch):
    _two_sessions(chat)
    monkeypatch.setattr(restore_module, "fill", _oom)
    with pytest.raises(RestoreFailed) as failed:
        chat.run("b", [20], **TURN)
    reason = failed.value.reason
    records = store.get("b").watermark
    assert f"restoring {records} rows of session 'b' into the f32 cache on cpu failed" in reason
    assert http_status(failed.value) == 503 and isinstance(failed.value.__cause__, torch.OutOfMemoryError)


def test_a_partial_turn_past_the_watermark_is_not_restored_and_the_next_turn_replaces_it(chat, store):
    """Records past the turn watermark (appended with complete_turn=False) are never restored; the
    next turn cuts them before appending, so the journal stays the conversation the cache holds."""
    _two_sessions(chat)
    extra = coli_kv.load(store.journal_path("b")).records[:2]
    store.append_records("b", extra, complete_turn=False)
    info = store.get("b")
    assert info.n_records == info.watermark + 2
    result = chat.run("b", [20], **TURN)
    assert (result.source, result.reused_tokens, result.dropped_records) == ("journal", info.watermark, 2)
    assert result.session.n_records == info.watermark + 1 + 3
    assert store.verify("b").ok
