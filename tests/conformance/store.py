"""The suite every session-store backend passes (the zarr way: subclass, implement the hooks).

(Over 500 lines on purpose: one class is the whole suite, which each backend inherits whole.)

A backend's test module subclasses :class:`StoreConformance`, names the backend's class
(:attr:`StoreConformance.backend`) and implements :meth:`make_store` (through
``kvstore.store.open``) and the hooks that look at what the backend stores (:meth:`stored_image`,
:meth:`flip_stored_byte`, :meth:`held_bytes`); everything else is the interface
``kvstore.store.Store``: create/append/append_records/resume/reader/truncate/fork/lookup/park/
unpark/delete/list/get/set_tags/verify/inspect/repair/migrate, budgets and eviction, owner
visibility and typed errors. What only one backend has (LMDB schema upgrades, journal files,
lost+found) stays in its own suite.

What a backend lacks is data on its class (``Store.capabilities``, :attr:`StoreConformance.lacks`
reads it): those tests skip with the reason, and ``test_lacked_operations_raise_a_typed_error``
checks that each lacked call raises ``NotOnSharedStore`` naming it and changes nothing.
``test_the_backend_keeps_the_interface`` fails when a method's signature drifts from the
interface (``kvstore.store.interface_drift``); ``test_a_drifted_signature_is_reported`` shows
that check failing on a planted drift.
"""

from __future__ import annotations

import abc
import base64
import inspect
import threading
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from kvstore import tiers
from kvstore.errors import (
    BudgetExceeded,
    FingerprintMismatch,
    FormatError,
    GeometryMismatch,
    IntegrityError,
    InvalidCursor,
    InvalidRequest,
    InvalidSessionId,
    NonFiniteValues,
    NotOnSharedStore,
    SessionExists,
    SessionNotFound,
    TooManySessions,
)
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry
from kvstore.store import CAPABILITIES, Fingerprint, ModelInfo, SessionStore, Store, interface_drift
from store.support import GEOMETRY, MODEL, Rows, new_session

TIERS = [tiers.F32, tiers.BF16, tiers.FP8, tiers.INT4, tiers.polar(3)]
REC = coli_kv.record_bytes(GEOMETRY, tiers.FP8)


def code_offset(record_index: int, rec_bytes: int) -> int:
    """A byte inside the first layer's L codes of a record (changes a value, not the format's validity)."""
    return HEADER_BYTES + record_index * rec_bytes + 4 + 3


def compressible(n: int, seed: int):
    """Rows that compress to almost nothing (the same row repeated), so parking frees space."""
    tokens, L, R, I = Rows(seed).make(n)
    return tokens, np.broadcast_to(L[:, :1], L.shape), np.broadcast_to(R[:, :1], R.shape), I * 0


