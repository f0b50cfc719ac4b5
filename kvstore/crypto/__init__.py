"""Encryption at rest (docs/SECURITY.md): the key hierarchy and the sealing of byte objects.

- :mod:`kvstore.crypto.kek` — the key-encryption key (KEK) behind :class:`KeyProvider` (a file or an
  environment variable today; a KMS can implement the same two methods).
- :mod:`kvstore.crypto.keyring` — per-owner data keys (random 256-bit, versioned), kept wrapped by
  the KEK in ``<data>/keyring.json``; shred, KEK rotation and data-key rotation.
- :mod:`kvstore.crypto.seal` — AES-256-GCM over one byte object under an owner's key with
  associated data (what the shared store's objects will reuse), and the per-file subkeys.
- :mod:`kvstore.crypto.container` — the encrypted journal's byte layout (``COLIKVE\\0``).

Everything goes through the ``cryptography`` package; nothing here implements a primitive.
"""

from kvstore.crypto.kek import KeyProvider, LocalKEK, provider_from_settings
from kvstore.crypto.keyring import DataKey, Keyring
from kvstore.crypto.seal import open_object, seal_object

__all__ = ["DataKey", "KeyProvider", "Keyring", "LocalKEK", "open_object", "provider_from_settings", "seal_object"]
