"""The session index's schema (LMDB named databases and key layouts) and its numbered upgrade steps.

The index stores small records only; rows live in the ``.coli_kv`` journals. The schema version is
``meta[b"schema_version"]`` (ASCII decimal). Opening an index applies every step from its version
to :data:`CURRENT_VERSION`, each in its own write transaction together with the version bump, so
a crash mid-upgrade leaves the index at a whole version and the next open resumes there. An index
newer than this code is refused (:class:`IndexSchemaError`), never rewritten.

History (what each version holds):

1. ``sessions-and-turns`` — ``meta``; ``sessions``: id -> JSON record (id, owner, model, geometry
   [6 words], tier {version, codec, bits}, n_records, watermark, created, updated, last_used,
   size_bytes, tags, state, parent, fork_point, problem); ``turns``: ``id \\0 end:u32be`` ->
   ``start:u32be end:u32be complete:u8 blake2b-256 digest`` (one entry per append, covering the
   records it wrote).
2. ``owner-and-lru-indexes`` — ``by_owner``: ``owner \\0 id`` -> b""; ``lru``: ``last_used_ns:u64be
   id`` -> b""; records gain ``last_used_ns``. Listing an owner's sessions and LRU eviction stop
   scanning every record.
3. ``prefix-blocks`` — ``prefix``: ``chain_hash[16] id`` -> ``blocks:u32be``; ``prefix_of``:
   ``id \\0 block:u32be`` -> ``chain_hash[16]``; ``reservations``: disk space reserved by writers in
   flight; records gain ``fingerprint`` (hex) and ``prefix_blocks``. The chain hash of block k
   covers tokens ``[0, (k+1)*PREFIX_BLOCK_TOKENS)`` of a session, seeded by its owner and model
   fingerprint, so a prefix lookup is a few key probes instead of a scan of every journal.
4. ``owner-scoped-ids`` — session ids are per owner: a session is stored under its **storage key**
   ``<id>~<owner>`` (:func:`storage_key`) everywhere an id was used (``sessions``, the prefix of its
   ``turns`` and ``prefix_of`` entries, ``by_owner``, ``lru``, ``prefix``; the record's ``id`` and
   ``parent`` fields hold keys), and its files are named by it (``journals/<id>~<owner>.coli_kv``,
   ``archive/<id>~<owner>.coli_kv.zst``): two owners may both have ``chat-1``, and another owner's id
   is simply a key that does not exist. The step renames the files (through the store, see
   :class:`MigrationContext`) before its transaction commits; a crash in between leaves files
   already renamed, which the step, run again on the next open, finds in place.
5. ``listing-and-counts`` — ``by_created``: ``owner \\0 created_ns:u64be key`` -> b"" and
   ``created``: ``created_ns:u64be key`` -> b"" (a page of a list, oldest first, is a cursor range
   scan from the position the previous page ended at, :func:`listing_key`); ``counts``: sessions and
   bytes by state and by tier name, store-wide and per owner (:func:`count_key` ->
   ``sessions:i64be bytes:i64be``), kept by every write of a record, so a scrape, a summary and a
   per-owner cap read a few keys instead of every record. A session being deleted is in neither.
6. ``expiry`` — ``expiry``: ``expires_ns:u64be key`` -> b"" for each visible session that has a
   time-to-live (records gain ``ttl_s``, its own, and ``expires_ns``: its last use plus the TTL in
   force), so the sweep reads the expired ones from the front of one range, never every record;
   ``owner_ttl``: ``owner`` -> ``ttl_ns:u64be``, the default TTL of an owner's sessions that have
   none of their own. Both start empty (no session had a TTL before).

>>> [step.name for step in plan(1)]
['owner-and-lru-indexes', 'prefix-blocks', 'owner-scoped-ids', 'listing-and-counts', 'expiry']
>>> storage_key("chat-1", "alice"), public_id("chat-1~alice"), key_owner("chat-1~alice")
('chat-1~alice', 'chat-1', 'alice')
>>> plan(CURRENT_VERSION)
[]
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np

from kvstore.formats.tiers import from_file
from kvstore.migrations.errors import IndexSchemaError

CURRENT_VERSION = 6
SCHEMA_KEY = b"schema_version"
USAGE_KEY = b"usage_bytes"  # sum of size_bytes over the sessions (journal + archive bytes)
PREFIX_BLOCK_KEY = b"prefix_block_tokens"
PREFIX_BLOCK_TOKENS = 64
CHAIN_BYTES = 16
DIGEST_BYTES = 32

# Named databases, one per concern (meta is the version and counters).
DB_META = b"meta"
DB_SESSIONS = b"sessions"
DB_TURNS = b"turns"
DB_BY_OWNER = b"by_owner"
DB_LRU = b"lru"
DB_PREFIX = b"prefix"
DB_PREFIX_OF = b"prefix_of"
DB_RESERVATIONS = b"reservations"
DB_BY_CREATED = b"by_created"
DB_CREATED = b"created"
DB_COUNTS = b"counts"
DB_EXPIRY = b"expiry"  # expires_ns:u64be key -> b"" (sessions with a TTL, soonest first)
DB_OWNER_TTL = b"owner_ttl"  # owner -> its default time-to-live in ns (u64be)
DATABASES_BY_VERSION = {
    1: (DB_META, DB_SESSIONS, DB_TURNS),
    2: (DB_META, DB_SESSIONS, DB_TURNS, DB_BY_OWNER, DB_LRU),
    3: (DB_META, DB_SESSIONS, DB_TURNS, DB_BY_OWNER, DB_LRU, DB_PREFIX, DB_PREFIX_OF, DB_RESERVATIONS),
    4: (DB_META, DB_SESSIONS, DB_TURNS, DB_BY_OWNER, DB_LRU, DB_PREFIX, DB_PREFIX_OF, DB_RESERVATIONS),
    5: (
        DB_META,
        DB_SESSIONS,
        DB_TURNS,
        DB_BY_OWNER,
        DB_LRU,
        DB_PREFIX,
        DB_PREFIX_OF,
        DB_RESERVATIONS,
        DB_BY_CREATED,
        DB_CREATED,
        DB_COUNTS,
    ),
    6: (
        DB_META,
        DB_SESSIONS,
        DB_TURNS,
        DB_BY_OWNER,
        DB_LRU,
        DB_PREFIX,
        DB_PREFIX_OF,
        DB_RESERVATIONS,
        DB_BY_CREATED,
        DB_CREATED,
        DB_COUNTS,
        DB_EXPIRY,
        DB_OWNER_TTL,
    ),
}
MAX_DBS = 16

SEP = b"\0"  # ids and owners never hold NUL, so "a\0" sorts apart from "ab\0"
KEY_SEP = "~"  # between a session's id and its owner in its storage key: neither ever holds it
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_TURN = struct.Struct(">IIB")
_COUNT = struct.Struct(">qq")  # sessions, bytes (signed: a delta is applied before its pair)
COUNT_STATE = b"state"  # count_key kinds: store-wide by state, by tier; per owner by state, by tier
COUNT_TIER = b"tier"
COUNT_OWNER_STATE = b"owner-state"
COUNT_OWNER_TIER = b"owner-tier"


# ------------------------------------------------------------------ key layouts (version 4)
# The ``session_id`` of the functions below is a storage key (``<id>~<owner>``) from version 4 on.
def storage_key(session_id: str, owner: str) -> str:
    """The key a session is stored under: its id is unique per owner, not per store."""
    return f"{session_id}{KEY_SEP}{owner}"


def public_id(key: str) -> str:
    """The id a storage key's owner knows the session by (the key itself before version 4)."""
    return key.split(KEY_SEP, 1)[0]


