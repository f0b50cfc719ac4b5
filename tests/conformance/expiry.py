"""Expiry, the same on every session-store backend (issue 41, item 4): subclass, implement the hooks.

A backend's test module subclasses :class:`ExpiryConformance`, names the backend
(:attr:`ExpiryConformance.backend`) and implements :meth:`make_store`, :meth:`age` (time passing
for one session: its last use moved back, as a clock moved on would leave it) and
:meth:`stored_units` (what the backend holds for a session: files, or segment objects). No test
sleeps or times anything: a session expires because the test moved its last use back past its TTL.

What is checked: a TTL set at create, changed and dropped later; an owner's default for sessions
without one; expiry counted from the last use (an append or a resume pushes it back); an expired
session is gone to get, list, append, resume and lookup before the sweep runs, and its id can be
created again; the sweep deletes what a delete deletes, in batches of ``limit``, counts it in the
stats, and keeps a session in use or used again since it was found expired.
"""

from __future__ import annotations

import abc
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from kvstore import tiers
from kvstore.errors import InvalidRequest, SessionNotFound
from kvstore.store import Fingerprint, ModelInfo, Store
from store.support import GEOMETRY, MODEL, Rows, new_session

HOUR = 3600.0


class ExpiryConformance(abc.ABC):
    """Subclass as ``class Test<Backend>Expiry(ExpiryConformance)`` and implement the hooks."""

    backend: ClassVar[type[Store]]

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def make_store(self, path: Path) -> Any:
        """Open (or create) the store kept under ``path``."""

    @abc.abstractmethod
    def age(self, store: Any, session_id: str, owner: str, seconds: float) -> None:
        """Move the session's last use ``seconds`` back, behind the store's back (the store then
        sees that much time passed since it was used; its expiry moves back with it)."""

    @abc.abstractmethod
    def stored_units(self, store: Any, session_id: str, owner: str) -> int:
        """How many things the backend stores for the session (files, objects, index rows)."""

    @abc.abstractmethod
    def hold(self, store: Any, session_id: str, owner: str) -> Any:
        """A context manager holding the session the way a writer in progress does (its write lock,
        or its lease), from another holder than ``store``."""

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture
    def store(self, tmp_path):
        with self.make_store(tmp_path / "data") as opened:
            yield opened

    # ------------------------------------------------------------------ setting a TTL
    def test_a_ttl_is_set_at_create_changed_and_dropped(self, store):
        info = new_session(store, "chat", ttl_s=HOUR)
        assert info.ttl_s == HOUR and info.expires_at == pytest.approx(info.last_used + HOUR, abs=1e-3)
        assert store.get("chat").to_dict()["ttl_s"] == HOUR
        changed = store.set_ttl("chat", 2 * HOUR, owner="alice")
        assert changed.ttl_s == 2 * HOUR and changed.expires_at == pytest.approx(changed.last_used + 2 * HOUR, abs=1e-3)
        assert changed.last_used >= info.last_used  # a change counts as a use: it expires 2 h from now
        dropped = store.set_ttl("chat", None, owner="alice")
        assert dropped.ttl_s is None and dropped.expires_at is None
        plain = new_session(store, "plain")
        assert plain.ttl_s is None and plain.expires_at is None
        for bad in (0, -1, float("nan"), float("inf"), "1h", True, 1e12):
            with pytest.raises(InvalidRequest):
                store.set_ttl("chat", bad, owner="alice")
            with pytest.raises(InvalidRequest):
                new_session(store, "never", ttl_s=bad)
        assert {s.id for s in store.list(owner="alice")} == {"chat", "plain"}  # a refused create made nothing
        with pytest.raises(SessionNotFound):
            store.set_ttl("chat", HOUR, owner="bob")

    def test_an_owner_ttl_applies_to_sessions_without_their_own(self, store):
        own = new_session(store, "own", ttl_s=10 * HOUR)
        plain = new_session(store, "plain")
        new_session(store, "other", owner="bob")
        assert store.owner_ttl("alice") is None
        assert store.set_owner_ttl("alice", HOUR) == 1  # "plain": "own" keeps its own
        assert store.owner_ttl("alice") == HOUR and store.owner_ttl("bob") is None
        assert store.get("plain").expires_at == pytest.approx(plain.last_used + HOUR, abs=1e-3)
        assert store.get("own").expires_at == pytest.approx(own.last_used + 10 * HOUR, abs=1e-3)
        assert store.get("other").expires_at is None
        later = new_session(store, "later")  # a new session of the owner takes it too
        assert later.ttl_s is None and later.expires_at == pytest.approx(later.last_used + HOUR, abs=1e-3)
        self.age(store, "plain", "alice", 2 * HOUR)
        with pytest.raises(SessionNotFound):
            store.get("plain")
        assert store.set_owner_ttl("alice", None) == 1  # "later" ("plain" expired: gone)
        assert store.get("later").expires_at is None and store.get("own").ttl_s == 10 * HOUR
        with pytest.raises(InvalidRequest):
            store.set_owner_ttl("alice", 0)
        with pytest.raises(InvalidRequest):
            store.set_owner_ttl("not an owner!", HOUR)

    # ------------------------------------------------------------------ what expired means
    def test_expiry_counts_from_the_last_use(self, store):
        rows = Rows(2)
        new_session(store, "chat", ttl_s=HOUR)
        store.append("chat", *rows.make(4))
        self.age(store, "chat", "alice", 0.75 * HOUR)
        store.append("chat", *rows.make(3))  # a use: the hour starts again
        self.age(store, "chat", "alice", 0.75 * HOUR)
        assert store.resume("chat").reused_tokens == 7  # 45 min since the append: alive, and used again
        self.age(store, "chat", "alice", 0.75 * HOUR)
        assert store.get("chat").n_records == 7
        self.age(store, "chat", "alice", 0.5 * HOUR)  # 75 min since the resume
        with pytest.raises(SessionNotFound):
            store.get("chat")

    def test_an_expired_session_is_gone_before_the_sweep(self, store):
        rows = Rows(3)
        tokens = np.arange(130, dtype=np.int32)
        new_session(store, "chat", ttl_s=HOUR, tags=["t"])
        store.append("chat", *rows.make(130, tokens=tokens))
        new_session(store, "kept")
        fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
        assert store.lookup("alice", fingerprint, tokens) is not None
        self.age(store, "chat", "alice", 2 * HOUR)
        calls = {
            "get": lambda: store.get("chat", owner="alice"),
            "get any owner": lambda: store.get("chat"),
            "resume": lambda: store.resume("chat", owner="alice"),
            "append": lambda: store.append("chat", *rows.make(1), owner="alice"),
            "truncate": lambda: store.truncate("chat", 1, owner="alice"),
            "fork": lambda: store.fork("chat", new_id="copy", owner="alice"),
            "tags": lambda: store.set_tags("chat", ["u"], owner="alice"),
            "ttl": lambda: store.set_ttl("chat", HOUR, owner="alice"),
            "verify": lambda: store.verify("chat", owner="alice"),
        }
        for name, call in calls.items():
            with pytest.raises(SessionNotFound):
                call()
                pytest.fail(f"{name} of an expired session answered")
        assert [s.id for s in store.list(owner="alice")] == ["kept"]
        assert [s.id for s in store.list()] == ["kept"] and store.list(tags=["t"]) == []
        assert store.existing(["chat", "kept"], owner="alice") == {"kept"}
        assert store.lookup("alice", fingerprint, tokens) is None
        assert self.stored_units(store, "chat", "alice") > 0  # not swept yet: only invisible
        again = new_session(store, "chat")  # the id is free again: the expired one goes first
        assert again.n_records == 0 and again.ttl_s is None
        assert store.resume("chat").reused_tokens == 0
        store.append("kept", *rows.make(3))
        new_session(store, "old", ttl_s=HOUR)
        self.age(store, "old", "alice", 2 * HOUR)
        forked = store.fork("kept", new_id="old", owner="alice")  # a fork into an expired id, too
        assert forked.n_records == 3 and forked.ttl_s is None and store.resume("old").reused_tokens == 3
        new_session(store, "gone", ttl_s=HOUR)
        store.append("gone", *rows.make(2))
        self.age(store, "gone", "alice", 2 * HOUR)
        store.delete("gone", owner="alice")  # a delete of an expired session removes what is left
        assert self.stored_units(store, "gone", "alice") == 0

    # ------------------------------------------------------------------ the sweep
    def test_the_sweep_deletes_expired_sessions_in_batches(self, store):
        rows = Rows(4)
        for n in range(5):
            new_session(store, f"s{n}", ttl_s=HOUR)
            store.append(f"s{n}", *rows.make(3))
        new_session(store, "forever")
        new_session(store, "fresh", ttl_s=HOUR)
        before = store.stats.snapshot()
        assert store.expire() == []  # nothing expired yet
        held = {f"s{n}": store.get(f"s{n}").size_bytes for n in range(5)}
        for n in range(5):
            self.age(store, f"s{n}", "alice", HOUR + 60 * (5 - n))  # s0 expired first
        first = store.expire(limit=2)
        assert [(e.session_id, e.owner) for e in first] == [("s0", "alice"), ("s1", "alice")]
        assert all(e.freed_bytes == held[e.session_id] for e in first)
        assert first[0].expired_at <= first[1].expired_at <= time.time()
        rest = store.expire(limit=100)
        assert [e.session_id for e in rest] == ["s2", "s3", "s4"]
        assert store.expire() == []
        for n in range(5):
            assert self.stored_units(store, f"s{n}", "alice") == 0
        assert {s.id for s in store.list()} == {"forever", "fresh"}
        after = store.stats.snapshot()
        assert after.expired - before.expired == 5
        assert after.expired_bytes - before.expired_bytes == sum(held.values())
        assert store.usage()["used_bytes"] == sum(s.size_bytes for s in store.list())
        assert store.counts().sessions == 2
        with pytest.raises(InvalidRequest):
            store.expire(limit=0)

    def test_the_sweep_keeps_a_session_in_use_or_used_again(self, store):
        rows = Rows(5)
        for name in ("busy", "used"):
            new_session(store, name, ttl_s=HOUR)
            store.append(name, *rows.make(2))
            self.age(store, name, "alice", 2 * HOUR)
        with self.hold(store, "busy", "alice"):
            swept = store.expire()
        assert [e.session_id for e in swept] == ["used"]
        assert self.stored_units(store, "busy", "alice") > 0  # held by a writer: left for a later sweep
        assert [e.session_id for e in store.expire()] == ["busy"]  # released: swept

        # found expired, then used again before the sweep re-read it under its lock: kept
        new_session(store, "raced", ttl_s=HOUR)
        store.append("raced", *rows.make(2))
        self.age(store, "raced", "alice", 2 * HOUR)
        self.revive_during_sweep(store, "raced", "alice")
        assert store.expire() == []
        assert store.get("raced").n_records == 2 and self.stored_units(store, "raced", "alice") > 0

    def revive_during_sweep(self, store: Any, session_id: str, owner: str) -> None:
        """Arrange that the next sweep finds ``session_id`` expired, and that its TTL is extended
        after the sweep read the expired list and before it deletes: default, through the hook
        :meth:`between_find_and_delete` the backend's sweep calls."""
        self.between_find_and_delete(store, lambda: self.age(store, session_id, owner, -2 * HOUR))

    def between_find_and_delete(self, store: Any, action) -> None:
        """Make the store's next sweep run ``action()`` after it found the expired sessions and
        before it takes the first one's lock: both backends' sweeps find them through
        ``store.index.expired_keys``, patched here for this store only."""
        index = store.index
        found = index.expired_keys

        def then_act(*args, **kwargs):
            keys = found(*args, **kwargs)
            action()
            return keys

        index.expired_keys = then_act
