"""Encrypted stores for the suites: a KEK, an encrypted store, and reading or damaging what it
stores behind its back (the sealed journal's plaintext image, a flipped ciphertext byte)."""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.crypto import LocalKEK
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.sealed import FRAME_HEADER_BYTES, SealedImage, Sealing
from kvstore.store import archive

KEK = LocalKEK(bytes(range(32)), "the tests' KEK")


def unauthenticated_image(store, path: Path) -> bytes:
    """What the sealed journal at ``path`` decrypts to *without* checking its tags (AES-GCM's
    keystream is AES-CTR from counter 2): a test's view of a damaged frame's bytes, which the store
    itself never reads this way."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    from kvstore.sealed import SealedHeader, walk

    key = path.name.split(".coli_kv")[0]
    raw = path.read_bytes()
    head = SealedHeader.parse(raw[:88], path.name)
    data_key = store.keyring.key(key.rsplit("~", 1)[-1], head.key_version).secret
    subkey = HKDF(hashes.SHA256(), 32, head.salt, b"kvstore v1 journal " + key.encode()).derive(data_key)
    fd = os.open(path, os.O_RDONLY)
    try:
        table = walk(fd, head.header.rec_bytes, head.header.nrec, path.name)
    finally:
        os.close(fd)
    body = []
    for offset, count in zip(table.offsets, table.counts):
        nonce = raw[offset + 16 : offset + 28]
        ciphertext = raw[offset + 28 : offset + 28 + count * head.header.rec_bytes]
        ctr = Cipher(algorithms.AES(subkey), modes.CTR(nonce + b"\0\0\0\2")).decryptor()
        body.append(ctr.update(ciphertext) + ctr.finalize())
    return head.header.with_nrec(table.n_records).to_bytes() + b"".join(body)


def sealed_image(store, path: Path, *, exact: bool = False) -> bytes:
    """The ``.coli_kv`` image (header + committed records) a sealed journal or archive stands for;
    ``exact``: the file must end at its last committed frame (no torn or unacknowledged tail)."""
    key = path.name.split(".coli_kv")[0]
    if path.name.endswith(".zst"):
        fd = os.memfd_create("image")
        os.write(fd, b"".join(archive.stream_archive(path)))
    else:
        fd = os.open(path, os.O_RDONLY)
    try:
        image = SealedImage(fd, Sealing.for_key(store.keyring, key), path.name)
        if exact:
            assert os.fstat(fd).st_size == image.table.end, (path.name, "a torn or unacknowledged tail")
        return image.header.to_bytes() + image.read_range(0, image.n_records)
    finally:
        os.close(fd)


def ciphertext_offset(path: Path, plain_offset: int, rec_bytes: int) -> int:
    """Where the byte ``plain_offset`` of the plaintext image lies in the sealed journal at ``path``
    (GCM is a stream cipher: the same bit of the ciphertext)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        from kvstore.sealed import SealedHeader, walk

        head = SealedHeader.parse(os.pread(fd, 88, 0), path.name)
        table = walk(fd, rec_bytes, head.header.nrec, path.name)
    finally:
        os.close(fd)
    record = (plain_offset - HEADER_BYTES) // rec_bytes
    i, _ = table.covering(record, record + 1)
    return table.offsets[i] + FRAME_HEADER_BYTES + (plain_offset - HEADER_BYTES - table.firsts[i] * rec_bytes)
