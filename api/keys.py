"""API keys: which owner a request acts for.

Keys come from ``<data>/keys.json`` and from the ``KVSTORE_API_KEYS`` variable (``key:owner,...``).
``keys.json`` holds ``{"keys": [{"owner": "alice", "sha256": "<hex of the key>"}, ...]}`` (a
``"key"`` entry with the plain key is accepted too, for hand-written files). When the file is
missing it is created (0600) with one fresh random key for owner ``default``, stored only as its
hash: the key is shown once, by whoever created the file. The file is re-read when it changes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
from pathlib import Path

from kvstore import DEFAULT_OWNER
from kvstore.errors import ConfigError, PathRefused
from kvstore.journal import AtomicFile
from kvstore.store.values import OWNER_PATTERN

KEYS_FILE = "keys.json"
MIN_KEY_CHARS = 16
log = logging.getLogger("kvstore.api")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "kvs_" + secrets.token_urlsafe(32)


def _check_owner(owner, where: str) -> str:
    if not isinstance(owner, str) or not OWNER_PATTERN.fullmatch(owner):
        raise ConfigError(f"{where}: invalid owner {owner!r} (letters, digits, '_', '.', '@', '-')")
    return owner


def parse_env_keys(value: str | None) -> dict[str, str]:
    """``key:owner,key:owner`` -> {sha256(key): owner}."""
    table: dict[str, str] = {}
    for item in (value or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, owner = item.rpartition(":")
        if not sep or len(key) < MIN_KEY_CHARS:
            raise ConfigError(
                f"KVSTORE_API_KEYS entries are key:owner with keys of at least {MIN_KEY_CHARS} characters"
            )
        table[key_digest(key)] = _check_owner(owner, "KVSTORE_API_KEYS")
    return table


def _parse_file(path: Path) -> dict[str, str]:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable JSON ({exc})") from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f'{path} must hold {{"keys": [{{"owner": ..., "sha256": ...}}, ...]}}')
    table: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: every key entry is an object")
        owner = _check_owner(entry.get("owner"), str(path))
        if isinstance(entry.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
            table[entry["sha256"]] = owner
        elif isinstance(entry.get("key"), str) and len(entry["key"]) >= MIN_KEY_CHARS:
            table[key_digest(entry["key"])] = owner
        else:
            raise ConfigError(
                f"{path}: an entry needs a 64-hex 'sha256' or a 'key' of at least {MIN_KEY_CHARS} characters"
            )
    return table


def ensure_keys_file(data_dir: Path) -> str | None:
    """Create ``keys.json`` with a fresh key if it is missing; returns that key (else None)."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = data_dir / KEYS_FILE
    if path.is_symlink():
        raise PathRefused(f"{path} is a symbolic link; keys.json must be a regular file in the data folder")
    if path.exists():
        return None
    key = new_key()
    document = {"keys": [{"owner": DEFAULT_OWNER, "sha256": key_digest(key)}]}
    try:
        with AtomicFile(path, replace=False) as out:
            out.write((json.dumps(document, indent=2) + "\n").encode())
    except FileExistsError:  # another process created it first: its key, not ours
        return None
    return key


class KeyTable:
    """Maps a presented key to its owner (keys are compared by SHA-256, never stored in clear).

    A presented key's digest is compared with every known digest by ``hmac.compare_digest``, none
    skipped and none looked up by hash: how long the check takes does not depend on which key
    matches, whether one does, or how many leading bytes a guess shares with a real digest.
    """

    def __init__(self, data_dir: Path, env_value: str | None):
        self.path = Path(data_dir) / KEYS_FILE
        self._env = parse_env_keys(env_value)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._file: dict[str, str] = {}
        self._reload()

    def _reload(self) -> None:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            self._stamp, self._file = None, {}
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        if not os.path.isfile(self.path) or os.path.islink(self.path):
            raise PathRefused(f"{self.path} must be a regular file")
        try:
            self._file = _parse_file(self.path)
        except ConfigError as exc:
            if self._stamp is None:
                raise  # at startup a broken file is an error to fix, not something to serve with
            # A half-edited file must not lock every owner out: keep the keys read last time.
            log.warning("keeping the previous API keys: %s", exc.reason)
        self._stamp = stamp

    def owner_for(self, key: str) -> str | None:
        """The owner of ``key`` (a key given by environment first), or None; constant time in the key."""
        digest = key_digest(key).encode()
        with self._lock:
            self._reload()
            known = [*self._env.items(), *self._file.items()]
        owner = None
        for stored, who in known:
            if hmac.compare_digest(digest, stored.encode()) and owner is None:
                owner = who
        return owner

    def __len__(self) -> int:
        return len(set(self._env) | set(self._file))
