"""Copying sessions between an embedded store and a shared one (``kvstore store push`` / ``pull``).

A session travels as its turns: each turn of the embedded index (records ``[start, end)``,
complete or not, the blake2b-256 of its bytes) becomes one segment of the shared store, whose
digest is the same hash. The two sides are therefore compared without reading a row: a session
whose turns and segments agree (same ranges, hashes and completeness) and whose metadata agrees is
**unchanged** and nothing is written; a target holding a prefix of the source's turns is
**extended** by the missing ones; a target whose metadata alone differs is **updated**; any other
difference is a conflict the copy refuses (:class:`SessionExists`) rather than overwrite. So a
second run changes nothing, and a run stopped by a failure resumes where it stopped when repeated
(``Unavailable`` — PostgreSQL or S3 down — stops the whole run; every other refusal is per
session and the run goes on).

Bytes are checked at both ends: push hashes every turn it reads and refuses a session whose bytes
no longer match their turn's hash (the damage ``kvstore verify`` reports) before uploading that
turn; pull appends through the embedded store's validated path (non-finite values refused, never
rewritten) and then compares the turn hashes the embedded index computed with the segments'
digests. The journal bytes of a session are thus identical on both sides (the shared image is
``SharedStore.file_bytes``).

Kept across a copy: id, owner, model, geometry and tier (so the fingerprint), tags, watermark,
every turn's completeness, created / updated / last-used times, parent and fork point, and whether
the session was parked (a pulled session that was parked is parked again). Prefix blocks are not
carried: pull recomputes them from the tokens, as any append does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from kvstore.errors import (
    InvalidRequest,
    KVStoreError,
    RecordCountMismatch,
    SessionDamaged,
    SessionExists,
    Unavailable,
)
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Header
from kvstore.store.index import visible
from kvstore.store.integrity import turn_digest
from kvstore.store.records import record_chunks
from kvstore.store.shared.store import SharedStore, default_holder
from kvstore.store.values import IndexRecord, Progress, geometry_of, public_id, record_bytes_of, tier_of

if TYPE_CHECKING:
    from kvstore.store.session_store import SessionStore

Action = Literal["created", "extended", "updated", "unchanged", "refused"]
PUSH_LEASE_TTL_S = 120.0  # each commit renews it; it must outlast the upload of one turn
PULL_BATCH_BYTES = 64 << 20  # segments read together (fetched in parallel) before they are appended


class Span(NamedTuple):
    """One turn (embedded) or segment (shared): records ``[start, end)`` and their blake2b-256."""

    start: int
    end: int
    complete: bool
    digest: bytes


@dataclass(frozen=True)
class Copied:
    """What a copy did with one session."""

    id: str
    owner: str
    action: Action
    n_records: int  # records the source holds
    copied_records: int = 0
    copied_bytes: int = 0
    reason: str | None = None  # why it was refused
    damaged: bool = False  # refused because its bytes do not match their hashes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TransferReport:
    direction: Literal["push", "pull"]
    sessions: list[Copied] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = {action: 0 for action in ("created", "extended", "updated", "unchanged", "refused")}
        for copied in self.sessions:
            out[copied.action] += 1
        return out

    @property
    def copied_bytes(self) -> int:
        return sum(copied.copied_bytes for copied in self.sessions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "direction": self.direction,
            "counts": self.counts(),
            "copied_bytes": self.copied_bytes,
            "sessions": [copied.to_dict() for copied in self.sessions],
        }


@dataclass
class _Plan:
    key: str
    owner: str
    n_records: int
    rec_bytes: int
    create: bool
    missing: list[Span]
    flips: list[Span]  # turns the target holds incomplete that the source completed
    meta_same: bool
    target_end: int

    @property
    def nbytes(self) -> int:
        return sum(span.end - span.start for span in self.missing) * self.rec_bytes

    @property
    def unchanged(self) -> bool:
        return not self.create and not self.missing and not self.flips and self.meta_same


def _diff(key: str, source: list[Span], target: list[Span], where: str) -> tuple[list[Span], list[Span]]:
    """``(missing, flips)``: the source's turns the target lacks, and those it holds incomplete.

    Raises
    ------
    SessionExists : the target holds other records than a prefix of the source's
    """
    if len(target) > len(source):
        raise SessionExists(
            f"session {public_id(key)!r} holds {target[-1].end} records in {where}, more than the "
            f"{source[-1].end if source else 0} being copied; nothing was changed (delete one of them to copy it)"
        )
    flips = []
    for mine, theirs in zip(source, target):
        if (mine.start, mine.end, mine.digest) != (theirs.start, theirs.end, theirs.digest):
            raise SessionExists(
                f"session {public_id(key)!r} in {where} differs from the one being copied at records "
                f"{theirs.start}..{theirs.end}; nothing was changed (delete one of them to copy it)"
            )
        if mine.complete != theirs.complete:
            if not mine.complete:
                raise SessionExists(
                    f"session {public_id(key)!r} in {where} marks records {theirs.start}..{theirs.end} a complete "
                    "turn, the one being copied does not; nothing was changed"
                )
            flips.append(mine)
    return source[len(target) :], flips


def _tiled(key: str, spans: list[Span], n_records: int) -> list[Span]:
    """``spans`` when they cover ``[0, n_records)`` in order, else :class:`SessionDamaged`."""
    at = 0
    for span in spans:
        if span.start != at or span.end <= span.start:
            break
        at = span.end
    if at != n_records:
        raise SessionDamaged(
            f"session {public_id(key)!r}: its turns do not cover its {n_records} records in order; "
            f"run `kvstore sessions repair {public_id(key)}` first"
        )
    return spans


# ---------------------------------------------------------------------------- push
def _shared_record(record: IndexRecord) -> dict[str, Any]:
    """What the shared index keeps of an embedded session's record (its ``record`` column)."""
    return {
        "model": record["model"],
        "tags": list(record["tags"]),
        "parent": record.get("parent"),
        "fork_point": record.get("fork_point"),
        "fingerprint": record["fingerprint"],
        "parked": record["state"] == "parked",
        "times": {
            "created": record["created"],
            "updated": record["updated"],
            "last_used": record["last_used"],
            "last_used_ns": record["last_used_ns"],
        },
    }


