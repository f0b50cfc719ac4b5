"""Per-owner data keys, wrapped by the KEK, in ``<data>/keyring.json``.

An owner's data keys are versioned: the *current* version seals new files; older versions open the
files still sealed under them until :meth:`Keyring.retire` drops them. Each data key is 256 random
bits, kept only wrapped (``KeyProvider.wrap``, bound to ``owner`` and ``version`` so a wrapped key
cannot be moved to another owner or version) and unwrapped in memory when first used.

The file is rewritten whole and atomically (``kvstore.durable.AtomicFile``: temp file, fsync,
rename, fsync of the folder) under ``keyring.lock``, so a crash leaves the old keyring or the new
one, and two processes (a server and ``kvstore crypto``) never lose each other's change. A running
process notices another's change by the file's identity (inode, size, mtime) at each key lookup
(one ``stat``): a shredded owner's keys are dropped from memory before the next read.

File layout (JSON)::

    {"format": "kvstore-keyring", "version": 1, "kek_id": "<KeyProvider.key_id>",
     "owners": {"<owner>": {"current": 2, "next": 3,
                            "keys": {"1": "<base64 wrapped>", "2": "<base64 wrapped>"}}},
     "shredded": {"<owner>": <unix time>}}
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvstore import config
from kvstore.crypto.kek import KeyProvider
from kvstore.crypto.seal import new_key
from kvstore.durable import AtomicFile
from kvstore.errors import KeyShredded, KeyUnavailable
from kvstore.locks import FileLock

KEYRING_NAME = "keyring.json"
FORMAT = "kvstore-keyring"


@dataclass(frozen=True)
class DataKey:
    """One owner's data key of one version, unwrapped (held in memory only; never printed)."""

    owner: str
    version: int
    secret: bytes

    def __repr__(self) -> str:  # never the key
        return f"DataKey({self.owner!r}, v{self.version})"


def _associated(owner: str, version: int) -> bytes:
    return f"kvstore data key v1\0{owner}\0{version}".encode()


