"""What a session is, as values: ids, owners and tags (validated), the model, the fingerprint, the info.

An index record is a JSON object (``kvstore.migrations.index`` encodes it), typed here as
:class:`IndexRecord`; :class:`SessionInfo` is its read-only view. Both backends speak these values:
the shared backend builds the same record from its rows. The helpers at the bottom convert the
record's tier and geometry fields.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, TypedDict

from kvstore import tiers
from kvstore.errors import InvalidCursor, InvalidRequest, InvalidSessionId
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry
from kvstore.migrations import index as schema
from kvstore.tiers import Tier

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
OWNER_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")
# A storage key (kvstore.migrations.index, schema 4): "<id>~<owner>"; a bare id is a key of an index
# before schema 4 (the upgrade steps before it read journals under those names).
KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}(~[A-Za-z0-9][A-Za-z0-9_.@-]{0,127})?$")
TAG_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:=@/-]{0,63}$")
MAX_TAGS = 32
STATES = ("active", "parked", "damaged")
# The header allows widths no model has; a record this large (GLM v1 is ~180 KB) is refused
# before numpy is asked for a record type it cannot build.
MAX_RECORD_BYTES = 64 << 20
MODEL_FIELDS = ("name", "revision", "weights_hash", "tokenizer_hash", "chat_template_hash", "attention_variant")

Progress = Callable[[int, int], None]  # (done, total)


class TierRecord(TypedDict):
    """A tier as an index record stores it: the ``.coli_kv`` version, codec and bits."""

    version: int
    codec: int | None
    bits: int | None


class _ExactTimes(TypedDict, total=False):
    created_ns: int  # the creation time exactly, where the index holds it so (a shared index's row)
    # expiry (absent in records written before it: no TTL): the session's own time-to-live in
    # seconds (None: its owner's applies, if any), and when it expires, in ns since the epoch
    # (None: never) = last_used_ns + the TTL in force (its own, else its owner's); see expires_ns()
    ttl_s: float | None
    expires_ns: int | None


class IndexRecord(_ExactTimes):
    """A session's record in the index (LMDB ``sessions``: key -> this JSON object).

    ``id`` is the storage key (``<id>~<owner>``), ``parent`` the key of the session it was forked
    from; times are seconds since the epoch; ``fingerprint`` is :meth:`Fingerprint.key`;
    ``prefix_blocks`` counts the chain hashes stored for it; ``last_used_ns`` orders the LRU.
    :meth:`SessionInfo.from_record` is its public view.
    """

    id: str
    owner: str
    model: dict[str, Any]
    geometry: list[int]
    tier: TierRecord
    n_records: int
    watermark: int
    created: float
    updated: float
    last_used: float
    last_used_ns: int
    size_bytes: int
    tags: list[str]
    state: str  # one of STATES, or "deleting" (hidden while a delete finishes)
    parent: str | None
    fork_point: int | None
    problem: str | None
    fingerprint: str
    prefix_blocks: int


# ---------------------------------------------------------------------------- validation
def validate_session_id(session_id: Any) -> str:
    """Return ``session_id`` if it is a valid id, else raise :class:`InvalidSessionId`.

    Ids are 1-64 characters of ``[A-Za-z0-9_-]`` starting with a letter or digit, so a path built
    from one can never leave its folder.
    """
    if not isinstance(session_id, str) or not ID_PATTERN.fullmatch(session_id):
        shown = session_id if isinstance(session_id, str) and len(session_id) <= 80 else "that value"
        raise InvalidSessionId(
            f"invalid session id {shown!r}: use 1-64 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return session_id


def validate_key(key: Any) -> str:
    """Return ``key`` if it is a storage key (``<id>~<owner>``), else raise :class:`InvalidSessionId`.

    Keys name a session's files, so a path built from one never leaves its folder either.
    """
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise InvalidSessionId(f"invalid session key {key if isinstance(key, str) else type(key).__name__!r}")
    return key


def storage_key(session_id: Any, owner: Any) -> str:
    """The storage key of ``owner``'s session ``session_id`` (both validated): ids are per owner."""
    return schema.storage_key(validate_session_id(session_id), validate_owner(owner))


def public_id(key: str) -> str:
    """The id a storage key's owner knows the session by."""
    return schema.public_id(key)


