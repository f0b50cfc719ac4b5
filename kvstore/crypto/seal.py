"""AES-256-GCM over byte objects, and the per-file subkeys (HKDF-SHA256), through ``cryptography``.

:func:`seal_object` / :func:`open_object` seal one whole byte object under an owner's data key with
associated data: the form the shared store's objects reuse (``nonce || ciphertext+tag``, a fresh
random 96-bit nonce each call, the key used directly only through a per-object subkey derived from
a random salt, so no (key, nonce) pair can repeat however many objects one key seals).
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstore.errors import SealBroken

KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # GCM's 96-bit nonce
TAG_BYTES = 16
SALT_BYTES = 32
OBJECT_MAGIC = b"KVSOBJ1\0"


def new_key() -> bytes:
    """A fresh random 256-bit key (the operating system's CSPRNG)."""
    return os.urandom(KEY_BYTES)


def new_nonce() -> bytes:
    """A fresh random 96-bit nonce: never a counter, so a frame a crash dropped and the append
    that takes its place never share one."""
    return os.urandom(NONCE_BYTES)


def derive_key(data_key: bytes, salt: bytes, purpose: bytes) -> bytes:
    """The AES-256 key of one file (or object): HKDF-SHA256 of the owner's data key with the file's
    random salt and what it is for (``purpose``, e.g. b"journal " + the session's key)."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=b"kvstore v1 " + purpose).derive(data_key)


def derive_subkey(data_key: bytes, salt: bytes, purpose: bytes) -> AESGCM:
    """:func:`derive_key` as an AES-256-GCM cipher."""
    return AESGCM(derive_key(data_key, salt, purpose))


def seal_object(
    data_key: bytes, plaintext: bytes | memoryview, associated: bytes, *, purpose: bytes = b"object"
) -> bytes:
    """``plaintext`` sealed: ``OBJECT_MAGIC | salt[32] | nonce[12] | ciphertext+tag``.

    ``associated`` (e.g. the owner, the object's name and version) is authenticated, not stored:
    :func:`open_object` must be given the same bytes.
    """
    salt, nonce = os.urandom(SALT_BYTES), new_nonce()
    cipher = derive_subkey(data_key, salt, purpose)
    return OBJECT_MAGIC + salt + nonce + cipher.encrypt(nonce, bytes(plaintext), OBJECT_MAGIC + salt + associated)


def open_object(data_key: bytes, sealed: bytes | memoryview, associated: bytes, *, purpose: bytes = b"object") -> bytes:
    """The plaintext of :func:`seal_object`'s output.

    Raises
    ------
    SealBroken : not a sealed object, or any byte changed, or another key or ``associated``
    """
    view = bytes(sealed)
    head = len(OBJECT_MAGIC) + SALT_BYTES + NONCE_BYTES
    if len(view) < head + TAG_BYTES or not view.startswith(OBJECT_MAGIC):
        raise SealBroken("not a sealed object (too short or no KVSOBJ1 magic); nothing was decrypted")
    salt = view[len(OBJECT_MAGIC) : len(OBJECT_MAGIC) + SALT_BYTES]
    nonce = view[len(OBJECT_MAGIC) + SALT_BYTES : head]
    try:
        return derive_subkey(data_key, salt, purpose).decrypt(nonce, view[head:], OBJECT_MAGIC + salt + associated)
    except InvalidTag:
        raise SealBroken(
            "a sealed object failed authentication (a changed byte, another key, or moved from elsewhere); "
            "nothing was decrypted"
        ) from None