class Keyring:
    """The data keys of one store's owners (see the module docstring).

    Parameters
    ----------
    folder : the store's data folder (``keyring.json`` and ``keyring.lock`` live there)
    provider : the KEK
    create : make an empty keyring when none exists (else :class:`KeyUnavailable`)
    """

    def __init__(self, folder: str | os.PathLike, provider: KeyProvider, *, create: bool = False):
        self.folder = Path(folder)
        self.path = self.folder / KEYRING_NAME
        self.provider = provider
        self._mutex = threading.Lock()
        self._cache: dict[tuple[str, int], bytes] = {}
        self._seen: tuple[int, int, int] | None = None
        self._doc: dict[str, Any] = {}
        self.on_change: list[Callable[[set[str]], None]] = []  # called with the owners whose keys went away
        if not self.path.exists():
            if not create:
                raise KeyUnavailable(f"{self.folder} holds no keyring ({KEYRING_NAME}): it is not an encrypted store")
            with self._locked():
                if not self.path.exists():
                    self._write(
                        {"format": FORMAT, "version": 1, "kek_id": provider.key_id, "owners": {}, "shredded": {}}
                    )
        self._reload(force=True)
        if self._doc["kek_id"] != provider.key_id:
            raise KeyUnavailable(
                f"the keyring of {self.folder} is wrapped by another key-encryption key than the one given "
                "(after `kvstore crypto rotate-kek`, give the new one)"
            )

    @staticmethod
    def exists(folder: str | os.PathLike) -> bool:
        return (Path(folder) / KEYRING_NAME).exists()

    # ------------------------------------------------------------------ reading
    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _reload(self, *, force: bool = False) -> None:
        seen = self._identity()
        if not force and seen == self._seen:
            return
        try:
            doc = json.loads(self.path.read_bytes())
        except (OSError, ValueError) as exc:
            raise KeyUnavailable(f"the keyring {self.path} cannot be read ({exc})") from None
        if doc.get("format") != FORMAT or doc.get("version") != 1:
            raise KeyUnavailable(f"{self.path} is not a kvstore keyring of version 1")
        gone = set()
        for owner, version in list(self._cache):
            entry = doc["owners"].get(owner)
            if entry is None or str(version) not in entry["keys"]:
                del self._cache[(owner, version)]  # shredded or retired: drop the plaintext key
                gone.add(owner)
        if doc["kek_id"] != self.provider.key_id and not force:
            # rotate-kek by another process: the keys this process holds stay valid (the same data
            # keys, wrapped anew); new unwraps need the new KEK (its file is read again by the caller)
            pass
        self._doc, self._seen = doc, seen
        if gone:
            for callback in self.on_change:
                callback(gone)

    def refresh(self) -> None:
        """Read the keyring again if another process changed it (one ``stat`` when it did not):
        keys destroyed there are dropped from memory here and :attr:`on_change` is told."""
        with self._mutex:
            self._reload()

    def key(self, owner: str, version: int) -> DataKey:
        """The data key ``version`` of ``owner``.

        Raises
        ------
        KeyShredded : the owner's keys were destroyed, or this version was retired
        KeyUnavailable : the KEK does not unwrap it
        """
        with self._mutex:
            self._reload()
            cached = self._cache.get((owner, version))
            if cached is not None:
                return DataKey(owner, version, cached)
            entry = self._doc["owners"].get(owner)
            if entry is None or str(version) not in entry["keys"]:
                what = "were shredded" if owner in self._doc["shredded"] else f"hold no version {version}"
                raise KeyShredded(f"the data keys of owner {owner!r} {what}: the rows sealed under them are unreadable")
            secret = self.provider.unwrap(base64.b64decode(entry["keys"][str(version)]), _associated(owner, version))
            self._cache[(owner, version)] = secret
            return DataKey(owner, version, secret)

    def current(self, owner: str, *, create: bool = True) -> DataKey:
        """The owner's current data key (new files are sealed under it), made on first use."""
        with self._mutex:
            self._reload()
            entry = self._doc["owners"].get(owner)
        if entry is None:
            if not create:
                raise KeyShredded(f"owner {owner!r} has no data key")
            with self._locked():
                doc = self._read()
                entry = doc["owners"].get(owner)
                if entry is None:
                    version = int(doc.get("next_version", {}).get(owner, 1))
                    entry = {"current": version, "next": version + 1, "keys": {}}
                    entry["keys"][str(version)] = self._wrapped(owner, version, new_key())
                    doc["owners"][owner] = entry
                    self._write(doc)
        return self.key(owner, int(entry["current"]))

    def versions(self, owner: str) -> list[int]:
        with self._mutex:
            self._reload()
            entry = self._doc["owners"].get(owner)
        return sorted(int(v) for v in entry["keys"]) if entry else []

    def owners(self) -> list[str]:
        with self._mutex:
            self._reload()
            return sorted(self._doc["owners"])

    def shredded(self) -> dict[str, float]:
        with self._mutex:
            self._reload()
            return dict(self._doc["shredded"])

    # ------------------------------------------------------------------ changing
    def _wrapped(self, owner: str, version: int, secret: bytes) -> str:
        return base64.b64encode(self.provider.wrap(secret, _associated(owner, version))).decode()

    def _locked(self) -> FileLock:
        return FileLock(self.folder / "keyring.lock", timeout=30.0, busy_reason="the keyring is being changed")

    def _read(self) -> dict[str, Any]:
        return json.loads(self.path.read_bytes())

    def _write(self, doc: dict[str, Any]) -> None:
        # temp file, fsync, rename over, fsync the folder: the old keyring or the new one survives
        with AtomicFile(self.path, replace=True) as out:
            out.write(json.dumps(doc, indent=1, sort_keys=True).encode())
        with self._mutex:
            self._reload(force=True)

    def rotate(self, owner: str) -> int:
        """A new data-key version for ``owner``; returns it. New files are sealed under it; the
        files sealed under older versions stay readable until they are rewritten and retired."""
        with self._locked():
            doc = self._read()
            entry = doc["owners"].get(owner)
            if entry is None:
                raise KeyShredded(f"owner {owner!r} has no data key to rotate")
            version = int(entry["next"])
            entry["keys"][str(version)] = self._wrapped(owner, version, new_key())
            entry["current"], entry["next"] = version, version + 1
            self._write(doc)
        return version

    def retire(self, owner: str, version: int) -> None:
        """Destroy one old version of ``owner``'s data key (never the current one)."""
        with self._locked():
            doc = self._read()
            entry = doc["owners"].get(owner)
            if entry is None or str(version) not in entry["keys"]:
                return
            if int(entry["current"]) == version:
                raise KeyUnavailable(f"version {version} is owner {owner!r}'s current data key; rotate first")
            del entry["keys"][str(version)]
            self._write(doc)

    def shred(self, owner: str) -> int:
        """Destroy every data key of ``owner`` (durably: the keyring is rewritten without them and
        fsynced); returns how many versions were destroyed. Every file sealed under them, and every
        copy of those files, is unreadable from then on."""
        with self._locked():
            doc = self._read()
            entry = doc["owners"].pop(owner, None)
            doc["shredded"][owner] = time.time()
            # a later key for this owner never reuses a destroyed version's number
            doc.setdefault("next_version", {})[owner] = int(entry["next"]) if entry else 1
            self._write(doc)
        return len(entry["keys"]) if entry else 0

    def rewrap(self, new_provider: KeyProvider) -> int:
        """Wrap every data key anew under ``new_provider`` (KEK rotation: no data is rewritten);
        returns the number of keys re-wrapped. Afterwards this keyring uses the new KEK."""
        with self._locked():
            doc = self._read()
            count = 0
            for owner, entry in doc["owners"].items():
                for version, wrapped in entry["keys"].items():
                    secret = self.provider.unwrap(base64.b64decode(wrapped), _associated(owner, int(version)))
                    entry["keys"][version] = base64.b64encode(
                        new_provider.wrap(secret, _associated(owner, int(version)))
                    ).decode()
                    count += 1
            doc["kek_id"] = new_provider.key_id
            self.provider = new_provider
            self._write(doc)
        return count

    def __enter__(self) -> "Keyring":
        return self

    def __exit__(self, *exc: object) -> None:
        self.forget()

    def forget(self) -> None:
        """Drop every unwrapped key this process holds."""
        with self._mutex:
            self._cache.clear()


