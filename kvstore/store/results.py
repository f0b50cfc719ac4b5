"""What the store's operations return, and the checks every backend makes the same way.

Both backends (the embedded store and ``kvstore.store.shared``) import these, and neither imports
the other's implementation: an :class:`AppendResult`, a :class:`VerifyReport` or a
:class:`LookupResult` means the same on either, and a fingerprint, a lookup's tokens or rows holding
NaN are refused with the same typed error and reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Collection, Iterable

import numpy as np

from kvstore.errors import FingerprintMismatch, InvalidRequest, NonFiniteValues
from kvstore.filetools import Scan
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import KVRecords
from kvstore.formats.nonfinite import Sanitized
from kvstore.store.values import (
    MODEL_FIELDS,
    STATES,
    Fingerprint,
    IndexRecord,
    SessionInfo,
    public_id,
    validate_owner,
)


# ---------------------------------------------------------------------------- results
@dataclass(frozen=True)
class AppendResult:
    """An acknowledged append: the session after it, and what this call wrote."""

    info: SessionInfo
    appended: int  # records written by this call
    turn: tuple[int, int] | None  # the record range hashed as this call's turn (None for an empty call)
    sanitized: Sanitized = Sanitized()  # non-finite values in the rows, stored as the tier's rule says


@dataclass(frozen=True)
class Resumed:
    """A resumed session: the records to restore, trimmed to the watermark (or before damage)."""

    info: SessionInfo
    records: KVRecords
    reused_tokens: int
    verified: bool
    damaged_from: int | None  # first record of the first bad turn, when verify found one

    @property
    def tokens(self) -> np.ndarray:
        return self.records.tokens

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(L f32[n_layers,n,kv_lora], R f32[n_layers,n,qk_rope], I f32[nic,n,index_hd] | None)``."""
        return self.records.dequantize()


@dataclass(frozen=True)
class VerifyReport:
    """What re-hashing a session found. ``first_bad`` is the first turn whose bytes differ."""

    session_id: str
    ok: bool
    n_records: int
    turns_checked: int
    first_bad: dict[str, int] | None  # {"turn": index, "start": record, "end": record}
    good_records: int  # records before the first bad turn (all of them when ok)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RepairReport:
    """What a repair did (or, with ``dry_run``, would do) to a session."""

    session_id: str
    dry_run: bool
    actions: list[str]
    kept_records: int
    dropped_records: int
    first_bad: dict[str, int] | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LookupResult:
    """The owner's session sharing the longest token prefix with a query."""

    session_id: str
    matched_tokens: int  # common prefix, at most the session's watermark
    state: str
    n_records: int
    watermark: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Eviction:
    """A session the soft budget evicted, and the bytes that freed."""

    session_id: str
    action: str  # "parked" or "deleted"
    freed_bytes: int


@dataclass(frozen=True)
class Expiry:
    """A session the expiry sweep deleted (its time-to-live ran out), and the bytes that freed."""

    session_id: str
    owner: str
    expired_at: float  # when it expired (seconds since the epoch)
    freed_bytes: int

    def to_dict(self) -> dict[str, object]:
        return {
            "session_id": self.session_id,
            "owner": self.owner,
            "expired_at": self.expired_at,
            "freed_bytes": self.freed_bytes,
        }


@dataclass(frozen=True)
class Tally:
    """Sessions, and the bytes they hold (journal + archive, or segment objects)."""

    sessions: int = 0
    bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"sessions": self.sessions, "bytes": self.bytes}


@dataclass(frozen=True)
class SessionCounts:
    """An owner's sessions, or the whole store's, by state (every state of ``STATES``, zeros
    included) and by tier name (tiers holding sessions only): what ``Store.counts`` returns."""

    by_state: dict[str, Tally]
    by_tier: dict[str, Tally]

    @classmethod
    def of(cls, by_state: dict[str, tuple[int, int]], by_tier: dict[str, tuple[int, int]]) -> SessionCounts:
        """From ``(sessions, bytes)`` pairs; a state missing is zero, a tier of no session is left out."""
        return cls(
            {state: Tally(*by_state.get(state, (0, 0))) for state in STATES},
            {tier: Tally(*pair) for tier, pair in sorted(by_tier.items()) if pair[0] > 0},
        )

    @property
    def sessions(self) -> int:
        return sum(entry.sessions for entry in self.by_state.values())

    @property
    def bytes(self) -> int:
        return sum(entry.bytes for entry in self.by_state.values())


