"""Rewriting a session's objects on the shared store: park, unpark and migrate.

Objects are immutable, so each of the three uploads new objects holding the same records and swaps
them in with one fenced transaction (``SharedIndex.replace_segments``), under the session's lease:

- **park** replaces each plain segment with its zstd frame (``codec = 'zstd'``); the digest stays
  the records', so verify, fork and prefix lookup read a parked session without unparking it;
- **unpark** replaces each compressed segment with the plain records again (ranged reads, the
  replica's cache);
- **migrate** replaces every segment with its records re-encoded in another tier
  (``kvstore.migrations.formats``), with the new header, fingerprint and prefix blocks.

Segment boundaries (turns) and their completeness are kept, so verify reports the same turns
after any of them. The objects no session lists any more wait for GC (``kv_dropped``); a rewrite
that fails before its commit takes its uploads back, and a crash leaves them to GC. The lease is
renewed as the rewrite goes, so a session larger than one lease's worth of transfers is rewritten
too; a writer that lost the lease meanwhile is fenced at the commit.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import numpy as np
import zstandard

from kvstore.errors import IntegrityError
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Header
from kvstore.migrations import formats as format_migrations
from kvstore.migrations.index import chain_hashes, chain_seed
from kvstore.store.shared.index import ReadPlan, Segment
from kvstore.store.shared.rows import check_of
from kvstore.store.shared.store import UNKNOWN_MODEL, Lease, SharedStore, digest_of
from kvstore.store.values import Fingerprint, ModelInfo, Progress, check_record_size, public_id
from kvstore.tiers import Tier

PARK_LEVEL = 3  # zstd's cheap end, as the embedded store's archives: parking is I/O-bound
_WINDOW = 8  # segments in flight at once (memory stays a few segments, S3 streams overlap)

#: (segment, its records) -> (the object's bytes, the segment row describing them, minus its name),
#: or None to keep the segment as it is
Convert = Callable[[Segment, memoryview], "tuple[bytes, Segment] | None"]


def park(shared: SharedStore, lease: Lease, *, hard_limit: int | None = None, progress: Progress | None = None) -> None:
    """Compress the session's plain segments, then mark it parked (one fenced commit)."""

    def pack(segment: Segment, raw: memoryview) -> tuple[bytes, Segment] | None:
        # a compressor per call: one is not safe to share between the threads that pack segments
        body = zstandard.ZstdCompressor(level=PARK_LEVEL, write_checksum=True, write_content_size=True).compress(raw)
        if len(body) >= len(raw):
            return None  # rows that do not compress (random fp8 codes): a frame would only add bytes
        return body, replace(segment, codec="zstd", stored_bytes=len(body))

    plan = shared.index.read_plan(lease.key)
    _rewrite(shared, lease, plan, [s for s in plan.segments if s.codec == "raw"], pack, "parked", hard_limit, progress)


def unpark(
    shared: SharedStore, lease: Lease, *, hard_limit: int | None = None, progress: Progress | None = None
) -> None:
    """Store the session's compressed segments plain again, then mark it active (one fenced commit)."""

    def plain(segment: Segment, raw: memoryview) -> tuple[bytes, Segment]:
        return bytes(raw), replace(segment, codec="raw", stored_bytes=None)

    plan = shared.index.read_plan(lease.key)
    _rewrite(shared, lease, plan, [s for s in plan.segments if s.codec != "raw"], plain, "active", hard_limit, progress)


def reseal(
    shared: SharedStore, lease: Lease, version: int, *, hard_limit: int | None = None, progress: Progress | None = None
) -> int:
    """Rewrite the session's objects not sealed under data-key ``version`` (the owner's current one,
    after a data-key rotation): each opened, checked, sealed anew — a parked one compressed again —
    and swapped in by one fenced commit; the state stays. Returns how many objects were rewritten."""

    def again(segment: Segment, raw: memoryview) -> tuple[bytes, Segment]:
        if segment.codec == "raw":
            return bytes(raw), segment
        packer = zstandard.ZstdCompressor(level=PARK_LEVEL, write_checksum=True, write_content_size=True)
        return packer.compress(raw), segment

    plan = shared.index.read_plan(lease.key)
    chosen = [s for s in plan.segments if s.key_version != version]
    state = str(shared.index.session(lease.key)["state"])
    _rewrite(shared, lease, plan, chosen, again, state, hard_limit, progress)
    return len(chosen)


