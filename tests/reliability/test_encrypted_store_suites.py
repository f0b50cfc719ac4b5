"""The store's crash, fault, power-loss, hostile-file and regression suites, again on stores
encrypted at rest.

Every test of those modules is collected here a second time (imported, not copied) with
``KVSTORE_ENCRYPT=1`` and a KEK in ``KVSTORE_KEK``: each ``SessionStore`` they open — in this
process and in the children they kill — is created encrypted (``kvstore.crypto.keyring.open_keyring``
reads the configuration), so every journal, archive and fork they write is sealed
(``kvstore.sealed``), and every check they make (nothing acknowledged is lost, nothing torn is
served, nothing hostile is read as rows) holds for the sealed journal too.
"""

from __future__ import annotations

import pytest

from kvstore import config
from reliability.test_hostile_files import *  # noqa: F403
from reliability.test_power_loss import *  # noqa: F403
from reliability.test_store_crash import *  # noqa: F403
from reliability.test_store_faults import *  # noqa: F403
from reliability.test_store_regressions import *  # noqa: F403

KEK_HEX = "00112233445566778899aabbccddeeff" * 2


@pytest.fixture(autouse=True)
def encrypted_at_rest(monkeypatch):
    monkeypatch.setenv(config.ENCRYPT.name, "1")
    monkeypatch.setenv(config.KEK.name, KEK_HEX)
    monkeypatch.delenv(config.KEK_FILE.name, raising=False)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """test_store_faults' template store, created encrypted (it is built once per module, before
    the autouse fixture above runs)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(config.ENCRYPT.name, "1")
        patch.setenv(config.KEK.name, KEK_HEX)
        root = tmp_path_factory.mktemp("faults") / "template"
        return root, build_template(root)  # noqa: F405
