"""A prefix cache of MLA latent rows over the session store, for serving engines' KV connectors.

An engine that keeps one latent row per token and layer (vLLM's MLA paged cache holds exactly a
``.coli_kv`` row: ``kv_lora`` latent values then ``qk_rope`` rope-key values) asks three things:

- :meth:`PrefixCache.lookup` — how many leading tokens of a prompt the store holds for this model
  (the store's prefix index: block-aligned chain hashes seeded with the owner and the fingerprint,
  confirmed against the stored tokens). Every call is counted as a hit or a miss; a prompt whose
  prefix is stored only under another fingerprint (another model, weights, dtype, geometry or tier)
  is a miss counted as ``refused`` too: it is never loaded.
- :meth:`PrefixCache.load` — the rows of tokens ``[start, stop)`` of a session that lookup found,
  re-hashed against the index first (``verify``): damaged, missing or refused rows raise, so the
  engine recomputes instead of attending to wrong KV. A session whose rows fail verification is
  quarantined (deleted, counted in ``quarantined``): kept, every later request would find it, fail
  and recompute, and its own prompt's next save would be skipped as stored already.
- :meth:`PrefixCache.save` — a prompt's rows as a new session (one per distinct prompt, its id
  derived from the fingerprint and the tokens, so the same prompt saved twice is stored once).

Rows are handed over as f32 ``[n_layers, n, kv_lora + qk_rope]``, encoded in the cache's tier (f32,
bf16, fp8, int4, ...) and dequantized on load. A ``bf16`` tier's rows can also be taken as stored
(``load(native=True)``: bf16 bit patterns, u16, half the bytes), and its hot tier keeps them so.

The check before a load runs at memory speed: a save records the XXH3-128 of the session's record
bytes as a tag (:data:`ROWS_DIGEST_TAG`), and a load compares the served bytes with it instead of
re-hashing them with the store's blake2b-256 turn hashes (which every append still records, for
``kvstore verify`` and the API). A session saved before the tag existed is verified by the turn hashes. The store is a local folder
(embedded mode) or a running ``kvstore serve`` reached with an API key (service mode): one code
path over :mod:`kvstore.connectors.store_client`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

import kvstore.store
from kvstore import config, tiers
from kvstore.connectors.hot_tier import HotKey, HotTier
from kvstore.connectors.store_client import LocalClient, ServiceClient, StoreClient, encode_rows
from kvstore.errors import ConfigError, IntegrityError, KeyShredded, KVStoreError, SessionExists
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header, KVRecords, record_bytes
from kvstore.formats.floats import bf16_decode
from kvstore.store import Fingerprint, ModelInfo, Store, validate_owner
from kvstore.tiers import Tier

logger = logging.getLogger(__name__)

# The connectors' own check of a session's rows: the tag a save records, then the XXH3-128 (hex) of
# every record of the session as stored. Fast enough to run before every load (blake2b-256 cost 60%
# of a load); not cryptographic, which is enough against damage (bit flips, torn or edited files):
# whoever can rewrite the index that holds it could rewrite the blake2b hashes beside it too. The
# version names what the digest covers; a session with no tag of this version (saved before it
# existed) is verified by the store's blake2b-256 turn hashes instead, so old entries still verify.
ROWS_DIGEST_TAG = "rows.xxh3-128.v1="

# The bytes of each weight file that the sampled hash reads: its head, its tail and this many
# evenly spaced windows, so two checkpoints of one shape (another seed, another fine-tune) differ
# without reading hundreds of gigabytes at every engine start.
SAMPLE_WINDOWS = 16
SAMPLE_BYTES = 1 << 20
# The hot tier's default budget (``hot_bytes``): 1 GiB of host memory per connector process holds
# ~230k tokens of the tests' 2-layer rows, or ~7k tokens of DeepSeek-V3's 61 layers in f32.
HOT_BYTES = 1 << 30


class LoadFailed(KVStoreError, LookupError):
    """Stored rows could not be served (missing, damaged, refused): the engine must recompute them."""


class RowsDamaged(LoadFailed):
    """Stored rows failed verification; the session was quarantined (see :meth:`PrefixCache.load`)."""


def rows_digest(records: np.ndarray) -> str:
    """XXH3-128 (32 hex digits) of records' bytes (a structured array [n] of one record type)."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(records).view(np.uint8).data)


