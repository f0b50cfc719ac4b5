"""The expiry suite (``tests/conformance/expiry.py``) on an embedded store encrypted at rest: an
expired session's sealed journal and archive go as a delete's do, and the sweep keeps one in use."""

from __future__ import annotations

import kvstore.store
import store.test_expiry as plain
from crypto.support import KEK


class TestEncryptedEmbeddedExpiry(plain.TestEmbeddedExpiry):
    def make_store(self, path):
        return kvstore.store.open(path, kek=KEK)
