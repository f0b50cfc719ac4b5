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
