"""The real fingerprint: every field is recorded, compared on restore and refused with its name.

A session written by one engine is continued by another that differs in exactly one field — the
geometry, the tier's codec, the tier's bits, the weights, the tokenizer, the chat template, the
attention variant. Each refusal names that field, and neither the refusing engine's live cache nor
the session changes. The weights hash is computed once per folder and kept on disk; the explicit
override continues a session whose weights were re-saved in another file layout.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from kvstore import tiers
from kvstore.engine import fingerprint
from kvstore.engine.config import preset
from kvstore.engine.fingerprint import ATTENTION_VARIANT, folder_model_info
from kvstore.engine.generate import Engine
from kvstore.engine.rows import StoredRows
from kvstore.engine.tokenizer import load_tokenizer
from kvstore.engine.weights import load_model, write_random_model
from kvstore.errors import FingerprintMismatch, InvalidRequest
from kvstore.formats import coli_kv
from trust.support import assert_same_cache, cache_state, session_engine, session_state, sibling

TURN = dict(max_new_tokens=3, stop_tokens=())


def _loaded(folder):
    return load_model(folder), load_tokenizer(folder)


def _refused(chat, store, session_id, *fields, **options):
    """``chat`` refuses ``session_id`` naming exactly ``fields``; its cache and the session do not change."""
    cache_before, session_before = cache_state(chat), session_state(store, session_id)
    live_before = chat.live_session
    with pytest.raises(FingerprintMismatch) as refused:
        chat.run(session_id, [40, 41], **TURN, **options)
    named = [part.split(":")[0].strip() for part in refused.value.reason.split(": ", 1)[1].split(";")]
    assert named == list(fields), refused.value.reason
    assert_same_cache(cache_before, cache_state(chat))
    assert chat.live_session == live_before
    assert session_state(store, session_id) == session_before
    return refused.value.reason


def test_a_session_records_the_engines_full_fingerprint(chat, store, tiny_folder):
    result = chat.run("s", "Hello", create=True, **TURN)
    info = store.get("s")
    config = json.loads((tiny_folder / "config.json").read_text())
    assert info.geometry.words() == (
        config["num_hidden_layers"],
        config["kv_lora_rank"],
        config["qk_rope_head_dim"],
        0,
        0,
        config["vocab_size"],
    )
    assert info.tier == tiers.F32
    assert info.model.name == "tiny" and info.model.revision == "local"
    assert info.model.weights_hash == fingerprint.weights_hash(tiny_folder) and info.model.weights_hash.startswith(
        "blake2b:"
    )
    assert info.model.tokenizer_hash == fingerprint.tokenizer_hashes(tiny_folder)[0] is not None
    assert info.model.attention_variant == ATTENTION_VARIANT
    assert result.session.fingerprint_key == chat.fingerprint.key()


@pytest.fixture
def holder(store, tiny_folder, tiny):
    """An f32 engine with a live session of its own (``mine``)."""
    chat = session_engine(store, tiny_folder, tiny)
    chat.run("mine", [5, 6, 7], create=True, **TURN)
    return chat


def test_another_weights_file_is_refused_naming_the_weights_hash(holder, store, tmp_path):
    other = write_random_model(tmp_path / "w" / "tiny", "tiny", seed=1)
    writer = session_engine(store, other, _loaded(other))
    writer.run("theirs", [8, 9], create=True, **TURN)
    reason = _refused(holder, store, "theirs", "model.weights_hash")
    assert fingerprint.weights_hash(other) in reason


def test_another_tokenizer_is_refused_naming_the_tokenizer_hash(holder, store, tiny_folder, tiny, tmp_path):
    other = sibling(tiny_folder, tmp_path / "t")
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["added_tokens"][0]["content"] = "<s>"  # another special token spelling: other ids for the same text
    (other / "tokenizer.json").write_text(json.dumps(spec))
    session_engine(store, other, tiny).run("theirs", [8, 9], create=True, **TURN)
    _refused(holder, store, "theirs", "model.tokenizer_hash")


def test_another_chat_template_is_refused_naming_only_the_template(holder, store, tiny_folder, tiny, tmp_path):
    other = sibling(tiny_folder, tmp_path / "c")
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    session_engine(store, other, tiny).run("theirs", [8, 9], create=True, **TURN)
    _refused(holder, store, "theirs", "model.chat_template_hash")


def test_another_attention_variant_is_refused(holder, store):
    model = dataclasses.replace(holder.model, attention_variant="interleaved-rope-latent")
    store.create("default", holder.geometry, holder.tier, model, session_id="theirs")
    store.append("theirs", np.array([8, 9]), np.zeros((4, 2, 64), np.float32), np.zeros((4, 2, 32), np.float32))
    _refused(holder, store, "theirs", "model.attention_variant")


def test_another_geometry_is_refused_and_cannot_be_overridden(holder, store, tmp_path):
    other = write_random_model(tmp_path / "g" / "tiny", preset("tiny").replace(vocab_size=600), seed=0)
    writer = session_engine(store, other, _loaded(other))
    writer.run("theirs", [8, 9], create=True, **TURN)
    reason = _refused(holder, store, "theirs", "geometry.vocab", "model.weights_hash")  # other shapes, other bytes
    assert "geometry.vocab: session 600, expected 512" in reason
    with pytest.raises(InvalidRequest, match="cannot override"):
        holder.run("theirs", [40], override=["geometry.vocab"], **TURN)


@pytest.mark.parametrize(
    "written, restoring, shown",
    [
        (
            ("fp8",),
            ("int4",),
            "tier: session fp8 (v2, e4m3 codes + f32 scale), expected int4 (v3, rotated int4 codes + radius)",
        ),
        (
            ("polar3",),
            ("polar4",),
            "tier: session polar3 (v3, PolarQuant 3-bit codes + radius), expected polar4 (v3, PolarQuant 4-bit",
        ),
    ],
    ids=["codec", "bits"],
)
def test_another_cache_tier_is_refused_naming_codec_and_bits(store, tiny_folder, tiny, written, restoring, shown):
    writer = session_engine(store, tiny_folder, tiny, *written)
    writer.run("theirs", [8, 9], create=True, **TURN)
    chat = session_engine(store, tiny_folder, tiny, *restoring)
    chat.run("mine", [5, 6, 7], create=True, **TURN)
    assert shown in _refused(chat, store, "theirs", "tier")


def test_the_weights_hash_is_computed_once_per_folder_and_kept_on_disk(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "_folder_hashes", {})
    folder = sibling(tiny_folder, tmp_path / "m")
    hashed = []
    real = fingerprint._hash_files
    monkeypatch.setattr(fingerprint, "_hash_files", lambda *args: hashed.append(args[0]) or real(*args))
    first = folder_model_info(folder).weights_hash
    assert folder_model_info(folder).weights_hash == first and len(hashed) == 1
    monkeypatch.setattr(fingerprint, "_folder_hashes", {})  # as a new process: only the disk record remains
    assert folder_model_info(folder).weights_hash == first and len(hashed) == 1
    records = list((tmp_path / "cache" / "weights").glob("*.json"))
    assert len(records) == 1 and records[0].stat().st_mode & 0o777 == 0o600
    weights = folder / "model.safetensors"
    os.utime(
        weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9)
    )  # a changed file is hashed again
    assert folder_model_info(folder).weights_hash == first and len(hashed) == 2


def test_the_same_weights_copied_need_no_override(holder, store, tiny_folder, tiny, tmp_path):
    copy = sibling(tiny_folder, tmp_path / "copy")  # new files, new mtimes and inodes, the same bytes
    stored = store.get("mine").n_records
    result = session_engine(store, copy, tiny).run("mine", [40], **TURN)
    assert (result.source, result.reused_tokens, result.prefilled_tokens) == ("journal", stored, 1)


def test_weights_resaved_in_another_layout_continue_with_the_explicit_override(
    holder, store, tiny_folder, tiny, tmp_path
):
    resaved = write_random_model(
        tmp_path / "r" / "tiny", "tiny", seed=0, max_shard_bytes=1 << 20
    )  # same weights, sharded
    assert len(fingerprint.weight_files(resaved)) > 1
    other = session_engine(store, resaved, _loaded(resaved))
    _refused(other, store, "mine", "model.weights_hash")
    history = store.resume("mine").tokens.tolist()
    continued = other.run("mine", [40, 41], override=["model.weights_hash"], **TURN)
    assert (continued.source, continued.reused_tokens, continued.prefilled_tokens) == ("journal", len(history), 2)
    # the same weights: the answer is the uninterrupted run's, token for token
    uninterrupted = Engine(tiny[0], tier="f32").generate(history + [40, 41], **TURN)
    assert continued.tokens == uninterrupted.tokens
    assert store.get("mine").model.weights_hash == holder.model.weights_hash  # the session keeps its fingerprint


def test_a_v1_session_resumes_in_an_fp8_engine_and_the_file_upgrades_on_the_next_append(store, tiny_folder, tiny):
    f32 = session_engine(store, tiny_folder, tiny, "f32")
    f32.run("u", [5, 6, 7, 8], create=True, **TURN)
    path = store.journal_path("u")
    v1_bytes = path.read_bytes()
    fp8 = session_engine(store, tiny_folder, tiny, "fp8")
    report = fp8.resume("u")  # no override needed: f32 rows are lossless
    assert (report.source, report.reused_tokens) == ("journal", 7)
    assert path.read_bytes() == v1_bytes and store.get("u").tier == tiers.F32  # quantized in memory only
    in_memory = fp8.resident_cache("u").export_rows(0)
    assert in_memory.version == 2
    result = fp8.run("u", [9, 10], **TURN)
    assert (result.source, result.reused_tokens, result.prefilled_tokens) == ("live", 7, 2)
    assert (
        result.upgraded == "f32 (v1, f32 values) -> fp8 (v2, e4m3 codes + f32 scale)"
        and store.get("u").tier == tiers.FP8
    )
    on_disk = StoredRows.from_records(coli_kv.load(path))
    assert on_disk.version == 2 and on_disk.n == 7 + 2 + 3
    for name in ("lc", "rc", "lc_scales", "rc_scales"):  # the file holds exactly the rows the cache used
        np.testing.assert_array_equal(getattr(on_disk, name)[:, :7], getattr(in_memory, name), err_msg=name)
    assert store.verify("u").ok
    with pytest.raises(FingerprintMismatch, match=r"tier: session fp8 \(v2"):  # an upgraded session is fp8 for good
        f32.run("u", [11], **TURN)


def test_a_quantized_session_in_an_f32_engine_needs_the_tier_override_and_stays_in_its_tier(store, tiny_folder, tiny):
    fp8 = session_engine(store, tiny_folder, tiny, "fp8")
    fp8.run("q", [5, 6, 7, 8], create=True, **TURN)
    f32 = session_engine(store, tiny_folder, tiny, "f32")
    f32.run("mine", [1, 2], create=True, **TURN)
    _refused(f32, store, "q", "tier")
    result = f32.run("q", [9, 10], override=["tier"], **TURN)
    assert (result.source, result.reused_tokens, result.prefilled_tokens) == ("journal", 7, 2)
    assert store.get("q").tier == tiers.FP8 and result.upgraded is None
    assert store.verify("q").ok and coli_kv.load(store.journal_path("q")).n == 7 + 2 + 3
