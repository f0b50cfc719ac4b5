"""The embedded store (LMDB index + journals in a local folder) on a real LMDB environment in tmp_path.

``TestEmbeddedStore`` runs the whole conformance suite (``tests/conformance/store.py``); the tests
below it are about what only this backend has: its folders and file modes, journal and archive
files, symbolic links, torn journal tails.
"""

from __future__ import annotations

import os
import stat

import pytest

import kvstore.store
from conformance.store import StoreConformance
from kvstore import tiers
from kvstore.errors import CodecMismatch, IntegrityError, PathRefused
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.journal import KVFile
from kvstore.store import SessionStore, archive
from store.support import files_bytes, new_session


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x01]))


class TestEmbeddedStore(StoreConformance):
    backend = SessionStore

    def make_store(self, path, **limits) -> SessionStore:
        return kvstore.store.open(path, **limits)

    def stored_image(self, store, session_id, owner=None):
        # Whatever files the folder holds for that id (indexed or not), named <id>~<owner>.
        journals = list(store.journals.glob(f"{session_id}~{owner or '*'}.coli_kv"))
        parked = list(store.archives.glob(f"{session_id}~{owner or '*'}.coli_kv.zst"))
        assert len(journals) + len(parked) <= 1, f"more than one file for {session_id!r}: {journals + parked}"
        if journals:
            return journals[0].read_bytes()
        if parked:
            return b"".join(archive.stream_archive(parked[0]))
        return None

    def flip_stored_byte(self, store, session_id, offset):
        flip_byte(store.journal_path(session_id), offset)

    def held_bytes(self, store):
        return files_bytes(store.data_dir)


# ------------------------------------------------------------------ folders, files, links
def test_layout_and_permissions(store, tmp_path):
    new_session(store)
    for name in ("index", "journals", "archive", "locks", "lost+found"):
        assert stat.S_IMODE(os.stat(tmp_path / "data" / name).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.journal_path("chat")).st_mode) == 0o600
    for entry in os.scandir(tmp_path / "data" / "index"):
        assert stat.S_IMODE(entry.stat().st_mode) == 0o600


def test_park_moves_the_journal_into_an_owner_only_archive(store, rows):
    new_session(store)
    store.append("chat", *rows.make(40))
    journal_bytes = store.journal_path("chat").read_bytes()
    parked = store.park("chat")
    assert not store.journal_path("chat").exists()
    assert parked.size_bytes == store.archive_path("chat").stat().st_size == store.usage()["used_bytes"]
    assert stat.S_IMODE(store.archive_path("chat").stat().st_mode) == 0o600
    assert store.inspect("chat")["file"]["path"] == "archive/chat~alice.coli_kv.zst"
    store.unpark("chat")
    assert not store.archive_path("chat").exists()
    assert store.journal_path("chat").read_bytes() == journal_bytes
    assert store.inspect("chat")["file"] == {"path": "journals/chat~alice.coli_kv", "bytes": len(journal_bytes)}


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


def test_repair_cuts_a_torn_tail(store, rows):
    new_session(store)
    store.append("chat", *rows.make(3))
    with open(store.journal_path("chat"), "ab") as f:
        f.write(b"\x07" * 11)
    report = store.repair("chat")
    assert report.actions == ["cut 11 bytes past the last committed record"] and report.kept_records == 3
    assert store.journal_path("chat").stat().st_size == HEADER_BYTES + 3 * store.get("chat").record_bytes


def test_symlinks_out_of_the_store_are_refused(tmp_path, rows):
    outside = tmp_path / "outside.coli_kv"
    with SessionStore(tmp_path / "data") as store:
        new_session(store)
        store.append("chat", *rows.make(2))
        os.replace(store.journal_path("chat"), outside)
        os.symlink(outside, tmp_path / "data" / "journals" / "chat~alice.coli_kv")
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


def test_a_symlinked_lock_file_is_refused(store, tmp_path):
    new_session(store)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, store.locks / "linked~alice.write")
    with pytest.raises(PathRefused, match="symbolic link"):
        new_session(store, "linked")
    assert [s.id for s in store.list()] == ["chat"] and target.read_bytes() == b""


def test_a_journal_is_not_reloaded_under_another_tier(store, rows):
    new_session(store, tier=tiers.FP8)
    store.append("chat", *rows.make(3))
    with pytest.raises(CodecMismatch):
        KVFile.open(store.journal_path("chat"), tier=tiers.INT4)
    assert store.get("chat").n_records == 3