def validate_owner(owner: Any) -> str:
    """Return ``owner`` if it is a valid owner name, else raise :class:`InvalidRequest`."""
    if not isinstance(owner, str) or not OWNER_PATTERN.fullmatch(owner):
        raise InvalidRequest(
            "invalid owner name: use 1-128 letters, digits, '_', '.', '@' or '-', starting with a letter or digit"
        )
    return owner


def validate_tags(tags: Iterable[str] | None) -> list[str]:
    """The tags, sorted and deduplicated, after checking each (raises :class:`InvalidRequest`)."""
    checked = sorted(set(tags or ()))
    if len(checked) > MAX_TAGS:
        raise InvalidRequest(f"at most {MAX_TAGS} tags per session")
    for tag in checked:
        if not isinstance(tag, str) or not TAG_PATTERN.fullmatch(tag):
            raise InvalidRequest(f"invalid tag {tag!r}: 1-64 of letters, digits and _ . : = @ / -")
    return checked


def check_record_size(geometry: Geometry, tier: Tier) -> None:
    """Refuse a geometry no model has (``BadHeader``) or a record over :data:`MAX_RECORD_BYTES`."""
    coli_kv.check_geometry(geometry, tier)
    size = coli_kv.record_bytes(geometry, tier)
    if size > MAX_RECORD_BYTES:
        raise InvalidRequest(
            f"a record of this geometry and tier is {size} bytes; kvstore stores records of at most {MAX_RECORD_BYTES}"
        )


