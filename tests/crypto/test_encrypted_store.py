"""The embedded store's whole conformance suite on a store encrypted at rest.

The suite is inherited (no test copied): only the hooks that look behind the store's back differ —
the stored image is the sealed journal's plaintext (a damaged frame's bytes decrypted without
checking its tag, as the format's own damage tests need), and a flipped byte is flipped in its
ciphertext. Every read of an encrypted store is authenticated, so it declares ``hashes_every_read``:
a damaged turn is refused (``SealBroken``, an ``IntegrityError``), never served unchecked.

The tests that assert a plaintext journal's exact byte size skip here (a sealed journal adds a
48-byte header and 44 bytes per frame); ``test_encrypted_limits.py`` checks the same limits with
sealed sizes.
"""

from __future__ import annotations

import pytest

import kvstore.store
import store.test_store as plain
from crypto.support import KEK, ciphertext_offset, sealed_image, unauthenticated_image
from kvstore.errors import SealBroken
from kvstore.formats.coli_kv import HEADER_BYTES

SIZE_EXACT = {
    "test_create_get_list_and_filters",
    "test_delete_removes_files_and_entries",
    "test_hard_limit_refuses_and_writes_nothing",
    "test_hard_limit_holds_under_concurrent_threads",
    "test_budget_evicts_the_least_recently_used_first",
    "test_budget_parks_least_recently_used_then_deletes_parked",
    "test_park_round_trip_is_byte_exact",
    "test_truncate_mid_turn_rehashes_the_cut_turn",
}


class TestEncryptedEmbeddedStore(plain.TestEmbeddedStore):
    @property
    def hashes_every_read(self) -> bool:
        return True  # every frame read is authenticated

    @pytest.fixture(autouse=True)
    def _sizes(self, request):
        if request.node.originalname in SIZE_EXACT:
            pytest.skip("asserts a plaintext journal's exact size; test_encrypted_limits.py checks sealed sizes")

    def make_store(self, path, **limits):
        return kvstore.store.open(path, kek=KEK, **limits)

    def stored_image(self, store, session_id, owner=None):
        journals = list(store.journals.glob(f"{session_id}~{owner or '*'}.coli_kv"))
        parked = list(store.archives.glob(f"{session_id}~{owner or '*'}.coli_kv.zst"))
        assert len(journals) + len(parked) <= 1, f"more than one file for {session_id!r}: {journals + parked}"
        found = journals or parked
        if not found:
            return None
        try:
            return sealed_image(store, found[0])
        except SealBroken:
            return unauthenticated_image(store, found[0])

    def flip_stored_byte(self, store, session_id, offset):
        path = store.journal_path(session_id)
        rec_bytes = store.get(session_id).record_bytes
        plain.flip_byte(path, ciphertext_offset(path, offset, rec_bytes))


def test_a_download_in_many_chunks_gives_the_plaintext_bytes_and_stops_at_a_damaged_frame(tmp_path):
    """``iter_bytes`` of an encrypted session decrypts the next chunk while this one is sent: the
    chunks, whatever their size against the frames, are the plaintext store's bytes in order; a
    damaged frame is refused (``SealBroken``) after every chunk before it, never served."""
    from store.support import Rows, new_session

    rows = Rows(3)
    turns = [rows.make(n) for n in (5, 17, 1, 9)]
    with kvstore.store.open(tmp_path / "plain") as clear, kvstore.store.open(tmp_path / "sealed", kek=KEK) as sealed:
        for store in (clear, sealed):
            new_session(store)
            for turn in turns:
                store.append("chat", *turn, owner="alice")
        rec = clear.get("chat").record_bytes
        with clear.reader("chat") as reader:
            expected = b"".join(bytes(c) for c in reader.iter_bytes())
        for chunk_records in (1, 3, 7, 32, 64):
            with sealed.reader("chat") as reader:
                chunks = [bytes(c) for c in reader.iter_bytes(chunk_records * rec)]
            assert b"".join(chunks) == expected
            assert all(len(c) % rec == 0 for c in chunks)
        # the third turn's frame (record 22) damaged: the chunks before the one holding it come —
        # [0, 3), then ending on frames where they can: [3, 5), [5, 8) ... [17, 20) — then the
        # refusal of [20, 23)
        path = sealed.journal_path("chat")
        plain.flip_byte(path, ciphertext_offset(path, HEADER_BYTES + 22 * rec + 5, rec))
        got = []
        with sealed.reader("chat") as reader, pytest.raises(SealBroken):
            for chunk in reader.iter_bytes(3 * rec):
                got.append(bytes(chunk))
        assert b"".join(got) == expected[: len(b"".join(got))]
        assert len(b"".join(got)) == 20 * rec
