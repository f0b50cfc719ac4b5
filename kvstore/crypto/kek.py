"""The key-encryption key (KEK): what wraps every owner's data keys, behind :class:`KeyProvider`.

A provider wraps and unwraps small secrets (data keys) with associated data and names its key by a
fingerprint (:attr:`KeyProvider.key_id`) that reveals nothing about it. :class:`LocalKEK` holds a
256-bit KEK read from a file (``--kek-file``) or from ``KVSTORE_KEK``; a KMS implements the same two
methods (wrap/unwrap calls to the service; the KEK never leaves it). The KEK's bytes are never
logged, printed or returned.
"""

from __future__ import annotations

import abc
import base64
import binascii
import hashlib
import hmac
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore import config
from kvstore.errors import KeyUnavailable

KEK_BYTES = 32
_WRAP_NONCE = 12


class KeyProvider(abc.ABC):
    """Wraps and unwraps data keys under one key-encryption key."""

    @property
    @abc.abstractmethod
    def key_id(self) -> str:
        """A public fingerprint of the KEK (which KEK a keyring was wrapped with)."""

    @abc.abstractmethod
    def wrap(self, secret: bytes, associated: bytes) -> bytes:
        """``secret`` encrypted and authenticated under the KEK, bound to ``associated``."""

    @abc.abstractmethod
    def unwrap(self, wrapped: bytes, associated: bytes) -> bytes:
        """The secret :meth:`wrap` sealed; :class:`KeyUnavailable` if this KEK did not wrap it (or
        ``associated`` differs)."""


def parse_kek(text: bytes, source: str) -> bytes:
    """A KEK from its stored form: 32 raw bytes, 64 hex digits, or base64 of 32 bytes."""
    if len(text) == KEK_BYTES:
        return bytes(text)
    word = text.strip()
    for decode in (binascii.unhexlify, lambda w: base64.b64decode(w, validate=True)):
        try:
            key = decode(word)
        except (binascii.Error, ValueError):
            continue
        if len(key) == KEK_BYTES:
            return key
    raise KeyUnavailable(f"{source} is not a 256-bit key (32 raw bytes, 64 hex digits, or base64 of 32 bytes)")


class LocalKEK(KeyProvider):
    """A KEK held in this process (from a file or an environment variable); AES-256-GCM wraps."""

    def __init__(self, kek: bytes, source: str = "the KEK"):
        if len(kek) != KEK_BYTES:
            raise KeyUnavailable(f"{source} is not a 256-bit key")
        self._aead = AESGCM(kek)
        self._id = hmac.new(kek, b"kvstore kek id v1", hashlib.sha256).hexdigest()[:16]
        self.source = source

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "LocalKEK":
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise KeyUnavailable(f"cannot read the KEK file {path} ({exc.strerror or exc})") from None
        return cls(parse_kek(raw, f"the KEK file {path}"), f"the KEK file {path}")

    @classmethod
    def from_text(cls, text: str, source: str) -> "LocalKEK":
        return cls(parse_kek(text.encode(), source), source)

    @property
    def key_id(self) -> str:
        return self._id

    def wrap(self, secret: bytes, associated: bytes) -> bytes:
        nonce = os.urandom(_WRAP_NONCE)
        return nonce + self._aead.encrypt(nonce, secret, associated)

    def unwrap(self, wrapped: bytes, associated: bytes) -> bytes:
        try:
            return self._aead.decrypt(wrapped[:_WRAP_NONCE], wrapped[_WRAP_NONCE:], associated)
        except InvalidTag:
            raise KeyUnavailable(
                f"{self.source} does not unwrap this keyring's data keys (another KEK, or a damaged keyring)"
            ) from None

    def __repr__(self) -> str:  # never the key
        return f"LocalKEK(id={self._id}, from {self.source})"


def write_kek_file(path: str | os.PathLike) -> LocalKEK:
    """Write a new random KEK (64 hex digits) to ``path`` (0600, never clobbering), durably."""
    from kvstore.durable import AtomicFile

    kek = os.urandom(KEK_BYTES)
    with AtomicFile(path, replace=False) as out:
        out.write(binascii.hexlify(kek) + b"\n")
    return LocalKEK(kek, f"the KEK file {path}")


def provider_from_settings(kek_file: str | os.PathLike | None = None) -> KeyProvider:
    """The KEK the caller names: ``kek_file`` (``--kek-file``), else ``KVSTORE_KEK_FILE``, else
    ``KVSTORE_KEK`` (the key itself).

    Raises
    ------
    KeyUnavailable : none is named, or the one named is not a 256-bit key
    """
    path = kek_file if kek_file is not None else config.KEK_FILE.get()
    if path is not None:
        return LocalKEK.from_file(path)
    text = config.KEK.get()
    if text is not None:
        return LocalKEK.from_text(text, "KVSTORE_KEK")
    raise KeyUnavailable(
        "this store is encrypted at rest: name its key-encryption key with --kek-file PATH, "
        "KVSTORE_KEK_FILE or KVSTORE_KEK"
    )