class StoreConformance(abc.ABC):
    """Subclass as ``class Test<Backend>Store(StoreConformance)`` and implement the hooks."""

    #: The backend's class: what it can do is read from it (``capabilities``, ``hashes_every_read``).
    backend: ClassVar[type[Store]]

    @property
    def lacks(self) -> frozenset[str]:
        """What the backend does not have (``Store.lacks()``): ``"park"`` (park and unpark),
        ``"repair"``, ``"migrate"``, ``"hard_limit"`` (a store opened with ``hard_limit_bytes``),
        ``"journal_files"`` (``journal_path``, ``archive_path``: their tests are the backend's own).
        Their tests skip; each raises ``NotOnSharedStore`` instead."""
        return self.backend.lacks()

    @property
    def hashes_every_read(self) -> bool:
        """Whether a resume re-hashes the turns it serves even without ``verify`` (it then refuses a
        damaged turn with ``IntegrityError`` instead of serving it unchecked)."""
        return self.backend.hashes_every_read

    def needs(self, *capabilities: str) -> None:
        """Skip the calling test, saying why, when the backend lacks one of ``capabilities``."""
        missing = sorted(set(capabilities) & self.lacks)
        if missing:
            pytest.skip(f"{self.backend.__name__} lacks {', '.join(missing)} (its capabilities)")

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def make_store(self, path: Path, **limits) -> SessionStore:
        """Open (or create) the store kept under ``path``; ``limits``: ``budget_bytes``, ``hard_limit_bytes``."""

    @abc.abstractmethod
    def stored_image(self, store: SessionStore, session_id: str, owner: str | None = None) -> bytes | None:
        """The ``.coli_kv`` image (header + records) the backend holds for ``owner``'s session (ids are
        per owner; None: the one owner's that has it), whether active or parked, as stored (records
        past the index's count included); None if it holds none."""

    @abc.abstractmethod
    def flip_stored_byte(self, store: SessionStore, session_id: str, offset: int) -> None:
        """Flip the low bit of byte ``offset`` of an active session's stored image behind the
        store's back (a silent bit flip the format cannot see)."""

    @abc.abstractmethod
    def held_bytes(self, store: SessionStore) -> int:
        """Bytes the backend's session files or objects take (what ``usage()`` must count)."""

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture
    def store(self, tmp_path):
        with self.make_store(tmp_path / "data") as opened:
            yield opened

    @pytest.fixture
    def rows(self):
        return Rows(1)

    def body(self, store: SessionStore, session_id: str, owner: str | None = None) -> bytes:
        image = self.stored_image(store, session_id, owner)
        assert image is not None, f"no stored image for {session_id!r}"
        return image[HEADER_BYTES:]

    # ------------------------------------------------------------------ create / list / ids / owners
    def test_create_get_list_and_filters(self, store):
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
        assert [s.id for s in store.list(fingerprint=store.get("c").fingerprint)] == ["c"]
        assert store.list(state="parked") == []
        with pytest.raises(InvalidRequest):
            store.list(state="gone")
        with pytest.raises(SessionExists):
            new_session(store, "a")

    @pytest.mark.parametrize("bad", ["", "-a", "_a", "a" * 65, "../etc", "a/b", "a.b", "a b", "é", "a\0b", 7])
    def test_invalid_ids_are_refused(self, store, bad):
        with pytest.raises(InvalidSessionId):
            store.create("alice", GEOMETRY, tiers.FP8, MODEL, session_id=bad)
        with pytest.raises(InvalidSessionId):
            store.get(bad)

    def test_bad_model_and_geometry_are_refused(self, store):
        with pytest.raises(InvalidRequest, match="revision"):
            store.create("alice", GEOMETRY, tiers.FP8, {"name": "m"})
        with pytest.raises(InvalidRequest, match="unknown model fields"):
            store.create("alice", GEOMETRY, tiers.FP8, {**MODEL, "colour": "red"})
        with pytest.raises(FormatError):
            store.create("alice", Geometry(0, 32, 8, 0, 0, 10), tiers.FP8, MODEL)
        with pytest.raises(InvalidRequest):
            store.create("bad owner!", GEOMETRY, tiers.FP8, MODEL)
        assert store.list() == []

    def test_other_owner_sees_nothing(self, store, rows):
        new_session(store, "mine")
        store.append("mine", *rows.make(4), owner="alice")
        with pytest.raises(SessionNotFound) as other:
            store.resume("mine", owner="mallory")
        with pytest.raises(SessionNotFound) as missing:
            store.resume("nothing", owner="mallory")
        assert other.value.reason == "no session 'mine'" and missing.value.reason == "no session 'nothing'"
        for needed, call in (
            (None, lambda: store.get("mine", owner="mallory")),
            (None, lambda: store.append("mine", *rows.make(1), owner="mallory")),
            (None, lambda: store.append_records("mine", b"", owner="mallory")),
            (None, lambda: store.truncate("mine", 1, owner="mallory")),
            (None, lambda: store.fork("mine", owner="mallory")),
            (None, lambda: store.delete("mine", owner="mallory")),
            ("park", lambda: store.park("mine", owner="mallory")),
            ("park", lambda: store.unpark("mine", owner="mallory")),
            (None, lambda: store.verify("mine", owner="mallory")),
            (None, lambda: store.reader("mine", owner="mallory")),
            (None, lambda: store.set_tags("mine", ["t"], owner="mallory")),
            (None, lambda: store.inspect("mine", owner="mallory")),
            ("repair", lambda: store.repair("mine", owner="mallory")),
            ("migrate", lambda: store.migrate("mine", tiers.F32, owner="mallory")),
        ):
            with pytest.raises(NotOnSharedStore if needed in self.lacks else SessionNotFound):
                call()
        assert store.list(owner="mallory") == []
        assert store.get("mine").n_records == 4 and store.get("mine").state == "active"
        assert store.get("mine").tags == ()

    def test_ids_are_per_owner(self, store, rows):
        # Two owners may both have "chat": each sees, changes, forks and deletes only their own.
        mine, theirs = rows.make(4), rows.make(2)
        new_session(store, "chat", owner="alice")
        new_session(store, "chat", owner="bob", tier=tiers.INT4)
        store.append("chat", *mine, owner="alice")
        store.append("chat", *theirs, owner="bob")
        alice, bob = store.get("chat", owner="alice"), store.get("chat", owner="bob")
        assert (alice.id, alice.owner, alice.n_records, alice.tier) == ("chat", "alice", 4, tiers.FP8)
        assert (bob.id, bob.owner, bob.n_records, bob.tier) == ("chat", "bob", 2, tiers.INT4)
        assert alice.key != bob.key
        assert self.body(store, "chat", "alice") == rows.encode(tiers.FP8, mine)
        assert self.body(store, "chat", "bob") == rows.encode(tiers.INT4, theirs)
        assert store.resume("chat", owner="bob").tokens.tolist() == theirs[0].tolist()
        with pytest.raises(SessionExists, match="'chat' already exists"):
            new_session(store, "chat", owner="bob")
        # A fork belongs to its source's owner, whatever id the other owner holds.
        assert store.fork("chat", new_id="branch", owner="bob").parent == "chat"
        assert store.fork("chat", new_id="branch", owner="alice").n_records == 4
        assert [(s.id, s.owner) for s in store.list(owner="bob")] == [("chat", "bob"), ("branch", "bob")]
        # Acting as any owner (owner=None), an id two owners have is refused, never guessed.
        for call in (
            lambda: store.get("chat"),
            lambda: store.append("chat", *rows.make(1)),
            lambda: store.truncate("chat", 0),
            lambda: store.delete("chat"),
        ):
            with pytest.raises(InvalidRequest, match=r"2 owners have a session .chat. \(alice, bob\)"):
                call()
        store.truncate("chat", 0, owner="bob")
        store.delete("chat", owner="bob")
        assert store.get("chat", owner="alice").n_records == 4 and store.verify("chat").ok  # one left: no owner needed
        with pytest.raises(SessionNotFound, match="no session 'chat'"):
            store.get("chat", owner="bob")
        fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
        assert store.lookup("bob", fingerprint, mine[0]) is None

    def test_set_tags_replaces_them(self, store):
        new_session(store, tags=["old"])
        info = store.set_tags("chat", ["b", "a", "b"], owner="alice")
        assert info.tags == ("a", "b") and store.get("chat").tags == ("a", "b")
        assert [s.id for s in store.list(tags=["a"])] == ["chat"] and store.list(tags=["old"]) == []
        with pytest.raises(InvalidRequest):
            store.set_tags("chat", ["no spaces"])
        with pytest.raises(InvalidRequest):
            store.set_tags("chat", [f"t{i}" for i in range(33)])
        assert store.get("chat").tags == ("a", "b")

    # ------------------------------------------------------------------ paging, counts, the cap per owner
    @staticmethod
    def pages(store, limit: int, **filters) -> list[list[str]]:
        """Every page of a list of ``limit``, followed cursor to cursor: the ids of each (a list that
        never ends fails, after more pages than the store holds sessions)."""
        out, after = [], None
        for _ in range(len(store.list()) + 2):
            page = store.list(limit=limit, after=after, **filters)
            assert len(page) <= limit
            if not page:
                return out
            out.append([info.id for info in page])
            after = page[-1].cursor
        raise AssertionError(f"the pages never end: {out[:4]} ...")

    def test_pages_give_every_session_once_in_order(self, store):
        ids = [f"s{i:02d}" for i in range(11)]
        for sid in ids:
            new_session(store, sid, tags=["even"] if int(sid[1:]) % 2 == 0 else [])
        new_session(store, "b1", owner="bob")
        everything = [info.id for info in store.list(owner="alice")]
        assert everything == ids  # oldest first, as created
        assert self.pages(store, 4, owner="alice") == [ids[0:4], ids[4:8], ids[8:11]]
        assert self.pages(store, 11, owner="alice") == [ids]
        assert sum(self.pages(store, 5), []) == [info.id for info in store.list()] == [*ids, "b1"]
        evens = [sid for sid in ids if int(sid[1:]) % 2 == 0]
        assert self.pages(store, 2, owner="alice", tags=["even"]) == [evens[0:2], evens[2:4], evens[4:6]]
        assert self.pages(store, 3, owner="alice", state="active") == [ids[0:3], ids[3:6], ids[6:9], ids[9:11]]
        assert self.pages(store, 3, owner="alice", state="parked") == []
        assert self.pages(store, 3, owner="bob") == [["b1"]]
        # a cursor is a position, not an owner's: bob's cursor in alice's list goes on from its time
        assert [i.id for i in store.list(owner="alice", after=store.get("b1").cursor)] == []

    def test_pages_survive_sessions_created_and_deleted_between_them(self, store):
        for i in range(6):
            new_session(store, f"s{i}")
        first = store.list(owner="alice", limit=2)
        assert [i.id for i in first] == ["s0", "s1"]
        store.delete("s1", owner="alice")  # the cursor's own session, gone
        store.delete("s2", owner="alice")  # one the next page would have held
        new_session(store, "a-new")  # sorts first by id, comes last by creation
        assert [i.id for i in store.list(owner="alice", after=first[-1].cursor)] == ["s3", "s4", "s5", "a-new"]
        seen = [info.id for info in first]
        after = first[-1].cursor
        for _ in range(10):  # 4 sessions left: 2 pages and an empty one (a list that never ends fails)
            page = store.list(owner="alice", limit=2, after=after)
            if not page:
                break
            seen += [info.id for info in page]
            after = page[-1].cursor
        assert seen == ["s0", "s1", "s3", "s4", "s5", "a-new"] and len(set(seen)) == len(seen)

    @pytest.mark.parametrize(
        "bad",
        [
            "", "x", "not a cursor", "é" * 4, "A" * 401, 7,
            # base64 of what a cursor holds, wrong: a key without its owner, another version, a negative
            # time, a time past 64 bits, a path, padding written out
            *(base64.urlsafe_b64encode(text.encode()).decode().rstrip("=") for text in (
                "1.1.a", "2.1.a~alice", "1.-1.a~alice", f"1.{1 << 64}.a~alice", "1.1.../etc~alice", "1.1.a~alice~x",
            )),
            base64.urlsafe_b64encode(b"1.1.a~alice").decode(),
        ],
    )  # fmt: skip
    def test_a_bad_cursor_is_refused(self, store, bad):
        new_session(store)
        with pytest.raises(InvalidCursor, match="cursor is not one a list of sessions handed out"):
            store.list(after=bad)
        good = store.get("chat").cursor
        with pytest.raises(InvalidCursor):
            store.list(after=good[:-1] + ("A" if good[-1] != "A" else "B"))  # one character changed
        assert store.list(after=good) == []

    @pytest.mark.parametrize("limit", [0, -1, True, 1.5, "10"])
    def test_a_bad_limit_is_refused(self, store, limit):
        with pytest.raises(InvalidRequest, match="limit"):
            store.list(limit=limit)

    def test_counts_follow_every_write(self, store, rows):
        def expected(owner=None):
            infos = store.list(owner=owner)
            by_state = {state: {"sessions": 0, "bytes": 0} for state in ("active", "parked", "damaged")}
            by_tier: dict = {}
            for info in infos:
                for table, name in ((by_state, info.state), (by_tier, info.tier.name)):
                    entry = table.setdefault(name, {"sessions": 0, "bytes": 0})
                    entry["sessions"] += 1
                    entry["bytes"] += info.size_bytes
            return by_state, by_tier

        def check():
            for owner in (None, "alice", "bob", "nobody"):
                counts = store.counts(owner=owner)
                by_state, by_tier = expected(owner)
                assert {k: v.to_dict() for k, v in counts.by_state.items()} == by_state, owner
                assert {k: v.to_dict() for k, v in counts.by_tier.items()} == by_tier, owner
                assert counts.sessions == len(store.list(owner=owner))
            assert store.usage_by_tier() == expected()[1]

        check()
        new_session(store, "a")
        new_session(store, "b", tier=tiers.INT4)
        new_session(store, "c", owner="bob")
        check()
        store.append("a", *compressible(40, 1), owner="alice")
        store.append("c", *rows.make(3), owner="bob")
        check()
        store.fork("a", new_id="f", owner="alice")
        store.truncate("a", 10, owner="alice")
        check()
        if "park" not in self.lacks:
            store.park("f", owner="alice")
            check()
            assert store.counts(owner="alice").by_state["parked"].sessions == 1
        store.delete("b", owner="alice")
        store.delete("c", owner="bob")
        check()
        assert store.counts(owner="bob").sessions == 0 and store.counts(owner="bob").by_tier == {}
        assert store.counts().sessions == 2

    def test_existing_answers_for_one_owner(self, store):
        new_session(store, "a")
        new_session(store, "b", owner="bob")
        assert store.existing(["a", "b", "zzz"], owner="alice") == {"a"}
        assert store.existing(["a", "b"], owner="bob") == {"b"}
        assert store.existing([], owner="alice") == set()
        store.delete("a", owner="alice")
        assert store.existing(["a"], owner="alice") == set()

    def test_the_cap_per_owner_refuses_the_next_create_and_creates_nothing(self, tmp_path, rows):
        with self.make_store(tmp_path / "capped", max_sessions_per_owner=3) as store:
            assert store.max_sessions_per_owner == 3
            for sid in ("a", "b", "c"):
                new_session(store, sid)
            store.append("a", *rows.make(2), owner="alice")
            before = [info.to_dict() for info in store.list()], store.usage()["used_bytes"]
            with pytest.raises(TooManySessions, match=r"'alice' has 3 sessions.*--max-sessions-per-owner 3"):
                new_session(store, "d")
            with pytest.raises(TooManySessions):
                store.fork("a", new_id="d", owner="alice")
            with pytest.raises(TooManySessions):
                store.create("alice", GEOMETRY, tiers.FP8, MODEL)  # a generated id too
            assert ([info.to_dict() for info in store.list()], store.usage()["used_bytes"]) == before
            assert self.stored_image(store, "d", "alice") is None and store.counts(owner="alice").sessions == 3
            # every owner has their own count
            for sid in ("a", "b", "c"):
                new_session(store, sid, owner="bob")
            with pytest.raises(TooManySessions, match="'bob' has 3"):
                new_session(store, "d", owner="bob")
            # a delete frees a place at once
            store.delete("b", owner="alice")
            assert new_session(store, "d").id == "d"
            with pytest.raises(TooManySessions):
                store.fork("d", new_id="e", owner="alice")
            assert store.counts(owner="alice").sessions == 3 and store.counts(owner="bob").sessions == 3
        with pytest.raises(InvalidRequest, match="max_sessions_per_owner"):
            self.make_store(tmp_path / "bad", max_sessions_per_owner=0)

    def test_the_cap_holds_under_concurrent_creates(self, tmp_path):
        with self.make_store(tmp_path / "capped", max_sessions_per_owner=5) as store:
            outcomes: list[str] = []
            lock = threading.Lock()

            def create(i: int) -> None:
                try:
                    new_session(store, f"s{i}")
                    result = "made"
                except TooManySessions:
                    result = "refused"
                with lock:
                    outcomes.append(result)

            threads = [threading.Thread(target=create, args=(i,)) for i in range(12)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert sorted(outcomes) == ["made"] * 5 + ["refused"] * 7
            assert len(store.list(owner="alice")) == 5 == store.counts(owner="alice").sessions

    # ------------------------------------------------------------------ append / resume / reader
    @pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.describe())
    def test_append_resume_round_trip(self, store, rows, tier):
        new_session(store, tier=tier)
        first, second = rows.make(5), rows.make(3)
        result = store.append("chat", *first)
        assert (result.appended, result.turn, result.info.watermark) == (5, (0, 5), 5)
        raw = rows.encode(tier, second)
        result = store.append_records("chat", raw)
        assert (result.info.n_records, result.info.watermark) == (8, 8)
        assert self.body(store, "chat") == rows.encode(tier, first) + raw
        resumed = store.resume("chat")
        assert resumed.reused_tokens == 8 and resumed.records.tier == tier
        assert resumed.records.record_bytes() == rows.encode(tier, first) + raw
        assert resumed.tokens.tolist() == first[0].tolist() + second[0].tolist()
        L, R, I = resumed.arrays()
        assert L.shape == (2, 8, 32) and R.shape == (2, 8, 8) and I.shape == (1, 8, 4)
        np.testing.assert_array_equal(I[:, :5], first[3])

    def test_resume_trims_to_the_watermark(self, store, rows):
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

    def test_reader_serves_the_watermark_whole_in_chunks_and_in_batches(self, store, rows):
        new_session(store)
        chunks = [rows.make(5), rows.make(4)]
        for chunk in chunks:
            store.append("chat", *chunk)
        store.append("chat", *rows.make(3), complete_turn=False)
        expected = rows.encode(tiers.FP8, *chunks)
        with store.reader("chat") as reader:
            assert (reader.n_records, reader.reused_tokens, reader.verified) == (9, 9, False)
            assert reader.body_bytes == len(expected) == 9 * reader.record_bytes
            assert reader.load().record_bytes() == expected
            assert b"".join(reader.iter_bytes(chunk_bytes=2 * reader.record_bytes + 1)) == expected
            # whole chunks of what was asked, across turns too: the first chunk, which a server reads
            # before its answer starts, holds that many records whatever the turns' sizes
            sizes = [
                len(chunk) // reader.record_bytes for chunk in reader.iter_bytes(chunk_bytes=6 * reader.record_bytes)
            ]
            assert sizes == [6, 3]
            batches = list(reader.iter_batches(4))
            assert [b.n for b in batches] == [4, 4, 1] and b"".join(b.record_bytes() for b in batches) == expected
            image = reader.header_bytes() + b"".join(reader.iter_bytes())
        records = coli_kv.parse(image)
        assert records.n == 9 and records.record_bytes() == expected and records.problems.messages() == []

    def test_bad_uploads_change_nothing(self, store, rows):
        new_session(store)
        store.append("chat", *rows.make(3))
        before = self.stored_image(store, "chat")
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
        with pytest.raises(FormatError):
            store.append_records("chat", rows.encode(tiers.INT4, rows.make(3)))  # another tier's records
        assert self.stored_image(store, "chat") == before
        info = store.get("chat")
        assert (info.n_records, info.watermark) == (3, 3)
        assert store.verify("chat").ok

    @pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.describe())
    def test_nonfinite_rows_are_counted_the_same_in_every_tier_or_refused(self, store, rows, tier):
        new_session(store, tier=tier)
        tokens, L, R, I = rows.make(4)
        L[1, 2, 3], I[0, 1, 0] = np.nan, np.inf
        result = store.append("chat", tokens, L, R, I)
        assert (result.appended, result.sanitized.values, result.sanitized.first) == (4, 2, (1, "I", 0, 0))
        assert result.sanitized.rows_zeroed == (1 if tier.version == 3 else 0)  # fp8: NaN alone is a 0 code
        dL, dR, dI = store.resume("chat").arrays()
        assert np.isfinite(dL).all() and np.isfinite(dI).all() and dI[0, 1, 0] == 0
        before = self.stored_image(store, "chat")
        with pytest.raises(NonFiniteValues, match="2 non-finite values .*first at record 1, I layer 0, element 0"):
            store.append("chat", tokens, L, R, I, reject_nonfinite=True)
        raw = coli_kv.encode_records(GEOMETRY, tier, *rows.make(2))
        raw["index"][1, 0, 2] = np.nan  # raw records: the indexer rows are f32 in every tier
        with pytest.raises(NonFiniteValues, match="1 non-finite value "):
            store.append_records("chat", raw.tobytes(), reject_nonfinite=True)
        assert self.stored_image(store, "chat") == before and store.get("chat").n_records == 4
        counted = store.append_records("chat", raw.tobytes())
        assert (counted.appended, counted.sanitized.values, counted.sanitized.first) == (2, 1, (1, "I", 0, 2))
        assert store.append("chat", *rows.make(1)).sanitized.values == 0 and store.verify("chat").ok

    def test_fingerprint_is_checked_on_resume(self, store, rows):
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
        for bogus in ({"bogus"}, {"model.weights_hash", "modle.name"}):  # misspelt: refused, never ignored
            with pytest.raises(InvalidRequest, match="cannot override"):
                store.resume("chat", override=bogus)  # no fingerprint stated: refused all the same

    # ------------------------------------------------------------------ truncate
    def test_truncate_mid_turn_rehashes_the_cut_turn(self, store, rows):
        new_session(store)
        first, second = rows.make(6), rows.make(6)
        store.append("chat", *first)
        store.append("chat", *second)
        info = store.truncate("chat", 9)
        assert (info.n_records, info.watermark, info.size_bytes) == (9, 9, HEADER_BYTES + 9 * info.record_bytes)
        assert len(self.stored_image(store, "chat")) == info.size_bytes
        assert self.body(store, "chat") == rows.encode(tiers.FP8, first, second)[: 9 * info.record_bytes]
        report = store.verify("chat")
        assert report.ok and report.turns_checked == 2
        with pytest.raises(InvalidRequest):
            store.truncate("chat", 10)
        with pytest.raises(InvalidRequest):
            store.truncate("chat", -1)
        assert store.truncate("chat", 0).n_records == 0 and store.verify("chat").ok

    def test_truncate_inside_the_incomplete_tail_keeps_the_watermark(self, store, rows):
        new_session(store)
        store.append("chat", *rows.make(4))
        store.append("chat", *rows.make(4), complete_turn=False)
        info = store.truncate("chat", 6)
        assert (info.n_records, info.watermark) == (6, 4)

    # ------------------------------------------------------------------ verify / repair
    def test_verify_finds_a_silent_bit_flip_and_resume_treats_it_as_a_miss(self, store, rows):
        new_session(store)
        for n in (3, 4, 5):
            store.append("chat", *rows.make(n))
        rec_bytes = store.get("chat").record_bytes
        good_bytes = self.body(store, "chat")
        self.flip_stored_byte(store, "chat", code_offset(8, rec_bytes))  # inside the third turn (7..12)
        assert coli_kv.parse(self.stored_image(store, "chat")).problems.messages() == []  # the format cannot see it
        report = store.verify("chat")
        assert not report.ok and report.first_bad == {"turn": 2, "start": 7, "end": 12} and report.good_records == 7
        resumed = store.resume("chat", verify=True)
        assert resumed.reused_tokens == 7 and resumed.damaged_from == 7 and resumed.verified
        assert resumed.records.record_bytes() == good_bytes[: 7 * rec_bytes]
        if self.hashes_every_read:
            with pytest.raises(IntegrityError):
                store.resume("chat")
        else:
            assert store.resume("chat").reused_tokens == 12  # without verify the hash is not consulted

    def test_repair_drops_the_damaged_tail(self, store, rows):
        self.needs("repair")
        new_session(store)
        store.append("chat", *rows.make(3))
        store.append("chat", *rows.make(3))
        store.append("chat", *rows.make(3), complete_turn=False)
        rec_bytes = store.get("chat").record_bytes
        self.flip_stored_byte(store, "chat", code_offset(4, rec_bytes))
        dry = store.repair("chat", dry_run=True)
        assert dry.dry_run and dry.kept_records == 3 and dry.first_bad["turn"] == 1
        assert store.get("chat").n_records == 9
        report = store.repair("chat")
        assert report.kept_records == 3 and report.dropped_records == 6
        info = store.get("chat")
        assert (info.n_records, info.watermark) == (3, 3) and "repaired" in info.problem
        assert store.verify("chat").ok and len(self.stored_image(store, "chat")) == HEADER_BYTES + 3 * rec_bytes
        assert store.repair("chat").actions == []

    # ------------------------------------------------------------------ fork
    def test_fork_copies_the_prefix_and_diverges(self, store, rows):
        new_session(store, tags=["t"])
        first, second = rows.make(5), rows.make(5)
        store.append("chat", *first)
        store.append("chat", *second, complete_turn=False)
        fork = store.fork("chat", new_id="branch")
        assert (fork.n_records, fork.watermark, fork.parent, fork.fork_point, fork.tags) == (5, 5, "chat", 5, ("t",))
        assert self.body(store, "branch") == rows.encode(tiers.FP8, first)
        mid = store.fork("chat", at=7, new_id="mid", tags=[])
        assert (mid.n_records, mid.watermark) == (7, 5)
        assert self.body(store, "mid") == self.body(store, "chat")[: 7 * mid.record_bytes]
        assert store.verify("mid").ok and store.verify("branch").ok
        store.append("branch", *rows.make(2))
        assert store.get("chat").n_records == 10 and store.get("branch").n_records == 7
        with pytest.raises(InvalidRequest):
            store.fork("chat", at=11)
        with pytest.raises(SessionExists):
            store.fork("chat", new_id="mid")

    def test_fork_refuses_to_rehash_a_damaged_turn(self, store, rows):
        new_session(store)
        store.append("chat", *rows.make(6))
        self.flip_stored_byte(store, "chat", code_offset(5, store.get("chat").record_bytes))
        with pytest.raises(IntegrityError):
            store.fork("chat", at=3, new_id="f")
        assert [s.id for s in store.list()] == ["chat"] and self.stored_image(store, "f") is None

    # ------------------------------------------------------------------ prefix lookup
    def test_prefix_lookup_finds_the_longest_common_prefix(self, store, rows):
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

    def test_prefix_lookup_ignores_the_incomplete_tail(self, store, rows):
        fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
        tokens = rows.rng.integers(0, 1000, 200).astype(np.int32)
        new_session(store)
        store.append("chat", *rows.make(100, tokens[:100]))
        store.append("chat", *rows.make(100, tokens[100:]), complete_turn=False)
        assert store.lookup("alice", fingerprint, tokens).matched_tokens == 100
        store.append_records("chat", b"", complete_turn=True)
        assert store.lookup("alice", fingerprint, tokens).matched_tokens == 200

    def test_prefix_lookup_sees_parked_sessions(self, store, rows):
        self.needs("park")
        fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
        tokens = rows.rng.integers(0, 1000, 200).astype(np.int32)
        new_session(store)
        store.append("chat", *rows.make(200, tokens))
        store.park("chat")
        hit = store.lookup("alice", fingerprint, tokens)
        assert (hit.matched_tokens, hit.state) == (200, "parked")

    # ------------------------------------------------------------------ park / unpark
    @pytest.mark.parametrize("tier", [tiers.F32, tiers.BF16, tiers.FP8, tiers.polar(4)], ids=lambda t: t.describe())
    def test_park_round_trip_is_byte_exact(self, store, rows, tier):
        self.needs("park")
        new_session(store, tier=tier)
        store.append("chat", *rows.make(40))
        store.append("chat", *rows.make(9), complete_turn=False)
        image = self.stored_image(store, "chat")
        seen = []
        parked = store.park("chat", progress=lambda done, total: seen.append((done, total)))
        assert parked.state == "parked" and store.get("chat").state == "parked"
        assert parked.size_bytes == store.usage()["used_bytes"] == self.held_bytes(store)
        assert seen[-1] == (len(image), len(image)) and seen == sorted(seen)
        assert self.stored_image(store, "chat") == image
        assert store.verify("chat").ok  # verify reads the parked session without unparking
        assert store.get("chat").state == "parked"
        assert store.park("chat").state == "parked"
        unparked = store.unpark("chat")
        assert unparked.state == "active" and self.stored_image(store, "chat") == image
        assert (unparked.n_records, unparked.watermark) == (49, 40)
        assert unparked.size_bytes == store.usage()["used_bytes"] == self.held_bytes(store) == len(image)
        assert store.unpark("chat").state == "active"

    def test_resume_and_append_unpark_transparently(self, store, rows):
        self.needs("park")
        new_session(store)
        first = rows.make(5)
        store.append("chat", *first)
        store.park("chat")
        assert store.resume("chat").tokens.tolist() == first[0].tolist()
        assert store.get("chat").state == "active"
        store.park("chat")
        assert store.append("chat", *rows.make(2)).info.n_records == 7

    # ------------------------------------------------------------------ migrate / inspect / delete
    def test_migrate_rewrites_the_journal_and_its_hashes(self, store, rows):
        self.needs("migrate")
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
        assert resumed.records.tier == tiers.INT4
        assert resumed.tokens.tolist() == np.concatenate([c[0] for c in chunks]).tolist()
        fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.INT4)
        assert store.lookup("alice", fingerprint, resumed.tokens).matched_tokens == 730
        with pytest.raises(FingerprintMismatch):
            store.resume("chat", expect=Fingerprint(fingerprint.model, GEOMETRY, tiers.FP8))
        assert store.migrate("chat", tiers.INT4).tier == tiers.INT4  # already there: nothing to do

    def test_migrate_refuses_a_damaged_session(self, store, rows):
        self.needs("migrate")
        new_session(store)
        store.append("chat", *rows.make(4))
        self.flip_stored_byte(store, "chat", code_offset(1, store.get("chat").record_bytes))
        before = self.stored_image(store, "chat")
        with pytest.raises(IntegrityError, match="repair"):
            store.migrate("chat", tiers.F32)
        assert self.stored_image(store, "chat") == before and store.get("chat").tier == tiers.FP8

    def test_inspect_reports_the_file(self, store, rows):
        new_session(store)
        store.append("chat", *rows.make(3))
        report = store.inspect("chat")
        assert report["header"]["nrec"] == 3 and report["header"]["version"] == 2
        assert report["loadable_records"] == 3 and report["problems"] == [] and report["turns"] == 1
        assert report["session"] == store.get("chat").to_dict() | {"last_used": report["session"]["last_used"]}

    def test_inspect_reports_a_parked_session(self, store, rows):
        self.needs("park")
        new_session(store)
        store.append("chat", *rows.make(3))
        store.park("chat")
        parked = store.inspect("chat")
        assert parked["loadable_records"] == 3 and parked["session"]["state"] == "parked"

    def test_delete_removes_files_and_entries(self, store, rows):
        new_session(store)
        store.append("chat", *rows.make(70))
        store.fork("chat", new_id="kept")
        store.delete("chat")
        assert self.stored_image(store, "chat") is None and [s.id for s in store.list()] == ["kept"]
        with pytest.raises(SessionNotFound):
            store.get("chat")
        with pytest.raises(SessionNotFound):
            store.delete("chat")
        fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
        assert store.lookup("alice", fingerprint, store.resume("kept").tokens).session_id == "kept"
        new_session(store, "chat")
        assert store.get("chat").n_records == 0
        store.delete("kept")
        assert store.usage()["used_bytes"] == HEADER_BYTES == self.held_bytes(store)

    # ------------------------------------------------------------------ concurrency on one session
    def test_concurrent_writers_on_one_session_never_interleave(self, store):
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
        body = self.body(store, "chat")
        assert len(body) == sum(len(b) for b in encoded.values())
        # the stored records are the eight turns back to back, each whole, in some order
        offset, seen = 0, set()
        while offset < len(body):
            match = next(i for i, b in encoded.items() if i not in seen and body[offset : offset + len(b)] == b)
            seen.add(match)
            offset += len(encoded[match])
        assert seen == set(turns) and store.verify("chat").turns_checked == 8

    def test_readers_during_appends_see_whole_turns(self, store):
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

    # ------------------------------------------------------------------ budget: hard limit and eviction
    def test_hard_limit_refuses_and_writes_nothing(self, tmp_path):
        self.needs("hard_limit")
        limit = HEADER_BYTES + 10 * REC
        rows = Rows(1)
        with self.make_store(tmp_path / "data", hard_limit_bytes=limit) as store:
            new_session(store)
            store.append("chat", *rows.make(6))
            before = self.stored_image(store, "chat")
            with pytest.raises(BudgetExceeded, match="hard limit"):
                store.append("chat", *rows.make(5))
            assert self.stored_image(store, "chat") == before and store.get("chat").n_records == 6
            store.append("chat", *rows.make(4))  # exactly fits
            assert store.usage()["used_bytes"] == limit == self.held_bytes(store)
            with pytest.raises(BudgetExceeded):
                new_session(store, "second")
            with pytest.raises(BudgetExceeded):
                store.fork("chat", new_id="copy")
            assert [s.id for s in store.list()] == ["chat"] and store.usage()["reserved_bytes"] == 0
            assert store.usage()["hard_limit_bytes"] == limit and store.usage()["budget_bytes"] is None

    def test_hard_limit_holds_under_concurrent_threads(self, tmp_path):
        self.needs("hard_limit")
        n_threads, turn = 8, 7
        limit = n_threads * HEADER_BYTES + 61 * turn * REC + REC  # not a multiple of anything the writers write
        with self.make_store(tmp_path / "data", hard_limit_bytes=limit) as store:
            for i in range(n_threads):
                new_session(store, f"s{i}")
            successes = [0] * n_threads
            errors: list[BaseException] = []

            def writer(i: int) -> None:
                rows = Rows(100 + i)
                try:
                    while True:
                        store.append(f"s{i}", *rows.make(turn))
                        successes[i] += 1
                except BudgetExceeded:
                    return
                except BaseException as exc:  # anything else fails the test below
                    errors.append(exc)

            threads = [threading.Thread(target=writer, args=(i,)) for i in range(n_threads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            assert sum(successes) == 61  # every byte that fits was used, none past the limit
            for i in range(n_threads):
                assert store.get(f"s{i}").n_records == successes[i] * turn
            assert store.usage()["used_bytes"] == self.held_bytes(store) <= limit
            assert store.usage()["reserved_bytes"] == 0

    def test_budget_parks_least_recently_used_then_deletes_parked(self, tmp_path):
        self.needs("park")
        data = tmp_path / "data"
        size = HEADER_BYTES + 50 * REC
        with self.make_store(data, budget_bytes=3 * size) as store:
            for seed, sid in enumerate(("a", "b", "c")):
                new_session(store, sid)
                store.append(sid, *compressible(50, seed))
            assert [s.state for s in store.list()] == ["active"] * 3
            store.resume("a")  # a is now more recent than b and c
            new_session(store, "d")  # over budget by one header: b, the least recently used, is parked
            assert {s.id: s.state for s in store.list()} == {"a": "active", "b": "parked", "c": "active", "d": "active"}
            store.append("d", *compressible(50, 9))  # over again: c goes next, a stays
            assert {s.id: s.state for s in store.list()} == {"a": "active", "b": "parked", "c": "parked", "d": "active"}
            assert store.usage()["used_bytes"] <= 3 * size
            assert store.resume("c").reused_tokens == 50  # a parked session resumes: unparked, and a pays
            assert {s.id: s.state for s in store.list()} == {"a": "parked", "b": "parked", "c": "active", "d": "active"}
        with self.make_store(data, budget_bytes=size) as store:
            evicted = store.enforce_budget(keep=["d"])
            # c is the only active one not kept; then the parked ones go, least recently used first
            assert [(e.session_id, e.action) for e in evicted] == [
                ("c", "parked"),
                ("b", "deleted"),
                ("a", "deleted"),
                ("c", "deleted"),
            ]
            assert store.usage()["used_bytes"] <= size
            assert [s.id for s in store.list()] == ["d"] and store.resume("d").reused_tokens == 50

    def test_budget_evicts_the_least_recently_used_first(self, tmp_path):
        # What every backend's eviction does, parking first or not: the least recently used session
        # goes first, the one just resumed and the one just written stay, the store ends in budget.
        size = HEADER_BYTES + 50 * REC
        with self.make_store(tmp_path / "data", budget_bytes=3 * size) as store:
            for seed, sid in enumerate(("a", "b", "c")):
                new_session(store, sid)
                store.append(sid, *compressible(50, seed))
            assert [s.state for s in store.list()] == ["active"] * 3 and store.usage()["used_bytes"] == 3 * size
            store.resume("a")  # a is now more recent than b and c
            new_session(store, "d")
            store.append("d", *compressible(50, 9))
            states = {s.id: s.state for s in store.list()}
            assert states.get("b") != "active" and states["a"] == states["d"] == "active"
            assert store.usage()["used_bytes"] <= 3 * size and store.usage()["used_bytes"] == self.held_bytes(store)
            assert store.resume("a").reused_tokens == store.resume("d").reused_tokens == 50
            assert store.enforce_budget() == []  # within budget: nothing more to evict

    def test_limits_are_validated(self, tmp_path):
        for limits in ({"budget_bytes": -1}, {"hard_limit_bytes": 1.5}, {"budget_bytes": "1G"}):
            with pytest.raises(InvalidRequest):
                self.make_store(tmp_path / "data", **limits)
        with self.make_store(tmp_path / "data") as store:
            assert store.enforce_budget() == []  # no budget: nothing to evict

    # ------------------------------------------------------------------ the interface, as declared
    def test_the_backend_keeps_the_interface(self, store):
        # every method and property of the interface, with its parameters (names, kinds, defaults,
        # annotations); the factory gives this backend; its capabilities are known names
        drift = interface_drift(self.backend)
        assert not drift, "the backend drifted from kvstore.store.Store:\n" + "\n".join(drift)
        assert isinstance(store, self.backend) and isinstance(store, Store)
        assert self.backend.capabilities <= set(CAPABILITIES)
        assert all(self.backend.supports(name) == (name not in self.lacks) for name in CAPABILITIES)
        with pytest.raises(InvalidRequest, match="unknown store capability"):
            self.backend.supports("teleport")

    def test_a_drifted_signature_is_reported(self):
        # The check above must be able to fail: plant a renamed parameter, a changed default, a
        # property turned method and an abstract method left unimplemented in a subclass.
        interface_migrate = Store.__dict__["migrate"]

        class Drifted(self.backend):  # type: ignore[misc, valid-type]
            def migrate(self, session_id, tier, *, who=None, progress=None):  # owner renamed
                raise AssertionError("never called")

            def get(self, session_id, *, owner="alice"):  # another default
                raise AssertionError("never called")

            def lock_timeout(self):  # a property in the interface
                raise AssertionError("never called")

            inspect = Store.__dict__["inspect"]  # abstract again: not implemented

        found = interface_drift(Drifted)
        assert any(line.startswith("Drifted.migrate(") and "owner" in line for line in found), found
        assert any(line.startswith("Drifted.get(") for line in found), found
        assert "Drifted.lock_timeout: a property in Store, not here" in found, found
        assert "Drifted.inspect: missing" in found, found
        assert len(found) == 4, found
        assert list(inspect.signature(interface_migrate).parameters)[3] == "owner"

    # ------------------------------------------------------------------ what a backend lacks
    def test_lacked_operations_raise_a_typed_error(self, store, rows, tmp_path):
        if not self.lacks:
            pytest.skip(f"{type(self).__name__} has every operation of the suite")
        new_session(store)
        store.append("chat", *rows.make(3))
        before, info = self.stored_image(store, "chat"), store.get("chat").to_dict()
        calls = {  # each lacked capability, the calls that need it and the words its error names
            "park": [("park", lambda: store.park("chat")), ("unpark", lambda: store.unpark("chat"))],
            "repair": [
                ("repair", lambda: store.repair("chat")),
                ("repair", lambda: store.repair("chat", dry_run=True)),
            ],
            "migrate": [("migrate", lambda: store.migrate("chat", tiers.INT4))],
            "hard_limit": [("hard limit", lambda: self.make_store(tmp_path / "limited", hard_limit_bytes=1 << 30))],
            "journal_files": [
                ("journal files", lambda: store.journal_path("chat")),
                ("archive files", lambda: store.archive_path("chat")),
            ],
        }
        assert self.lacks <= set(calls), f"unknown capabilities in lacks: {sorted(self.lacks - set(calls))}"
        for name in sorted(self.lacks):
            for words, call in calls[name]:
                with pytest.raises(NotOnSharedStore, match=words):
                    call()
        assert self.stored_image(store, "chat") == before
        assert store.get("chat").to_dict() | {"last_used": info["last_used"]} == info
        assert store.verify("chat").ok
