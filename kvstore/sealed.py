# Over 700 lines: the encrypted container is one format — its header, frame table, codec, reads, appends and rewrites share the layout and the nonce rules, and are reviewed together.
"""The journal encrypted at rest (docs/SECURITY.md, "The encrypted journal"): :class:`SealedKVFile`.

Byte layout (little-endian), magic ``COLIKVE\\0`` so no ``.coli_kv`` reader (the C engine,
``kvstore inspect``/``repair``/``migrate``/``export``, ``coli_kv.parse_header``) reads it as rows::

    header, 88 bytes, plaintext
      0   8  magic  COLIKVE\\0
      8  24  h0..h5 the geometry words of the .coli_kv header (docs/FORMAT.md section 1)
     32   4  h6 nrec: records committed: the commit point, as in a plaintext journal
     36   4  h7 tag of the plaintext tier
     40   8  the plaintext file's magic (COLIKV1/2/3\\0: the tier's file version)
     48   4  container version (1)
     52   4  the owner's data-key version the file is sealed under
     56  32  salt: random per file (HKDF salt of the file's subkey)
    frames, back to back from byte 88, one per append batch (at most FRAME_BYTES of records each)
      0   4  first record index
      4   4  record count k (>= 1)
      8   8  ciphertext length = k * rec_bytes + 16
     16  12  nonce: 96 random bits, fresh for every frame ever written
     28   .  AES-256-GCM ciphertext of the k records (their .coli_kv bytes), then its 16-byte tag

The file's subkey is ``HKDF-SHA256(owner data key, salt, "kvstore v1 journal " + identity)``
(identity: the session's storage key ``<id>~<owner>``). Each frame's associated data is the header
without h6 (magic, geometry, tier, plaintext magic, container and key version, salt), the identity
and the frame header's first 16 bytes: a frame is bound to its file, its session, its position and
its length, so it cannot be spliced, reordered, moved to another file or cut short unnoticed. h6 is
not authenticated (it changes with every append): lowering it is a truncation, which the index's
record count and turn hashes detect; raising it finds no frame to serve.

Durability is the plaintext journal's (``kvstore.journal``): frames are written past the commit
point and fsynced, then h6 is written and fsynced. A crash leaves bytes past the last committed
frame, ignored by every reader and overwritten by the next append with new frames under new random
nonces (a counter could repeat after a dropped frame; a random nonce under a per-file key cannot,
short of a 2^-96 draw). A truncate at a frame boundary lowers h6 then shortens the file; one
inside a frame rewrites the file (a new file, a new salt) through the atomic rewrite path.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore.crypto.seal import SALT_BYTES, TAG_BYTES, decrypt_into, derive_key, new_nonce
from kvstore.durable import AtomicFile, pwrite_all
from kvstore.errors import FormatError, JournalWriteError, SealBroken
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, NREC_OFFSET, Header, KVRecords
from kvstore.formats.layout import SEALED_MAGIC

if TYPE_CHECKING:
    from kvstore.crypto.keyring import Keyring

SEALED_HEADER_BYTES = 88
FRAME_HEADER_BYTES = 28
CONTAINER_VERSION = 1
# records of one frame at most (one AEAD call each; a range read decrypts whole frames). Each frame
# costs its reader a few microseconds holding the GIL (the cipher's set-up, the frame's bookkeeping)
# beside its AES work, which runs without it: at 1 MiB a restore's 8-16 reader threads queued on
# the GIL (12 GB/s at 8 threads, 10 at 16, on a 16-core H100 host); at 4 MiB 21 and 25 GB/s.
FRAME_BYTES = 4 << 20
_HEAD = struct.Struct("<8s8i8sII32s")
_FRAME = struct.Struct("<IIQ12s")
_WALK_WINDOW = 1 << 16


def read_any_header(path: Path) -> Header:
    """The ``.coli_kv`` header a journal stands for, plaintext or sealed (its h6 as stored)."""
    with open(path, "rb") as f:
        head = f.read(SEALED_HEADER_BYTES)
    if is_sealed(head):
        return SealedHeader.parse(head, path.name).header
    return coli_kv.parse_header(head[:HEADER_BYTES])


def is_sealed(head: bytes) -> bool:
    """Whether the first bytes of a file are an encrypted journal's magic."""
    return bytes(head[:8]) == SEALED_MAGIC


@dataclass(frozen=True)
class Sealing:
    """What opens or seals one journal: the store's keyring, the owner whose key seals it and the
    file's identity (the session's storage key), bound into every frame."""

    keyring: "Keyring"
    owner: str
    identity: str

    @classmethod
    def for_key(cls, keyring: "Keyring", storage_key: str) -> "Sealing":
        """The sealing of the store journal ``<id>~<owner>.coli_kv``."""
        return cls(keyring, storage_key.rsplit("~", 1)[-1], storage_key)