def recorded_digest(tags) -> str | None:
    """The rows digest a save recorded among a session's tags (None: none of this version)."""
    for tag in tags:
        if tag.startswith(ROWS_DIGEST_TAG):
            return tag[len(ROWS_DIGEST_TAG) :]
    return None


# ---------------------------------------------------------------------------- fingerprint
def sampled_weights_hash(folder: str | os.PathLike) -> str | None:
    """``sampled-blake2b:<hex>`` over a model folder's ``*.safetensors`` files: names, sizes, and the
    first, last and :data:`SAMPLE_WINDOWS` evenly spaced windows of :data:`SAMPLE_BYTES` bytes.

    None when ``folder`` is not a folder holding weights (a hub id: the revision names it instead).
    Unlike the bundled engine's full ``blake2b:`` hash it does not read every byte; pass
    ``weights_hash`` in the connector's configuration to pin a full one.
    """
    path = Path(folder)
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file()) if path.is_dir() else []
    if not files:
        return None
    digest = hashlib.blake2b(digest_size=32)
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        starts = {0, max(size - SAMPLE_BYTES, 0)}
        starts |= {int(size * k / (SAMPLE_WINDOWS + 1)) for k in range(1, SAMPLE_WINDOWS + 1)}
        with open(file, "rb") as f:
            for start in sorted(starts):
                f.seek(start)
                digest.update(f.read(SAMPLE_BYTES))
    return "sampled-blake2b:" + digest.hexdigest()


def model_fingerprint(
    *,
    name: str,
    revision: str,
    geometry: Geometry,
    tier: Tier,
    attention_variant: str,
    weights_hash: str | None = None,
) -> Fingerprint:
    """The fingerprint a connector's rows are stored and looked up under."""
    model = ModelInfo.from_dict(
        {"name": name, "revision": revision, "weights_hash": weights_hash, "attention_variant": attention_variant}
    )
    return Fingerprint(model, geometry, tier)


