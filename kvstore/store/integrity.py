"""Integrity beyond the format: a blake2b-256 per appended turn, kept in the index, and verify.

The ``.coli_kv`` bytes must stay compatible, so what the format cannot see (a silent bit flip in a
code byte) is caught here: every append records the hash of the record bytes it wrote with its
record range (a :class:`~kvstore.store.index.Turn`). :meth:`Integrity.verify` re-hashes the journal
(or the archive) and reports the first bad turn; ``resume(verify=True)`` serves only what precedes
it; a cut inside a turn checks the whole turn, then re-hashes the part kept.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Iterator

import numpy as np

from kvstore.errors import IntegrityError, SessionNotFound
from kvstore.migrations import index as schema
from kvstore.store.context import StoreContext
from kvstore.store.index import Turn, refuse_damaged, visible
from kvstore.store.records import bytes_view, record_chunks
from kvstore.store.results import VerifyReport
from kvstore.store.values import IndexRecord, Progress, public_id, record_bytes_of


def turn_digest(payload) -> bytes:
    """The blake2b-256 of a turn's record bytes (what the index stores per turn)."""
    return hashlib.blake2b(payload, digest_size=schema.DIGEST_BYTES).digest()


def _hasher():
    return hashlib.blake2b(digest_size=schema.DIGEST_BYTES)


def complete_end(turns: list[Turn], keep: int, record: IndexRecord) -> int:
    """The watermark after cutting at ``keep``: the last complete turn that ends by then."""
    return min(record["watermark"], max((t.end for t in turns if t.end <= keep and t.complete), default=0))


def first_bad_turn(
    turns: list[Turn], stop: int, chunks: Iterable[bytes | memoryview], rec_bytes: int, progress: Progress | None = None
) -> tuple[int, int | None]:
    """Re-hash the turns ending at or before ``stop`` against the record bytes ``chunks`` yields
    from record 0 on; returns (turns checked, index of the first bad turn or None).

    A gap or an overlap in the hashed ranges is bad from there (nothing past it is vouched for), and
    so is a turn the bytes end inside (``chunks`` raising :class:`IntegrityError` included).
    ``progress(bytes_hashed, bytes_total)`` is called after each chunk.
    """
    checked = [t for t in turns if t.end <= stop]
    if not checked:
        return 0, None
    expected_start = 0
    for index, turn in enumerate(checked):
        if turn.start != expected_start or turn.end <= turn.start:
            return index, index
        expected_start = turn.end
    hasher = _hasher()
    turn_index, remaining = 0, (checked[0].end - checked[0].start) * rec_bytes
    hashed, to_hash = 0, checked[-1].end * rec_bytes
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            if progress is not None:
                hashed += len(view)
                progress(min(hashed, to_hash), to_hash)
            while len(view):
                take = min(remaining, len(view))
                hasher.update(view[:take])
                view = view[take:]
                remaining -= take
                if remaining == 0:
                    if hasher.digest() != checked[turn_index].digest:
                        return turn_index, turn_index
                    turn_index += 1
                    if turn_index == len(checked):
                        return turn_index, None
                    hasher = _hasher()
                    remaining = (checked[turn_index].end - checked[turn_index].start) * rec_bytes
    except IntegrityError:
        return turn_index, turn_index  # the file ends inside this turn
    return turn_index, (turn_index if turn_index < len(checked) else None)