@dataclass(frozen=True)
class SealedHeader:
    header: Header  # the plaintext .coli_kv header it stands for (nrec as stored in h6)
    key_version: int
    salt: bytes

    def to_bytes(self) -> bytes:
        plain = self.header.to_bytes()
        words = struct.unpack("<8i", plain[8:HEADER_BYTES])
        return _HEAD.pack(
            SEALED_MAGIC, *words[:6], words[6], words[7], plain[:8], CONTAINER_VERSION, self.key_version, self.salt
        )

    def bound(self) -> bytes:
        """The header bytes every frame authenticates (all but h6)."""
        raw = self.to_bytes()
        return raw[:NREC_OFFSET] + raw[NREC_OFFSET + 4 :]

    @classmethod
    def parse(cls, raw: bytes, name: str) -> "SealedHeader":
        if len(raw) < SEALED_HEADER_BYTES:
            raise FormatError(f"{name}: an encrypted journal's header is {SEALED_HEADER_BYTES} bytes, {len(raw)} found")
        magic, *rest = _HEAD.unpack(raw[:SEALED_HEADER_BYTES])
        words, plain_magic, version, key_version, salt = rest[:8], rest[8], rest[9], rest[10], rest[11]
        if magic != SEALED_MAGIC or version != CONTAINER_VERSION:
            raise FormatError(f"{name}: not an encrypted journal of container version {CONTAINER_VERSION}")
        header = coli_kv.parse_header(plain_magic + struct.pack("<8i", *words))
        return cls(header, key_version, salt)


class FrameTable:
    """The committed frames of a sealed journal: first record, count, ciphertext offset and length
    (numpy arrays, found by walking the frame headers once on open)."""

    def __init__(self) -> None:
        self.firsts: list[int] = []
        self.counts: list[int] = []
        self.offsets: list[int] = []  # of each frame's header
        self.ends: list[int] = []  # the byte after each frame
        self.end = SEALED_HEADER_BYTES  # the byte after the last committed frame
        self.n_records = 0

    def add(self, first: int, count: int, offset: int, ct_len: int) -> None:
        self.firsts.append(first)
        self.counts.append(count)
        self.offsets.append(offset)
        self.end = offset + FRAME_HEADER_BYTES + ct_len
        self.ends.append(self.end)
        self.n_records = first + count

    def copy(self) -> "FrameTable":
        other = FrameTable()
        other.firsts, other.counts = list(self.firsts), list(self.counts)
        other.offsets, other.ends = list(self.offsets), list(self.ends)
        other.end, other.n_records = self.end, self.n_records
        return other

    def cut(self, n_frames: int) -> None:
        """Keep the first ``n_frames`` frames."""
        del self.firsts[n_frames:], self.counts[n_frames:], self.offsets[n_frames:], self.ends[n_frames:]
        self.end = self.ends[-1] if n_frames else SEALED_HEADER_BYTES
        self.n_records = self.firsts[-1] + self.counts[-1] if n_frames else 0

    def boundary(self, n_records: int) -> int | None:
        """How many frames hold exactly the first ``n_records`` records, or None when that count
        falls inside a frame."""
        if n_records == 0:
            return 0
        for k in range(len(self.firsts) - 1, -1, -1):  # per frame from the end: a cut is near it
            end = self.firsts[k] + self.counts[k]
            if end == n_records:
                return k + 1
            if end < n_records:
                return None
        return None

    def covering(self, start: int, stop: int) -> tuple[int, int]:
        """Frames ``[i, j)`` that hold records ``[start, stop)``."""
        # bisect on the list: a numpy search would convert the whole table at every read, holding
        # the GIL that a restore's other reading threads wait for
        i = bisect.bisect_right(self.firsts, start) - 1
        j = bisect.bisect_left(self.firsts, stop)
        return max(i, 0), j