def key_owner(key: str) -> str | None:
    """The owner part of a storage key (None for an id of an index before version 4)."""
    _, sep, owner = key.partition(KEY_SEP)
    return owner if sep else None


def session_key(session_id: str) -> bytes:
    return session_id.encode()


def scoped(session_id: str) -> bytes:
    """The key prefix of a session's entries in ``turns`` and ``prefix_of``."""
    return session_id.encode() + SEP


def turn_key(session_id: str, end: int) -> bytes:
    return scoped(session_id) + _U32.pack(end)


def turn_value(start: int, end: int, complete: bool, digest: bytes) -> bytes:
    if len(digest) != DIGEST_BYTES:
        raise ValueError("a turn digest is 32 bytes")
    return _TURN.pack(start, end, 1 if complete else 0) + digest


def parse_turn_value(value: bytes) -> tuple[int, int, bool, bytes]:
    start, end, complete = _TURN.unpack_from(value)
    return start, end, bool(complete), bytes(value[_TURN.size :])


def owner_key(owner: str, session_id: str) -> bytes:
    return owner.encode() + SEP + session_id.encode()


def lru_key(last_used_ns: int, session_id: str) -> bytes:
    return _U64.pack(last_used_ns) + session_id.encode()


def expiry_key(expires_ns: int, session_id: str) -> bytes:
    return _U64.pack(max(0, int(expires_ns))) + session_id.encode()


