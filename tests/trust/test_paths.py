"""Paths: the store's folders and files stay inside the data folder, symlinks out of it are refused,
and everything kvstore writes is owner-only.

A symlinked ``journals/`` (or ``index/``, ``archive/``) folder is refused when the store opens —
in-process and through ``kvstore chat`` — with nothing written to the link's target. A journal
file replaced by a symlink is refused when a turn restores it and when a turn appends to it (the
session is live), and the link's target is never read into the cache nor written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kvstore.errors import InvalidSessionId, PathRefused
from kvstore.store import SessionStore
from trust.support import assert_same_cache, cache_state, session_engine

TURN = dict(max_new_tokens=3, stop_tokens=())


@pytest.mark.parametrize("folder", ["journals", "index", "archive"])
def test_a_symlinked_store_folder_is_refused_on_open(tmp_path, folder):
    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    (data / folder).symlink_to(outside, target_is_directory=True)
    with pytest.raises(PathRefused, match="symbolic link"):
        SessionStore(data)
    assert list(outside.iterdir()) == []


def test_kvstore_chat_refuses_a_symlinked_journals_folder(tmp_path, tiny_folder):
    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    (data / "journals").symlink_to(outside, target_is_directory=True)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "chat",
            str(tiny_folder),
            "--session",
            "s",
            "--ids",
            "5 6",
            "--data",
            str(data),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "journals is a symbolic link" in done.stderr
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("live", [False, True], ids=["restore", "append"])
def test_a_symlinked_journal_file_is_refused_and_its_target_untouched(chat, store, tmp_path, live):
    chat.run("s", [5, 6, 7], create=True, **TURN)
    if not live:
        chat.run("other", [8, 9], create=True, **TURN)  # the cache holds another session: a turn on s restores
    path = store.journal_path("s")
    target = tmp_path / "elsewhere.coli_kv"
    shutil.copyfile(path, target)
    target_bytes = target.read_bytes()
    path.unlink()
    path.symlink_to(target)
    before = cache_state(chat)
    with pytest.raises(PathRefused, match="symbolic link"):
        chat.run("s", [10], **TURN)
    assert target.read_bytes() == target_bytes
    if not live:  # refused before anything reached the cache
        assert_same_cache(before, cache_state(chat))
        assert chat.live_session == "other"
    else:  # generated, then refused at the append: the cache is no longer trusted as the session's
        assert chat.live_session is None
    assert store.get("s").n_records == 3 + 3


@pytest.mark.parametrize("bad", ["../escape", "a/b", ".hidden", "x" * 65, ""])
def test_session_ids_cannot_name_a_path(chat, bad):
    with pytest.raises(InvalidSessionId):
        chat.run(bad, [5], create=True, **TURN)


def test_every_file_kvstore_writes_is_owner_only(store, tiny_folder, tiny, hash_cache):
    f32 = session_engine(store, tiny_folder, tiny, "f32")
    f32.run("a", [5, 6, 7], create=True, **TURN)
    f32.run("b", [8, 9], create=True, **TURN)
    fp8 = session_engine(store, tiny_folder, tiny, "fp8")
    assert fp8.run("a", [10], **TURN).upgraded  # an atomic rewrite (temp file, rename)
    store.park("b")  # the archive
    assert fp8.run("c", [11], create=True, **TURN).created
    seen = 0
    for root, _folders, files in os.walk(store.data_dir):
        assert os.stat(root).st_mode & 0o777 == 0o700, root
        for name in files:
            mode = os.stat(os.path.join(root, name)).st_mode & 0o777
            assert mode == 0o600, f"{root}/{name} is {oct(mode)}"
            seen += 1
    assert seen >= 8  # journals, their lock sidecars, the archive, the index, the session locks
    weights = hash_cache / "weights"
    assert os.stat(weights).st_mode & 0o777 == 0o700
    assert all(record.stat().st_mode & 0o777 == 0o600 for record in weights.iterdir())
