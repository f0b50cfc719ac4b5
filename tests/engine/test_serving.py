"""Many conversations through one ``SessionEngine``: resident sessions, the host tier, concurrent turns.

A turn on a resident session restores nothing (``live``); a session that left the device comes
back from the host tier (``host``: one copy) or the journal (``journal``), and every path gives the
same tokens; turns of many sessions in flight at once each get what they get alone; two turns on
one session never overlap. Real store, real model folder, CPU, f32.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.engine.fingerprint import folder_model_info
from kvstore.engine.generate import Engine
from kvstore.engine.scheduler import SchedulerLimits
from kvstore.engine.session import SessionEngine
from kvstore.engine.tokenizer import load_tokenizer
from kvstore.engine.weights import load_model, write_random_model
from kvstore.store import SessionStore

TURN = dict(max_new_tokens=4, stop_tokens=())


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_model(tiny_folder), load_tokenizer(tiny_folder)


def chat_on(store, folder, loaded, **options) -> SessionEngine:
    model, tokenizer = loaded
    return SessionEngine(Engine(model, tokenizer=tokenizer), store, folder_model_info(folder), folder=folder, **options)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 500, int(rng.integers(2, 30))).tolist() for _ in range(n)]


def conversation(chat: SessionEngine, session_id: str, turns: list[list[int]]) -> list:
    results = [chat.run(session_id, turns[0], create=True, **TURN)]
    results += [chat.run(session_id, ids, **TURN) for ids in turns[1:]]
    return results


def test_resident_sessions_resume_with_nothing_restored(tmp_path, tiny_folder, tiny):
    with SessionStore(tmp_path / "data") as store:
        chat = chat_on(store, tiny_folder, tiny)
        try:
            turns = prompts(3, seed=1)
            for sid in ("s1", "s2", "s3"):
                chat.run(sid, turns[0], create=True, **TURN)
            again = chat.run("s1", turns[1], **TURN)
            assert (again.source, again.restored_tokens) == ("live", 0)
            assert chat.pool.usage()["device_sessions"] == 3 and chat.live_session == "s1"
        finally:
            chat.close()
    with SessionStore(tmp_path / "fresh") as store:  # the same conversation, restored at every turn
        chat = chat_on(store, tiny_folder, tiny, pool_bytes=0)
        try:
            chat.run("s1", turns[0], create=True, **TURN)
            chat.run("other", turns[2], create=True, **TURN)
            restored = chat.run("s1", turns[1], **TURN)
            assert restored.source == "journal" and restored.tokens == again.tokens
        finally:
            chat.close()


@pytest.mark.parametrize("host_bytes", [1 << 30, 0], ids=["host", "journal"])
def test_a_session_that_left_the_device_comes_back_with_the_same_rows(tmp_path, tiny_folder, tiny, host_bytes):
    turns = prompts(2, seed=2)
    with SessionStore(tmp_path / "kept") as store:
        chat = chat_on(store, tiny_folder, tiny)
        try:
            kept = conversation(chat, "s", turns)
        finally:
            chat.close()
    with SessionStore(tmp_path / "evicted") as store:
        chat = chat_on(store, tiny_folder, tiny, pool_bytes=0, host_bytes=host_bytes)
        try:
            chat.run("s", turns[0], create=True, **TURN)
            chat.run("other", turns[1], create=True, **TURN)  # the device keeps one idle session: s leaves
            usage = chat.pool.usage()
            assert usage["evicted_to_host" if host_bytes else "evicted"] == 1
            back = chat.run("s", turns[1], **TURN)
        finally:
            chat.close()
    source = "host" if host_bytes else "journal"
    assert (back.source, back.reused_tokens) == (source, kept[0].session.n_records)
    assert back.tokens == kept[1].tokens and back.session.n_records == kept[1].session.n_records


def test_a_session_in_a_turn_stays_resident_and_a_second_turn_on_it_waits(tmp_path, tiny_folder, tiny):
    turns = prompts(3, seed=3)
    with SessionStore(tmp_path / "data") as store:
        chat = chat_on(store, tiny_folder, tiny, pool_bytes=0)
        try:
            chat.run("s", turns[0], create=True, **TURN)
            held = chat.begin("s", turns[1], **TURN)
            chat.run("other", turns[2], create=True, **TURN)  # over the budget: s cannot leave, it is in a turn
            assert chat.resident_cache("s") is not None
            order: list[str] = []
            second = threading.Thread(target=lambda: order.append(chat.run("s", [7], **TURN).source))
            second.start()
            second.join(timeout=0.5)
            assert second.is_alive() and order == []  # it waits for the turn holding s
            with held:
                tokens = list(held)
            second.join(timeout=120)
            assert held.result is not None and held.result.source == "live" and tokens == held.result.tokens
            assert order == ["live"]  # then continues s where the first turn left it
            assert store.get("s").n_records == held.result.session.n_records + 1 + TURN["max_new_tokens"]
        finally:
            chat.close()


def test_concurrent_turns_on_many_sessions_each_get_what_they_get_alone(tmp_path, tiny_folder, tiny):
    sessions = {f"s{i}": prompts(2, seed=10 + i) for i in range(8)}
    with SessionStore(tmp_path / "alone") as store:
        chat = chat_on(store, tiny_folder, tiny)
        try:
            alone = {sid: [r.tokens for r in conversation(chat, sid, turns)] for sid, turns in sessions.items()}
        finally:
            chat.close()
    with SessionStore(tmp_path / "together") as store:
        chat = chat_on(store, tiny_folder, tiny, limits=SchedulerLimits(max_batch=8))
        got: dict[str, list] = {}
        errors: list[BaseException] = []

        def converse(sid: str) -> None:
            try:
                got[sid] = [r.tokens for r in conversation(chat, sid, sessions[sid])]
            except BaseException as exc:  # reported below
                errors.append(exc)

        try:
            threads = [threading.Thread(target=converse, args=(sid,)) for sid in sessions]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=300)
            steps = chat.scheduler.counters["steps"]
        finally:
            chat.close()
        assert not errors, errors
        assert got == alone
        assert all(store.verify(sid).ok for sid in sessions)
    assert steps < 8 * 2 * (TURN["max_new_tokens"] + 1)  # the turns shared their decode steps


def test_a_bf16_engine_journals_v4_and_continues_an_f32_session_rewritten_as_v4(tmp_path, tiny_folder, tiny):
    """A bf16 cache's session is stored as bf16 (v4, half the bytes of f32); a session an f32
    engine wrote is continued by a bf16 engine and rewritten as v4 at that turn (its rows were
    rounded to bf16 in the cache anyway); a new process restoring the v4 journal continues as
    the one that kept its rows on the device."""
    model, tokenizer = tiny
    turns = prompts(3, seed=4)

    def bf16_chat(store, **options):
        return SessionEngine(
            Engine(model, tokenizer=tokenizer, tier="bf16"),
            store,
            folder_model_info(tiny_folder),
            folder=tiny_folder,
            **options,
        )

    with SessionStore(tmp_path / "data") as store:
        chat = chat_on(store, tiny_folder, tiny)  # f32
        try:
            chat.run("old", turns[0], create=True, **TURN)
        finally:
            chat.close()
        assert store.get("old", owner="default").tier.name == "f32"
        chat = bf16_chat(store)
        try:
            continued = chat.run("old", turns[1], **TURN)
            assert continued.upgraded == "f32 (v1, f32 values) -> bf16 (v4, bf16 values)"
            fresh = conversation(chat, "new", turns[:2])
        finally:
            chat.close()
        info = store.get("new", owner="default")
        journal = store.journal_path("new", owner="default")
        assert info.tier.name == "bf16" and journal.read_bytes()[:8] == b"COLIKV4\0"
        g = info.geometry
        assert journal.stat().st_size == 40 + info.n_records * (4 + 2 * g.n_layers * (g.kv_lora + g.qk_rope))
        assert store.get("old", owner="default").tier.name == "bf16"
        chat = bf16_chat(store, pool_bytes=0)  # every turn restores from the journal
        try:
            chat.run("other", turns[0], create=True, **TURN)
            restored = chat.run("new", turns[2], **TURN)
        finally:
            chat.close()
    assert restored.source == "journal" and restored.reused_tokens == fresh[1].session.n_records
    with SessionStore(tmp_path / "kept") as store:
        chat = bf16_chat(store)
        try:
            kept = conversation(chat, "new", turns)
        finally:
            chat.close()
    assert restored.tokens == kept[2].tokens