def migrate(
    shared: SharedStore,
    lease: Lease,
    row: dict,
    tier: Tier,
    *,
    hard_limit: int | None = None,
    progress: Progress | None = None,
) -> None:
    """Re-encode every record of the session in ``tier`` (one fenced commit with the new header,
    fingerprint and prefix blocks). ``row``: the session's index row, read under ``lease``.

    Raises
    ------
    IntegrityError : a segment does not match its digest (repair the session first); nothing changed
    MigrationError : no conversion from the session's tier to ``tier``
    """
    plan = shared.index.read_plan(lease.key)
    source = coli_kv.parse_header(plan.header)
    geometry = source.geometry
    check_record_size(geometry, tier)
    format_migrations.plan(source.tier, tier)
    bad = shared.first_damaged(lease.key, plan, plan.n_records)
    if bad is not None:
        raise IntegrityError(
            f"the segment of session {public_id(lease.key)!r} from record {bad} does not match its digest; "
            "repair the session before migrating"
        )

    def convert(segment: Segment, raw: memoryview) -> tuple[bytes, Segment]:
        records = coli_kv.parse(Header(geometry, source.tier, segment.n_records).to_bytes() + bytes(raw))
        body = format_migrations.convert(records, tier).tobytes()
        return body, replace(
            segment, nbytes=len(body), digest=digest_of(body), codec="raw", stored_bytes=None, check=check_of(body)
        )

    def count(done_bytes: int, total_bytes: int) -> None:  # records converted, as the embedded store reports
        if progress is not None:
            rec = source.rec_bytes
            progress((done_bytes - HEADER_BYTES) // rec, (total_bytes - HEADER_BYTES) // rec)

    stored = row.get("record") or {}
    model = ModelInfo.from_dict(stored["model"]) if stored.get("model") else UNKNOWN_MODEL
    fingerprint = Fingerprint(model, geometry, tier).key()
    tokens = _tokens(shared, lease.key, plan, source, int(row["watermark"]))
    shared.renew(lease)  # the checks above read every record once
    blocks = chain_hashes(chain_seed(str(row["owner"]), fingerprint), tokens)
    _rewrite(
        shared, lease, plan, plan.segments, convert, "active", hard_limit, count,
        header=Header(geometry, tier, 0).to_bytes(), record_patch={"fingerprint": fingerprint}, blocks=blocks,
    )  # fmt: skip


def _tokens(shared: SharedStore, key: str, plan: ReadPlan, header: Header, upto: int) -> np.ndarray:
    """The tokens of records ``[0, upto)`` (what the prefix blocks hash)."""
    raw = shared.read_planned(key, plan, 0, min(upto, plan.n_records))
    return np.frombuffer(raw, dtype=coli_kv.record_dtype(header.geometry, header.tier))["token"].astype(np.int32)


def _rewrite(
    shared: SharedStore,
    lease: Lease,
    plan: ReadPlan,
    chosen: list[Segment],
    convert: Convert,
    state: str,
    hard_limit: int | None,
    progress: Progress | None,
    **changes,
) -> None:
    """Upload ``convert``'s object for each of ``chosen`` (fetched whole and checked against its
    digest, ``_WINDOW`` at a time), then swap them in with one fenced commit; the uploads are taken
    back if anything fails before the commit. ``progress(bytes, total)`` counts the session's
    image (header included) as each segment is done."""
    key = lease.key
    total = HEADER_BYTES + sum(s.nbytes for s in chosen)
    done = HEADER_BYTES
    replaced: list[Segment] = []
    uploaded: list[Segment] = []

    def one(segment: Segment) -> Segment | None:
        converted = convert(segment, shared.whole(key, segment))
        if converted is None:
            return None
        body, row = converted
        name = shared.segment_name(key, segment.first_record, lease.token)
        stored, version = shared.put_object(key, lease.token, name, row.first_record, row.n_records, row.codec, body)
        return replace(row, object=name, token=lease.token, stored_bytes=stored, key_version=version)

    try:
        for window in range(0, len(chosen), _WINDOW):
            jobs = [shared.pool.submit(one, s) for s in chosen[window : window + _WINDOW]]
            failure: BaseException | None = None
            for segment, job in zip(chosen[window : window + _WINDOW], jobs):
                try:
                    new = job.result()
                    if new is not None:
                        replaced.append(segment)
                        uploaded.append(new)
                except BaseException as exc:  # wait for the window's other uploads, to take them back too
                    failure = failure or exc
                    continue
                done += segment.nbytes
                if progress is not None:
                    progress(done, total)
            if failure is not None:
                raise failure
            shared.renew(lease)  # a rewrite may outlast the lease's TTL: each window extends it
        if progress is not None and not chosen:
            progress(total, total)
        shared.index.replace_segments(
            key,
            lease.token,
            replaced,
            uploaded,
            lease.ttl,
            time.time_ns(),
            state=state,
            hard_limit=hard_limit,
            **changes,
        )
    except BaseException:
        for segment in uploaded:
            shared.abandon(segment.object)
        raise