def _local_spans(local: "SessionStore", key: str) -> list[Span]:
    with local.index.read() as txn:
        return [Span(t.start, t.end, t.complete, t.digest) for t in local.index.turns(txn, key)]


def _turn_payloads(local: "SessionStore", record: IndexRecord, spans: list[Span]) -> Iterator[tuple[Span, bytes]]:
    """Each span's stored bytes, from one pass over the journal (or the archive: one decompression)."""
    rec_bytes = record_bytes_of(record)
    chunks = record_chunks(local._ctx, record, spans[0].start, spans[-1].end)
    pending = bytearray()
    for span in spans:
        want = (span.end - span.start) * rec_bytes
        while len(pending) < want:
            chunk = next(chunks, None)
            if chunk is None:
                raise SessionDamaged(f"the file of session {public_id(record['id'])!r} ends before record {span.end}")
            pending += chunk
        yield span, bytes(pending[:want])
        del pending[:want]


def _plan_push(local: "SessionStore", shared: SharedStore, record: IndexRecord, row: dict | None) -> _Plan:
    key = record["id"]
    if record["state"] == "damaged":
        raise SessionDamaged(f"session {public_id(key)!r} is damaged: {record.get('problem')}")
    source = _tiled(key, _local_spans(local, key), record["n_records"])
    rec_bytes = record_bytes_of(record)
    desired = _shared_record(record)
    if row is None:
        return _Plan(key, record["owner"], record["n_records"], rec_bytes, True, source, [], False, 0)
    if row["header"] != Header(geometry_of(record), tier_of(record), 0).to_bytes() or row["rec_bytes"] != rec_bytes:
        raise SessionExists(
            f"session {public_id(key)!r} exists in the shared store with another geometry or tier; nothing was changed"
        )
    plan = shared.index.read_plan(key)
    target = [Span(s.first_record, s.end, s.complete, s.digest) for s in plan.segments]
    missing, flips = _diff(key, source, target, "the shared store")
    meta_same = row["record"] == desired and row["watermark"] == record["watermark"]
    return _Plan(key, record["owner"], record["n_records"], rec_bytes, False, missing, flips, meta_same, plan.n_records)


def push(
    local: "SessionStore",
    shared: SharedStore,
    *,
    owner: str | None = None,
    progress: Progress | None = None,
    holder: str | None = None,
) -> TransferReport:
    """Copy every session of ``local`` (``owner``'s only, if given) into ``shared``.

    ``progress(bytes_done, bytes_total)`` as rows are uploaded.

    Raises
    ------
    IndexUnavailable, BlobStoreUnavailable : a server is down; run the push again later
    """
    holder = holder or f"push:{default_holder()}"
    with local.index.read() as txn:
        records = [r for r in local.index.records(txn) if visible(r, owner)]
    records.sort(key=lambda r: (r["created"], r["id"]))
    rows = {row["key"]: row for row in shared.index.sessions(owner)}
    report = TransferReport("push")
    plans: list[_Plan] = []
    for record in records:
        try:
            plans.append(_plan_push(local, shared, record, rows.get(record["id"])))
        except Unavailable:
            raise
        except KVStoreError as exc:
            report.sessions.append(_refused(record["id"], record["owner"], record["n_records"], exc))
    total, done = sum(plan.nbytes for plan in plans), 0
    if progress is not None:
        progress(0, total)
    for plan in plans:
        before = done

        def advance(nbytes: int, before: int = before) -> None:
            nonlocal done
            done = before + nbytes
            if progress is not None:
                progress(min(done, total), total)

        try:
            report.sessions.append(_push_one(local, shared, plan, holder, advance))
        except Unavailable:
            raise
        except KVStoreError as exc:
            report.sessions.append(_refused(plan.key, plan.owner, plan.n_records, exc))
        advance(plan.nbytes)
    return report