class TurnHasher:
    """Hash a stream of record chunks at the given turns' boundaries (ranges kept, bytes new)."""

    def __init__(self, turns: list[Turn], rec_bytes: int):
        self._turns = turns
        self._rec_bytes = rec_bytes
        self._digests: list[bytes] = []
        self._hasher = _hasher()
        self._remaining = (turns[0].end - turns[0].start) * rec_bytes if turns else 0

    def wrap(self, chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """Pass ``chunks`` through, hashing them on the way."""
        for chunk in chunks:
            view = bytes_view(chunk)
            while len(view) and len(self._digests) < len(self._turns):
                take = min(self._remaining, len(view))
                self._hasher.update(view[:take])
                view = view[take:]
                self._remaining -= take
                if self._remaining == 0:
                    self._digests.append(self._hasher.digest())
                    self._hasher = _hasher()
                    if len(self._digests) < len(self._turns):
                        nxt = self._turns[len(self._digests)]
                        self._remaining = (nxt.end - nxt.start) * self._rec_bytes
            yield chunk

    def turns(self) -> list[Turn]:
        """The turns with the digests of the bytes that went through :meth:`wrap`."""
        if len(self._digests) != len(self._turns):
            raise IntegrityError("the rewritten journal ended before its last turn")
        return [turn._replace(digest=digest) for turn, digest in zip(self._turns, self._digests)]


class Integrity:
    """Turn hashes of the sessions of one store: check, re-hash a cut turn, verify."""

    def __init__(self, ctx: StoreContext):
        self.ctx = ctx

    def check_turns(
        self, record: IndexRecord, turns: list[Turn], stop: int, progress: Progress | None = None
    ) -> tuple[int, int | None]:
        """Re-hash the turns ending at or before ``stop`` from the session's journal or archive;
        returns (turns checked, first bad index) (:func:`first_bad_turn`).

        The caller holds the session's read or write lock. ``progress(bytes_hashed, bytes_total)``
        is called after each chunk read.
        """
        checked = [t for t in turns if t.end <= stop]
        if not checked:
            return 0, None
        chunks = record_chunks(self.ctx, record, 0, checked[-1].end)
        return first_bad_turn(checked, stop, chunks, record_bytes_of(record), progress)

    def rehash_prefix(self, record: IndexRecord, turn: Turn, keep: int, complete: bool) -> Turn:
        """The turn ``[start, keep)`` cut out of ``turn``, after checking the whole turn's hash.

        Raises
        ------
        IntegrityError : the whole turn no longer matches its hash (a cut must not vouch for it)
        """
        rec_bytes = record_bytes_of(record)
        whole, part = _hasher(), _hasher()
        remaining_part = (keep - turn.start) * rec_bytes
        for chunk in record_chunks(self.ctx, record, turn.start, turn.end):
            whole.update(chunk)
            if remaining_part > 0:
                part.update(chunk[:remaining_part])
                remaining_part -= min(remaining_part, len(chunk))
        if whole.digest() != turn.digest:
            raise IntegrityError(
                f"records {turn.start}..{turn.end} of session {public_id(record['id'])!r} do not match their hash; "
                f"cut at or before record {turn.start}, or run repair"
            )
        return Turn(turn.start, keep, complete, part.digest())

    def verify(self, session_id: str, owner: str | None, progress: Progress | None = None) -> VerifyReport:
        """Re-hash every turn of a session (journal or archive) against the hashes in the index."""
        ctx = self.ctx
        ctx.record(session_id, owner)
        with ctx.reading(session_id):
            # One snapshot for the count and the turns: an append (which needs no read lock)
            # commits both together, and a turn read past the count looked like damage.
            with ctx.index.read() as txn:
                record = ctx.index.get(txn, session_id)
                turns = ctx.index.turns(txn, session_id)
            if not visible(record, owner):
                raise SessionNotFound(f"no session {public_id(session_id)!r}")
            refuse_damaged(record)
            checked, bad = self.check_turns(record, turns, record["n_records"], progress)
        covered = turns[-1].end if turns else 0
        first_bad = None
        if bad is not None:
            turn = turns[bad]
            first_bad = {"turn": bad, "start": turn.start, "end": turn.end}
        elif covered != record["n_records"]:
            first_bad = {"turn": len(turns), "start": covered, "end": record["n_records"]}
        good = first_bad["start"] if first_bad else record["n_records"]
        return VerifyReport(session_id, first_bad is None, record["n_records"], checked, first_bad, good)