class FrameCodec:
    """Sealing and opening frames of one file (its subkey and associated-data prefix)."""

    def __init__(self, sealing: Sealing, head: SealedHeader, name: str):
        key = sealing.keyring.key(sealing.owner, head.key_version)
        self._key = derive_key(key.secret, head.salt, b"journal " + sealing.identity.encode())
        self._aead = AESGCM(self._key)
        self._bound = head.bound() + sealing.identity.encode() + b"\0"
        self.rec_bytes = head.header.rec_bytes
        self.name = name

    def seal(self, first: int, payload: memoryview) -> bytes:
        """One frame (header + ciphertext + tag) holding ``payload``'s whole records."""
        count = len(payload) // self.rec_bytes
        nonce = new_nonce()
        prefix = struct.pack("<IIQ", first, count, len(payload) + TAG_BYTES)
        return prefix + nonce + self._aead.encrypt(nonce, payload, self._bound + prefix)

    def seal_into(self, first: int, payload: memoryview, out: memoryview) -> int:
        """:meth:`seal` written into ``out`` (exactly the frame's size); returns its size."""
        into = getattr(self._aead, "encrypt_into", None)  # cryptography >= 45
        if into is None:
            frame = self.seal(first, payload)
            out[: len(frame)] = frame
            return len(frame)
        count = len(payload) // self.rec_bytes
        nonce = new_nonce()
        prefix = struct.pack("<IIQ", first, count, len(payload) + TAG_BYTES)
        out[:16] = prefix
        out[16:FRAME_HEADER_BYTES] = nonce
        into(nonce, payload, self._bound + prefix, out[FRAME_HEADER_BYTES:])
        return FRAME_HEADER_BYTES + len(payload) + TAG_BYTES

    def open(self, frame_header: bytes, ciphertext: bytes | memoryview, out: memoryview | None = None) -> bytes | None:
        """The frame's records, or (``out``: exactly their size) decrypted into ``out``, no copy."""
        first, count, _, nonce = _FRAME.unpack(frame_header)
        try:
            if out is None:
                return self._aead.decrypt(nonce, ciphertext, self._bound + frame_header[:16])
            into = getattr(self._aead, "decrypt_into", None)  # cryptography >= 45
            if into is not None:
                into(nonce, ciphertext, self._bound + frame_header[:16], out)
            else:
                out[:] = self._aead.decrypt(nonce, ciphertext, self._bound + frame_header[:16])
            return None
        except InvalidTag:
            broken = SealBroken(
                f"{self.name}: the frame of records [{first}, {first + count}) failed authentication (a changed "
                "byte, a frame moved from elsewhere, or another key); nothing of it was decrypted: "
                "`kvstore sessions repair` cuts the session back to its last good turn"
            )
            broken.first_record = first  # where the damage starts (a store's verify names its turn)
            raise broken from None

    def open_at(self, frame_header: bytes, body: memoryview, buf: memoryview, pos: int) -> None:
        """Decrypt the frame (``body``: ciphertext and tag) into ``buf[pos:pos + its size]``.

        Through :func:`~kvstore.crypto.seal.decrypt_into` (the streaming GCM interface, which
        releases the GIL: a server's reader thread never stalls its event loop). On a mismatch of
        the tag the bytes written are zeroed and :class:`SealBroken` is raised."""
        first, count, _, nonce = _FRAME.unpack(frame_header)
        size = len(body) - TAG_BYTES
        if not decrypt_into(
            self._key, nonce, bytes(body[size:]), self._bound + frame_header[:16], body[:size], buf, pos
        ):
            broken = SealBroken(
                f"{self.name}: the frame of records [{first}, {first + count}) failed authentication (a changed "
                "byte, a frame moved from elsewhere, or another key); nothing of it was decrypted: "
                "`kvstore sessions repair` cuts the session back to its last good turn"
            )
            broken.first_record = first
            raise broken

    def frames(self, first: int, body: memoryview) -> list[bytes]:
        """``body`` (whole records) as frames of at most :data:`FRAME_BYTES`, first record ``first``."""
        per = max(1, FRAME_BYTES // self.rec_bytes) * self.rec_bytes
        return [self.seal(first + lo // self.rec_bytes, body[lo : lo + per]) for lo in range(0, len(body), per)]


def walk(fd: int, rec_bytes: int, nrec: int, name: str) -> FrameTable:
    """The frames of the committed records (``min(nrec, records in whole frames present)``).

    A frame header that is inconsistent before the commit point is damage (:class:`SealBroken`);
    a file that ends early stops the walk at its last whole frame (as a short plaintext journal
    stops at its last whole record). One ``pread`` per window of headers, never per record.
    """
    st = os.fstat(fd)
    size = st.st_size
    table = _walked(fd, (st.st_dev, st.st_ino), nrec, size)
    offset, expected = table.end, table.n_records
    window_start, window = offset, b""
    while expected < nrec:
        if offset + FRAME_HEADER_BYTES > size:
            break
        if not (window_start <= offset and offset + FRAME_HEADER_BYTES <= window_start + len(window)):
            window_start, window = offset, os.pread(fd, _WALK_WINDOW, offset)
        at = offset - window_start
        first, count, ct_len, _ = _FRAME.unpack(window[at : at + FRAME_HEADER_BYTES])
        if first != expected or count < 1 or ct_len != count * rec_bytes + TAG_BYTES or first + count > nrec:
            raise SealBroken(
                f"{name}: the frame at byte {offset} does not follow record {expected} "
                f"(first {first}, count {count}, length {ct_len}); the journal is damaged there"
            )
        if offset + FRAME_HEADER_BYTES + ct_len > size:
            break
        table.add(first, count, offset, ct_len)
        offset, expected = table.end, first + count
    if table.firsts:
        entry = (table.copy(), _fixed_header(fd) + os.pread(fd, FRAME_HEADER_BYTES, table.offsets[-1]))
        with _walked_lock:
            _WALKED[(st.st_dev, st.st_ino)] = entry
            while len(_WALKED) > _WALKED_MAX:
                _WALKED.pop(next(iter(_WALKED)))
    return table


# The frames a walk found, per file (device, inode): the next open of the same journal (the store
# opens it for every append) walks only the frames appended since, not all of them again. Reused
# only when the file still has the same header (h6 aside) and holds the last frame walked byte for
# byte (its header carries a random nonce, so a truncate and new appends in its place never match)
# and its commit point is not lower.
_WALKED: dict[tuple[int, int], tuple["FrameTable", bytes]] = {}
_WALKED_MAX = 4096
_walked_lock = threading.Lock()


def _walked(fd: int, identity: tuple[int, int], nrec: int, size: int) -> "FrameTable":
    with _walked_lock:
        found = _WALKED.get(identity)
    if found is not None:
        table, check = found
        if table.n_records <= nrec and table.end <= size:
            if _fixed_header(fd) + os.pread(fd, FRAME_HEADER_BYTES, table.offsets[-1]) == check:
                return table.copy()
    return FrameTable()


def _fixed_header(fd: int) -> bytes:
    """The file's header but h6: what a cached walk was made under (geometry, tier, key, salt)."""
    raw = os.pread(fd, SEALED_HEADER_BYTES, 0)
    return raw[:NREC_OFFSET] + raw[NREC_OFFSET + 4 :]


def read_frames(
    fd: int, codec: FrameCodec, table: FrameTable, i: int, j: int, *, head_room: int = 0, held: mmap.mmap | None = None
) -> memoryview:
    """The plaintext records of frames ``[i, j)`` (after ``head_room`` free bytes): one read of
    their bytes into one buffer, then one AEAD call per frame decrypting into the output buffer."""
    lo, hi = (table.offsets[i], table.ends[j - 1]) if i < j else (0, 0)
    plain = np.empty(head_room + sum(table.counts[i:j]) * codec.rec_bytes, dtype=np.uint8)
    out = plain.data
    with _ciphertext(fd, lo, hi, codec.name, held) as view:
        pos = head_room
        for k in range(i, j):
            at = table.offsets[k] - lo
            size = table.counts[k] * codec.rec_bytes
            head = bytes(view[at : at + FRAME_HEADER_BYTES])
            body = view[at + FRAME_HEADER_BYTES : at + FRAME_HEADER_BYTES + size + TAG_BYTES]
            codec.open_at(head, body, out, pos)
            pos += size
    return out


MAP_BYTES = 1 << 20  # a range at least this large is decrypted from a mapping of the file, not a read


@contextlib.contextmanager
def _ciphertext(fd: int, lo: int, hi: int, name: str, held: mmap.mmap | None = None) -> Iterator[memoryview]:
    """Bytes ``[lo, hi)`` of the file for the length of the block. A large range is mapped: AES
    then reads the page cache itself, one pass over the bytes where a read into a buffer first
    costs a copy as well (1.5x the decryption rate of one core here). Safe because every reader of a
    sealed journal holds what keeps it from shrinking (the writer lock or a store's read lock), as
    :func:`kvstore.journal.read_tokens` does; a range past the file's end is :class:`SealBroken`.
    ``held``: a mapping of the file from byte 0 that the caller keeps open
    (:meth:`SealedKVFile.map_for_reads`), used where it covers the range instead of a new one, and
    the file still holds the range: a page of a mapping past the file's end (cut by something
    outside kvstore's locks since it was mapped) would be a SIGBUS, not an error."""
    source, base, owned = None, 0, False  # the mapping the range is read from, its first byte, ours to unmap
    if held is not None and not held.closed and MAP_BYTES <= hi - lo and hi <= min(len(held), os.fstat(fd).st_size):
        source = held
    elif hi - lo >= MAP_BYTES:
        base = lo - lo % mmap.ALLOCATIONGRANULARITY
        try:
            source, owned = mmap.mmap(fd, hi - base, access=mmap.ACCESS_READ, offset=base), True
        except ValueError:  # the mapping would run past the file's end
            raise SealBroken(f"{name}: the journal ended inside its committed frames") from None
        except OSError:  # a file system that cannot map this file: read it as a small range is
            pass
    if source is None:
        with _scratch(hi - lo) as view:
            _read_exact(fd, view, lo, name)
            yield view
        return
    whole = memoryview(source)
    try:
        yield whole[lo - base : hi - base]
    finally:
        whole.release()
        if owned:
            try:
                source.close()
            except BufferError:  # a slice still held (by a traceback's frame): unmapped when it goes
                pass


def _read_exact(fd: int, view: memoryview, offset: int, name: str) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise SealBroken(f"{name}: the journal ended inside its committed frames")
        got += n


STAGE_BYTES = 2 << 20  # ciphertext read at a time by a range read: fits a core's L2 cache with room
_POOL: list[np.ndarray] = []
_POOL_LOCK = threading.Lock()
_POOL_KEEP = 8  # buffers kept for reuse (by any thread: a restore's reader threads are new each time)
_POOL_BIGGEST = 64 << 20  # a larger buffer is freed after use


@contextlib.contextmanager
def _scratch(nbytes: int) -> Iterator[memoryview]:
    """A buffer of at least ``nbytes`` for the duration of the block, reused across calls and
    threads (a fresh one would be page-faulted in every time); what it holds is never handed out."""
    with _POOL_LOCK:
        fits = [k for k, b in enumerate(_POOL) if b.size >= nbytes]
        buf = _POOL.pop(min(fits, key=lambda k: _POOL[k].size)) if fits else None
    if buf is None:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    try:
        yield buf.data[:nbytes]
    finally:
        if buf.size <= _POOL_BIGGEST:
            with _POOL_LOCK:
                _POOL.append(buf)
                if len(_POOL) > _POOL_KEEP:
                    _POOL.pop(min(range(len(_POOL)), key=lambda k: _POOL[k].size))


def read_records_into(
    fd: int, codec: FrameCodec, table: FrameTable, start: int, stop: int, out: memoryview, held: mmap.mmap | None = None
) -> int:
    """Decrypt records ``[start, stop)`` straight into ``out`` (bytes, at least their size): the
    covering frames' bytes are mapped (:func:`_ciphertext`; a small range is read into a reused
    buffer), each frame wholly inside the range is decrypted in place in ``out`` (one AEAD call, no
    copy), a frame cut by the range's ends through a small buffer. Returns the bytes written."""
    if stop <= start:
        return 0
    rec = codec.rec_bytes
    i, j = table.covering(start, stop)
    if i < j and table.ends[j - 1] - table.offsets[i] >= MAP_BYTES:
        with _ciphertext(fd, table.offsets[i], table.ends[j - 1], codec.name, held) as raw:
            _open_frames(codec, table, i, j, raw, table.offsets[i], start, stop, out)
        return (stop - start) * rec
    # a small range (or mapping off): the frames' bytes read a few at a time into a buffer small
    # enough to stay in the core's cache, then decrypted from there. A frame larger than the buffer
    # is read alone.
    k = i
    with _scratch(STAGE_BYTES) as stage:
        while k < j:
            m, lo = k + 1, table.offsets[k]
            while m < j and table.ends[m] - lo <= STAGE_BYTES:
                m += 1
            size = table.ends[m - 1] - lo
            with contextlib.nullcontext(stage[:size]) if size <= STAGE_BYTES else _scratch(size) as raw:
                _read_exact(fd, raw, lo, codec.name)
                _open_frames(codec, table, k, m, raw, lo, start, stop, out)
            k = m
    return (stop - start) * rec


def _open_frames(
    codec: FrameCodec,
    table: FrameTable,
    i: int,
    j: int,
    raw: memoryview,
    lo: int,
    start: int,
    stop: int,
    out: memoryview,
) -> None:
    rec = codec.rec_bytes
    for k in range(i, j):
        first, count = table.firsts[k], table.counts[k]
        at = table.offsets[k] - lo
        head = bytes(raw[at : at + FRAME_HEADER_BYTES])
        body = raw[at + FRAME_HEADER_BYTES : at + FRAME_HEADER_BYTES + count * rec + TAG_BYTES]
        a, b = max(first, start), min(first + count, stop)
        if a == first and b == first + count:
            codec.open_at(head, body, out[: (stop - start) * rec], (first - start) * rec)
        else:
            whole = np.empty(count * rec, dtype=np.uint8)
            codec.open_at(head, body, whole.data, 0)
            out[(a - start) * rec : (b - start) * rec] = whole.data[(a - first) * rec : (b - first) * rec]


def read_records(
    fd: int, codec: FrameCodec, table: FrameTable, start: int, stop: int, held: mmap.mmap | None = None
) -> memoryview:
    """The plaintext bytes of records ``[start, stop)`` (within the committed ones): only the frames
    covering them are read and decrypted."""
    if stop <= start:
        return memoryview(b"")
    out = np.empty((stop - start) * codec.rec_bytes, dtype=np.uint8).data
    read_records_into(fd, codec, table, start, stop, out, held)
    return out


def write_image(
    target: Path, sealing: Sealing, header: Header, bodies: Iterable[memoryview | np.ndarray], *, replace: bool
) -> tuple[SealedHeader, FrameTable]:
    """A whole sealed journal (header nrec = the records of ``bodies``), atomically: a new salt and
    the owner's current data key. Returns its header and frames."""
    key = sealing.keyring.current(sealing.owner)
    head = SealedHeader(header, key.version, os.urandom(SALT_BYTES))
    codec = FrameCodec(sealing, head, target.name)
    table = FrameTable()
    first = 0
    with AtomicFile(target, replace=replace) as out:
        out.write(head.to_bytes())
        for chunk in bodies:
            body = np.ascontiguousarray(chunk).data.cast("B") if isinstance(chunk, np.ndarray) else chunk.cast("B")
            for frame in codec.frames(first, body):
                count = struct.unpack_from("<I", frame, 4)[0]
                table.add(first, count, out.size, len(frame) - FRAME_HEADER_BYTES)
                out.write(frame)
                first += count
    if first != header.nrec:
        raise FormatError(f"{target.name}: sealed {first} records, the header says {header.nrec}")
    return head, table


class SealedImage:
    """A sealed journal's committed records read from an open descriptor (a journal, or an archive
    decompressed into memory): :meth:`read_range` decrypts only the frames covering a range."""

    def __init__(self, fd: int, sealing: Sealing, name: str):
        self.fd = fd
        self.name = name
        self.head = SealedHeader.parse(os.pread(fd, SEALED_HEADER_BYTES, 0), name)
        self.table = walk(fd, self.head.header.rec_bytes, self.head.header.nrec, name)
        self.codec = FrameCodec(sealing, self.head, name)

    @property
    def n_records(self) -> int:
        return self.table.n_records

    @property
    def header(self) -> Header:
        """The plaintext ``.coli_kv`` header the file stands for (nrec: the committed records)."""
        return self.head.header.with_nrec(self.table.n_records)

    def read_range(self, start: int, stop: int) -> memoryview:
        return read_records(self.fd, self.codec, self.table, start, min(stop, self.table.n_records))

    def iter_range(self, start: int, stop: int, chunk_records: int) -> Iterator[memoryview]:
        """Records ``[start, stop)`` in chunks that end on frames (:func:`iter_records`)."""
        return iter_records(self.fd, self.codec, self.table, start, min(stop, self.table.n_records), chunk_records)


def iter_records(
    fd: int,
    codec: FrameCodec,
    table: FrameTable,
    start: int,
    stop: int,
    chunk_records: int,
    held: mmap.mmap | None = None,
) -> Iterator[memoryview]:
    """Records ``[start, stop)`` in chunks of about ``chunk_records`` that end on frames (no frame
    decrypted twice): a frame refused (:class:`SealBroken`) is raised after every good record
    before it was yielded."""
    if stop <= start:
        return
    i, j = table.covering(start, stop)
    rec = codec.rec_bytes
    while i < j:
        k = i + 1
        while k < j and table.firsts[k] + table.counts[k] - table.firsts[i] <= chunk_records:
            k += 1
        try:
            plain = read_frames(fd, codec, table, i, k, held=held)
        except SealBroken:
            for single in range(i, k):  # yield the good frames before the refused one, then raise
                plain = read_frames(fd, codec, table, single, single + 1, held=held)
                lo = max(start - table.firsts[single], 0) * rec
                hi = (min(stop, table.firsts[single] + table.counts[single]) - table.firsts[single]) * rec
                yield plain[lo:hi]
            raise
        lo = max(start - table.firsts[i], 0) * rec
        hi = (min(stop, table.firsts[k - 1] + table.counts[k - 1]) - table.firsts[i]) * rec
        yield plain[lo:hi]
        i = k


def chunk_starts(table: FrameTable, start: int, stop: int, chunk_records: int) -> list[int]:
    """First records of chunks of at most ``chunk_records`` covering ``[start, stop)`` (a
    fixed-size ring's), ending on frames where they can, so no frame is decrypted twice (a chunk
    ending inside a frame makes the next one open it again); a frame larger than a chunk is split."""
    if stop <= start:
        return []
    step = max(1, chunk_records)
    i, j = table.covering(start, stop)
    ends = np.minimum(np.asarray(table.firsts[i:j], dtype=np.int64) + table.counts[i:j], stop)
    starts, pos = [], start
    while pos < stop:
        starts.append(pos)
        limit = min(pos + step, stop)
        k = int(np.searchsorted(ends, limit, side="right")) - 1
        pos = int(ends[k]) if k >= 0 and ends[k] > pos else limit
    return starts


def sealed_bytes_bound(nbytes: int, rec_bytes: int, chunk_bytes: int) -> int:
    """At most the size of a sealed journal holding ``nbytes`` of records written from chunks of at
    most ``chunk_bytes`` (what a store reserves before a copy)."""
    per = max(1, FRAME_BYTES // rec_bytes) * rec_bytes
    frames = -(-nbytes // per) + -(-nbytes // max(chunk_bytes, 1)) + 1
    return SEALED_HEADER_BYTES + nbytes + frames * (FRAME_HEADER_BYTES + TAG_BYTES)


def write_sealed(target: Path, sealing: Sealing, header: Header, chunks: Iterable[np.ndarray], *, replace: bool) -> int:
    """``write_atomic`` for an encrypted store: ``header`` + record chunks sealed into a new file,
    atomically (``write_errors`` names what was kept). Returns the file's size in bytes."""
    from kvstore.durable import write_errors

    with write_errors(f"writing {target.name}", "the previous file (if any) is intact"):
        _, table = write_image(target, sealing, header, chunks, replace=replace)
    return table.end


APPEND_WRITE_BYTES = 8 << 20  # sealed frames written per pwrite during one append


def append_frames(fd: int, codec: FrameCodec, table: FrameTable, records: memoryview, name: str) -> int:
    """Write frames of ``records`` past the commit point and fsync them (not the commit point
    itself: the caller publishes h6 next). Returns the new record count.

    Frames are sealed in place into a reused buffer (one AEAD call each) and written a few MiB at a
    time; the one fsync comes after the last write, before the caller's commit point."""
    first, offset = table.n_records, table.end
    rec = codec.rec_bytes
    per = max(1, FRAME_BYTES // rec) * rec
    body = records.cast("B")
    frames_per_write = max(1, APPEND_WRITE_BYTES // (per + FRAME_HEADER_BYTES + TAG_BYTES))
    group = frames_per_write * per
    spans = []
    pos = offset
    for start in range(0, len(body), group):
        part = body[start : start + group]
        n_frames = -(-len(part) // per)
        with _scratch(len(part) + n_frames * (FRAME_HEADER_BYTES + TAG_BYTES)) as out:
            used = 0
            for lo in range(0, len(part), per):
                chunk = part[lo : lo + per]
                index = first + (start + lo) // rec
                spans.append((index, len(chunk) // rec, pos + used, len(chunk) + TAG_BYTES))
                end = used + FRAME_HEADER_BYTES + len(chunk) + TAG_BYTES
                used += codec.seal_into(index, chunk, out[used:end])
            pwrite_all(fd, out[:used], pos)
        pos += used
    os.fsync(fd)  # data first: h6 must never point at frames not on disk
    for span in spans:
        table.add(*span)
    return table.n_records


def publish(fd: int, count: int, previous: int) -> None:
    """Write h6 and fsync it; on failure put the previous count back (best effort) and raise."""
    try:
        pwrite_all(fd, struct.pack("<i", count), NREC_OFFSET)
        os.fsync(fd)  # the commit point itself
    except OSError:
        try:
            pwrite_all(fd, struct.pack("<i", previous), NREC_OFFSET)
            os.fsync(fd)
        except OSError:
            pass
        raise


def load_records(fd: int, codec: FrameCodec, table: FrameTable, header: Header) -> KVRecords:
    """Every committed record, parsed and sanitized as ``coli_kv.parse`` parses a plaintext file."""
    image = read_frames(fd, codec, table, 0, len(table.firsts), head_room=HEADER_BYTES)
    image[:HEADER_BYTES] = header.with_nrec(table.n_records).to_bytes()
    return coli_kv.parse(image)


__all__ = [
    "FRAME_BYTES",
    "SEALED_HEADER_BYTES",
    "FrameCodec",
    "FrameTable",
    "JournalWriteError",
    "SealedHeader",
    "Sealing",
    "is_sealed",
    "read_records",
    "walk",
    "write_image",
]


# ---------------------------------------------------------------------------- the journal
from kvstore.journal import KVFile, open_regular  # noqa: E402  (journal.py imports this module lazily)


class SealedKVFile(KVFile):
    """A :class:`~kvstore.journal.KVFile` whose records are sealed in frames (module docstring).

    The same interface and the same protocol; opened through ``KVFile.open``/``create`` with
    ``sealing``. Reads decrypt only the frames covering the records asked for.
    """

    def __init__(self, path, fd, head: SealedHeader, table: FrameTable, tier, lock, dir_fd, target, sealing: Sealing):
        self._held: mmap.mmap | None = None  # map_for_reads: one mapping for every range read
        self._hold, self._held_lock = False, threading.Lock()
        super().__init__(path, fd, head.header.with_nrec(table.n_records), table.n_records, tier, lock, dir_fd, target)
        self._sealing = sealing
        self._set_image(head, table)

    def map_for_reads(self) -> None:
        """Let the range reads of this open file share one mapping of its committed frames, made at
        the first large read and unmapped at :meth:`close`, where each read would map and unmap its
        own range: an unmap makes every core the process runs on drop the range from its TLB, and a
        restore's reading threads unmap a range each per chunk. Only for a file that cannot shrink
        while it is open: a store's reader, which holds the session's read lock for its life."""
        self._hold = True

    def _mapping(self) -> mmap.mmap | None:
        """The held mapping (:meth:`map_for_reads`), made on first use; None where not held."""
        if not self._hold:
            return None
        with self._held_lock:
            if self._held is None and self._table.end >= MAP_BYTES:
                try:
                    self._held = mmap.mmap(self._fd, self._table.end, access=mmap.ACCESS_READ)
                except (OSError, ValueError):  # no mapping here: each range read as it would be
                    self._hold = False
            return self._held

    def close(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            try:
                held.close()
            except BufferError:  # a view still held (by a traceback's frame): unmapped when it goes
                pass
        super().close()

    def _set_image(self, head: SealedHeader, table: FrameTable) -> None:
        self._head = head
        self._codec_of: FrameCodec | None = None  # made on first read or write: opening needs no key
        self._table = table

    @property
    def _codec(self) -> FrameCodec:
        if self._codec_of is None:
            self._codec_of = FrameCodec(self._sealing, self._head, self.path.name)
        return self._codec_of

    @classmethod
    def create_sealed(cls, path, target, header: Header, tier, lock, dir_fd, sealing: Sealing) -> "SealedKVFile":
        head, table = write_image(target, sealing, header, [], replace=False)
        fd = open_regular(target, os.O_RDWR, dir_fd)
        return cls(path, fd, head, table, tier, lock, dir_fd, target, sealing)

    @classmethod
    def open_sealed(cls, path, fd, target, geometry, tier, lock, dir_fd, sealing: Sealing) -> "SealedKVFile":
        from kvstore.errors import CodecMismatch, GeometryMismatch, KeyUnavailable

        raw = os.pread(fd, SEALED_HEADER_BYTES, 0)
        if not is_sealed(raw):
            raise KeyUnavailable(
                f"{path.name} is a plaintext journal in a store encrypted at rest; it is not mixed in "
                "(move it out, or seal it with `kvstore crypto rotate-key`)"
            )
        head = SealedHeader.parse(raw, path.name)
        header = head.header
        if geometry is not None and header.geometry != geometry:
            raise GeometryMismatch(
                f"{path.name} is for another model: " + "; ".join(header.geometry.mismatches(geometry))
            )
        active = tier or header.tier
        if header.tier != active:
            raise CodecMismatch(f"{path.name} is {header.tier.describe()} but the active tier is {active.describe()}")
        table = walk(fd, header.rec_bytes, header.nrec, path.name)
        return cls(path, fd, head, table, active, lock, dir_fd, target, sealing)

    # ------------------------------------------------------------------ state
    @property
    def key_version(self) -> int:
        """The owner's data-key version this file is sealed under."""
        return self._head.key_version

    @property
    def committed_bytes(self) -> int:
        self._commit_point()
        return self._table.end

    def _commit_point(self) -> int:
        self._check_open()
        if self._committed is None:  # after a failure: trust the disk, not memory
            head = SealedHeader.parse(os.pread(self._fd, SEALED_HEADER_BYTES, 0), self.path.name)
            self._set_image(head, walk(self._fd, head.header.rec_bytes, head.header.nrec, self.path.name))
            self._committed = self._table.n_records
            self._header = head.header.with_nrec(self._committed)
        return self._committed

    def holds(self, n_records: int) -> bool:
        return self.n_records == n_records and self.size_bytes == self._table.end

    def size_after_truncate(self, n: int) -> int:
        n = min(n, self.n_records)
        frames = self._table.boundary(n)
        if frames is not None:  # in place: the file ends after the frame ending at record n
            return self._table.ends[frames - 1] if frames else SEALED_HEADER_BYTES
        return SEALED_HEADER_BYTES + self.growth(n * self._header.rec_bytes)  # a rewrite: one body, whole frames

    def growth(self, nbytes: int) -> int:
        """Bytes an append of ``nbytes`` of records adds to the file (its frames' headers and tags)."""
        per = max(1, FRAME_BYTES // self._header.rec_bytes) * self._header.rec_bytes
        return nbytes + -(-nbytes // per) * (FRAME_HEADER_BYTES + TAG_BYTES)

    # ------------------------------------------------------------------ reading
    def read_range(self, start: int, stop: int) -> memoryview:
        self._check_open()
        return read_records(self._fd, self._codec, self._table, start, min(stop, self._commit_point()), self._mapping())

    def iter_records(self, start: int, stop: int, chunk_records: int) -> Iterator[memoryview]:
        """Committed records ``[start, stop)`` decrypted in chunks that end on frames."""
        self._check_open()
        stop = min(stop, self._commit_point())
        return iter_records(self._fd, self._codec, self._table, start, stop, chunk_records, self._mapping())

    def chunk_starts(self, start: int, stop: int, chunk_records: int) -> list[int]:
        """Chunks of committed records ``[start, stop)`` ending on frames (:func:`chunk_starts`)."""
        self._check_open()
        return chunk_starts(self._table, start, min(stop, self._commit_point()), chunk_records)

    def read_into(self, out: memoryview, start: int, stop: int) -> int:
        """Decrypt committed records ``[start, stop)`` straight into ``out``; returns the bytes."""
        self._check_open()
        stop = min(stop, self._commit_point())
        return read_records_into(self._fd, self._codec, self._table, start, stop, out, self._mapping())

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        raw = self.read_range(start, stop)
        dtype = coli_kv.record_dtype(self.geometry, self._header.tier)
        return np.frombuffer(raw, dtype=dtype)["token"].astype(np.int32)

    def load(self) -> KVRecords:
        self._check_open()
        self._commit_point()
        return load_records(self._fd, self._codec, self._table, self._header)

    # ------------------------------------------------------------------ writing
    def _write_tail(self, records: np.ndarray, committed: int, total: int) -> None:
        got = append_frames(self._fd, self._codec, self._table, records.data.cast("B"), self.path.name)
        if got != total:
            raise FormatError(f"{self.path.name}: sealed up to record {got}, expected {total}")
        publish(self._fd, total, committed)

    def _publish(self, count: int, previous: int) -> None:
        publish(self._fd, count, previous)

    def _cut(self, target: int, committed: int) -> bool:
        frames = self._table.boundary(target)
        if frames is None:
            return False  # inside a frame: the caller rewrites the file (a new salt, new frames)
        publish(self._fd, target, committed)  # the lower commit point is durable before bytes disappear
        self._table.cut(frames)
        os.ftruncate(self._fd, self._table.end)
        os.fsync(self._fd)
        return True

    def _rewrite(self, extra: np.ndarray | None = None, keep: int | None = None) -> int:
        records = self.load()
        if keep is not None:
            records = records.slice(0, keep)
        bodies = [np.ascontiguousarray(records.records).data.cast("B")]
        if extra is not None:
            bodies.append(np.ascontiguousarray(extra).data.cast("B"))
        total = records.n + (0 if extra is None else extra.shape[0])
        header = Header(self.geometry, self.tier, total)
        head, table = write_image(self.target, self._sealing, header, bodies, replace=True)
        new_fd = open_regular(self.target, os.O_RDWR, self._dir_fd)
        os.close(self._fd)
        self._fd = new_fd
        self._set_image(head, table)
        self._header = header
        self._committed = total
        return total

    def reseal(self) -> int:
        """Rewrite the file under the owner's current data key (atomically: a new file, a new salt);
        returns the key version it is sealed under now."""
        self._require_writer()
        if self._head.key_version != self._sealing.keyring.current(self._sealing.owner).version:
            self._rewrite()
        return self._head.key_version
