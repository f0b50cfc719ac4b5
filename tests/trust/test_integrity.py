"""Integrity beyond the format: a silent bit flip in a stored turn is found by the turn hashes, and a
restore with ``verify`` treats the bad turn as a miss — its rows are never served, the conversation
continues from the turns before it, and the next append replaces the damaged tail.

The ``.coli_kv`` format cannot see the flip (an f32 value changed by one bit is a valid value), so
a restore without ``verify`` would attend the corrupt row: the answer after a verified restore must
equal an engine that never saw the damaged turn.
"""

from __future__ import annotations

import pytest

from kvstore.engine.generate import Engine
from kvstore.formats.coli_kv import HEADER_BYTES

TURN = dict(max_new_tokens=3, stop_tokens=())


def _flip(store, session_id: str, record: int) -> None:
    """Flip one bit of a stored L value of ``record`` (past its 4-byte token id)."""
    path = store.journal_path(session_id)
    offset = HEADER_BYTES + record * store.get(session_id).record_bytes + 4 + 2
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("bad_turn", [1, 0])
def test_a_bit_flip_found_by_verify_is_a_miss_never_served(chat, store, tiny, bad_turn):
    first = chat.run("c", [5, 6, 7, 8], create=True, **TURN)
    second = chat.run("c", [9, 10], **TURN)
    history = store.resume("c").tokens.tolist()
    turns = [(0, first.session.n_records), (first.session.n_records, second.session.n_records)]
    start, end = turns[bad_turn]
    _flip(store, "c", start + 1)
    report = store.verify("c")
    assert not report.ok and report.first_bad == {"turn": bad_turn, "start": start, "end": end}

    # the live cache holds the session, but verify re-reads the journal: the damage is a miss
    result = chat.run("c", [11, 12], verify=True, **TURN)
    assert result.source == "journal" and result.damaged_from == start
    assert (result.reused_tokens, result.prefilled_tokens) == (start, 2)
    assert result.dropped_records == second.session.n_records - start
    never_damaged = Engine(tiny[0], tier="f32").generate(history[:start] + [11, 12], **TURN)
    assert result.tokens == never_damaged.tokens
    after = store.verify("c")
    assert after.ok and after.n_records == start + 2 + 3


def test_verify_on_demand_rereads_even_a_live_session_and_serves_nothing_past_the_flip(chat, store):
    chat.run("c", [5, 6, 7, 8], create=True, **TURN)
    n = store.get("c").n_records
    _flip(store, "c", 2)
    assert chat.resume("c").source == "live"  # without verify the live cache is trusted: no read at all
    verified = chat.resume("c", verify=True)
    assert (verified.source, verified.reused_tokens, verified.damaged_from, verified.unserved_records) == (
        "journal",
        0,
        0,
        n,
    )
