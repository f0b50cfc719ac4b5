"""Sessions on the shared backend: create, lease, append (upload then fenced commit), read, GC.

The protocol is docs/SCALE.md's: an append writes its records to a new immutable object, then one
PostgreSQL transaction (``SharedIndex.commit``) publishes it, checked against the lease's fencing
token. A session's bytes are the embedded store's ``.coli_kv`` image: the 40-byte header (kept in
the index, ``nrec`` set to the committed count) followed by the committed segments in order.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generator, Iterable

import numpy as np

from kvstore import config as settings
from kvstore.errors import (
    BudgetExceeded,
    IdempotencyKeyReused,
    InvalidRequest,
    KeyUnavailable,
    RecordCountMismatch,
    SegmentLost,
    SessionDamaged,
    Unavailable,
)
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header, check_geometry, record_bytes
from kvstore.migrations.index import PREFIX_BLOCK_TOKENS, chain_hashes, chain_seed
from kvstore.store.shared.blobs import BlobStore
from kvstore.store.shared.cache import SegmentCache
from kvstore.store.shared.fetch import SegmentFetcher
from kvstore.store.shared.index import ReadPlan, Segment, SharedIndex
from kvstore.store.shared.keys import SegmentSealer
from kvstore.store.shared.rows import check_of, digest_of
from kvstore.store.values import (
    Fingerprint,
    ModelInfo,
    public_id,
    storage_key,
    validate_key,
    validate_owner,
    validate_tags,
)
from kvstore.tiers import Tier

DEFAULT_TTL_S = settings.LEASE_TTL_S.value
REQUEST_KEY_RETENTION_S = 24 * 3600.0  # how long an idempotency key answers a retry (then GC forgets it)
JOB_RETENTION_S = 24 * 3600.0  # how long a finished job answers GET /jobs/{id} on every replica
MAX_REQUEST_KEY_CHARS = 255
DEFAULT_GC_GRACE_S = 3600.0


@dataclass
class _InDoubt:
    """An attempt whose commit got no answer: committed or not is found out on the next append."""

    object: str
    start: int
    n_records: int
    digest: bytes
    stored_bytes: int | None = None
    key_version: int | None = None


@dataclass
class Lease:
    """A writer's hold on one session: its fencing token and the count it appends after."""

    key: str
    holder: str
    token: int
    n_records: int  # the committed count as this writer knows it (exact while the lease holds)
    ttl: float
    in_doubt: _InDoubt | None = field(default=None, repr=False)


@dataclass(frozen=True)
class AppendAck:
    """An acknowledged append: records ``[start, end)`` are committed under ``token``."""

    start: int
    end: int
    token: int
    object: str | None  # None for an empty append (or a replayed one)
    replayed: bool = False  # answered from the index: an earlier request with this idempotency key did it


@dataclass(frozen=True)
class Prepared:
    """An uploaded segment waiting for its commit (:meth:`SharedStore.commit`)."""

    object: str
    start: int
    n_records: int
    digest: bytes
    payload: memoryview = field(repr=False)
    complete: bool = True
    request: tuple[str, bytes] | None = None  # (idempotency key, request digest), recorded by the commit
    blocks: tuple[int, list[bytes]] = (0, [])  # prefix blocks the commit's watermark completes
    check: bytes | None = None  # BLAKE3-256 of the payload, what reads match
    stored_bytes: int | None = None  # the sealed object's size (None: the object is the payload)
    key_version: int | None = None  # the owner's data-key version it is sealed under (None: plaintext)


@dataclass(frozen=True)
class GCReport:
    intents: int  # stale intents dropped (their objects deleted)
    swept: int  # unreferenced objects deleted by the listing sweep
    uploads_aborted: int
    dropped: int = 0  # objects a truncate dropped, deleted once no session lists them
    requests: int = 0  # idempotency keys older than their retention, forgotten
    jobs: int = 0  # finished jobs older than their retention, forgotten