def expiry_entry(key: bytes) -> tuple[int, str]:
    """``(expires_ns, session key)`` of an ``expiry`` entry."""
    return _U64.unpack(key[:8])[0], key[8:].decode()


def lru_session(key: bytes) -> str:
    return key[_U64.size :].decode()


def prefix_key(chain: bytes, session_id: str) -> bytes:
    return chain + session_id.encode()


def prefix_of_key(session_id: str, block: int) -> bytes:
    return scoped(session_id) + _U32.pack(block)


def pack_u32(value: int) -> bytes:
    return _U32.pack(value)


def pack_u64(value: int) -> bytes:
    return _U64.pack(value)


def unpack_u64(value: bytes) -> int:
    return _U64.unpack(value)[0]


def unpack_u32(value: bytes) -> int:
    return _U32.unpack(value)[0]


def created_ns(record: Mapping[str, Any]) -> int:
    """A record's creation time in integer nanoseconds: the listing order. A record that carries
    them exactly (``created_ns``: a shared index's row) gives those; an embedded record its
    ``created`` seconds, rounded (distinct float seconds of this era differ by more than 200 ns,
    so the rounded values keep the floats' order)."""
    exact = record.get("created_ns")
    return int(exact) if exact is not None else int(round(float(record["created"]) * 1e9))


def listing_key(owner: str | None, created: int, session_id: str) -> bytes:
    """The key of a session in ``by_created`` (``owner`` given) or ``created`` (None): keys sort as
    ``(created_ns, storage key)``, the order lists are read in."""
    position = _U64.pack(created) + session_id.encode()
    return position if owner is None else owner.encode() + SEP + position


def listing_session(key: bytes, owner: str | None) -> str:
    """The storage key a ``listing_key`` names."""
    skip = 0 if owner is None else len(owner.encode()) + 1
    return key[skip + _U64.size :].decode()


def count_key(kind: bytes, *names: str) -> bytes:
    """A counter of ``counts``: ``kind \\0 name [\\0 name]`` (an owner, then a state or tier name)."""
    return SEP.join((kind, *(name.encode() for name in names)))


def pack_count(sessions: int, nbytes: int) -> bytes:
    return _COUNT.pack(sessions, nbytes)


def unpack_count(value: bytes | None) -> tuple[int, int]:
    return _COUNT.unpack(value) if value is not None else (0, 0)


