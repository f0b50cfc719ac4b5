"""A replica's local cache of segment objects (``--data`` of ``kvstore serve --index --blobs``).

Segments are immutable and named once, so a cached copy is never stale and needs no
invalidation: a name always means the same bytes. What is cached is whole objects, by name, in
``<data>/segments/``, within a byte budget, evicted least recently used first (this replica's own
LRU; the global budget of sessions is the index's). The session's segment list and counts always
come from PostgreSQL: the cache only saves GETs, so an empty cache (a new or restarted replica)
serves everything from S3.

On a store encrypted at rest a copy is the sealed object as fetched (ciphertext only, never
plaintext on the replica's disk: :meth:`SegmentCache.sealed`), authenticated by the AEAD tag each
time it is opened, then matched against the records' digest.

A damaged copy is never served: its length must equal the segment's ``nbytes`` (every read), and
its blake2b-256 the segment's digest — checked on the first read of a file this process did not
write or check itself (a file's identity, inode, size and mtime, changing makes it checked
again) and on every read of a resume with ``verify``. A failed check deletes the copy and the
caller fetches the object again.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from kvstore.store.results import CacheCounts
from kvstore.store.shared.index import Segment

log = logging.getLogger("kvstore.store")

SEGMENTS_DIR = "segments"
DEFAULT_CACHE_BYTES = 8 << 30


class SegmentCache:
    """Whole segment objects on local disk, at most ``budget_bytes``, least recently used evicted.

    Parameters
    ----------
    folder : the replica's local folder (``--data``); copies go to ``folder/segments``
    budget_bytes : the most bytes the copies may take; an object larger than it is never cached
    """

    def __init__(self, folder: str | os.PathLike, budget_bytes: int = DEFAULT_CACHE_BYTES):
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.root = Path(folder) / SEGMENTS_DIR  # made by the first copy: --data stays empty until then
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self._checked: dict[str, tuple[int, int, int]] = {}  # file name -> (inode, size, mtime) it was checked at
        self._used = 0
        self._hits = self._misses = self._damaged = self._evictions = 0
        self._adopt()

    def _adopt(self) -> None:
        """Take the copies a previous run left (oldest modified first); drop temporary files."""
        found = []
        for entry in self.root.rglob("*") if self.root.is_dir() else ():
            if not entry.is_file():
                continue
            if entry.name.startswith("."):  # a write a crash interrupted
                entry.unlink(missing_ok=True)
                continue
            stat = entry.stat()
            found.append((stat.st_mtime_ns, entry.name, stat.st_size))
        for _, name, size in sorted(found):
            self._lru[name] = size
            self._used += size
        with self._lock:
            self._evict()

    def _file(self, object_name: str) -> tuple[str, Path]:
        # object names hold '/': a digest of the name is a flat, fixed-length file name
        name = hashlib.blake2b(object_name.encode(), digest_size=16).hexdigest()
        return name, self.root / name[:2] / name

    # ------------------------------------------------------------------ reading
    def read(self, segment: Segment, offset: int, into: memoryview, *, verify: bool = False) -> bool:
        """Fill ``into`` with bytes ``[offset, offset + len(into))`` of ``segment`` from its local
        copy; False (a miss) when there is none or it failed its check (then it is deleted).

        The digest is checked on the first read of a copy this process did not write or check (or
        whose identity changed since), and on every read with ``verify`` (a resume that re-hashes).
        """
        name, path = self._file(segment.object)
        whole = offset == 0 and len(into) == segment.nbytes
        try:
            with open(path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
                if stat.st_size != segment.nbytes:
                    raise _Damaged
                with self._lock:
                    checked = self._checked.get(name) == identity
                if verify or not checked:
                    if whole:  # straight into the caller's buffer, hashed there
                        if handle.readinto(into) != len(into) or not segment.holds(into):
                            raise _Damaged
                    else:
                        body = handle.read()
                        if len(body) != segment.nbytes or not segment.holds(body):
                            raise _Damaged
                        into[:] = memoryview(body)[offset : offset + len(into)]
                    with self._lock:
                        self._checked[name] = identity
                else:
                    handle.seek(offset)
                    if handle.readinto(into) != len(into):
                        raise _Damaged
        except OSError:  # no copy (or an unreadable one): the object store serves it
            self._missed(name)
            return False
        except _Damaged:
            self._missed(name, damaged=path)
            return False
        self._hit(name)
        return True

    def view(self, segment: Segment, *, verify: bool = False) -> memoryview | None:
        """The local copy of ``segment`` as a read-only view of the mapped file — no copy: the page
        cache's pages themselves — or None (a miss; a copy that fails its check is deleted). Checked
        as :meth:`read` checks. The view stays valid while it is held, even if the copy is evicted
        meanwhile (an unlinked file's pages live until the last map goes)."""
        name, path = self._file(segment.object)
        try:
            with open(path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
                if stat.st_size != segment.nbytes or segment.nbytes == 0:
                    raise _Damaged
                # read in now, by this (worker) thread: whoever touches the view later never waits on the disk
                populate = getattr(mmap, "MAP_POPULATE", 0)
                mapped = memoryview(
                    mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
                )
            with self._lock:
                checked = self._checked.get(name) == identity
            if verify or not checked:
                if not segment.holds(mapped):
                    raise _Damaged
                with self._lock:
                    self._checked[name] = identity
        except OSError:  # no copy (or an unreadable one): the object store serves it
            self._missed(name)
            return None
        except _Damaged:
            self._missed(name, damaged=path)
            return None
        self._hit(name)
        return mapped

    # ------------------------------------------------------------------ sealed objects
    @staticmethod
    def _stored(segment: Segment) -> int:
        """The bytes a copy of ``segment`` holds: its sealed object's on an encrypted store (the
        ciphertext: never plaintext on the replica's disk), else its records'."""
        return segment.object_bytes if segment.key_version is not None else segment.nbytes

    def sealed(self, segment: Segment) -> memoryview | None:
        """The local copy of a sealed segment's object as a read-only view of the mapped file (the
        ciphertext, decrypted from the page cache's pages with no copy first) — checked for its
        length here and authenticated by the caller when opened (a failure: :meth:`drop`) — or None
        (a miss). Valid while held, as :meth:`view`'s."""
        name, path = self._file(segment.object)
        try:
            with open(path, "rb") as handle:
                if os.fstat(handle.fileno()).st_size != segment.object_bytes or segment.object_bytes == 0:
                    self._missed(name, damaged=path)
                    return None
                populate = getattr(mmap, "MAP_POPULATE", 0)
                body = memoryview(mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ))
        except OSError:
            self._missed(name)
            return None
        self._hit(name)
        return body

    def drop(self, segment: Segment) -> None:
        """Delete the copy of ``segment`` (it failed authentication when opened)."""
        name, path = self._file(segment.object)
        self._missed(name, damaged=path)

    def _hit(self, name: str) -> None:
        with self._lock:
            self._hits += 1
            if name in self._lru:
                self._lru.move_to_end(name)

    def _missed(self, name: str, damaged: Path | None = None) -> None:
        """A miss; ``damaged``: the copy failed its check and is deleted."""
        if damaged is not None:
            damaged.unlink(missing_ok=True)
        with self._lock:
            self._damaged += damaged is not None
            self._misses += 1
            self._forget(name)

    # ------------------------------------------------------------------ writing
    def fits(self, segment: Segment) -> bool:
        return 0 < segment.nbytes <= self.budget_bytes

    def put(self, segment: Segment, payload: bytes | memoryview) -> None:
        """Keep a copy of ``segment``'s whole object (``payload``, already checked against its
        digest by the caller), then evict least recently used copies past the budget.

        Written to a temporary file and renamed into place, so a reader sees the whole copy or
        none. No fsync: a copy torn by a crash fails its length or digest check and is fetched
        again; nothing depends on the cache surviving.
        """
        if not self.fits(segment) or len(payload) != self._stored(segment):
            return
        name, path = self._file(segment.object)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=".", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(payload)
                os.replace(temporary, path)
                stat = os.stat(path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as exc:  # a full or removed disk fails the copy, never the read it came with
            log.warning("segment cache: not keeping %s (%s)", segment.object, exc)
            return
        with self._lock:
            self._forget(name)
            self._lru[name] = len(payload)
            self._used += len(payload)
            self._checked[name] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            self._evict()

    def _forget(self, name: str) -> None:
        size = self._lru.pop(name, None)
        if size is not None:
            self._used -= size
        self._checked.pop(name, None)

    def _evict(self) -> None:
        while self._used > self.budget_bytes and self._lru:
            name, size = self._lru.popitem(last=False)
            self._used -= size
            self._checked.pop(name, None)
            (self.root / name[:2] / name).unlink(missing_ok=True)
            self._evictions += 1

    def counts(self) -> CacheCounts:
        with self._lock:
            return CacheCounts(
                self._hits, self._misses, self._damaged, self._evictions, self._used, len(self._lru), self.budget_bytes
            )


class _Damaged(Exception):
    """A local copy whose length or digest does not match its segment (internal: it is a miss)."""
