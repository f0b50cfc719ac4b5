"""AES-256-GCM over byte objects, and the per-file subkeys (HKDF-SHA256), through ``cryptography``.

:func:`seal_object` / :func:`open_object` seal one whole byte object under an owner's data key with
associated data: the form the shared store's objects reuse (``nonce || ciphertext+tag``, a fresh
random 96-bit nonce each call, the key used directly only through a per-object subkey derived from
a random salt, so no (key, nonce) pair can repeat however many objects one key seals).
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstore.errors import SealBroken

KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # GCM's 96-bit nonce
TAG_BYTES = 16
SALT_BYTES = 32
OBJECT_MAGIC = b"KVSOBJ1\0"
_BLOCK = 16  # the streaming interface writes up to a block past the data


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


def decrypt_into(
    key: bytes, nonce: bytes, tag: bytes, associated: bytes, ciphertext: memoryview, buf: memoryview, pos: int = 0
) -> bool:
    """AES-256-GCM: ``ciphertext`` decrypted into ``buf[pos:pos + len(ciphertext)]`` through the
    streaming interface (it releases the GIL; the one-shot call holds it and allocates its output).
    That interface wants a block of room past what it writes, less one: when ``buf`` has none, the
    last bytes come back separately. Returns whether the tag passed; when it did not, the bytes
    written are zeroed, so no caller ever sees them."""
    size = len(ciphertext)
    decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
    decryptor.authenticate_additional_data(associated)
    lead = size if len(buf) - pos >= size + _BLOCK - 1 else max(0, size - _BLOCK)
    if lead:
        decryptor.update_into(ciphertext[:lead], buf[pos : pos + lead + _BLOCK - 1])
    if lead < size:
        buf[pos + lead : pos + size] = decryptor.update(ciphertext[lead:])
    try:
        decryptor.finalize()
    except InvalidTag:
        buf[pos : pos + size] = bytes(size)
        return False
    return True


def seal_object(
    data_key: bytes, plaintext: bytes | memoryview, associated: bytes, *, purpose: bytes = b"object"
) -> memoryview:
    """``plaintext`` sealed: ``OBJECT_MAGIC | salt[32] | nonce[12] | ciphertext+tag``.

    ``associated`` (e.g. the owner, the object's name and version) is authenticated, not stored:
    :func:`open_object` must be given the same bytes.
    """
    salt, nonce = os.urandom(SALT_BYTES), new_nonce()
    source = memoryview(plaintext).cast("B")
    head = OBJECT_MAGIC + salt + nonce
    out = np.empty(len(head) + len(source) + _BLOCK - 1 + TAG_BYTES, dtype=np.uint8)
    view = out.data
    view[: len(head)] = head
    # the streaming interface: ~4x the one-shot call on a large object here (no fresh output
    # object to fault in) and it releases the GIL, so the store's threads seal in parallel
    encryptor = Cipher(algorithms.AES(derive_key(data_key, salt, purpose)), modes.GCM(nonce)).encryptor()
    encryptor.authenticate_additional_data(OBJECT_MAGIC + salt + associated)
    end = len(head) + len(source)
    encryptor.update_into(source, view[len(head) : end + _BLOCK - 1])
    encryptor.finalize()
    view[end : end + TAG_BYTES] = encryptor.tag
    return view[: end + TAG_BYTES]


def open_object(
    data_key: bytes,
    sealed: bytes | memoryview,
    associated: bytes,
    *,
    purpose: bytes = b"object",
    into: memoryview | None = None,
) -> memoryview:
    """The plaintext of :func:`seal_object`'s output, decrypted straight into ``into`` (exactly its
    size) or a buffer of its own (:func:`decrypt_into`: on a failure ``into`` is zeroed);
    ``sealed`` may be a mapped file: it is read once, never copied.

    Raises
    ------
    SealBroken : not a sealed object, or any byte changed, or another key or ``associated``
    """
    view = memoryview(sealed).cast("B")
    head = len(OBJECT_MAGIC) + SALT_BYTES + NONCE_BYTES
    if len(view) < head + TAG_BYTES or bytes(view[: len(OBJECT_MAGIC)]) != OBJECT_MAGIC:
        raise SealBroken("not a sealed object (too short or no KVSOBJ1 magic); nothing was decrypted")
    salt = bytes(view[len(OBJECT_MAGIC) : len(OBJECT_MAGIC) + SALT_BYTES])
    nonce = bytes(view[len(OBJECT_MAGIC) + SALT_BYTES : head])
    size = len(view) - head - TAG_BYTES
    if into is not None and len(into) != size:
        raise SealBroken(f"a sealed object holds {size} bytes, not the {len(into)} expected; nothing was decrypted")
    out = np.empty(size + _BLOCK - 1, dtype=np.uint8).data if into is None else into
    key = derive_key(data_key, salt, purpose)
    if not decrypt_into(
        key, nonce, bytes(view[head + size :]), OBJECT_MAGIC + salt + associated, view[head : head + size], out
    ):
        raise SealBroken(
            "a sealed object failed authentication (a changed byte, another key, or moved from elsewhere); "
            "nothing was decrypted"
        )
    return out[:size]