def _push_one(local: "SessionStore", shared: SharedStore, plan: _Plan, holder: str, advance) -> Copied:
    ctx = local._ctx
    key = plan.key
    if plan.unchanged:
        return Copied(public_id(key), plan.owner, "unchanged", plan.n_records)
    with ctx.reading(key):  # nothing shrinks or replaces the files while they are read
        record = ctx.record(key)
        desired = _shared_record(record)
        if plan.create:
            shared.create(
                record["owner"],
                geometry_of(record),
                tier_of(record),
                record["model"],
                session_id=public_id(key),
                tags=record["tags"],
                extra={name: value for name, value in desired.items() if name not in ("model", "tags")},
                ttl_s=record.get("ttl_s"),  # its own time-to-live goes with it (an owner's default does not)
            )
        lease = shared.acquire(key, holder, ttl=PUSH_LEASE_TTL_S)
        try:
            if lease.n_records != plan.target_end:
                raise RecordCountMismatch(
                    f"session {public_id(key)!r} changed in the shared store during the push "
                    f"({lease.n_records} records, {plan.target_end} planned); run the push again",
                    current=lease.n_records,
                )
            copied = 0
            if plan.missing:
                for span, payload in _turn_payloads(local, record, plan.missing):
                    if turn_digest(payload) != span.digest:
                        raise SessionDamaged(
                            f"session {public_id(key)!r}: records {span.start}..{span.end} no longer match their "
                            f"turn's hash (`kvstore verify {public_id(key)}`); the records before them were copied"
                        )
                    shared.append(lease, payload, at=span.start, complete=span.complete)
                    copied += len(payload)
                    advance(copied)
            times = desired["times"]
            shared.index.update_meta(
                key,
                lease.token,
                record=desired,
                watermark=record["watermark"],
                created_ns=round(times["created"] * 1e9),
                updated_ns=round(times["updated"] * 1e9),
                last_used_ns=times["last_used_ns"],
                complete=[span.start for span in plan.flips],
            )
        finally:
            shared.release(lease)
    action: Action = "created" if plan.create else "extended" if plan.missing else "updated"
    n_copied = sum(span.end - span.start for span in plan.missing)
    return Copied(public_id(key), plan.owner, action, plan.n_records, n_copied, n_copied * plan.rec_bytes)


def _refused(key: str, owner: str, n_records: int, exc: KVStoreError) -> Copied:
    return Copied(
        public_id(key), owner, "refused", n_records, reason=exc.reason, damaged=isinstance(exc, SessionDamaged)
    )


# ---------------------------------------------------------------------------- pull
def _local_fields(row: dict[str, Any]) -> dict[str, Any]:
    """The embedded record fields a shared session's row says (times, tags, lineage)."""
    stored = row["record"] or {}
    times = stored.get("times") or {
        "created": row["created_ns"] / 1e9,
        "updated": row["updated_ns"] / 1e9,
        "last_used": row["last_used_ns"] / 1e9,
        "last_used_ns": row["last_used_ns"],
    }
    return {
        "tags": list(stored.get("tags") or ()),
        "parent": stored.get("parent"),
        "fork_point": stored.get("fork_point"),
        "created": times["created"],
        "updated": times["updated"],
        "last_used": times["last_used"],
        "last_used_ns": times["last_used_ns"],
    }


