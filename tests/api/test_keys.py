"""API keys are compared in constant time: every known digest, with hmac.compare_digest, every time."""

from __future__ import annotations

import hmac
import json

from kvstore.api import keys as api_keys
from kvstore.api.keys import KeyTable, key_digest

ENV = "env-key-0123456789abcdef:alice,second-key-0123456789ab:carol"


def test_every_known_digest_is_compared_whatever_the_key(tmp_path, monkeypatch):
    (tmp_path / "keys.json").write_text(
        json.dumps({"keys": [{"owner": "bob", "sha256": key_digest("file-key-0123456789abcdef")}]})
    )
    table = KeyTable(tmp_path, ENV)
    compared = []
    real = hmac.compare_digest

    def counting(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", counting)
    presented = {
        "env-key-0123456789abcdef": "alice",  # the first known digest
        "second-key-0123456789ab": "carol",
        "file-key-0123456789abcdef": "bob",  # the last
        "env-key-0123456789abcdeX": None,  # one character off
        "env-key-0123456789abcde": None,  # a prefix of a real key
        "x" * 8192: None,
    }
    for key, owner in presented.items():
        compared.clear()
        assert table.owner_for(key) == owner
        assert len(compared) == 3 and all(a == key_digest(key).encode() for a, _ in compared), key
