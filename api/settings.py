"""Service settings: where the data lives, limits, the engine, and the API keys given by environment.

Nothing here reads the environment at import time: ``KVSTORE_API_KEYS`` (``kvstore.config``) is
read when a :class:`Settings` is built without ``api_keys_env``; the defaults shared with the
command line (the data folder, the engine's tier, the lease's length) are ``kvstore.config``'s.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from kvstore import config, tiers
from kvstore.api.connections import DEFAULT_HEADER_TIMEOUT_S
from kvstore.api.jobs import DEFAULT_MAX_PENDING, DEFAULT_MAX_PENDING_PER_OWNER
from kvstore.api.uploads import DEFAULT_MAX_INFLIGHT_BYTES
from kvstore.errors import ConfigError
from kvstore.locks import DEFAULT_LOCK_TIMEOUT_S
from kvstore.store.index import DEFAULT_MAP_SIZE

DEFAULT_MAX_BODY_BYTES = 256 << 20  # a 256-token turn of a 78-layer fp8 model is ~12 MiB
DEFAULT_SESSION_WAITERS = 16  # 8 writers and their readers on one session wait; the 17th is told to retry
DEFAULT_MAX_SESSIONS_PER_OWNER = 100_000  # generous: bounds what one key can make (~250 creates/s over HTTP)


@dataclass
class Settings:
    """Everything the service is configured with.

    Attributes
    ----------
    data_dir : the store's folder (``keys.json`` lives there too)
    budget_bytes, hard_limit_bytes : the store's disk budget and hard limit (see SessionStore); on a
        replica of a shared store both are the whole shared store's (its LRU sessions parked, then
        deleted; a write past the hard limit refused in its commit)
    max_body_bytes : request bodies larger than this are refused with 413 before being read
    max_inflight_bytes : upload bodies held at once, service-wide (``kvstore.api.uploads``); an
        append that would pass it is refused with 503 ``UploadsBusy`` and ``Retry-After`` before
        its body is read; at least ``max_body_bytes`` (None: 1 GiB, or four of the largest body)
    header_timeout : seconds a connection may take to send a request's headers (from its opening,
        or from a new request's first byte) before it is answered 408 and closed
        (``kvstore.api.connections``)
    api_keys_env : ``key:owner,key:owner`` (the ``KVSTORE_API_KEYS`` variable by default, read
        when the settings are built)
    lock_timeout : seconds a request waits for a session another request (or process) holds before
        answering 409 ``JournalLocked``; also the store's and its journals' lock wait (one setting)
    session_waiters : requests of one owner that may wait for one session at once; one more is
        refused at once with 429 ``SessionBusy`` and ``Retry-After`` (the waiters hold no thread)
    job_workers : threads running long jobs (park, unpark, migrate)
    max_jobs, max_jobs_per_owner : jobs queued or running at once, service-wide and per owner; one
        more is refused with 429 ``JobQueueFull`` and ``Retry-After``
    max_sessions_per_owner : sessions one owner may have (the store counts them in its index); a
        create or fork past it is refused with 409 ``TooManySessions``, nothing created (None: no
        cap). On a replica, the whole shared store's count of the owner's sessions
    stream_chunk_bytes : bytes per chunk when streaming rows out
    reject_nonfinite : refuse appended rows holding NaN or infinity (422 ``NonFiniteValues``)
        instead of storing them by the tier's rule and counting them in the answer's ``sanitized``
    model_dir : a model folder to load the bundled engine from (None: no ``/generate``)
    tier : the engine's cache tier, a name of :mod:`kvstore.tiers` (``f32``, ``bf16``, ``fp8``,
        ``int4``, ``polar2`` .. ``polar6``, ``q8``) or a ``Tier``; held as the canonical name. Old
        spellings (``tq-polar``, ``int8``, ...) are read for one release with a
        ``TierSpellingDeprecated`` warning.
    bits : deprecated (one release): PolarQuant bits for the old ``tq-polar`` spelling; folded
        into ``tier`` (then None)
    device, dtype : where the engine runs (``cpu``, ``cuda``, ``mps``) and its weights dtype
    index_url, blobs_url : a shared store (``postgresql://...`` and ``s3://BUCKET/PREFIX``, both or
        neither): this service is then one replica of it (``kvstore.store.shared``, docs/SCALE.md)
        and reads its API keys from the index; ``data_dir`` is only the replica's local folder
    lease_ttl : seconds a replica's write lease on a session lasts (shared store only)
    cache_bytes : the size budget of a replica's local cache of segment objects in ``data_dir``
        (shared store only; None: 8 GiB, 0: no cache)
    max_new_tokens : the most tokens one turn may ask for (a request asking more is refused)
    max_batch : turns the engine decodes together (its decode slots; docs/SERVE.md)
    arena_rows : rows of the decode arena reserved at start (None: 4096 a slot on a GPU, none on
        the CPU; docs/SERVE.md)
    step_tokens : the most tokens one decode step runs, short prompts joining the batch inside it
        (None: 512 where steps replay CUDA graphs, none elsewhere; 0: every prompt takes prefill
        forwards; docs/SERVE.md)
    max_queue : turns in flight beyond the slots, service-wide; one more gets 429 ``ServerBusy``
    max_turns_per_owner : turns one owner may have in flight; one more gets 429 ``ServerBusy``
    turn_deadline : seconds a turn may run before it is stopped (``finish_reason: deadline``);
        None: no deadline
    pool_bytes : device memory resident sessions keep between their turns (None: half the free
        device memory on CUDA, 1 GiB elsewhere); least recently used sessions leave first
    host_pool_bytes : pinned host memory sessions leaving the device move to (0: none; they are
        restored from the store next time)
    expiry_sweep : seconds between the service's sweeps of expired sessions (``kvstore.api.expiry``;
        0: none, expired sessions are then only refused, their files kept until a sweep,
        ``kvstore sessions expire``)
    torch_threads : torch's intra-op threads in this process (None: 1 on the CPU — torch's spinning
        worker threads would starve the server's own between steps, docs/SERVE.md — and torch's
        default elsewhere)
    """

    data_dir: Path = Path(config.DATA_DIR.value)
    budget_bytes: int | None = None
    hard_limit_bytes: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_inflight_bytes: int | None = None
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    map_size: int = DEFAULT_MAP_SIZE
    encrypt: bool = False  # `serve --encrypt`: a new store is created encrypted at rest (docs/SECURITY.md)
    kek_file: Path | None = None  # `serve --kek-file`: the store's key-encryption key
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S
    session_waiters: int = DEFAULT_SESSION_WAITERS
    api_keys_env: str | None = field(default_factory=config.API_KEYS.get)
    job_workers: int = 2
    max_jobs: int = DEFAULT_MAX_PENDING
    max_jobs_per_owner: int = DEFAULT_MAX_PENDING_PER_OWNER
    max_sessions_per_owner: int | None = DEFAULT_MAX_SESSIONS_PER_OWNER
    stream_chunk_bytes: int = 4 << 20
    reject_nonfinite: bool = False
    model_dir: Path | None = None
    tier: str = config.ENGINE_TIER.value
    bits: int | None = None
    device: str = "cpu"
    dtype: str | None = None
    index_url: str | None = None
    blobs_url: str | None = None
    lease_ttl: float = config.LEASE_TTL_S.value
    cache_bytes: int | None = None
    max_new_tokens: int = 4096
    max_batch: int | None = None
    arena_rows: int | None = None
    step_tokens: int | None = None
    max_queue: int = 64
    max_turns_per_owner: int = 8
    turn_deadline: float | None = 600.0
    pool_bytes: int | None = None
    host_pool_bytes: int = 0
    torch_threads: int | None = None
    expiry_sweep: float = 60.0

    def __post_init__(self):
        self.data_dir = Path(self.data_dir)
        if self.model_dir is not None:
            self.model_dir = Path(self.model_dir)
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ConfigError("max_body_bytes must be a positive number of bytes")
        if self.max_inflight_bytes is None:
            self.max_inflight_bytes = max(DEFAULT_MAX_INFLIGHT_BYTES, 4 * self.max_body_bytes)
        if not isinstance(self.max_inflight_bytes, int) or self.max_inflight_bytes < self.max_body_bytes:
            raise ConfigError(
                f"max_inflight_bytes ({self.max_inflight_bytes!r}) must be at least max_body_bytes "
                f"({self.max_body_bytes}): a body of the largest size must fit (--max-inflight-bytes, --max-body)"
            )
        for name in ("session_waiters", "job_workers", "max_jobs", "max_jobs_per_owner", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, not {value!r}")
        if not isinstance(self.header_timeout, (int, float)) or not 0 < self.header_timeout <= 3600:
            raise ConfigError(
                f"header_timeout must be more than 0 and at most 3600 seconds, not {self.header_timeout!r}"
            )
        if not isinstance(self.expiry_sweep, (int, float)) or not 0 <= self.expiry_sweep <= 86400:
            raise ConfigError(f"expiry_sweep must be 0 to 86400 seconds, not {self.expiry_sweep!r}")
        if not isinstance(self.lock_timeout, (int, float)) or not 0 <= self.lock_timeout <= 3600:
            raise ConfigError(f"lock_timeout must be 0 to 3600 seconds, not {self.lock_timeout!r}")
        self.tier, self.bits = self._engine_tier().name, None
        self._check_shared()
        self._check_serving()

    @property
    def shared(self) -> bool:
        """Whether the sessions live in a shared store (PostgreSQL + S3) rather than in ``data_dir``."""
        return self.index_url is not None

    def _check_shared(self) -> None:
        if (self.index_url is None) != (self.blobs_url is None):
            raise ConfigError(
                "a shared store needs both its index (--index postgresql://..., KVSTORE_INDEX_URL) and its object "
                "store (--blobs s3://BUCKET/PREFIX, KVSTORE_BLOBS_URL)"
            )
        if not isinstance(self.lease_ttl, (int, float)) or not 0.5 <= self.lease_ttl <= 3600:
            raise ConfigError(f"lease_ttl must be 0.5 to 3600 seconds, not {self.lease_ttl!r}")
        if self.cache_bytes is not None and (
            not isinstance(self.cache_bytes, int) or isinstance(self.cache_bytes, bool) or self.cache_bytes < 0
        ):
            raise ConfigError(f"cache_bytes must be a number of bytes >= 0, not {self.cache_bytes!r}")
        if self.index_url is None and self.cache_bytes is not None:
            raise ConfigError("--cache-size: only a replica of a shared store (--index, --blobs) has a segment cache")

    def _check_serving(self) -> None:
        for name in ("max_batch", "max_turns_per_owner", "torch_threads", "max_sessions_per_owner"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, not {value!r}")
        for name in ("max_queue", "host_pool_bytes", "arena_rows", "step_tokens"):
            value = getattr(self, name)
            if name in ("arena_rows", "step_tokens") and value is None:
                continue  # the device's default
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, not {value!r}")
        if self.pool_bytes is not None and (not isinstance(self.pool_bytes, int) or self.pool_bytes < 0):
            raise ConfigError(f"pool_bytes must be a number of bytes >= 0, not {self.pool_bytes!r}")
        if self.turn_deadline is not None and not (
            isinstance(self.turn_deadline, (int, float)) and 0 < self.turn_deadline <= 7 * 24 * 3600
        ):
            raise ConfigError(f"turn_deadline must be 0 to 604800 seconds, not {self.turn_deadline!r}")

    def scheduler_limits(self, device: str):
        """The engine's :class:`~kvstore.engine.scheduler.SchedulerLimits` (decode slots: 16 on a
        GPU, 8 on the CPU unless ``max_batch`` says; the decode arena: 4096 rows a slot reserved on
        a GPU, where growing it recaptures graphs, none on the CPU, unless ``arena_rows`` says)."""
        from kvstore.engine.scheduler import SchedulerLimits

        slots = self.max_batch if self.max_batch is not None else (8 if device == "cpu" else 16)
        arena = self.arena_rows if self.arena_rows is not None else (0 if device == "cpu" else slots * 4096)
        return SchedulerLimits(
            max_batch=slots,
            arena_rows=arena,
            step_tokens=self.step_tokens,
            max_queue=self.max_queue,
            max_turns_per_owner=self.max_turns_per_owner,
            max_new_tokens=self.max_new_tokens,
            turn_deadline=self.turn_deadline,
        )

    def _engine_tier(self) -> tiers.Tier:
        spelled = self.tier.name if isinstance(self.tier, tiers.Tier) else self.tier
        try:
            tier, note = tiers.resolve(spelled, bits=self.bits)
        except tiers.UnknownTier as exc:
            raise ConfigError(f"the engine's tier: {exc.reason}") from None
        if note is not None:
            warnings.warn(note, tiers.TierSpellingDeprecated, stacklevel=4)  # the caller of Settings(...)
        return tier