# ---------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class CacheConfig:
    """What a connector's ``kv_connector_extra_config`` may hold (every key optional but ``store`` or ``url``).

    store : the store's folder (embedded mode); or
    url : a running ``kvstore serve`` (service mode), with ``api_key`` (or the variable named by
        ``api_key_env``, default ``KVSTORE_API_KEY``): the key decides the owner
    owner : embedded mode: whose sessions these are; another owner never sees them (default ``vllm``)
    tier : how rows are stored: ``bf16`` (v4) or ``f32`` (v1), exact, ``fp8``, ``int4``,
        ``polar2``..``polar6``; by default the exact tier of the engine's cache dtype
        (:meth:`tier_for`: bf16 for a bf16 cache, at half the bytes of f32)
    model_name, revision, weights_hash : the model part of the fingerprint (defaults: the engine's
        model path or id, its revision or ``main``, the sampled hash of the folder's weights)
    verify : check the stored rows before each load (default true): their XXH3-128, or the store's
        turn hashes for sessions saved without one
    min_tokens : prompts shorter than this are neither looked up nor saved (default 64, the
        store's prefix block)
    stats_dir : a folder where each connector process keeps its counters as JSON (optional)
    save_queue : vLLM: saves that may wait for the background writer (default 4); a save finding the
        queue full is skipped (``save_skipped``); 0 writes each save inside the step
    hot_bytes : the hot tier's budget: rows of recently loaded or saved sessions kept in host memory
        (default :data:`HOT_BYTES`; 0: no hot tier), see :mod:`kvstore.connectors.hot_tier`
    """

    store: str | None = None
    url: str | None = None
    api_key: str | None = dataclasses.field(default=None, repr=False)
    api_key_env: str = config.API_KEY.name
    owner: str = "vllm"
    tier: Tier | None = None  # None: by the cache's dtype (tier_for)
    model_name: str | None = None
    revision: str | None = None
    weights_hash: str | None = None
    verify: bool = True
    min_tokens: int = 64
    stats_dir: str | None = None
    save_queue: int = 4
    hot_bytes: int = HOT_BYTES

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "CacheConfig":
        """Validate a connector's extra configuration (raises :class:`ConfigError` naming the key)."""
        extra = dict(extra or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"unknown kvstore connector settings {unknown}; known: {sorted(known)}")
        store, url = extra.get("store"), extra.get("url")
        if (store is None) == (url is None):
            raise ConfigError(
                "kv_connector_extra_config needs either 'store' (a kvstore folder: embedded mode) "
                "or 'url' (a running kvstore serve: service mode)"
            )
        for key in ("store", "url", "api_key", "api_key_env"):
            if key in extra and (not isinstance(extra[key], str) or not extra[key]):
                raise ConfigError(f"kvstore connector: {key!r} must be a non-empty string")
        api_key = None
        if url is not None:
            if "owner" in extra:
                raise ConfigError("kvstore connector: in service mode the API key decides the owner; drop 'owner'")
            env_name = extra.get("api_key_env", config.API_KEY.name)
            api_key = extra.get("api_key") or config.environment(env_name)
            if not api_key:
                raise ConfigError(f"kvstore connector: service mode needs 'api_key' or the variable {env_name}")
        elif "api_key" in extra or "api_key_env" in extra:
            raise ConfigError("kvstore connector: 'api_key' is for service mode ('url'), not a store folder")
        try:
            owner = validate_owner(extra.get("owner", "vllm"))
            tier = tiers.get(str(extra["tier"])) if extra.get("tier") is not None else None
        except KVStoreError as exc:
            raise ConfigError(f"kvstore connector: {exc}") from exc
        if tier is not None and not tier.in_file:
            raise ConfigError(
                f"kvstore connector: tier {tier.name!r} is not stored in files; use bf16, f32, fp8 or int4"
            )
        for key in ("model_name", "revision", "weights_hash", "stats_dir"):
            if extra.get(key) is not None and not isinstance(extra[key], str):
                raise ConfigError(f"kvstore connector: {key!r} must be a string")
        verify = extra.get("verify", True)
        min_tokens = extra.get("min_tokens", 64)
        save_queue = extra.get("save_queue", 4)
        if not isinstance(save_queue, int) or isinstance(save_queue, bool) or save_queue < 0:
            raise ConfigError("kvstore connector: 'save_queue' must be 0 or a positive integer")
        hot_bytes = extra.get("hot_bytes", HOT_BYTES)
        if not isinstance(hot_bytes, int) or isinstance(hot_bytes, bool) or hot_bytes < 0:
            raise ConfigError("kvstore connector: 'hot_bytes' must be 0 (no hot tier) or a number of bytes")
        if not isinstance(verify, bool):
            raise ConfigError("kvstore connector: 'verify' must be true or false")
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 1:
            raise ConfigError("kvstore connector: 'min_tokens' must be a positive integer")
        return cls(
            store=store,
            url=url,
            api_key=api_key,
            api_key_env=extra.get("api_key_env", config.API_KEY.name),
            owner=owner,
            tier=tier,
            model_name=extra.get("model_name"),
            revision=extra.get("revision"),
            weights_hash=extra.get("weights_hash"),
            verify=verify,
            min_tokens=min_tokens,
            stats_dir=extra.get("stats_dir"),
            save_queue=save_queue,
            hot_bytes=hot_bytes,
        )

    def tier_for(self, cache_dtype: str) -> Tier:
        """The tier rows are stored in: the one configured, else the exact tier of the engine's cache
        dtype — ``bf16`` (v4, 2 bytes a value) for a ``bfloat16`` cache, ``f32`` for any other (an
        fp16 value is not always a bf16 one; f32 holds every cache dtype exactly)."""
        if self.tier is not None:
            return self.tier
        return tiers.BF16 if cache_dtype.removeprefix("torch.") == "bfloat16" else tiers.F32


