"""API keys: which owner a request acts for.

Keys are the records of ``<data>/keys.json`` (:mod:`kvstore.keys`, managed with ``kvstore keys
create|list|revoke``) and the keys of the ``KVSTORE_API_KEYS`` variable (``key:owner,...``). When the
file is missing it is created (0600) with one fresh key for owner ``default``, stored only as a
salted digest: the key is shown once, by whoever created the file (``kvstore serve`` prints it once
it listens, and creates no file when ``KVSTORE_API_KEYS`` gives the keys). The file is re-read when it changes, so a new key works and a revoked one is refused
from the next request on. An expired or revoked key gets the same 401 as an unknown one; the log
says why at debug level.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from kvstore import keys as store_keys
from kvstore.errors import ConfigError, PathRefused
from kvstore.keys import KEYS_FILE, KeyFile, Keyring

__all__ = ["KEYS_FILE", "KeyTable", "ensure_keys_file", "key_digest"]

log = logging.getLogger("kvstore.api")


def key_digest(key: str) -> str:
    """The hex SHA-256 of a whole key: the ``sha256`` of a hand-written ``keys.json`` entry."""
    return store_keys.plain_digest(key).hex()


def ensure_keys_file(data_dir: Path) -> str | None:
    """Create ``keys.json`` with a fresh key for owner ``default`` if it is missing; returns that key
    (else None: the file exists, or another process made it first)."""
    created = KeyFile(data_dir).first_key()
    return None if created is None else created[1]


class KeyTable:
    """Maps a presented key to its owner (keys are compared by digest, never stored in clear; see
    :class:`kvstore.keys.Keyring` for why the check takes the same time whatever the key)."""

    def __init__(self, data_dir: Path, env_value: str | None):
        self.file = KeyFile(data_dir)
        self.path = self.file.path
        self._env = store_keys.env_records(env_value)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int, int] | None = None
        self._read_once = False
        self._ring = Keyring(self._env)
        self._reload()

    def _reload(self) -> None:
        stamp = self.file.stamp()
        if self._read_once and stamp == self._stamp:
            return
        try:
            records = self.file.records()
        except (ConfigError, PathRefused) as exc:
            if not self._read_once:
                raise  # at startup a broken file is an error to fix, not something to serve with
            # A half-edited file must not lock every owner out: keep the keys read last time.
            log.warning("keeping the previous API keys: %s", exc.reason)
        else:
            self._ring = Keyring([*self._env, *records])  # a key given by environment first
            self._read_once = True
        self._stamp = stamp

    def owner_for(self, key: str) -> str | None:
        """The owner of ``key``, or None (unknown, expired or revoked: the caller cannot tell which)."""
        with self._lock:
            self._reload()
            ring = self._ring
        record = ring.match(key)
        if record is None:
            log.debug("refused an API key: no key matches it")
            return None
        state = record.state()
        if state != "active":
            when = record.revoked if state == "revoked" else record.expires
            log.debug(
                "refused API key %s of owner %r: %s at %s", record.id, record.owner, state, store_keys.format_time(when)
            )
            return None
        return record.owner

    def __len__(self) -> int:
        return len(self._ring)
