"""A turn is stored only onto the conversation it continued.

If another writer changes the session while a turn is generated (a raw append through the API,
say), the turn is refused with ``ConversationMismatch`` and nothing of it is written; the engine
stops trusting its cache for that session, so the next turn restores the session as it now is.
A turn stopped early (a streaming client that left) stores exactly what was generated.
"""

from __future__ import annotations

import pytest

from kvstore.engine.errors import ConversationMismatch
from kvstore.formats import coli_kv

TURN = dict(max_new_tokens=3, stop_tokens=())


def test_a_session_changed_during_the_turn_refuses_the_turn_and_is_restored_next_time(chat, store):
    chat.run("s", [5, 6, 7, 8], create=True, **TURN)
    turn = chat.begin("s", [9, 10], **TURN)
    assert turn.source == "live"
    foreign = coli_kv.load(store.journal_path("s")).records[:2]
    store.append_records("s", foreign)  # another client, mid-turn
    changed = store.get("s")
    with pytest.raises(ConversationMismatch, match="changed while this turn was generated"):
        for _ in turn:
            pass
    assert store.get("s").n_records == changed.n_records and store.verify("s").ok
    assert chat.live_session is None
    after = chat.run("s", [11], **TURN)
    assert (after.source, after.reused_tokens, after.prefilled_tokens) == ("journal", changed.n_records, 1)


def test_a_cancelled_turn_stores_what_was_generated(chat, store):
    chat.run("s", [5, 6, 7, 8], create=True, **TURN)
    before = store.get("s").n_records
    with chat.begin("s", [9, 10], max_new_tokens=50, stop_tokens=()) as turn:
        for seen, _ in enumerate(turn, start=1):
            if seen == 2:
                turn.cancel()
    result = turn.result
    assert result.finish_reason == "cancelled" and len(result.tokens) == 2  # no token after the cancel
    assert result.session.n_records == before + 2 + 2 == result.session.watermark
    assert store.resume("s").tokens[before:].tolist() == [9, 10, *result.tokens]
    nxt = chat.run("s", [12], **TURN)
    assert (nxt.source, nxt.reused_tokens) == ("live", before + 4)


def test_a_turn_closed_before_it_ran_stores_nothing_and_releases_the_engine(chat, store):
    chat.run("s", [5, 6, 7, 8], create=True, **TURN)
    before = store.get("s").n_records
    with chat.begin("s", [9, 10], **TURN) as turn:
        assert turn.reused_tokens == before and turn.prefilled_tokens == 2
    assert turn.result is None and store.get("s").n_records == before
    assert chat.run("s", [9, 10], **TURN).source == "live"  # the lock was released, the cache still the session's


def test_a_turn_found_for_any_owner_is_stored_on_that_owners_session(chat, store):
    # Ids are per owner. A turn begun without an owner continues the one session of that id; if
    # another owner creates the same id meanwhile, the turn still goes to the session it began on
    # (looked up again by id alone, the id would now name two sessions and the turn be lost).
    chat.run("s", [5, 6, 7, 8], create=True, **TURN)
    before = store.get("s")
    with chat.begin("s", [9, 10], **TURN) as turn:
        chat.create_session("bob", "s")  # another owner's "s", mid-turn
        tokens = list(turn)
    assert turn.result.session.owner == before.owner == "default"
    assert store.get("s", owner="default").n_records == before.n_records + 2 + len(tokens)
    assert store.get("s", owner="bob").n_records == 0
    assert store.verify("s", owner="default").ok
