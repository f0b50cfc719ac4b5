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


def sealed_image(store, path: Path) -> bytes:
    """The ``.coli_kv`` image (header + committed records) a sealed journal or archive stands for."""
    key = path.name.split(".coli_kv")[0]
    if path.name.endswith(".zst"):
        fd = os.memfd_create("image")
        os.write(fd, b"".join(archive.stream_archive(path)))
    else:
        fd = os.open(path, os.O_RDONLY)
    try:
        image = SealedImage(fd, Sealing.for_key(store.keyring, key), path.name)
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
