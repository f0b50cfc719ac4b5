"""The encrypted journal (kvstore.sealed): refused by every plaintext reader, authenticated frame by
frame, never a repeated nonce, and the plaintext journal's durability protocol."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import kvstore.sealed
from kvstore import tiers
from kvstore.crypto import Keyring, LocalKEK
from kvstore.errors import EncryptedJournal, FormatError, KeyShredded, SealBroken
from kvstore.formats import coli_kv
from kvstore.journal import KVFile
from kvstore.sealed import (
    FRAME_HEADER_BYTES,
    SEALED_HEADER_BYTES,
    SealedHeader,
    SealedKVFile,
    Sealing,
    append_frames,
    walk,
)
from store.support import GEOMETRY, Rows

TIER = tiers.FP8
REC = coli_kv.record_bytes(GEOMETRY, TIER)


@pytest.fixture
def ring(tmp_path):
    (tmp_path / "keys").mkdir()
    return Keyring(tmp_path / "keys", LocalKEK(bytes(range(32))), create=True)


@pytest.fixture(params=["mapped", "held", "read"])
def ranges(request, monkeypatch):
    """Every range of frames decrypted from a mapping of the file, from one mapping the open file
    holds (``SealedKVFile.map_for_reads``, as a store's reader asks), or read into a buffer first
    (``kvstore.sealed.MAP_BYTES``: large ranges are mapped, small ones read)."""
    monkeypatch.setattr(kvstore.sealed, "MAP_BYTES", 0 if request.param in ("mapped", "held") else 1 << 62)
    if request.param == "held":
        made = SealedKVFile.__init__

        def holding(self, *args, **kwargs):
            made(self, *args, **kwargs)
            self.map_for_reads()

        monkeypatch.setattr(SealedKVFile, "__init__", holding)
    return request.param


def sealed(ring, path, identity=None):
    """The sealing of the journal at ``path`` (its identity: the file's name, as in a store)."""
    identity = identity or path.name.removesuffix(".coli_kv")
    return Sealing(ring, identity.rsplit("~", 1)[-1], identity)


def frames_of(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        head = SealedHeader.parse(os.pread(fd, SEALED_HEADER_BYTES, 0), path.name)
        return walk(fd, head.header.rec_bytes, head.header.nrec, path.name)
    finally:
        os.close(fd)


def nonces(path) -> list[bytes]:
    raw = path.read_bytes()
    return [raw[o + 16 : o + 28] for o in frames_of(path).offsets]


def make(ring, path, batches=(3, 5, 2), seed=0):
    rows = Rows(seed)
    with KVFile.create(path, GEOMETRY, TIER, sealing=sealed(ring, path)) as journal:
        for n in batches:
            journal.append(*rows.make(n))
    return rows


def plain_twin(tmp_path, batches=(3, 5, 2), seed=0):
    path = tmp_path / "plain.coli_kv"
    rows = Rows(seed)
    with KVFile.create(path, GEOMETRY, TIER) as journal:
        for n in batches:
            journal.append(*rows.make(n))
    return path


def test_the_records_are_the_plaintext_journals_and_none_is_in_clear(ring, ranges, tmp_path):
    path = tmp_path / "chat~alice.coli_kv"
    make(ring, path)
    plain = plain_twin(tmp_path)
    with KVFile.open(path, sealing=sealed(ring, path)) as journal:
        loaded = journal.load()
        assert loaded.n == 10 and loaded.records.tobytes() == coli_kv.load(plain).records.tobytes()
        assert journal.read_range(4, 9) == coli_kv.load(plain).records[4:9].tobytes()
        assert (journal.read_tokens(2, 7) == coli_kv.load(plain).tokens[2:7]).all()
    body = coli_kv.load(plain).records.tobytes()
    stored = path.read_bytes()
    for at in range(0, len(body) - 16, 16):  # no 16-byte run of the plaintext appears in the file
        assert body[at : at + 16] not in stored
    assert len(frames_of(path).offsets) == 3  # one frame per append batch


def test_every_plaintext_reader_refuses_it_with_a_typed_error(ring, tmp_path):
    path = tmp_path / "chat~alice.coli_kv"
    make(ring, path)
    for read in (coli_kv.load, lambda p: KVFile.open(p), coli_kv.read_header):
        with pytest.raises(EncryptedJournal, match="encrypted at rest") as caught:
            read(path)
        assert isinstance(caught.value, FormatError)
    for command in (["inspect", str(path)], ["export", str(path), str(tmp_path / "out.npz")], ["repair", str(path)]):
        done = subprocess.run([sys.executable, "-m", "kvstore", *command], capture_output=True, text=True)
        assert done.returncode != 0 and "encrypted at rest" in done.stderr, (command, done.stderr)
    assert not (tmp_path / "out.npz").exists()


@pytest.mark.parametrize(
    "where",
    [
        "header geometry",
        "header salt",
        "key version",
        "frame first",
        "frame count",
        "frame length",
        "nonce",
        "ciphertext",
        "tag",
    ],
)
def test_a_flipped_bit_anywhere_is_refused(ring, ranges, tmp_path, where):
    path = tmp_path / "chat~alice.coli_kv"
    make(ring, path)
    second = frames_of(path).offsets[1]
    at = {
        "header geometry": 9,
        "header salt": 60,
        "key version": 52,
        "frame first": second,
        "frame count": second + 4,
        "frame length": second + 8,
        "nonce": second + 20,
        "ciphertext": second + FRAME_HEADER_BYTES + 7,
        "tag": frames_of(path).ends[1] - 3,
    }[where]
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x04
    path.write_bytes(raw)
    with pytest.raises((SealBroken, KeyShredded, FormatError)):
        with KVFile.open(path, sealing=sealed(ring, path)) as journal:
            journal.load()


def test_a_range_read_into_a_buffer_is_decrypted_in_place_or_zeroed(ring, ranges, tmp_path):
    """``read_into`` (a restore's ring): records across frames land at their places in the caller's
    buffer, a range cut inside frames too; a changed byte in a frame is refused with every byte of
    that frame written zeroed, never its plaintext or garbage."""
    path = tmp_path / "chat~alice.coli_kv"
    make(ring, path, (3, 5, 2))
    expected = coli_kv.load(plain_twin(tmp_path)).records.tobytes()
    out = np.full(10 * REC, 0xAB, dtype=np.uint8)
    with KVFile.open(path, sealing=sealed(ring, path)) as journal:
        assert journal.read_into(out.data, 0, 10) == 10 * REC and out.tobytes() == expected
        assert journal.read_into(out.data, 2, 9) == 7 * REC and out[: 7 * REC].tobytes() == expected[2 * REC : 9 * REC]
    table = frames_of(path)
    raw = bytearray(path.read_bytes())
    raw[table.offsets[1] + FRAME_HEADER_BYTES + REC + 5] ^= 0x10  # inside the second frame's ciphertext
    path.write_bytes(raw)
    out[:] = 0xAB
    with KVFile.open(path, sealing=sealed(ring, path)) as journal:
        with pytest.raises(SealBroken, match=r"records \[3, 8\) failed authentication"):
            journal.read_into(out.data, 0, 10)
    assert out[: 3 * REC].tobytes() == expected[: 3 * REC]  # the frame before it, decrypted
    assert not out[3 * REC : 8 * REC].any()  # the refused frame: zeroed


def test_a_journal_cut_short_under_an_open_reader_is_refused_not_misread(ring, ranges, tmp_path):
    """Frames walked at open and then cut off the file by something outside kvstore's locks (an
    operator's ``truncate``): a read of them is :class:`SealBroken`, whether its range is mapped
    (the mapping would pass the file's end) or read."""
    path = tmp_path / "chat~alice.coli_kv"
    make(ring, path, (3, 5, 2))
    expected = coli_kv.load(plain_twin(tmp_path)).records.tobytes()
    with KVFile.open(path, sealing=sealed(ring, path)) as journal:
        os.truncate(path, frames_of(path).ends[1] - 40)  # into the second frame
        with pytest.raises(SealBroken, match="ended inside its committed frames"):
            journal.read_range(0, 10)
        assert journal.read_range(0, 3) == expected[: 3 * REC]  # the frame still whole reads


def test_a_reader_holds_one_mapping_until_it_closes_and_a_cut_file_is_refused_not_a_crash(ring, tmp_path, monkeypatch):
    """A file whose reads share one mapping (``map_for_reads``) maps it once, at its first read, and
    unmaps it at close; cut short under it afterwards (an operator's ``truncate``), a read of the
    cut frames is :class:`SealBroken` — a page of the mapping past the file's end would kill the
    process with SIGBUS — and the frames still whole read as before."""
    import mmap

    path = tmp_path / "chat~alice.coli_kv"
    batches = (30, 50, 20)  # frames of pages: the cut below leaves whole pages of the mapping past the end
    make(ring, path, batches)
    expected = coli_kv.load(plain_twin(tmp_path, batches)).records.tobytes()
    monkeypatch.setattr(kvstore.sealed, "MAP_BYTES", 0)
    maps = []
    real = mmap.mmap

    def counted(*args, **kwargs):
        made = real(*args, **kwargs)
        maps.append(made)
        return made

    monkeypatch.setattr(mmap, "mmap", counted)
    with KVFile.open(path, sealing=sealed(ring, path)) as journal:
        journal.map_for_reads()
        out = np.empty(100 * REC, dtype=np.uint8)
        for start, stop in ((0, 100), (20, 90), (80, 100)):
            assert journal.read_into(out.data, start, stop) == (stop - start) * REC
            assert out[: (stop - start) * REC].tobytes() == expected[start * REC : stop * REC]
        assert journal.read_range(0, 100) == expected
        assert len(maps) == 1 and not maps[0].closed  # one mapping for every read
        os.truncate(path, frames_of(path).ends[0] + 40)  # into the second frame
        with pytest.raises(SealBroken, match="ended inside its committed frames"):
            journal.read_into(out.data, 0, 100)
        assert journal.read_range(0, 30) == expected[: 30 * REC]
    assert maps[0].closed  # unmapped with the file


def test_a_file_that_cannot_be_mapped_is_read(ring, tmp_path, monkeypatch):
    """A file system that refuses ``mmap`` (some network or FUSE mounts) costs the copy, not the read."""
    import errno
    import mmap

    path = tmp_path / "chat~alice.coli_kv"
    make(ring, path)
    expected = coli_kv.load(plain_twin(tmp_path)).records.tobytes()

    def refused(*args, **kwargs):
        raise OSError(errno.ENODEV, "no mapping here")

    monkeypatch.setattr(kvstore.sealed, "MAP_BYTES", 0)
    monkeypatch.setattr(mmap, "mmap", refused)
    with KVFile.open(path, sealing=sealed(ring, path)) as journal:
        assert journal.load().records.tobytes() == expected
        assert journal.read_range(2, 9) == expected[2 * REC : 9 * REC]


def test_frames_cannot_be_spliced_reordered_or_moved(ring, tmp_path):
    a, b = tmp_path / "a~alice.coli_kv", tmp_path / "b~alice.coli_kv"
    make(ring, a, (4, 4))
    make(ring, b, (4, 4), seed=1)
    fa, fb = frames_of(a), frames_of(b)
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    # another file's frame (same owner, same key, same position) in place of ours
    spliced = raw_a[: fa.offsets[1]] + raw_b[fb.offsets[1] : fb.ends[1]]
    a.write_bytes(spliced)
    with pytest.raises(SealBroken):
        KVFile.open(a, sealing=sealed(ring, a, "a~alice")).load()
    # our two frames swapped (their headers rewritten to look in order)
    first, second = raw_a[fa.offsets[0] : fa.ends[0]], raw_a[fa.offsets[1] : fa.ends[1]]
    swapped = (struct.pack("<I", 0) + second[4:], struct.pack("<I", 4) + first[4:])
    a.write_bytes(raw_a[: fa.offsets[0]] + swapped[0] + swapped[1])
    with pytest.raises(SealBroken):
        KVFile.open(a, sealing=sealed(ring, a, "a~alice")).load()
    # the whole file moved to another session's name
    a.write_bytes(raw_a)
    moved = tmp_path / "c~alice.coli_kv"
    shutil.copy(a, moved)
    with pytest.raises(SealBroken):
        KVFile.open(moved, sealing=sealed(ring, moved, "c~alice")).load()
    assert KVFile.open(a, sealing=sealed(ring, a, "a~alice")).load().n == 8


def test_another_owners_key_or_another_kek_reads_nothing(ring, tmp_path):
    path = tmp_path / "chat~alice.coli_kv"
    make(ring, path)
    ring.current("bob")
    with pytest.raises(SealBroken):  # bob's key under alice's name is another key
        KVFile.open(path, sealing=Sealing(ring, "bob", "chat~alice")).load()
    (tmp_path / "other").mkdir()
    stranger = Keyring(tmp_path / "other", LocalKEK(os.urandom(32)), create=True)
    stranger.current("alice")
    with pytest.raises(SealBroken):
        KVFile.open(path, sealing=sealed(stranger, path)).load()


def test_nonces_never_repeat_across_restarts_and_a_crash_dropped_tail(ring, tmp_path):
    path = tmp_path / "chat~alice.coli_kv"
    rows = make(ring, path, (2, 2))
    seen = nonces(path)
    for _ in range(3):  # restarts: reopen and append
        with KVFile.open(path, writable=True, sealing=sealed(ring, path)) as journal:
            journal.append(*rows.make(3))
        seen += nonces(path)[-1:]
    # a crash after the frame's fsync, before the commit point: its frame is on disk, never published
    with KVFile.open(path, writable=True, sealing=sealed(ring, path)) as journal:
        records = journal.encode(*rows.make(3))
        append_frames(journal._fd, journal._codec, journal._table, records.data.cast("B"), path.name)
        dropped = path.read_bytes()[journal._table.offsets[-1] + 16 : journal._table.offsets[-1] + 28]
    seen.append(dropped)
    with KVFile.open(path, writable=True, sealing=sealed(ring, path)) as journal:
        assert journal.n_records == 13 and not journal.holds(13)  # the dropped tail is ignored
        journal.append(*rows.make(3))  # takes the dropped frame's place, at the same offset
        assert journal.load().n == 16
    seen += nonces(path)[-1:]
    assert len(seen) == len(set(seen)) == 2 + 3 + 1 + 1


def test_a_torn_tail_is_dropped_as_in_a_plaintext_journal(ring, ranges, tmp_path):
    path = tmp_path / "chat~alice.coli_kv"
    rows = make(ring, path, (4,))
    size = path.stat().st_size
    with open(path, "ab") as f:  # a frame header and half a ciphertext, never committed
        f.write(struct.pack("<IIQ", 4, 2, 2 * REC + 16) + os.urandom(12) + os.urandom(REC))
    with KVFile.open(path, writable=True, sealing=sealed(ring, path)) as journal:
        assert journal.n_records == 4 and not journal.holds(4)
        journal.truncate(4)  # what a store's reconcile does
        assert path.stat().st_size == size
        journal.append(*rows.make(2))
        assert journal.load().n == 6
    raw = bytearray(path.read_bytes())  # h6 past what is on disk: the short file stops at its last frame
    raw[32:36] = struct.pack("<i", 50)
    path.write_bytes(raw)
    assert KVFile.open(path, sealing=sealed(ring, path)).n_records == 6


def test_truncate_at_a_frame_is_in_place_and_inside_one_rewrites(ring, ranges, tmp_path):
    path = tmp_path / "chat~alice.coli_kv"
    make(ring, path)
    plain = coli_kv.load(plain_twin(tmp_path)).records.tobytes()
    inode = path.stat().st_ino
    with KVFile.open(path, writable=True, sealing=sealed(ring, path)) as journal:
        assert journal.truncate(8) == 8 and path.stat().st_ino == inode  # a frame boundary
        assert journal.truncate(6) == 6 and path.stat().st_ino != inode  # inside a frame: a new file
        assert journal.load().records.tobytes() == plain[: 6 * REC]
    assert KVFile.open(path, sealing=sealed(ring, path)).load().records.tobytes() == plain[: 6 * REC]


def test_large_batches_are_cut_into_bounded_frames(ring, ranges, tmp_path, monkeypatch):
    import kvstore.sealed as sealed_module

    monkeypatch.setattr(sealed_module, "FRAME_BYTES", 3 * REC)
    path = tmp_path / "chat~alice.coli_kv"
    make(ring, path, (10,))
    table = frames_of(path)
    assert table.counts == [3, 3, 3, 1]
    with KVFile.open(path, sealing=sealed(ring, path)) as journal:
        assert journal.read_range(2, 7) == coli_kv.load(plain_twin(tmp_path, (10,))).records[2:7].tobytes()
    assert np.diff(table.firsts).tolist() == [3, 3, 3]


def test_a_journal_written_with_smaller_frames_reads_and_grows_with_the_current_size(ring, tmp_path, monkeypatch):
    """Readers take each frame's size from its header: a journal written when frames were smaller
    (1 MiB before, here 2 records) reads whole and by range, and grows in frames of today's size."""
    import kvstore.sealed as sealed_module

    path = tmp_path / "chat~alice.coli_kv"
    with monkeypatch.context() as old_writer:
        old_writer.setattr(sealed_module, "FRAME_BYTES", 2 * REC)
        rows = make(ring, path, (5, 3))
    with KVFile.open(path, writable=True, sealing=sealed(ring, path)) as journal:
        journal.append(*rows.make(6))  # today's frame size: one frame
    assert frames_of(path).counts == [2, 2, 1, 2, 1, 6]
    expected = coli_kv.load(plain_twin(tmp_path, (5, 3, 6))).records
    with KVFile.open(path, sealing=sealed(ring, path)) as journal:
        assert journal.load().records.tobytes() == expected.tobytes()
        assert journal.read_range(3, 12) == expected[3:12].tobytes()


def test_a_reopened_journal_reuses_its_walk_only_while_the_frames_are_the_same(ring, tmp_path):
    path = tmp_path / "chat~alice.coli_kv"
    rows = make(ring, path, (3, 3, 3))
    expected = KVFile.open(path, sealing=sealed(ring, path)).load().records.tobytes()
    with KVFile.open(path, writable=True, sealing=sealed(ring, path)) as journal:
        journal.truncate(3)  # in place: the same inode, a lower commit point
        journal.append(*rows.make(4))  # new frames where the walked ones were
        journal.append(*rows.make(2))
        now = journal.load().records.tobytes()
    assert now[: 3 * REC] == expected[: 3 * REC] and len(now) == 9 * REC
    with KVFile.open(path, sealing=sealed(ring, path)) as again:  # a fresh open: no stale frame table
        assert again.n_records == 9 and again.load().records.tobytes() == now