# ---------------------------------------------------------------------------- counters
@dataclass
class CacheStats:
    """A connector process's counters. Every lookup is a hit or a miss (``hits + misses ==
    lookups``); ``refused`` counts the misses whose prefix was stored under another fingerprint."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    refused: int = 0
    matched_tokens: int = 0  # tokens the hits offered to the engine
    loads: int = 0
    loaded_tokens: int = 0  # rows written into the engine's cache
    load_errors: int = 0
    quarantined: int = 0  # stored sessions dropped because their rows failed verification
    saves: int = 0
    saved_tokens: int = 0
    save_errors: int = 0
    save_skipped: int = 0  # saves dropped because the background writer's queue was full
    save_pending: int = 0  # a gauge: saves queued for the background writer or being written
    finished_planned: int = 0  # scheduler: finished requests whose conversation save was asked for
    finished_done: int = 0  # worker: such requests settled (saved, failed or given up)
    hot_hits: int = 0  # loads served from the hot tier (host memory)
    hot_misses: int = 0  # loads the hot tier could not serve (read from the store)
    hot_evictions: int = 0  # entries this cache's puts pushed out of the hot tier
    hot_bytes: int = 0  # a gauge: bytes the hot tier holds
    load_us: int = 0  # worker: wall time of its loads (read, check, decode, placement), microseconds
    loaded_bytes: int = 0  # worker: stored bytes of the rows those loads placed (their records)
    errors: list[str] = field(default_factory=list)  # the last few reasons, newest last

    def note_error(self, reason: str) -> None:
        self.errors = (self.errors + [reason])[-8:]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- the cache
_stores: dict[str, Store] = {}
_stores_lock = threading.Lock()


def open_store(folder: str) -> Store:
    """One store per folder and process, from the one factory (``kvstore.store.open``; LMDB must
    not be opened twice in a process: a scheduler and a worker may share one)."""
    key = os.path.realpath(folder)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = kvstore.store.open(key)
        return store


def open_client(config: CacheConfig) -> StoreClient:
    """The store a configuration names: a folder (embedded) or a service (with its key)."""
    if config.url is not None:
        assert config.api_key is not None  # from_extra requires one
        return ServiceClient(config.url, config.api_key)
    assert config.store is not None
    return LocalClient(open_store(config.store), config.owner)


@dataclass(frozen=True)
class Match:
    """A stored session sharing ``tokens`` leading tokens with a prompt."""

    session_id: str
    tokens: int


class PrefixCache:
    """Prefix lookup, load and save of one model's rows in one owner's part of a store.

    Parameters
    ----------
    store : a :class:`StoreClient` (see :func:`open_client`), or a session store (see
        :func:`open_store`) used for ``owner``
    owner : the owner the sessions belong to (a client's own owner when None)
    fingerprint : the model, geometry and tier rows are stored and looked up under
    verify : re-hash stored turns before a load
    min_tokens : prompts shorter than this are not looked up (a miss) nor saved
    stats_path : a JSON file the counters are written to after each change (optional)
    hot : a hot tier in host memory in front of the store (optional; it may be shared by caches
        of other fingerprints or owners: entries are keyed by both)
    """

    def __init__(
        self,
        store: StoreClient | Store,
        owner: str | None,
        fingerprint: Fingerprint,
        *,
        verify: bool = True,
        min_tokens: int = 64,
        stats_path: str | os.PathLike | None = None,
        hot: HotTier | None = None,
    ):
        if isinstance(store, Store):
            if owner is None:
                raise ValueError("a session store needs the owner the cache acts for")
            store = LocalClient(store, owner)
        elif owner is not None and owner != store.owner:
            raise ValueError(f"the client acts for {store.owner!r}, not {owner!r}")
        self.client: StoreClient = store
        self.owner = validate_owner(store.owner)
        self.fingerprint = fingerprint
        self.verify = verify
        self.min_tokens = min_tokens
        self.stats = CacheStats()
        self.stats_path = Path(stats_path) if stats_path is not None else None
        self._lock = threading.Lock()
        self._key = fingerprint.key()
        g = fingerprint.geometry
        self.row_width = g.kv_lora + g.qk_rope
        self.record_bytes = record_bytes(g, fingerprint.tier)  # one stored row (all layers)
        #: the element type of the rows the hot tier keeps and ``load(native=True)`` returns: a value
        #: tier's own (bf16 bit patterns for bf16: half the memory of f32, widened exactly), else f32
        self.native_dtype = np.dtype(np.uint16) if fingerprint.tier is tiers.BF16 else np.dtype(np.float32)
        # the tier stores rows as values (f32, bf16), which a load may hand out as they lie in the records
        self.holds_values = fingerprint.tier.row_codec.holds_values
        self.hot = hot if hot is not None and hot.budget > 0 else None
        self._shred_mark = self.client.shred_mark() if self.hot is not None else None

    def _forget_if_shredded(self) -> None:
        """Drop the owner's rows from the hot tier once its data keys were destroyed (``kvstore
        crypto shred`` in any process): checked before every lookup and every hot hit (one ``stat``
        of an encrypted store's keyring), so no plaintext of a shredded owner is served from memory
        or kept past this process's next request."""
        if self.hot is None:
            return
        mark = self.client.shred_mark()
        if mark != self._shred_mark:
            self._shred_mark = mark
            self._drop_owner("its data keys were destroyed")

    def _drop_owner(self, reason: str) -> None:
        if self.hot is not None and self.hot.drop_owner(self.owner):
            logger.warning("kvstore connector: owner %s's rows dropped from the hot tier: %s", self.owner, reason)
            self._add({}, None, hot_bytes=self.hot.nbytes)

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens) -> Match | None:
        """The stored session sharing the longest prefix with ``tokens`` (int[n]), counted as a hit
        or a miss; a prefix stored only under another fingerprint is a refused miss."""
        tokens = np.asarray(tokens, dtype=np.int64)
        found = None
        refused = False
        self._forget_if_shredded()
        if tokens.size >= self.min_tokens:
            try:
                result = self.client.lookup(self.fingerprint, tokens)
                if result is not None:
                    found = Match(result.session_id, result.tokens)
                else:
                    refused = self._stored_elsewhere(tokens)
            except (KVStoreError, OSError) as exc:
                if isinstance(exc, KeyShredded):
                    self._drop_owner(str(exc))
                self._count(error=f"lookup: {exc}")
            self._forget_if_shredded()  # a service says it in the lookup's answer
        with self._lock:
            self.stats.lookups += 1
            if found is not None:
                self.stats.hits += 1
                self.stats.matched_tokens += found.tokens
            else:
                self.stats.misses += 1
                self.stats.refused += int(refused)
        self._write_stats()
        return found

    def _stored_elsewhere(self, tokens: np.ndarray) -> bool:
        """Whether the owner holds this prefix under another fingerprint (one lookup per distinct
        fingerprint of the owner's sessions: a miss's extra cost; in service mode the server counts
        these lookups too)."""
        others = [f for f in self.client.fingerprints() if f.key() != self._key]
        for other in others:
            try:
                if self.client.lookup(other, tokens) is not None:
                    return True
            except KVStoreError:  # e.g. token ids beyond the other model's vocabulary
                continue
        return False

    # ------------------------------------------------------------------ load
    def load(self, session_id: str, start: int, stop: int, *, view: bool = False, native: bool = False) -> np.ndarray:
        """Rows of tokens ``[start, stop)`` of a session, f32 ``[n_layers, stop - start, kv_lora + qk_rope]``
        (``native``: in :attr:`native_dtype` — a bf16 tier's bit patterns, u16 — for a caller that
        places them in a bf16 cache itself).

        A session whose rows fail verification is quarantined: deleted from the store (counted in
        ``quarantined``), so the next lookup of its prompt misses and the next save stores it anew.

        With a hot tier, rows this process loaded (checked) or saved earlier are copied from host
        memory (``hot_hits``); else the store's rows are read and checked, and all of them are kept
        in the tier for the next load (``hot_misses``). The array returned is the caller's; with
        ``view`` it may instead be a read-only view of the tier's entry, or of the records read —
        a value tier's rows (f32, bf16) as they lie there, undecoded (no copy: for a caller that
        only reads the rows, such as a worker placing them in its engine's cache).

        Raises
        ------
        RowsDamaged
            The rows before ``stop`` failed verification (the session was quarantined).
        LoadFailed
            The session is gone, was written under another fingerprint or holds fewer rows. Both
            are counted in ``load_errors``; nothing partial is returned.
        """
        if self.hot is not None:
            self._forget_if_shredded()
            entry = self.hot.get(self._hot_key(session_id))
            if entry is not None and entry.shape[1] >= stop:
                # the entry is never written (read-only): no lock needed, and a view is safe to hand out
                rows = self._handed(entry[:, start:stop], view=view, native=native)
                self._count(hot_hits=1, loads=1, loaded_tokens=stop - start)
                return rows
            self._count(hot_misses=1)
        try:
            expected = None
            if self.verify:  # the index's answer is small; the rows are checked against it below
                stored = self.client.stored(session_id)
                expected = recorded_digest(stored.tags) if stored is not None else None
            try:
                # without a recorded digest, the store re-hashes the turns (blake2b-256) as it reads
                served = self.client.resume(session_id, self.fingerprint, self.verify and expected is None)
            except KeyShredded as exc:  # unreadable by design, not damage: nothing to quarantine
                self._drop_owner(str(exc))
                raise LoadFailed(f"session {session_id!r}: {exc}") from exc
            except IntegrityError as exc:  # e.g. a session the store marked damaged
                self._quarantine(session_id, str(exc))
                raise RowsDamaged(str(exc)) from exc
            if expected is not None and rows_digest(served.records.records) != expected:
                reason = f"the {served.records.n} rows of session {session_id!r} do not match their XXH3-128"
                self._quarantine(session_id, reason)
                raise RowsDamaged(f"{reason} (quarantined)")
            if served.damaged_from is not None:
                self._quarantine(session_id, f"records from {served.damaged_from} on fail verification")
            if served.records.n < stop:
                if served.damaged_from is not None:
                    raise RowsDamaged(
                        f"session {session_id!r} serves {served.records.n} rows, {stop} needed "
                        f"(damaged from record {served.damaged_from}; quarantined)"
                    )
                raise LoadFailed(f"session {session_id!r} serves {served.records.n} rows, {stop} needed")
            if self.hot is not None and served.damaged_from is None:
                # every served row, checked: the tier answers later loads of any range of them
                # (a value tier's rows a view of the records read: the tier copies them into row
                # order, in place of a decode pass; a quantized tier's decoded rows are kept as they are)
                everything = self._keep_hot(session_id, self._native_rows(served.records), owned=True)
                rows = self._handed(everything[:, start:stop], view=view, native=native)
            else:  # the records are this load's alone: one pass over the rows at most
                rows = self._handed(self._native_rows(served.records.slice(start, stop)), view=view, native=native)
        except (KVStoreError, OSError) as exc:
            reason = f"load {session_id}[{start}:{stop}]: {exc}"
            self._count(load_errors=1, error=reason)
            if isinstance(exc, LoadFailed):
                raise
            raise LoadFailed(reason) from exc
        self._count(loads=1, loaded_tokens=stop - start)
        return rows

    def _native_rows(self, records: KVRecords) -> np.ndarray:
        """``records``' rows in :attr:`native_dtype`, only to be read: a value tier's (f32, bf16) as
        a view of the records themselves (no pass over the rows, no fresh array); a quantized
        tier's decoded into a fresh array."""
        return records.values_view() if self.holds_values else records.rows()

    @staticmethod
    def _handed(rows: np.ndarray, *, view: bool, native: bool) -> np.ndarray:
        """Rows as a caller gets them: f32 unless ``native``; as they are with ``view`` and nothing
        to convert, else the caller's own array — read-only rows (a hot-tier entry, a view of the
        records read) copied, fresh ones (a quantized tier's decode) handed over."""
        if rows.dtype == np.uint16 and not native:
            return bf16_decode(rows)  # exact, and a fresh array
        return rows if view or rows.flags.writeable else rows.copy()

    def _quarantine(self, session_id: str, reason: str) -> None:
        """Drop a session whose rows fail verification. Kept, it would be found by every later
        lookup, fail every load, and make its own prompt's save a no-op ("stored already"); dropped,
        the next save of that prompt replaces it. (Two processes finding the same damage may race:
        the later delete can drop a fresh copy the other just saved: a future miss, never wrong rows.)"""
        self._drop_hot(session_id)
        try:
            self.client.delete(session_id)
        except (KVStoreError, OSError) as exc:  # gone already, or the store unreachable: not counted
            self._count(error=f"quarantine {session_id}: {exc}")
            return
        logger.warning("kvstore connector: session %s quarantined (deleted): %s", session_id, reason)
        self._count(quarantined=1, error=f"quarantined {session_id}: {reason}")

    # ------------------------------------------------------------------ save
    def session_id_for(self, tokens: np.ndarray) -> str:
        """The id a prompt's rows are saved under: the same prompt of the same model, one session."""
        digest = hashlib.blake2b(self._key.encode() + b"\0" + tokens.astype("<i4").tobytes(), digest_size=16)
        return "vllm-" + digest.hexdigest()

    def save(self, tokens, rows: np.ndarray) -> str | None:
        """Store a prompt's rows (``tokens`` int[n], ``rows`` ``[n_layers, n, kv_lora + qk_rope]``: f32,
        or with the bf16 tier the bf16 bit patterns of :attr:`native_dtype`, a bf16 cache's own
        bits) as one complete turn of a new session; None when it was stored already or could not
        be (the reason is counted in ``save_errors``: a failed save is a future miss, never an error
        for the request)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        g = self.fingerprint.geometry
        if tokens.size < self.min_tokens:
            return None
        if rows.shape != (g.n_layers, tokens.size, self.row_width):
            raise ValueError(f"rows must be [{g.n_layers}, {tokens.size}, {self.row_width}], got {list(rows.shape)}")
        if rows.dtype == np.uint16 and self.native_dtype != np.uint16:
            raise ValueError(f"bf16 bit patterns are saved by the bf16 tier only, not {self.fingerprint.tier}")
        session_id = self.session_id_for(tokens)
        return session_id if self._store(session_id, tokens, rows) == "saved" else None

    def _store(self, session_id: str, tokens: np.ndarray, rows: np.ndarray) -> str:
        """Rows as one complete turn of a new session: ``"saved"``, ``"exists"`` (stored already) or
        ``"failed"`` (the reason counted in ``save_errors``; nothing is left behind)."""
        g = self.fingerprint.geometry
        if rows.dtype != np.uint16:  # (bf16 bits are copied into the records as they are)
            rows = np.ascontiguousarray(rows, dtype=np.float32)
        try:  # encoded here, so that the digest is of the very bytes the journal will hold
            records = encode_rows(self.fingerprint, tokens, rows[..., : g.kv_lora], rows[..., g.kv_lora :])
            tags = (ROWS_DIGEST_TAG + rows_digest(records),)
            self.client.create(session_id, self.fingerprint, tags)
        except SessionExists:
            return "exists"
        except (KVStoreError, OSError) as exc:
            self._count(save_errors=1, error=f"save: {exc}")
            return "failed"
        try:
            self.client.append_records(session_id, records)
        except (KVStoreError, OSError) as exc:
            self._count(save_errors=1, error=f"save: {exc}")
            self._drop_hot(session_id)
            try:  # an empty session would only shadow a later save of the same rows
                self.client.delete(session_id)
            except (KVStoreError, OSError):
                pass
            return "failed"
        self._count(saves=1, saved_tokens=int(tokens.size))
        if self.hot is not None:  # the rows as a load will read them back (quantized, non-finite as 0)
            n = int(records.shape[0])
            written = KVRecords(Header(g, self.fingerprint.tier, n), records, HEADER_BYTES + records.nbytes)
            # the records were encoded here and nobody else holds them (the tier copies a value
            # tier's view into row order)
            self._keep_hot(session_id, self._native_rows(written), owned=True)
        return "saved"

    # ------------------------------------------------------------------ hot tier
    def _hot_key(self, session_id: str) -> HotKey:
        return (self.owner, self._key, session_id)

    def _keep_hot(self, session_id: str, rows: np.ndarray, *, owned: bool = False) -> np.ndarray:
        """Keep rows this process checked or wrote in the hot tier (counting what it evicted);
        ``owned``: :meth:`HotTier.put`'s. Returns the entry kept (``rows`` when none is)."""
        if self.hot is None:
            return rows
        key = self._hot_key(session_id)
        evicted = self.hot.put(key, rows, owned=owned)
        self._add({"hot_evictions": evicted}, None, hot_bytes=self.hot.nbytes)
        kept = self.hot.get(key)
        return rows if kept is None else kept

    def _drop_hot(self, session_id: str) -> None:
        """Forget a session this process deletes: quarantined, or a save that failed halfway."""
        if self.hot is not None and self.hot.drop(self._hot_key(session_id)):
            self._add({}, None, hot_bytes=self.hot.nbytes)

    # ------------------------------------------------------------------ counters
    def count(self, **increments: int) -> None:
        """Add to counters kept outside this class's calls (e.g. the background writer's)."""
        self._add(increments, None)

    def count_save_error(self, reason: str) -> None:
        """A save that failed before reaching :meth:`save` (e.g. reading the engine's cache)."""
        self._count(save_errors=1, error=f"save: {reason}")

    def _count(self, *, error: str | None = None, **increments: int) -> None:
        self._add(increments, error)

    def _add(self, increments: dict[str, int], error: str | None, hot_bytes: int | None = None) -> None:
        with self._lock:
            for name, amount in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + amount)
            if error is not None:
                self.stats.note_error(error)
            if hot_bytes is not None:  # a gauge: set, not added
                self.stats.hot_bytes = hot_bytes
        self._write_stats()

    def _write_stats(self) -> None:
        """The counters as JSON, replaced atomically (a reader never sees half a file)."""
        if self.stats_path is None:
            return
        with self._lock:
            text = json.dumps(self.stats.to_dict())
        folder = self.stats_path.parent
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".stats-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.stats_path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
