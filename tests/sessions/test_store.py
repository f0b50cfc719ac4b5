"""The session store on a real LMDB environment and real journals in tmp_path."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvstore.errors import (
    CodecMismatch,
    FingerprintMismatch,
    FormatError,
    GeometryMismatch,
    IntegrityError,
    InvalidRequest,
    InvalidSessionId,
    PathRefused,
    SessionExists,
    SessionNotFound,
)
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Tier
from kvstore.sessions import Fingerprint, ModelInfo, SessionStore
from kvstore import tiers
from sessions.support import GEOMETRY, MODEL, Rows, journal_body, new_session

TIERS = [tiers.F32, tiers.FP8, tiers.INT4, tiers.polar(3)]


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x01]))


def code_offset(record_index, rec_bytes):
    """A byte inside the first layer's L codes of a record (changes a value, not the format's validity)."""
    return HEADER_BYTES + record_index * rec_bytes + 4 + 3


# ------------------------------------------------------------------ create / list / ids
def test_layout_and_permissions(store, tmp_path):
    new_session(store)
    for name in ("index", "journals", "archive", "locks", "lost+found"):
        assert stat.S_IMODE(os.stat(tmp_path / "data" / name).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.journal_path("chat")).st_mode) == 0o600
    for entry in os.scandir(tmp_path / "data" / "index"):
        assert stat.S_IMODE(entry.stat().st_mode) == 0o600


def test_create_get_list_and_filters(store):
    a = new_session(store, "a", tags=["x", "y"])
    new_session(store, "b", owner="bob", tags=["x"])
    store.create("alice", GEOMETRY, tiers.FP8, {"name": "other", "revision": "1"}, session_id="c")
    generated = store.create("alice", GEOMETRY, tiers.FP8, MODEL)
    assert a.n_records == 0 and a.state == "active" and a.tags == ("x", "y") and a.size_bytes == HEADER_BYTES
    assert store.get("a").fingerprint == Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
    assert len(generated.id) == 32 and store.get(generated.id).owner == "alice"
    assert {s.id for s in store.list(owner="alice")} == {"a", "c", generated.id}
    assert [s.id for s in store.list(owner="bob")] == ["b"]
    assert {s.id for s in store.list(tags=["x"])} == {"a", "b"}
    assert [s.id for s in store.list(tags=["x", "y"])] == ["a"]
    assert [s.id for s in store.list(model_name="other")] == ["c"]
    assert store.list(state="parked") == []
    with pytest.raises(InvalidRequest):
        store.list(state="gone")
    with pytest.raises(SessionExists):
        new_session(store, "a")


@pytest.mark.parametrize("bad", ["", "-a", "_a", "a" * 65, "../etc", "a/b", "a.b", "a b", "é", "a\0b", 7])
def test_invalid_ids_are_refused(store, bad):
    with pytest.raises(InvalidSessionId):
        store.create("alice", GEOMETRY, tiers.FP8, MODEL, session_id=bad)
    with pytest.raises(InvalidSessionId):
        store.get(bad)


def test_bad_model_and_geometry_are_refused(store):
    with pytest.raises(InvalidRequest, match="revision"):
        store.create("alice", GEOMETRY, tiers.FP8, {"name": "m"})
    with pytest.raises(InvalidRequest, match="unknown model fields"):
        store.create("alice", GEOMETRY, tiers.FP8, {**MODEL, "colour": "red"})
    with pytest.raises(FormatError):
        store.create("alice", Geometry(0, 32, 8, 0, 0, 10), tiers.FP8, MODEL)
    with pytest.raises(InvalidRequest):
        store.create("bad owner!", GEOMETRY, tiers.FP8, MODEL)
    assert store.list() == []


def test_other_owner_sees_nothing(store, rows):
    new_session(store, "mine")
    store.append("mine", *rows.make(4), owner="alice")
    with pytest.raises(SessionNotFound) as other:
        store.resume("mine", owner="mallory")
    with pytest.raises(SessionNotFound) as missing:
        store.resume("nothing", owner="mallory")
    assert other.value.reason == "no session 'mine'" and missing.value.reason == "no session 'nothing'"
    for call in (
        lambda: store.append("mine", *rows.make(1), owner="mallory"),
        lambda: store.truncate("mine", 1, owner="mallory"),
        lambda: store.fork("mine", owner="mallory"),
        lambda: store.delete("mine", owner="mallory"),
        lambda: store.park("mine", owner="mallory"),
        lambda: store.verify("mine", owner="mallory"),
    ):
        with pytest.raises(SessionNotFound):
            call()
    assert store.get("mine").n_records == 4 and store.get("mine").state == "active"


# ------------------------------------------------------------------ append / resume
@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.describe())
def test_append_resume_round_trip(store, rows, tier):
    new_session(store, tier=tier)
    first, second = rows.make(5), rows.make(3)
    result = store.append("chat", *first)
    assert (result.appended, result.turn, result.info.watermark) == (5, (0, 5), 5)
    raw = rows.encode(tier, second)
    result = store.append_records("chat", raw)
    assert (result.info.n_records, result.info.watermark) == (8, 8)
    assert journal_body(store, "chat") == rows.encode(tier, first) + raw
    resumed = store.resume("chat")
    assert resumed.reused_tokens == 8 and resumed.records.tier == tier
    assert resumed.records.record_bytes() == rows.encode(tier, first) + raw
    assert resumed.tokens.tolist() == first[0].tolist() + second[0].tolist()
    L, R, I = resumed.arrays()
    assert L.shape == (2, 8, 32) and R.shape == (2, 8, 8) and I.shape == (1, 8, 4)
    np.testing.assert_array_equal(I[:, :5], first[3])


def test_resume_trims_to_the_watermark(store, rows):
    new_session(store)
    done = rows.make(6)
    store.append("chat", *done)
    partial = store.append("chat", *rows.make(4), complete_turn=False)
    assert (partial.info.n_records, partial.info.watermark) == (10, 6)
    resumed = store.resume("chat")
    assert resumed.reused_tokens == 6 and resumed.tokens.tolist() == done[0].tolist()
    marked = store.append_records("chat", b"", complete_turn=True)
    assert marked.appended == 0 and marked.info.watermark == 10
    assert store.resume("chat").reused_tokens == 10


def test_bad_uploads_change_nothing(store, rows):
    new_session(store)
    store.append("chat", *rows.make(3))
    before = store.journal_path("chat").read_bytes()
    good = coli_kv.encode_records(GEOMETRY, tiers.FP8, *rows.make(2))
    bad_scale = good.copy()
    bad_scale["layers"]["Ls"][1, 0] = np.nan
    bad_token = good.copy()
    bad_token["token"][0] = GEOMETRY.vocab
    for payload in (good.tobytes()[:-1], bad_scale.tobytes(), bad_token.tobytes()):
        with pytest.raises(FormatError):
            store.append_records("chat", payload)
    with pytest.raises(GeometryMismatch):
        store.append("chat", *Rows(2, Geometry(3, 32, 8, 4, 1, 1000)).make(2))
    with pytest.raises(FormatError):
        store.append_records("chat", coli_kv.encode_records(GEOMETRY, tiers.F32, *rows.make(1)))
    assert store.journal_path("chat").read_bytes() == before
    info = store.get("chat")
    assert (info.n_records, info.watermark) == (3, 3)
    assert store.verify("chat").ok


def test_fingerprint_is_checked_on_resume(store, rows):
    new_session(store, tier=tiers.FP8)
    store.append("chat", *rows.make(2))
    same = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
    assert store.resume("chat", expect=same).reused_tokens == 2
    resaved = Fingerprint(ModelInfo.from_dict({**MODEL, "weights_hash": "abc"}), GEOMETRY, tiers.FP8)
    with pytest.raises(FingerprintMismatch, match="model.weights_hash"):
        store.resume("chat", expect=resaved)
    assert store.resume("chat", expect=resaved, override={"model.weights_hash"}).reused_tokens == 2
    with pytest.raises(FingerprintMismatch, match="tier"):
        store.resume("chat", expect=Fingerprint(same.model, GEOMETRY, tiers.INT4))
    with pytest.raises(FingerprintMismatch, match="geometry.vocab"):
        store.resume("chat", expect=Fingerprint(same.model, Geometry(2, 32, 8, 4, 1, 999), tiers.FP8))
    with pytest.raises(InvalidRequest):
        store.resume("chat", expect=resaved, override={"geometry.vocab"})


# ------------------------------------------------------------------ truncate
def test_truncate_mid_turn_rehashes_the_cut_turn(store, rows):
    new_session(store)
    first, second = rows.make(6), rows.make(6)
    store.append("chat", *first)
    store.append("chat", *second)
    info = store.truncate("chat", 9)
    assert (info.n_records, info.watermark, info.size_bytes) == (9, 9, HEADER_BYTES + 9 * info.record_bytes)
    assert store.journal_path("chat").stat().st_size == info.size_bytes
    assert journal_body(store, "chat") == rows.encode(tiers.FP8, first, second)[: 9 * info.record_bytes]
    report = store.verify("chat")
    assert report.ok and report.turns_checked == 2
    with pytest.raises(InvalidRequest):
        store.truncate("chat", 10)
    with pytest.raises(InvalidRequest):
        store.truncate("chat", -1)
    assert store.truncate("chat", 0).n_records == 0 and store.verify("chat").ok


def test_truncate_inside_the_incomplete_tail_keeps_the_watermark(store, rows):
    new_session(store)
    store.append("chat", *rows.make(4))
    store.append("chat", *rows.make(4), complete_turn=False)
    info = store.truncate("chat", 6)
    assert (info.n_records, info.watermark) == (6, 4)


# ------------------------------------------------------------------ verify / repair
def test_verify_finds_a_silent_bit_flip_and_resume_treats_it_as_a_miss(store, rows):
    new_session(store)
    for n in (3, 4, 5):
        store.append("chat", *rows.make(n))
    rec_bytes = store.get("chat").record_bytes
    good_bytes = journal_body(store, "chat")
    flip_byte(store.journal_path("chat"), code_offset(8, rec_bytes))  # inside the third turn (7..12)
    assert coli_kv.load(store.journal_path("chat")).problems.messages() == []  # the format cannot see it
    report = store.verify("chat")
    assert not report.ok and report.first_bad == {"turn": 2, "start": 7, "end": 12} and report.good_records == 7
    resumed = store.resume("chat", verify=True)
    assert resumed.reused_tokens == 7 and resumed.damaged_from == 7 and resumed.verified
    assert resumed.records.record_bytes() == good_bytes[: 7 * rec_bytes]
    assert store.resume("chat").reused_tokens == 12  # without verify the hash is not consulted


def test_repair_drops_the_damaged_tail(store, rows):
    new_session(store)
    store.append("chat", *rows.make(3))
    store.append("chat", *rows.make(3))
    store.append("chat", *rows.make(3), complete_turn=False)
    rec_bytes = store.get("chat").record_bytes
    flip_byte(store.journal_path("chat"), code_offset(4, rec_bytes))
    dry = store.repair("chat", dry_run=True)
    assert dry.dry_run and dry.kept_records == 3 and dry.first_bad["turn"] == 1
    assert store.get("chat").n_records == 9
    report = store.repair("chat")
    assert report.kept_records == 3 and report.dropped_records == 6
    info = store.get("chat")
    assert (info.n_records, info.watermark) == (3, 3) and "repaired" in info.problem
    assert store.verify("chat").ok and store.journal_path("chat").stat().st_size == HEADER_BYTES + 3 * rec_bytes
    assert store.repair("chat").actions == []


def test_repair_cuts_a_torn_tail(store, rows):
    new_session(store)
    store.append("chat", *rows.make(3))
    with open(store.journal_path("chat"), "ab") as f:
        f.write(b"\x07" * 11)
    report = store.repair("chat")
    assert report.actions == ["cut 11 bytes past the last committed record"] and report.kept_records == 3
    assert store.journal_path("chat").stat().st_size == HEADER_BYTES + 3 * store.get("chat").record_bytes


# ------------------------------------------------------------------ fork
def test_fork_copies_the_prefix_and_diverges(store, rows):
    new_session(store, tags=["t"])
    first, second = rows.make(5), rows.make(5)
    store.append("chat", *first)
    store.append("chat", *second, complete_turn=False)
    fork = store.fork("chat", new_id="branch")
    assert (fork.n_records, fork.watermark, fork.parent, fork.fork_point, fork.tags) == (5, 5, "chat", 5, ("t",))
    assert journal_body(store, "branch") == rows.encode(tiers.FP8, first)
    mid = store.fork("chat", at=7, new_id="mid", tags=[])
    assert (mid.n_records, mid.watermark) == (7, 5)
    assert journal_body(store, "mid") == journal_body(store, "chat")[: 7 * mid.record_bytes]
    assert store.verify("mid").ok and store.verify("branch").ok
    store.append("branch", *rows.make(2))
    assert store.get("chat").n_records == 10 and store.get("branch").n_records == 7
    with pytest.raises(InvalidRequest):
        store.fork("chat", at=11)
    with pytest.raises(SessionExists):
        store.fork("chat", new_id="mid")


def test_fork_refuses_to_rehash_a_damaged_turn(store, rows):
    new_session(store)
    store.append("chat", *rows.make(6))
    flip_byte(store.journal_path("chat"), code_offset(5, store.get("chat").record_bytes))
    with pytest.raises(IntegrityError):
        store.fork("chat", at=3, new_id="f")
    assert [s.id for s in store.list()] == ["chat"] and not store.journal_path("f").exists()


# ------------------------------------------------------------------ prefix lookup
def test_prefix_lookup_finds_the_longest_common_prefix(store, rows):
    fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
    base = rows.rng.integers(0, 1000, 400).astype(np.int32)
    new_session(store, "short")
    store.append("short", *rows.make(150, base[:150]))
    new_session(store, "long")
    store.append("long", *rows.make(300, base[:300]))
    new_session(store, "other")
    store.append("other", *rows.make(200, (base[:200] + 1) % 1000))
    hit = store.lookup("alice", fingerprint, base[:250])
    assert (hit.session_id, hit.matched_tokens) == ("long", 250)
    hit = store.lookup("alice", fingerprint, np.concatenate([base[:130], [7, 7, 7]]))
    assert hit.matched_tokens == 130 and hit.session_id in ("short", "long")
    assert store.lookup("alice", fingerprint, base[:40]) is None  # less than one block
    assert store.lookup("bob", fingerprint, base[:250]) is None
    other_model = Fingerprint(ModelInfo.from_dict({**MODEL, "revision": "r2"}), GEOMETRY, tiers.FP8)
    assert store.lookup("alice", other_model, base[:250]) is None
    store.truncate("long", 100)
    hit = store.lookup("alice", fingerprint, base[:250])
    assert (hit.session_id, hit.matched_tokens) == ("short", 150)
    with pytest.raises(InvalidRequest):
        store.lookup("alice", fingerprint, [1.5, 2.5])
    with pytest.raises(InvalidRequest):
        store.lookup("alice", fingerprint, [1000])


def test_prefix_lookup_ignores_the_incomplete_tail_and_sees_parked_sessions(store, rows):
    fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
    tokens = rows.rng.integers(0, 1000, 200).astype(np.int32)
    new_session(store)
    store.append("chat", *rows.make(100, tokens[:100]))
    store.append("chat", *rows.make(100, tokens[100:]), complete_turn=False)
    assert store.lookup("alice", fingerprint, tokens).matched_tokens == 100
    store.append_records("chat", b"", complete_turn=True)
    assert store.lookup("alice", fingerprint, tokens).matched_tokens == 200
    store.park("chat")
    hit = store.lookup("alice", fingerprint, tokens)
    assert (hit.matched_tokens, hit.state) == (200, "parked")


# ------------------------------------------------------------------ park / unpark
@pytest.mark.parametrize("tier", [tiers.F32, tiers.FP8, tiers.polar(4)], ids=lambda t: t.describe())
def test_park_round_trip_is_byte_exact(store, rows, tier):
    new_session(store, tier=tier)
    store.append("chat", *rows.make(40))
    store.append("chat", *rows.make(9), complete_turn=False)
    journal_bytes = store.journal_path("chat").read_bytes()
    seen = []
    parked = store.park("chat", progress=lambda done, total: seen.append((done, total)))
    assert parked.state == "parked" and not store.journal_path("chat").exists()
    assert parked.size_bytes == store.archive_path("chat").stat().st_size == store.usage()["used_bytes"]
    assert stat.S_IMODE(store.archive_path("chat").stat().st_mode) == 0o600
    assert seen[-1] == (len(journal_bytes), len(journal_bytes)) and seen == sorted(seen)
    assert store.verify("chat").ok  # verify reads the archive without unparking
    assert store.park("chat").state == "parked"
    unparked = store.unpark("chat")
    assert unparked.state == "active" and not store.archive_path("chat").exists()
    assert store.journal_path("chat").read_bytes() == journal_bytes
    assert (unparked.n_records, unparked.watermark) == (49, 40)


def test_resume_and_append_unpark_transparently(store, rows):
    new_session(store)
    first = rows.make(5)
    store.append("chat", *first)
    store.park("chat")
    assert store.resume("chat").tokens.tolist() == first[0].tolist()
    assert store.get("chat").state == "active"
    store.park("chat")
    assert store.append("chat", *rows.make(2)).info.n_records == 7


def test_a_damaged_archive_is_refused_and_kept(store, rows):
    new_session(store)
    store.append("chat", *rows.make(20))
    store.park("chat")
    path = store.archive_path("chat")
    flip_byte(path, path.stat().st_size // 2)
    damaged = path.read_bytes()
    with pytest.raises(IntegrityError):
        store.unpark("chat")
    assert store.get("chat").state == "parked" and path.read_bytes() == damaged
    assert not store.journal_path("chat").exists()


# ------------------------------------------------------------------ migrate / inspect / delete
def test_migrate_rewrites_the_journal_and_its_hashes(store, rows):
    new_session(store, tier=tiers.FP8)
    chunks = [rows.make(700), rows.make(30)]
    for chunk in chunks:
        store.append("chat", *chunk)
    seen = []
    info = store.migrate("chat", tiers.INT4, progress=lambda done, total: seen.append((done, total)))
    assert info.tier == tiers.INT4 and seen[-1] == (730, 730)
    assert info.fingerprint_key == Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.INT4).key()
    assert store.verify("chat").ok
    resumed = store.resume("chat")
    assert resumed.records.tier == tiers.INT4 and resumed.tokens.tolist() == np.concatenate([c[0] for c in chunks]).tolist()
    fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.INT4)
    assert store.lookup("alice", fingerprint, resumed.tokens).matched_tokens == 730
    with pytest.raises(FingerprintMismatch):
        store.resume("chat", expect=Fingerprint(fingerprint.model, GEOMETRY, tiers.FP8))


def test_migrate_refuses_a_damaged_session(store, rows):
    new_session(store)
    store.append("chat", *rows.make(4))
    before = None
    flip_byte(store.journal_path("chat"), code_offset(1, store.get("chat").record_bytes))
    before = store.journal_path("chat").read_bytes()
    with pytest.raises(IntegrityError, match="repair"):
        store.migrate("chat", tiers.F32)
    assert store.journal_path("chat").read_bytes() == before and store.get("chat").tier == tiers.FP8


def test_inspect_reports_the_file(store, rows):
    new_session(store)
    store.append("chat", *rows.make(3))
    report = store.inspect("chat")
    assert report["header"]["nrec"] == 3 and report["header"]["version"] == 2
    assert report["loadable_records"] == 3 and report["problems"] == [] and report["turns"] == 1
    store.park("chat")
    parked = store.inspect("chat")
    assert parked["file"]["path"] == "archive/chat.coli_kv.zst" and parked["loadable_records"] == 3


def test_delete_removes_files_and_entries(store, rows):
    new_session(store)
    store.append("chat", *rows.make(70))
    store.fork("chat", new_id="kept")
    store.delete("chat")
    assert not store.journal_path("chat").exists() and [s.id for s in store.list()] == ["kept"]
    with pytest.raises(SessionNotFound):
        store.get("chat")
    fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
    assert store.lookup("alice", fingerprint, store.resume("kept").tokens).session_id == "kept"
    new_session(store, "chat")
    assert store.get("chat").n_records == 0
    store.delete("kept")
    assert store.usage()["used_bytes"] == HEADER_BYTES


def test_symlinks_out_of_the_store_are_refused(tmp_path, rows):
    outside = tmp_path / "outside.coli_kv"
    with SessionStore(tmp_path / "data") as store:
        new_session(store)
        store.append("chat", *rows.make(2))
        os.replace(store.journal_path("chat"), outside)
        os.symlink(outside, tmp_path / "data" / "journals" / "chat.coli_kv")
        with pytest.raises(PathRefused):
            store.append("chat", *rows.make(1))
        with pytest.raises(PathRefused):
            store.resume("chat")
    assert coli_kv.load(outside).n == 2
    os.makedirs(tmp_path / "elsewhere")
    (tmp_path / "other").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "other" / "journals")
    with pytest.raises(PathRefused):
        SessionStore(tmp_path / "other")


def test_codec_mismatch_is_not_a_silent_reload(store, rows):
    new_session(store, tier=tiers.FP8)
    store.append("chat", *rows.make(3))
    raw = rows.encode(tiers.INT4, rows.make(3))
    with pytest.raises(FormatError):
        store.append_records("chat", raw)
    assert store.get("chat").n_records == 3
    with pytest.raises(CodecMismatch):
        from kvstore.journal import KVFile

        KVFile.open(store.journal_path("chat"), tier=tiers.INT4)


# ------------------------------------------------------------------ concurrency on one session
def test_concurrent_writers_on_one_session_never_interleave(store):
    import threading

    new_session(store)
    turns = {i: Rows(50 + i).make(5 + i) for i in range(8)}
    encoded = {i: Rows(50 + i).encode(tiers.FP8, turns[i]) for i in turns}
    failures = []

    def writer(i):
        try:
            store.append("chat", *turns[i])
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in turns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    body = journal_body(store, "chat")
    assert len(body) == sum(len(b) for b in encoded.values())
    # the journal is the eight turns back to back, each whole, in some order
    offset, seen = 0, set()
    while offset < len(body):
        match = next(i for i, b in encoded.items() if i not in seen and body[offset:offset + len(b)] == b)
        seen.add(match)
        offset += len(encoded[match])
    assert seen == set(turns) and store.verify("chat").turns_checked == 8


def test_readers_during_appends_see_whole_turns(store):
    import threading

    new_session(store)
    rows = Rows(60)
    chunks = [rows.make(3 + i % 4) for i in range(30)]
    expected = rows.encode(tiers.FP8, *chunks)
    boundaries = {0}
    total = 0
    for chunk in chunks:
        total += len(rows.encode(tiers.FP8, chunk))
        boundaries.add(total)
    done = threading.Event()
    seen = []

    def reader():
        while not done.is_set():
            seen.append(store.resume("chat").records.record_bytes())

    thread = threading.Thread(target=reader)
    thread.start()
    for chunk in chunks:
        store.append("chat", *chunk)
    done.set()
    thread.join()
    assert seen and all(len(s) in boundaries and expected.startswith(s) for s in seen)