#: The longest time-to-live a session or owner may have (about 100 years): expiry times stay in int64 ns.
MAX_TTL_S = 100 * 365 * 86400
_TTL_SPAN = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_TTL_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def check_ttl(ttl_s: Any, what: str = "ttl_s") -> float | None:
    """A time-to-live as both backends take it: a positive, finite number of seconds up to
    :data:`MAX_TTL_S`, or None (no TTL of its own). Raises :class:`InvalidRequest`."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s):
        raise InvalidRequest(f"{what} must be a number of seconds (or none), not {ttl_s!r}")
    if not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidRequest(f"{what} must be more than 0 and at most {MAX_TTL_S} seconds (100 years), not {ttl_s!r}")
    return float(ttl_s)


def parse_ttl(text: str, what: str = "--ttl") -> float | None:
    """A time-to-live as the command line writes it: seconds (``3600``) or a span (``90s``, ``30m``,
    ``12h``, ``30d``, ``2w``); ``none`` for no TTL. Raises :class:`InvalidRequest`."""
    spelled = text.strip().lower()
    if spelled == "none":
        return None
    found = _TTL_SPAN.fullmatch(spelled)
    if found is None:
        raise InvalidRequest(f"{what}: {text!r} is not seconds or a span like 90s, 30m, 12h, 30d, 2w (or none)")
    return check_ttl(float(found.group(1)) * _TTL_UNITS[found.group(2)], what)


def expires_ns(last_used_ns: int, own_ttl_s: float | None, owner_ttl_s: float | None) -> int | None:
    """When a session last used at ``last_used_ns`` expires: its own TTL, else its owner's, counted
    from its last use (None: neither is set, it never expires)."""
    ttl = own_ttl_s if own_ttl_s is not None else owner_ttl_s
    return None if ttl is None else int(last_used_ns) + int(round(ttl * 1e9))


def _seconds(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e9


def expired(record: IndexRecord, now_ns: int) -> bool:
    """Whether ``record``'s session has expired at ``now_ns`` (an expired session is gone to every
    caller, swept or not)."""
    when = record.get("expires_ns")
    return when is not None and when <= now_ns


# ---------------------------------------------------------------------------- index record fields
def tier_record(tier: Tier) -> TierRecord:
    """A tier as the index record stores it (the file's version, codec and bits)."""
    return {"version": tier.version, "codec": tier.codec, "bits": tier.bits}


def stored_tier(stored: TierRecord) -> Tier:
    """The tier a record's ``tier`` field names."""
    return tiers.from_file(stored["version"], stored.get("codec"), stored.get("bits"))


def tier_of(record: IndexRecord) -> Tier:
    """The tier of an index record."""
    return stored_tier(record["tier"])


def geometry_of(record: IndexRecord) -> Geometry:
    """The geometry of an index record (its six words)."""
    return Geometry(*record["geometry"])


def record_bytes_of(record: IndexRecord) -> int:
    """Bytes per record of a session, from its index record."""
    return coli_kv.record_bytes(geometry_of(record), tier_of(record))


# ---------------------------------------------------------------------------- public value types
@dataclass(frozen=True)
class ModelInfo:
    """What the caller says about the model that produced a session's rows.

    ``name`` and ``revision`` are required; the hashes (of the weights, tokenizer and chat
    template) and the engine's attention variant are compared when present.
    """

    name: str
    revision: str
    weights_hash: str | None = None
    tokenizer_hash: str | None = None
    chat_template_hash: str | None = None
    attention_variant: str | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any] | "ModelInfo") -> "ModelInfo":
        """Validate a mapping of the model fields (raises :class:`InvalidRequest` naming the field)."""
        if isinstance(values, ModelInfo):
            return values
        if not isinstance(values, dict):
            raise InvalidRequest("model must be an object with at least name and revision")
        unknown = sorted(set(values) - set(MODEL_FIELDS))
        if unknown:
            raise InvalidRequest(f"unknown model fields {unknown}; known: {list(MODEL_FIELDS)}")
        for required in ("name", "revision"):
            if not isinstance(values.get(required), str) or not values[required]:
                raise InvalidRequest(f"model.{required} is required (a non-empty string)")
        for name in MODEL_FIELDS:
            value = values.get(name)
            if value is not None and (not isinstance(value, str) or len(value) > 256 or "\0" in value):
                raise InvalidRequest(f"model.{name} must be a string of at most 256 characters")
        return cls(
            name=values["name"],
            revision=values["revision"],
            weights_hash=values.get("weights_hash"),
            tokenizer_hash=values.get("tokenizer_hash"),
            chat_template_hash=values.get("chat_template_hash"),
            attention_variant=values.get("attention_variant"),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Fingerprint:
    """Everything a cache depends on: the model, the six geometry words and the cache tier."""

    model: ModelInfo
    geometry: Geometry
    tier: Tier

    def key(self) -> str:
        """The stable digest the index stores (and prefix chains are seeded with)."""
        return schema.fingerprint_key(self.model.to_dict(), self.geometry.words(), dict(tier_record(self.tier)))

    def mismatches(self, expected: "Fingerprint") -> list[str]:
        """``field: session X, expected Y`` for each field that differs."""
        out = [
            f"geometry.{field.name}: session {getattr(self.geometry, field.name)}, expected {getattr(expected.geometry, field.name)}"
            for field in dataclasses.fields(Geometry)
            if getattr(self.geometry, field.name) != getattr(expected.geometry, field.name)
        ]
        if self.tier != expected.tier:
            out.append(f"tier: session {self.tier.describe()}, expected {expected.tier.describe()}")
        for name in MODEL_FIELDS:
            mine, theirs = getattr(self.model, name), getattr(expected.model, name)
            if mine != theirs:
                out.append(f"model.{name}: session {mine!r}, expected {theirs!r}")
        return out


@dataclass(frozen=True)
class SessionFilter:
    """The filters of ``Store.list``, checked once (:meth:`of`); a record matches when it matches
    every filter given (all the tags present). Both backends list through it."""

    model_name: str | None = None
    tags: frozenset[str] = frozenset()
    state: str | None = None
    fingerprint: str | None = None  # Fingerprint.key()

    @classmethod
    def of(
        cls,
        model_name: str | None,
        tags: Iterable[str],
        state: str | None,
        fingerprint: Fingerprint | None,
    ) -> SessionFilter:
        if state is not None and state not in STATES:
            raise InvalidRequest(f"unknown state {state!r}: use one of {list(STATES)}")
        return cls(model_name, frozenset(tags), state, fingerprint.key() if fingerprint is not None else None)

    def matches(self, record: IndexRecord) -> bool:
        return (
            (self.model_name is None or record["model"]["name"] == self.model_name)
            and (self.state is None or record["state"] == self.state)
            and self.tags <= set(record["tags"])
            and (self.fingerprint is None or record["fingerprint"] == self.fingerprint)
        )


@dataclass(frozen=True)
class ListCursor:
    """A position in a list of sessions, ordered oldest first: the creation time and storage key
    of the last session a page held. Handed out as opaque text (:meth:`encode`); a list given it
    continues with the sessions after that position, so a session deleted meanwhile never shifts a
    page, and one created meanwhile comes at the end."""

    created_ns: int
    key: str

    VERSION: ClassVar[str] = "1"
    MAX_CHARS: ClassVar[int] = 400  # the longest a cursor this version writes is ~280 characters

    def encode(self) -> str:
        text = f"{self.VERSION}.{self.created_ns}.{self.key}"
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: Any) -> ListCursor:
        """The position ``text`` (an :meth:`encode` result) holds; :class:`InvalidCursor` for
        anything else, checked before it is used."""
        refused = InvalidCursor(
            "cursor is not one a list of sessions handed out: pass the last page's next_cursor unchanged "
            "(or none, to start from the oldest session)"
        )
        if not isinstance(text, str) or not 0 < len(text) <= cls.MAX_CHARS or not text.isascii():
            raise refused
        try:
            decoded = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode("ascii")
        except (binascii.Error, ValueError):
            raise refused from None
        version, _, rest = decoded.partition(".")
        created, _, key = rest.partition(".")
        valid_key = KEY_PATTERN.fullmatch(key) is not None and schema.key_owner(key) is not None  # <id>~<owner>
        if version != cls.VERSION or not created.isdigit() or int(created) >= 1 << 64 or not valid_key:
            raise refused
        if cls(int(created), key).encode() != text:  # one spelling per position: nothing else slips through
            raise refused
        return cls(int(created), key)