def _plan_pull(local: "SessionStore", shared: SharedStore, row: dict[str, Any]) -> tuple[_Plan, list[Span]]:
    key = row["key"]
    header = coli_kv.parse_header(row["header"])
    read = shared.index.read_plan(key)
    source = _tiled(key, [Span(s.first_record, s.end, s.complete, s.digest) for s in read.segments], read.n_records)
    rec_bytes = coli_kv.record_bytes(header.geometry, header.tier)
    with local.index.read() as txn:
        record = local.index.get(txn, key)
    if not visible(record, None):
        if (row["record"] or {}).get("model") is None:
            raise InvalidRequest(
                f"session {public_id(key)!r} in the shared store records no model; the embedded store needs one"
            )
        return _Plan(key, row["owner"], read.n_records, rec_bytes, True, source, [], False, 0), source
    if geometry_of(record) != header.geometry or tier_of(record) != header.tier:
        raise SessionExists(
            f"session {public_id(key)!r} exists in the local store with another geometry or tier; nothing was changed"
        )
    target = _tiled(key, _local_spans(local, key), record["n_records"])
    missing, flips = _diff(key, source, target, "the local store")
    if flips and (missing or flips != [source[len(target) - 1]]):
        # the embedded store can complete only its last turn (an empty append marking it complete)
        raise SessionExists(
            f"session {public_id(key)!r} in the local store has an incomplete turn the shared store completed "
            "before later ones; nothing was changed"
        )
    wanted = _local_fields(row)
    meta_same = all(record.get(name) == value for name, value in wanted.items())
    return _Plan(
        key, row["owner"], read.n_records, rec_bytes, False, missing, flips, meta_same, record["n_records"]
    ), source


def pull(
    local: "SessionStore", shared: SharedStore, *, owner: str | None = None, progress: Progress | None = None
) -> TransferReport:
    """Copy every session of ``shared`` (``owner``'s only, if given) into ``local``.

    ``progress(bytes_done, bytes_total)`` as rows are appended.

    Raises
    ------
    IndexUnavailable, BlobStoreUnavailable : a server is down; run the pull again later
    """
    report = TransferReport("pull")
    plans: list[tuple[_Plan, list[Span], dict[str, Any]]] = []
    for row in shared.index.sessions(owner):
        try:
            plan, source = _plan_pull(local, shared, row)
            plans.append((plan, source, row))
        except Unavailable:
            raise
        except KVStoreError as exc:
            report.sessions.append(_refused(row["key"], row["owner"], int(row["n_records"]), exc))
    total, done = sum(plan.nbytes for plan, _, _ in plans), 0
    if progress is not None:
        progress(0, total)
    for plan, source, row in plans:
        before = done

        def advance(nbytes: int, before: int = before) -> None:
            nonlocal done
            done = before + nbytes
            if progress is not None:
                progress(min(done, total), total)

        try:
            report.sessions.append(_pull_one(local, shared, plan, source, row, advance))
        except Unavailable:
            raise
        except KVStoreError as exc:
            report.sessions.append(_refused(plan.key, plan.owner, plan.n_records, exc))
        advance(plan.nbytes)
    return report


def _batches(spans: list[Span], rec_bytes: int) -> Iterator[list[Span]]:
    batch: list[Span] = []
    size = 0
    for span in spans:
        batch.append(span)
        size += (span.end - span.start) * rec_bytes
        if size >= PULL_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _pull_one(
    local: "SessionStore", shared: SharedStore, plan: _Plan, source: list[Span], row: dict[str, Any], advance
) -> Copied:
    key, owner = plan.key, plan.owner
    sid = public_id(key)
    if plan.unchanged:
        return Copied(sid, owner, "unchanged", plan.n_records)
    stored = row["record"] or {}
    if plan.create:
        header = coli_kv.parse_header(row["header"])
        local.create(owner, header.geometry, header.tier, stored["model"], session_id=sid, tags=stored.get("tags", ()))
    copied = 0
    for batch in _batches(plan.missing, plan.rec_bytes):
        _, rows = shared.read_records(key, batch[0].start, batch[-1].end)
        offset = 0
        for span in batch:
            nbytes = (span.end - span.start) * plan.rec_bytes
            result = local.append_records(
                sid, rows[offset : offset + nbytes], owner=owner, complete_turn=span.complete, reject_nonfinite=True
            )
            if result.turn != (span.start, span.end):
                raise RecordCountMismatch(
                    f"session {sid!r} changed in the local store during the pull (records {result.turn} were "
                    f"appended, {span.start}..{span.end} expected); run the pull again",
                    current=result.info.n_records,
                )
            offset += nbytes
            copied += nbytes
            advance(copied)
    if plan.flips:
        local.append_records(sid, b"", owner=owner, complete_turn=True)
    if _local_spans(local, key) != source:
        raise SessionDamaged(
            f"session {sid!r}: the local copy's turn hashes differ from the shared store's segments after the pull"
        )
    if plan.create and (stored.get("parked") or row.get("state") == "parked"):  # pushed parked, or parked here
        local.park(sid, owner=owner)
    ctx = local._ctx  # the times and lineage of the source: fields no public write sets
    with ctx.writing(key), ctx.index.write() as txn:
        ctx.index.update(txn, key, **_local_fields(row))
    action: Action = "created" if plan.create else "extended" if plan.missing else "updated"
    n_copied = sum(span.end - span.start for span in plan.missing)
    return Copied(sid, owner, action, plan.n_records, n_copied, copied)