@dataclass(frozen=True)
class RequestKey:
    """A client's idempotency key for one append (HTTP ``Idempotency-Key``), valid across replicas.

    The commit that applies the append records ``(session, key) -> (digest of the request, result)``;
    a request with the same key answers that result again instead of appending, whichever replica
    it reaches; the same key with other rows is refused (:class:`IdempotencyKeyReused`).
    """

    value: str

    def __post_init__(self):
        if not 1 <= len(self.value) <= MAX_REQUEST_KEY_CHARS or not all(" " < c <= "~" for c in self.value):
            raise InvalidRequest(
                f"an idempotency key is 1 to {MAX_REQUEST_KEY_CHARS} visible ASCII characters (e.g. a UUID)"
            )


UNKNOWN_MODEL = ModelInfo(name="unknown", revision="unknown")  # a session pushed or made without one


def fingerprint_key_of(row: dict[str, Any]) -> str:
    """The fingerprint key of a session's index row (kept in its record; else derived from it)."""
    stored = row["record"] or {}
    if stored.get("fingerprint"):
        return str(stored["fingerprint"])
    header = coli_kv.parse_header(row["header"])
    model = ModelInfo.from_dict(stored["model"]) if stored.get("model") else UNKNOWN_MODEL
    return Fingerprint(model, header.geometry, header.tier).key()


def chain_seed_of(row: dict[str, Any]) -> bytes:
    """The hash before prefix block 0 of a session (owner and fingerprint, as the embedded index seeds it)."""
    return chain_seed(row["owner"], fingerprint_key_of(row))