def encode_record(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def decode_record(value: bytes) -> dict[str, Any]:
    return json.loads(value)


# ------------------------------------------------------------------ fingerprints and prefix chains
def fingerprint_key(model: dict[str, Any], geometry_words: Iterable[int], tier: dict[str, Any]) -> str:
    """A stable hex key over everything a cache depends on: model identity, geometry and tier.

    Two sessions can share rows only when their keys are equal; absent optional fields are
    ``None`` on both sides.
    """
    canonical = json.dumps(
        {"model": model, "geometry": [int(w) for w in geometry_words], "tier": tier},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def chain_seed(owner: str, fingerprint: str) -> bytes:
    """The hash before block 0: prefixes of different owners or models never share a key."""
    return hashlib.blake2b(owner.encode() + SEP + fingerprint.encode(), digest_size=CHAIN_BYTES).digest()


def chain_hashes(previous: bytes, tokens: np.ndarray) -> list[bytes]:
    """Chain hashes of the whole blocks of ``tokens`` (int32), continuing from ``previous``.

    Block k's hash is ``blake2b(hash[k-1] || tokens of block k)``; a trailing partial block is
    not hashed.
    """
    tokens = np.ascontiguousarray(tokens, dtype="<i4")
    n_blocks = tokens.shape[0] // PREFIX_BLOCK_TOKENS
    blocks = tokens[: n_blocks * PREFIX_BLOCK_TOKENS].reshape(n_blocks, PREFIX_BLOCK_TOKENS)
    hashes = []
    for block in blocks:  # a chain is sequential by nature: one hash per 64 tokens
        previous = hashlib.blake2b(previous + block.tobytes(), digest_size=CHAIN_BYTES).digest()
        hashes.append(previous)
    return hashes


# ------------------------------------------------------------------ upgrade steps
class MigrationContext(Protocol):
    """What a step needs from the store that runs it."""

    txn: Any  # the write transaction the step runs in

    def db(self, name: bytes) -> Any:
        """The handle of a named database (created if missing)."""

    def tokens_of(self, record: dict[str, Any], n_records: int) -> np.ndarray | None:
        """The first ``n_records`` tokens of a session from its journal or archive (None if lost)."""

    def move_files(self, old_key: str, new_key: str) -> None:
        """Rename a session's journal and archive from ``old_key`` to ``new_key`` (durably; a file
        already renamed, or missing, is left as it is)."""


@dataclass(frozen=True)
class SchemaStep:
    source: int
    name: str
    description: str
    apply: Callable[[MigrationContext], None]

    @property
    def target(self) -> int:
        return self.source + 1


def _each_record(ctx: MigrationContext):
    with ctx.txn.cursor(db=ctx.db(DB_SESSIONS)) as cursor:
        items = [(bytes(key), decode_record(value)) for key, value in cursor]
    return items


def _add_owner_and_lru(ctx: MigrationContext) -> None:
    sessions, by_owner, lru = ctx.db(DB_SESSIONS), ctx.db(DB_BY_OWNER), ctx.db(DB_LRU)
    for key, record in _each_record(ctx):
        record["last_used_ns"] = int(round(float(record["last_used"]) * 1e9))
        ctx.txn.put(key, encode_record(record), db=sessions)
        if record.get("state") != "deleting":
            ctx.txn.put(owner_key(record["owner"], record["id"]), b"", db=by_owner)
            ctx.txn.put(lru_key(record["last_used_ns"], record["id"]), b"", db=lru)


def _add_prefix_blocks(ctx: MigrationContext) -> None:
    sessions, prefix, prefix_of = ctx.db(DB_SESSIONS), ctx.db(DB_PREFIX), ctx.db(DB_PREFIX_OF)
    ctx.db(DB_RESERVATIONS)
    ctx.txn.put(PREFIX_BLOCK_KEY, str(PREFIX_BLOCK_TOKENS).encode(), db=ctx.db(DB_META))
    for key, record in _each_record(ctx):
        record["fingerprint"] = fingerprint_key(record["model"], record["geometry"], record["tier"])
        record["prefix_blocks"] = 0
        if record.get("state") in ("active", "parked") and record["watermark"] >= PREFIX_BLOCK_TOKENS:
            tokens = ctx.tokens_of(record, record["watermark"])
            if tokens is not None:
                hashes = chain_hashes(chain_seed(record["owner"], record["fingerprint"]), tokens)
                for block, chain in enumerate(hashes):
                    ctx.txn.put(prefix_key(chain, record["id"]), pack_u32(block + 1), db=prefix)
                    ctx.txn.put(prefix_of_key(record["id"], block), chain, db=prefix_of)
                record["prefix_blocks"] = len(hashes)
        ctx.txn.put(key, encode_record(record), db=sessions)


def _move_scoped(ctx: MigrationContext, db: Any, old: str, new: str) -> list[tuple[bytes, bytes]]:
    """Re-key the entries of ``db`` under ``scoped(old)`` to ``scoped(new)``; returns the old
    (suffix, value) pairs."""
    start = scoped(old)
    moved = []
    with ctx.txn.cursor(db=db) as cursor:
        if cursor.set_range(start):
            for key, value in cursor:
                if not bytes(key).startswith(start):
                    break
                moved.append((bytes(key)[len(start) :], bytes(value)))
    for suffix, value in moved:
        ctx.txn.delete(start + suffix, db=db)
        ctx.txn.put(scoped(new) + suffix, value, db=db)
    return moved


def _scope_ids_by_owner(ctx: MigrationContext) -> None:
    sessions, turns, by_owner = ctx.db(DB_SESSIONS), ctx.db(DB_TURNS), ctx.db(DB_BY_OWNER)
    lru, prefix, prefix_of = ctx.db(DB_LRU), ctx.db(DB_PREFIX), ctx.db(DB_PREFIX_OF)
    for key, record in _each_record(ctx):
        old = record["id"]
        if key_owner(old) is not None:
            continue
        owner = record["owner"]
        new = storage_key(old, owner)
        ctx.move_files(old, new)
        record["id"] = new
        if record.get("parent") and key_owner(record["parent"]) is None:
            record["parent"] = storage_key(record["parent"], owner)  # a fork's source has its owner
        ctx.txn.delete(key, db=sessions)
        ctx.txn.put(session_key(new), encode_record(record), db=sessions)
        _move_scoped(ctx, turns, old, new)
        for _, chain in _move_scoped(ctx, prefix_of, old, new):
            blocks = ctx.txn.get(prefix_key(chain, old), db=prefix)
            if blocks is not None:
                ctx.txn.delete(prefix_key(chain, old), db=prefix)
                ctx.txn.put(prefix_key(chain, new), blocks, db=prefix)
        if ctx.txn.delete(owner_key(owner, old), db=by_owner):
            ctx.txn.put(owner_key(owner, new), b"", db=by_owner)
        if "last_used_ns" in record and ctx.txn.delete(lru_key(record["last_used_ns"], old), db=lru):
            ctx.txn.put(lru_key(record["last_used_ns"], new), b"", db=lru)


def tier_name(stored: Mapping[str, Any]) -> str:
    """The tier name (``kvstore.tiers``) of a record's ``tier`` field, by its file version, codec and bits."""
    return from_file(stored["version"], stored.get("codec"), stored.get("bits")).name


def tally(records: Iterable[Mapping[str, Any]]) -> dict[bytes, tuple[int, int]]:
    """Every ``counts`` entry of ``records`` (a session being deleted counts nowhere)."""
    groups: dict[tuple[str, str, tuple], list[int]] = {}  # (owner, state, tier form) -> [sessions, bytes]
    for record in records:
        if record.get("state") == "deleting":
            continue
        stored = record["tier"]
        group = groups.setdefault(
            (record["owner"], record["state"], (stored["version"], stored.get("codec"), stored.get("bits"))), [0, 0]
        )
        group[0] += 1
        group[1] += int(record["size_bytes"])
    out: dict[bytes, list[int]] = {}
    for (owner, state, form), (n, nbytes) in groups.items():
        tier = from_file(*form).name
        for key in (
            count_key(COUNT_STATE, state),
            count_key(COUNT_TIER, tier),
            count_key(COUNT_OWNER_STATE, owner, state),
            count_key(COUNT_OWNER_TIER, owner, tier),
        ):
            entry = out.setdefault(key, [0, 0])
            entry[0] += n
            entry[1] += nbytes
    return {key: (n, nbytes) for key, (n, nbytes) in out.items()}


def _add_listing_and_counts(ctx: MigrationContext) -> None:
    by_created, created, counts = ctx.db(DB_BY_CREATED), ctx.db(DB_CREATED), ctx.db(DB_COUNTS)
    records = [record for _, record in _each_record(ctx)]
    for record in records:
        if record.get("state") != "deleting":
            ctx.txn.put(listing_key(record["owner"], created_ns(record), record["id"]), b"", db=by_created)
            ctx.txn.put(listing_key(None, created_ns(record), record["id"]), b"", db=created)
    for key, (n, nbytes) in tally(records).items():
        ctx.txn.put(key, pack_count(n, nbytes), db=counts)


def _add_expiry(ctx: MigrationContext) -> None:
    # no session had a time-to-live before this version: both databases start empty
    ctx.db(DB_EXPIRY)
    ctx.db(DB_OWNER_TTL)


STEPS: dict[int, SchemaStep] = {}


def register(step: SchemaStep) -> SchemaStep:
    STEPS[step.source] = step
    return step


register(SchemaStep(1, "owner-and-lru-indexes", "index sessions by owner and by last use", _add_owner_and_lru))
register(
    SchemaStep(2, "prefix-blocks", "index block-aligned token prefix hashes; space reservations", _add_prefix_blocks)
)
register(
    SchemaStep(
        3, "owner-scoped-ids", "session ids per owner: store every session under <id>~<owner>", _scope_ids_by_owner
    )
)
register(
    SchemaStep(
        4,
        "listing-and-counts",
        "index sessions by creation (paged lists) and count them by state, tier and owner",
        _add_listing_and_counts,
    )
)


register(
    SchemaStep(
        5,
        "expiry",
        "index sessions by when they expire; each owner's default time-to-live",
        _add_expiry,
    )
)


def plan(current: int) -> list[SchemaStep]:
    """The steps that take an index at version ``current`` to :data:`CURRENT_VERSION`."""
    if current > CURRENT_VERSION:
        raise IndexSchemaError(
            f"the index is at schema version {current}, newer than this kvstore understands "
            f"({CURRENT_VERSION}); upgrade kvstore"
        )
    if current < 1:
        raise IndexSchemaError(f"schema version {current} is not a version kvstore ever wrote")
    steps = []
    for version in range(current, CURRENT_VERSION):
        if version not in STEPS:
            raise IndexSchemaError(f"no upgrade step from index schema version {version}")
        steps.append(STEPS[version])
    return steps