@dataclass(frozen=True)
class SessionInfo:
    """One session as the index records it (times are seconds since the epoch).

    ``id`` is the id its owner knows it by (ids are per owner); ``key`` is the store's own name for
    it (``<id>~<owner>``: its files and index entries), ``parent`` the id of the session it was
    forked from (same owner).
    """

    id: str
    owner: str
    model: ModelInfo
    geometry: Geometry
    tier: Tier
    n_records: int
    watermark: int
    created: float
    updated: float
    last_used: float
    size_bytes: int
    tags: tuple[str, ...]
    state: str
    parent: str | None
    fork_point: int | None
    problem: str | None
    fingerprint_key: str
    prefix_blocks: int
    key: str
    created_ns: int  # the creation time the lists are ordered by (``created`` is it in seconds)
    ttl_s: float | None = None  # its own time-to-live (None: its owner's applies, if any)
    expires_at: float | None = None  # when it expires (seconds since the epoch; None: never)

    @classmethod
    def from_record(cls, record: IndexRecord) -> "SessionInfo":
        parent = record.get("parent")
        return cls(
            id=public_id(record["id"]),
            owner=record["owner"],
            model=ModelInfo.from_dict(record["model"]),
            geometry=geometry_of(record),
            tier=tier_of(record),
            n_records=record["n_records"],
            watermark=record["watermark"],
            created=record["created"],
            updated=record["updated"],
            last_used=record["last_used"],
            size_bytes=record["size_bytes"],
            tags=tuple(record["tags"]),
            state=record["state"],
            parent=public_id(parent) if parent is not None else None,
            fork_point=record.get("fork_point"),
            problem=record.get("problem"),
            fingerprint_key=record["fingerprint"],
            prefix_blocks=record.get("prefix_blocks", 0),
            key=record["id"],
            created_ns=schema.created_ns(record),
            ttl_s=record.get("ttl_s"),
            expires_at=_seconds(record.get("expires_ns")),
        )

    @property
    def cursor(self) -> str:
        """Where a list continues after this session (``Store.list(after=...)``): opaque text."""
        return ListCursor(self.created_ns, self.key).encode()

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.model, self.geometry, self.tier)

    @property
    def record_bytes(self) -> int:
        return coli_kv.record_bytes(self.geometry, self.tier)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what the API and ``--json`` print)."""
        return {
            "id": self.id,
            "owner": self.owner,
            "model": self.model.to_dict(),
            "geometry": dataclasses.asdict(self.geometry),
            "tier": self.tier.to_dict(),
            "record_bytes": self.record_bytes,
            "n_records": self.n_records,
            "watermark": self.watermark,
            "created": self.created,
            "updated": self.updated,
            "last_used": self.last_used,
            "size_bytes": self.size_bytes,
            "tags": list(self.tags),
            "state": self.state,
            "parent": self.parent,
            "fork_point": self.fork_point,
            "problem": self.problem,
            "fingerprint": self.fingerprint_key,
            "ttl_s": self.ttl_s,
            "expires_at": self.expires_at,
        }