def open_keyring(folder: str | os.PathLike, provider: KeyProvider | None) -> Keyring | None:
    """The keyring of the store in ``folder`` as its opener asks: None for a plaintext store.

    Without ``provider``, a store that holds a keyring, or any store when ``KVSTORE_ENCRYPT=1``,
    takes the KEK the configuration names (``KVSTORE_KEK_FILE``, ``KVSTORE_KEK``).

    Raises
    ------
    KeyUnavailable : an encrypted store opened without a KEK (or with another one), or a store
        created without encryption opened with one (the two are never mixed)
    """
    folder = Path(folder)
    if provider is None and (Keyring.exists(folder) or config.ENCRYPT.get()):
        from kvstore.crypto.kek import provider_from_settings

        # KVSTORE_ENCRYPT=1, or a store created encrypted: the KEK the configuration names
        provider = provider_from_settings()
    if Keyring.exists(folder):
        if provider is None:
            raise KeyUnavailable(
                f"the store in {folder} is encrypted at rest: open it with --encrypt and its key-encryption key "
                "(--kek-file PATH, KVSTORE_KEK_FILE or KVSTORE_KEK)"
            )
        return Keyring(folder, provider)
    if provider is None:
        return None
    if (folder / "index" / "data.mdb").exists():
        raise KeyUnavailable(
            f"the store in {folder} was created without encryption; an encrypted store starts in a new data "
            "folder (copy sessions over with `kvstore export` / import), the two are never mixed"
        )
    return Keyring(folder, provider, create=True)


class KeyringWatcher:
    """Checks a keyring for another process's change every ``interval_s`` seconds (a daemon
    thread; one ``stat`` a check), so a running server drops a shredded owner's keys, and the
    plaintext its :attr:`Keyring.on_change` callbacks hold, within that time even when no read of
    that owner comes."""

    def __init__(self, keyring: Keyring, interval_s: float = 0.5):
        self.keyring = keyring
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-keyring-watch", daemon=True)

    def start(self) -> "KeyringWatcher":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.keyring.refresh()
            except Exception:  # a keyring being replaced or unreadable for a moment: next time
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