def default_holder() -> str:
    """A holder name unique to this writer: host, process, random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class SharedStore:
    """Sessions in a shared index (:class:`SharedIndex`) with rows in objects (:class:`BlobStore`).

    Parameters
    ----------
    index, blobs : the two servers' clients (closed by :meth:`close`)
    ttl : seconds a lease lasts without a commit or renewal
    cache : this replica's local copies of segment objects (:class:`SegmentCache`), or None
    """

    def __init__(
        self, index: SharedIndex, blobs: BlobStore, *, ttl: float = DEFAULT_TTL_S, cache: SegmentCache | None = None
    ):
        self.index = index
        self.blobs = blobs
        self.ttl = ttl
        self.cache = cache
        self.hard_limit: int | None = (
            None  # bytes the whole store may hold (None: no limit); writes past it are refused
        )
        self.max_sessions: int | None = None  # sessions one owner may have (None: no cap); creates past it refused
        self.reads = SegmentFetcher(blobs, cache)  # parallel ranged GETs, the cache, read-ahead
        self.sealer: SegmentSealer | None = None  # encrypted at rest: every object sealed (keys.py)

    def encrypt(self, sealer: SegmentSealer) -> None:
        """Seal every object written from now on, and open every sealed object read (``attach``
        decided the store is encrypted: it never holds a plaintext segment)."""
        self.sealer = sealer
        self.reads.sealer = sealer

    @property
    def pending(self) -> Callable[[], None] | None:
        return self.reads.pending

    @pending.setter
    def pending(self, attach: Callable[[], None] | None) -> None:
        self.reads.pending = attach

    @classmethod
    def connect(cls, index_url: str, blobs_url: str, **options: Any) -> "SharedStore":
        return cls(SharedIndex(index_url), BlobStore(blobs_url), **options)

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The threads that move objects (parallel segment reads and rewrites)."""
        return self.reads.pool

    def close(self) -> None:
        self.reads.close()
        self.index.close()

    def __enter__(self) -> "SharedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sessions
    def create(
        self,
        owner: str,
        geometry: Geometry,
        tier: Tier,
        model: ModelInfo | dict[str, Any] | None = None,
        session_id: str | None = None,
        tags: Iterable[str] = (),
        *,
        extra: dict[str, Any] | None = None,
        ttl_s: float | None = None,
    ) -> str:
        """Create an empty session; returns its key ``<id>~<owner>``.

        ``extra``: more fields of the session's record (what ``store push`` carries over: parent,
        fork point, fingerprint, the embedded state). ``ttl_s``: its own time-to-live. An expired
        session of that id not swept yet is deleted first (its objects too).
        """
        validate_owner(owner)
        check_geometry(geometry, tier)
        key = storage_key(session_id if session_id is not None else uuid.uuid4().hex, owner)
        header = Header(geometry, tier, 0).to_bytes()
        record = {
            "model": ModelInfo.from_dict(model).to_dict() if model is not None else None,
            "tags": validate_tags(tags),
            **(extra or {}),
        }
        ttl_ns = None if ttl_s is None else int(round(ttl_s * 1e9))
        replaced = self.index.create_session(
            key, owner, header, record_bytes(geometry, tier), record, time.time_ns(), hard_limit=self.hard_limit,
            max_sessions=self.max_sessions, ttl_ns=ttl_ns,
        )  # fmt: skip
        for name in replaced:  # an expired session's objects, its row deleted with the create
            self.blobs.delete(name)
        return key

    def delete(self, key: str) -> None:
        """Drop a session from the index, then its objects (a crash in between leaves them to GC)."""
        for name in self.index.delete_session(validate_key(key)):
            self.blobs.delete(name)

    def n_records(self, key: str) -> int:
        return int(self.index.session(key)["n_records"])

    # ------------------------------------------------------------------ leases
    def acquire(
        self, key: str, holder: str | None = None, ttl: float | None = None, *, carry: Lease | None = None
    ) -> Lease:
        """Take the session's write lease (``LeaseHeld`` while another writer's is live).

        ``carry``: this writer's previous lease on the session (fenced or expired); an append it left
        in doubt is settled by the new lease's next append, so a retry still appends it once.
        """
        ttl = self.ttl if ttl is None else ttl
        grant = self.index.acquire(validate_key(key), holder or default_holder(), ttl)
        lease = Lease(grant.key, grant.holder, grant.token, grant.n_records, ttl)
        if carry is not None and carry.key == lease.key:
            lease.in_doubt = carry.in_doubt
        return lease

    def renew(self, lease: Lease) -> None:
        self.index.renew(lease.key, lease.token, lease.ttl)

    def release(self, lease: Lease) -> None:
        self.index.release(lease.key, lease.token)

    # ------------------------------------------------------------------ append
    def segment_name(self, key: str, start: int, token: int) -> str:
        # a hash first spreads sessions over the store's partitions (docs/SCALE.md, 1 PB)
        spread = hashlib.blake2b(key.encode(), digest_size=1).hexdigest()
        return self.blobs.object_name("seg", spread, key, f"{start:012d}-{token}-{uuid.uuid4().hex}")

    def append(
        self,
        lease: Lease,
        records: bytes | bytearray | memoryview | np.ndarray,
        *,
        at: int | None = None,
        complete: bool = True,
        request: RequestKey | None = None,
    ) -> AppendAck:
        """Append whole records (raw ``.coli_kv`` record bytes) under ``lease``; acknowledged once committed.

        ``at``: the count the caller expects the session to hold (``RecordCountMismatch`` otherwise).
        ``complete``: the records end a turn (the watermark moves to the new count).
        ``request``: the client's idempotency key; a request with a key already committed (through
        any replica) answers that first result (``replayed``) and appends nothing.
        Retrying the same bytes after an unanswered commit (``Unavailable``) appends them once.
        :meth:`prepare` then :meth:`commit` are the same in two steps.

        Raises
        ------
        InvalidRequest : not whole records of this session
        IdempotencyKeyReused : ``request`` was committed with other rows
        StaleLease, LeaseExpired : fenced; acquire the lease again (``acquire(..., carry=lease)``)
        IndexUnavailable, BlobStoreUnavailable : a server is down; retry the same call later
        """
        prepared = self.prepare(lease, records, at=at, complete=complete, request=request)
        return prepared if isinstance(prepared, AppendAck) else self.commit(lease, prepared)

    def prepare(
        self,
        lease: Lease,
        records: bytes | bytearray | memoryview | np.ndarray,
        *,
        at: int | None = None,
        complete: bool = True,
        request: RequestKey | None = None,
    ) -> "Prepared | AppendAck":
        """Steps 1-2 of an append: the intent, then the upload. An :class:`AppendAck` instead when
        there is nothing to commit (no records, the same bytes an unanswered commit did commit, or
        a ``request`` key some replica already committed: its first result, ``replayed``)."""
        payload = memoryview(records.tobytes() if isinstance(records, np.ndarray) else records).cast("B")
        digest = digest_of(payload)
        if lease.in_doubt is not None:
            done = self._settle_doubt(lease, digest)
            if done is not None:
                return done
        request_digest = digest_of(digest + bytes([complete])) if request is not None else b""
        if request is not None:
            # under the lease no other commit can record this key between here and our commit
            found = self.index.request_result(lease.key, request.value)
            if found is not None:
                if found[0] != request_digest:
                    raise IdempotencyKeyReused(
                        f"idempotency key {request.value!r} was used for another append to session "
                        f"{public_id(lease.key)!r} (other rows or turn flag); nothing was written: use a new key"
                    )
                return AppendAck(found[1], found[2], lease.token, None, replayed=True)
        if at is not None and at != lease.n_records:
            raise RecordCountMismatch(
                f"session {public_id(lease.key)!r} holds {lease.n_records} records, the append expected {at}; "
                "nothing was written",
                current=lease.n_records,
            )
        row = self.index.session(lease.key)
        rec_bytes = int(row["rec_bytes"])
        if len(payload) % rec_bytes:
            raise InvalidRequest(
                f"{len(payload)} bytes are not whole records of session {public_id(lease.key)!r} "
                f"({rec_bytes} bytes each); nothing was written"
            )
        n = len(payload) // rec_bytes
        start = lease.n_records
        if n == 0:
            return AppendAck(start, start, lease.token, None)
        self.check_fits(len(payload))
        blocks = self.new_blocks(lease.key, row, start, payload, start + n) if complete else (0, [])
        doubt = lease.in_doubt
        if doubt is not None:
            name, stored, version = doubt.object, doubt.stored_bytes, doubt.key_version
        else:
            name, stored, version = self._upload(lease, start, n, payload)
        return Prepared(
            name, start, n, digest, payload, complete, (request.value, request_digest) if request else None, blocks,
            check_of(payload), stored, version,
        )  # fmt: skip

    def commit(self, lease: Lease, prepared: "Prepared") -> AppendAck:
        """Step 3, the commit point: publish a prepared segment, fenced by ``lease.token``."""
        name, stored, version = prepared.object, prepared.stored_bytes, prepared.key_version
        for _ in range(2):  # a second upload only when GC took the first one's intent
            try:
                segment, _ = self.index.commit(
                    lease.key, lease.token, prepared.start, prepared.n_records, name, prepared.digest, lease.ttl,
                    time.time_ns(), prepared.complete, request=prepared.request, blocks=prepared.blocks,
                    hard_limit=self.hard_limit, check=prepared.check, stored_bytes=stored, key_version=version,
                )  # fmt: skip
            except (BudgetExceeded, KeyUnavailable):
                lease.in_doubt = None
                self.abandon(name)  # refused by the commit itself: nothing was published
                raise
            except Unavailable:
                lease.in_doubt = _InDoubt(name, prepared.start, prepared.n_records, prepared.digest, stored, version)
                raise
            except SegmentLost:
                lease.in_doubt = None
                name, stored, version = self._upload(lease, prepared.start, prepared.n_records, prepared.payload)
                continue
            lease.in_doubt = None
            lease.n_records = segment.first_record + segment.n_records
            return AppendAck(segment.first_record, lease.n_records, lease.token, name)
        raise SegmentLost(f"the uploads for session {public_id(lease.key)!r} keep being collected before commit")

    def check_fits(self, grow: int) -> None:
        """Refuse, before uploading anything, a write of ``grow`` bytes that does not fit the hard
        limit now (the commit checks again, serialized: a race is refused there)."""
        if self.hard_limit is None:
            return
        used = sum(nbytes for _, _, nbytes in self.index.usage())
        if used + grow > self.hard_limit:
            raise BudgetExceeded(
                f"writing {grow} bytes would take the shared store to {used + grow} bytes, over its hard limit of "
                f"{self.hard_limit}; nothing was written. Delete or park sessions, or raise the limit"
            )

    def _upload(
        self, lease: Lease, start: int, n_records: int, payload: memoryview
    ) -> tuple[str, int | None, int | None]:
        """``(name, stored_bytes, key_version)`` of a new object holding ``payload`` (``n_records``
        records from ``start``)."""
        name = self.segment_name(lease.key, start, lease.token)
        stored, version = self.put_object(lease.key, lease.token, name, start, n_records, "raw", payload)
        return name, stored, version

    def put_object(
        self, key: str, token: int, name: str, first_record: int, n_records: int, codec: str, body: bytes | memoryview
    ) -> tuple[int | None, int | None]:
        """Upload ``body`` (records ``first_record..`` of session ``key``, ``codec``-encoded) as object
        ``name`` under an intent (recorded first: GC sees it). On an encrypted store the object is
        ``body`` sealed under the owner's current data key. Returns ``(stored_bytes, key_version)``
        for its segment row: ``(None, None)`` for plaintext records, the object's size for a
        compressed or sealed one and, when sealed, the data-key version."""
        version = None
        if self.pending is not None:
            self.pending()
        if self.sealer is not None:
            sealed = self.sealer.seal(key, name, first_record, n_records, codec, body)
            body, version = sealed.body, sealed.key_version
        self.index.add_intent(key, token, name, len(body))
        self.blobs.put(name, body)
        return (None if codec == "raw" and version is None else len(body)), version

    def _settle_doubt(self, lease: Lease, digest: bytes) -> AppendAck | None:
        """Find out whether the unanswered attempt was committed; an ack when it was this same append."""
        doubt = lease.in_doubt
        if doubt is None:
            return None
        segment = self.index.committed(lease.key, doubt.object)
        if segment is not None:
            lease.in_doubt = None
            lease.n_records = max(lease.n_records, segment.first_record + segment.n_records)
            if doubt.digest == digest:
                return AppendAck(
                    segment.first_record, segment.first_record + segment.n_records, segment.token, doubt.object
                )
            return None
        if doubt.digest != digest or doubt.start != lease.n_records:
            lease.in_doubt = None  # another append now: the old intent is left to GC
        return None  # the same bytes again: committed below from the same object

    # ------------------------------------------------------------------ prefix blocks
    def new_blocks(
        self, key: str, row: dict[str, Any], start: int, payload: memoryview | None, new_watermark: int
    ) -> tuple[int, list[bytes]]:
        """``(first block, chain hashes)`` of the 64-token prefix blocks that a watermark moved to
        ``new_watermark`` completes: tokens of committed records before ``start`` (read back), then
        of ``payload`` (the records being appended at ``start``). Called under the session's lease."""
        have, last = self.index.prefix_tail(key)
        want = new_watermark // PREFIX_BLOCK_TOKENS
        if want <= have:
            return have, []
        header = coli_kv.parse_header(row["header"])
        dtype = coli_kv.record_dtype(header.geometry, header.tier)
        lo, hi = have * PREFIX_BLOCK_TOKENS, want * PREFIX_BLOCK_TOKENS
        parts = []
        if lo < start:
            _, before = self.read_records(key, lo, min(hi, start))
            parts.append(np.frombuffer(before, dtype=dtype)["token"])
        if hi > start and payload is not None:
            parts.append(np.frombuffer(payload, dtype=dtype)["token"][: hi - start])
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        if tokens.shape[0] != hi - lo:
            raise SessionDamaged(f"session {public_id(key)!r}: tokens {lo}..{hi} are not all committed")
        return have, chain_hashes(last if last is not None else chain_seed_of(row), tokens)

    # ------------------------------------------------------------------ fork and truncate
    def _cut_copy(self, key: str, segment: Segment, keep: int, rec_bytes: int, token: int, into: str) -> Segment:
        """A new object holding records ``[segment.first_record, keep)`` of ``segment`` (of session
        ``key``), uploaded under an intent of session ``into``: the part of a segment a fork or a
        truncate keeps (objects are immutable, so the kept part is a new one)."""
        n = keep - segment.first_record
        # the whole object, checked against its digest: damage is refused, never re-hashed into a copy
        whole = self.reads.whole(key, segment)
        kept = whole[: n * rec_bytes]
        name = self.segment_name(into, segment.first_record, token)
        stored, version = self.put_object(into, token, name, segment.first_record, n, "raw", kept)
        return Segment(
            segment.first_record, n, name, len(kept), digest_of(kept), token, segment.complete, check=check_of(kept),
            stored_bytes=stored, key_version=version,
        )  # fmt: skip

    def fork(
        self, source: str, new_key: str, at: int | None, record: dict[str, Any], *, attempts: int = 3
    ) -> tuple[int, int]:
        """A new session ``new_key`` holding the first ``at`` records of ``source`` (default: its
        watermark), published by one transaction; ``(at, watermark)`` of the fork.

        Segments that end at or before ``at`` are shared (their rows are copied; objects are
        immutable and only deleted once no row lists them); a segment cut by ``at`` gets a new
        object with its first records. ``record``: the new session's record fields (tags, parent...).

        Raises
        ------
        InvalidRequest : ``at`` outside ``0..n_records``
        SessionExists : ``new_key`` exists (an expired session of that key not swept yet is deleted
            first, its objects too)
        SessionNotFound : no ``source``
        """
        for name in self.index.drop_expired(validate_key(new_key), time.time_ns()):
            self.blobs.delete(name)
        for attempt in range(attempts):
            plan = self.index.read_plan(validate_key(source))
            point = plan.watermark if at is None else at
            if isinstance(point, bool) or not isinstance(point, (int, np.integer)) or not 0 <= point <= plan.n_records:
                raise InvalidRequest(f"fork point must be in 0..{plan.n_records}, got {at!r}")
            point = int(point)
            watermark = min(plan.watermark, point)
            below = [s for s in plan.segments if s.first_record < point]
            cut = below[-1] if below and below[-1].end > point else None
            replacement = None
            if cut is not None:
                replacement = self._cut_copy(source, cut, point, plan.rec_bytes, 0, new_key)
                replacement = replace(replacement, complete=point <= plan.watermark)
            try:
                self.index.fork_session(
                    source, new_key, point, [(s.first_record, s.object) for s in below], replacement,
                    {**record, "fork_point": point}, watermark, time.time_ns(), hard_limit=self.hard_limit,
                    max_sessions=self.max_sessions,
                )  # fmt: skip
            except RecordCountMismatch:
                if replacement is not None:
                    self.abandon(replacement.object)
                if attempt + 1 == attempts:
                    raise
                continue
            except BaseException:
                if replacement is not None:
                    self.abandon(replacement.object)
                raise
            return point, watermark
        raise AssertionError("unreachable")  # the loop returns or raises

    def truncate(self, lease: Lease, keep: int, *, record_patch: dict[str, Any] | None = None) -> int:
        """Shorten the session to ``keep`` records under ``lease`` (a fenced commit, see
        :meth:`SharedIndex.truncate`, which merges ``record_patch`` into the session's record); the
        new watermark. Dropped objects go to GC."""
        if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or keep < 0:
            raise InvalidRequest("n_records must be a non-negative integer")
        keep = int(keep)
        plan = self.index.read_plan(lease.key)
        if keep > plan.n_records:
            raise InvalidRequest(
                f"session {public_id(lease.key)!r} holds {plan.n_records} records; cannot truncate to {keep}"
            )
        if keep == plan.n_records:
            return plan.watermark
        cut = next((s for s in plan.segments if s.first_record < keep < s.end), None)
        replacement = None
        if cut is not None:
            replacement = self._cut_copy(lease.key, cut, keep, plan.rec_bytes, lease.token, lease.key)
            replacement = replace(replacement, complete=keep <= plan.watermark)
        try:
            self.index.truncate(
                lease.key, lease.token, keep, replacement, lease.ttl, time.time_ns(), record_patch=record_patch
            )
        except BaseException:
            if replacement is not None:
                self.abandon(replacement.object)
            raise
        lease.n_records = keep
        lease.in_doubt = None
        return min(plan.watermark, keep)

    def abandon(self, name: str) -> None:
        """An upload that will not be committed: its intent and object go now (else GC takes them)."""
        try:
            if self.index.drop_intent(name):
                self.blobs.delete(name)
        except Unavailable:
            pass  # the intent stays; GC collects it after the grace

    # ------------------------------------------------------------------ reads
    def segments(self, key: str) -> list[Segment]:
        return self.index.read_plan(validate_key(key)).segments

    def read_records(self, key: str, start: int = 0, stop: int | None = None) -> tuple[int, bytearray]:
        """``(n_records, bytes of records [start, min(stop, n_records)))`` as committed at one instant.

        Raises
        ------
        SessionDamaged : an object is missing or its bytes do not match the index
        """
        if start < 0 or (stop is not None and stop < start):
            raise InvalidRequest(f"records [{start}, {stop}) is not a range of records (0 <= start <= stop)")
        plan = self.index.read_plan(validate_key(key), start, stop)
        if start > plan.n_records:
            raise InvalidRequest(f"session {public_id(key)!r} holds {plan.n_records} records; cannot read from {start}")
        end = plan.n_records if stop is None else min(stop, plan.n_records)
        return plan.n_records, self.read_planned(key, plan, start, end)

    def read_planned(self, key: str, plan: ReadPlan, start: int, end: int) -> bytearray:
        """Bytes of records ``[start, end)`` from the segments of ``plan`` (one snapshot, taken once
        by a reader that then streams its records in several reads); ``end <= plan.n_records``."""
        self._check_range(plan, start, end)
        return self.reads.read(key, plan, start, end)

    def stream_planned(
        self,
        key: str,
        plan: ReadPlan,
        start: int,
        end: int,
        chunk_records: int,
        *,
        read_ahead_bytes: int | None = None,
    ) -> Generator[memoryview, None, None]:
        """:meth:`read_planned` as chunks of ``chunk_records`` records, in order, the next ones fetched
        ahead while one is consumed (``SegmentFetcher.stream``: a download's bounded read-ahead;
        ``read_ahead_bytes`` 0 reads one block of whole segments at a time)."""
        self._check_range(plan, start, end)
        return self.reads.stream(key, plan, start, end, chunk_records, read_ahead_bytes)

    @staticmethod
    def _check_range(plan: ReadPlan, start: int, end: int) -> None:
        if not 0 <= start <= end <= plan.n_records:
            raise InvalidRequest(f"records [{start}, {end}) are not within the {plan.n_records} committed")

    def first_damaged(
        self, key: str, plan: ReadPlan, end: int, progress: Callable[[int, int], None] | None = None
    ) -> int | None:
        """Re-hash every segment of ``plan`` that starts before ``end``: the first record of the first
        one whose bytes do not match their digest, or None (``SegmentFetcher.first_damaged``)."""
        return self.reads.first_damaged(key, plan, end, progress)

    def whole(self, key: str, segment: Segment) -> memoryview:
        """Every record byte of ``segment`` (decompressed if it is a parked one's), checked against
        the digest its commit recorded (:class:`SessionDamaged` if they differ)."""
        return self.reads.whole(key, segment)

    def file_bytes(self, key: str) -> bytes:
        """The session as a ``.coli_kv`` file image: header with ``nrec`` = the committed count, then records."""
        n_records, rows = self.read_records(key)
        header = bytearray(self.index.session(key)["header"])
        header[32:36] = np.int32(n_records).tobytes()  # h6 nrec, little-endian (docs/FORMAT.md section 1)
        if len(header) != HEADER_BYTES:
            raise SessionDamaged(f"session {public_id(key)!r}: its header in the index is {len(header)} bytes")
        return bytes(header) + rows

    # ------------------------------------------------------------------ garbage collection
    def gc(self, grace: float = DEFAULT_GC_GRACE_S) -> GCReport:
        """Delete objects no commit refers to that are older than ``grace`` seconds (docs/SCALE.md)."""
        stale = self.index.take_stale_intents(grace)
        for name in stale:
            self.blobs.delete(name)
        # the sweep: objects left by a GC that died between its steps, or by deleted sessions
        cutoff = self.index.now() - grace
        old = [info.name for info in self.blobs.list("seg") if info.modified <= cutoff]
        swept = 0
        for chunk in range(0, len(old), 1000):
            for name in self.index.unreferenced(old[chunk : chunk + 1000]):
                self.blobs.delete(name)
                swept += 1
        aborted = self.blobs.abort_stale_uploads(cutoff)
        dropped = self.index.take_dropped(grace)
        for name in dropped:
            self.blobs.delete(name)
        forgotten = self.index.forget_requests(max(grace, REQUEST_KEY_RETENTION_S))
        jobs = self.index.forget_jobs(max(grace, JOB_RETENTION_S))
        return GCReport(len(stale), swept, aborted, len(dropped), forgotten, jobs)