@dataclass(frozen=True)
class CacheCounts:
    """What a replica's local cache of segment objects did since it started (``GET /metrics``)."""

    hits: int  # reads served from a local copy
    misses: int  # reads that went to the object store
    damaged: int  # local copies refused by their length or digest (deleted, fetched again)
    evictions: int  # copies removed to stay within the budget
    bytes: int  # bytes held now
    files: int  # copies held now
    budget_bytes: int


# ---------------------------------------------------------------------------- checks both backends make
def checked_override(override: Iterable[str]) -> set[str]:
    """The fields a resume is told not to compare, each ``model.*`` or ``tier`` (``InvalidRequest``
    naming any other: a misspelt override is refused, never silently ignored), whether or not the
    caller states a fingerprint to compare."""
    skip = set(override)
    unknown = skip - {f"model.{n}" for n in MODEL_FIELDS} - {"tier"}
    if unknown:
        raise InvalidRequest(f"cannot override {sorted(unknown)}: only model.* fields and tier can be overridden")
    return skip


def check_fingerprint(record: IndexRecord, expect: Fingerprint, override: Iterable[str]) -> None:
    """Raise :class:`FingerprintMismatch` naming each field of ``expect`` the session differs in
    (``override``: fields not to compare, ``model.*`` or ``tier`` only)."""
    skip = checked_override(override)
    found = SessionInfo.from_record(record).fingerprint.mismatches(expect)
    blocking = [m for m in found if m.split(":")[0] not in skip]
    if blocking:
        raise FingerprintMismatch(
            f"session {public_id(record['id'])!r} was written by another model or cache tier: "
            + "; ".join(blocking)
            + " (pass an override only if you know the caches are interchangeable)"
        )


def refuse_nonfinite(found: Sanitized) -> None:
    """Raise :class:`NonFiniteValues` when ``found`` counts any (the caller asked for refusal)."""
    if found.values:
        raise NonFiniteValues(
            f"the rows hold {found.describe()}; this store refuses non-finite values (reject_nonfinite, "
            "kvstore serve --reject-nonfinite): nothing was written"
        )


def query_tokens(owner: str, fingerprint: Fingerprint, tokens) -> np.ndarray | None:
    """A lookup's tokens as int32, checked as every backend checks them (None: an empty query,
    which matches nothing). ``InvalidRequest`` for a bad owner, shape or token id."""
    validate_owner(owner)
    tokens = np.asarray(tokens)
    if tokens.size == 0:
        return None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise InvalidRequest("tokens must be a 1-D list of integers")
    if tokens.min() < 0 or tokens.max() >= fingerprint.geometry.vocab:
        raise InvalidRequest(f"token ids must be in [0, {fingerprint.geometry.vocab})")
    return tokens.astype(np.int32)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two 1-D token arrays."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def records_report(records: coli_kv.KVRecords | Scan) -> dict[str, Any]:
    """What a session's ``.coli_kv`` image holds, as ``inspect`` reports it on every backend:
    header fields, sizes and what a loader would neutralize — of loaded records, or of a
    :class:`~kvstore.filetools.Scan` that judged them a chunk at a time (the same answers)."""
    header = records.header
    return {
        "header": {
            "version": header.version,
            "codec": header.tier.codec_name,
            "bits": header.bits,
            "tag": header.tag,
            "nrec": header.nrec,
            **dataclasses.asdict(header.geometry),
        },
        "record_bytes": header.rec_bytes,
        "complete_records": records.complete_records,
        "loadable_records": records.n,
        "problems": records.problems.messages(),
    }


def finish_rotation(
    keyring, owner: str, version: int, in_use: Collection[int], resealed: list[str], skipped: list[str]
) -> dict[str, Any]:
    """The end of a data-key rotation on either backend: retire the owner's versions that neither
    are ``version`` nor are used by a stored file or object any longer, and report what was done."""
    retired = [v for v in keyring.versions(owner) if v != version and v not in in_use]
    for old in retired:
        keyring.retire(owner, old)
    return {
        "owner": owner,
        "version": version,
        "resealed": resealed,
        "skipped": skipped,
        "retired": retired,
        "in_use": sorted(in_use),
    }
