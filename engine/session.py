"""Conversations on stored sessions, many at once: the engine, a pool of resident sessions and one
scheduler, joined to the session store.

A :class:`SessionEngine` owns one :class:`~kvstore.engine.generate.Engine` (the model), a
:class:`~kvstore.engine.pool.ResidentPool` (the sessions whose rows stay on the device between
turns) and a :class:`~kvstore.engine.scheduler.Scheduler` (one thread owning the device: every turn
in flight decodes in one batch). A turn (:meth:`SessionEngine.begin` / :meth:`SessionEngine.run`)
does, in order:

1. **Admit.** The owner's turns in flight and the server's queue are bounded
   (``ServerBusy``: 429 on the API); the session is held for this turn (a second turn on it waits).
2. **Fingerprint.** The session's fingerprint (geometry words, tier, model: name, revision,
   weights/tokenizer/chat-template hashes, attention variant) is compared with the engine's
   (:mod:`kvstore.engine.fingerprint`); a difference is refused with ``FingerprintMismatch``
   naming the field, unless the caller overrides that field explicitly. A v1 (f32) session is
   accepted by a quantized engine without an override: its rows are lossless (see 4).
3. **Bring the rows in**, from the nearest tier: the pool when it holds this session's current
   state (``live``: nothing restored), the pinned host tier (``host``: one copy back), else the
   records up to the turn watermark from the store (``journal``, or ``shared`` on a replica; with
   ``verify`` the turn hashes are checked first and a bad turn is a miss: only the turns before it
   are served). A restore builds a new cache and enters the pool **all or nothing**: on any failure
   (missing or truncated journal, a header that no longer matches, decode, device upload or
   allocation, out of memory) the pool and the session are left exactly as they were and the error
   says why (``RestoreFailed`` wraps what is not a ``KVStoreError`` already).
4. **Generate**, on the scheduler: the new tokens are prefilled in chunks between decode steps,
   then the turn decodes in the batch with every other turn in flight. A v1 session in a quantized
   engine is quantized in memory (docs/FORMAT.md section 4, lazy upgrade).
5. **Append.** The turn's rows (prompt + answer, the last token's row included) are appended as
   one complete turn. Before that, records the restore did not serve (a partial turn past the
   watermark, or a damaged tail found by ``verify``) are cut, and a v1 session written by a
   quantized engine is upgraded to the engine's tier (``Store.migrate``: an atomic rewrite). If the
   session changed while the turn ran (another writer), nothing is appended (``ConversationMismatch``)
   and its rows leave the pool.
6. **Report** ``reused_tokens`` / ``prefilled_tokens`` and where the reused rows came from in the
   :class:`TurnResult` and in the log.

Examples
--------
>>> import kvstore.store                                          # doctest: +SKIP
>>> store = kvstore.store.open("./data")                            # doctest: +SKIP
>>> chat = SessionEngine.from_folder("models/tiny", store, tier="fp8")   # doctest: +SKIP
>>> first = chat.run("chat-1", "Hello", create=True, owner="me")     # doctest: +SKIP
>>> again = chat.run("chat-1", " and again", owner="me")             # doctest: +SKIP
>>> again.reused_tokens == first.session.n_records, again.source    # doctest: +SKIP
(True, 'live')
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import torch

from kvstore import DEFAULT_OWNER
from kvstore.engine.cache import LatentCache
from kvstore.engine.errors import GenerationError, RestoreFailed
from kvstore.engine.fingerprint import check_override, folder_model_info, refuse_mismatch
from kvstore.engine.generate import DEFAULT_PREFILL_CHUNK, Engine, SamplingParams
from kvstore.engine.pool import Resident, ResidentPool, to_device
from kvstore.engine.scheduler import Scheduler, SchedulerLimits
from kvstore.engine.turns import TextDeltas, Turn, TurnResult
from kvstore.errors import FingerprintMismatch, KVStoreError, SessionDamaged, SessionNotFound
from kvstore.store import Fingerprint, ModelInfo, SessionInfo, Store, validate_session_id

if TYPE_CHECKING:
    from kvstore.tiers import Tier

__all__ = ["DEFAULT_OWNER", "ResumeReport", "SessionEngine", "TextDeltas", "Turn", "TurnResult"]

log = logging.getLogger(__name__)

SOURCES = ("new", "live", "host", "journal", "shared")
#: Rows a restored or new session's cache keeps free after its own: a turn's prompt and answer.
HEADROOM = 256


def default_pool_bytes(device: torch.device) -> int:
    """The resident pool's default budget: half the device memory free now (CUDA), else 1 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return 1 << 30


@dataclass(frozen=True)
class ResumeReport:
    """What bringing a session's rows onto the device did.

    Attributes
    ----------
    session_id : the session
    source : ``"live"`` (resident already), ``"host"`` (from the host tier), ``"journal"`` /
        ``"shared"`` (restored from the store) or ``"new"`` (nothing stored)
    reused_tokens : rows the cache holds for the session (the next turn does not prefill them)
    restored_tokens : rows brought in by this call (0 for ``live``/``new``)
    damaged_from : first record of the first bad turn when ``verify`` found one (not served)
    unserved_records : stored records past what is served (a partial turn, or a damaged tail);
        the next turn's append replaces them
    seconds : wall time of bringing the rows in
    """

    session_id: str
    source: str
    reused_tokens: int
    restored_tokens: int
    damaged_from: int | None
    unserved_records: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SessionEngine:
    """An engine whose conversations live in a session store, many served at once.

    Parameters
    ----------
    engine : the model (any tier, any device); its cache tier is the sessions' cache tier
    store : the session store turns are read from and appended to
    model : the model part of the fingerprint (:func:`kvstore.engine.fingerprint.folder_model_info`)
    folder : the model folder (reported only)
    limits : the scheduler's limits (:class:`~kvstore.engine.scheduler.SchedulerLimits`)
    pool_bytes : device bytes resident sessions may keep between turns (default
        :func:`default_pool_bytes`)
    host_bytes : bytes of the pinned host tier evicted sessions move to (0: none)

    Attributes
    ----------
    fingerprint : Fingerprint — what sessions this engine writes carry, and what restores compare
    pool, scheduler : the resident sessions and the decode loop
    """

    def __init__(
        self,
        engine: Engine,
        store: Store,
        model: ModelInfo,
        *,
        folder: str | os.PathLike | None = None,
        limits: SchedulerLimits | None = None,
        pool_bytes: int | None = None,
        host_bytes: int = 0,
    ):
        self.engine = engine
        self.store = store
        self.model = ModelInfo.from_dict(model)
        self.folder = Path(folder).resolve() if folder is not None else None
        self.geometry = engine.config.coli_geometry()
        self.tier = engine.cache.tier.file_tier
        self.fingerprint = Fingerprint(self.model, self.geometry, self.tier)
        self.limits = limits or SchedulerLimits(prefill_chunk=engine.prefill_chunk)
        self.scheduler = Scheduler(engine, self.limits)
        began = time.perf_counter()
        warmed = self.scheduler.warm()  # where steps replay graphs: every batch size class, now
        if warmed:
            log.info("decode steps of %s turns made ready in %.1f s", warmed, time.perf_counter() - began)
        if torch.device(engine.device).type == "cuda":
            # the restore ring's pinned buffers and device stage, into torch's caching allocators
            # now: the first resume from a journal pays no cudaHostAlloc (tens of milliseconds)
            from kvstore.engine.restore import RecordLayout, read_threads, reserve_buffers

            layout = RecordLayout.of(self.geometry, self.tier)
            reserve_buffers(layout.rec_bytes, 1 << 20, engine.device, threads=read_threads(decrypting=True))
        budget = default_pool_bytes(engine.device) if pool_bytes is None else pool_bytes
        self.pool = ResidentPool(budget, host_bytes)
        # where a session restored from the store comes from, as turns report it
        self._stored_source = "journal" if store.supports("journal_files") else "shared"

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike,
        store: Store,
        *,
        tier: "Tier | str" = "f32",
        bits: int | None = None,
        device: "torch.device | str" = "cpu",
        dtype: "torch.dtype | str | None" = None,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
        limits: SchedulerLimits | None = None,
        pool_bytes: int | None = None,
        host_bytes: int = 0,
    ) -> "SessionEngine":
        """Load a model folder (and its tokenizer) with a ``tier`` cache on ``device``.

        The weights hash is computed once per folder and cached (see
        :func:`kvstore.engine.fingerprint.weights_hash`).
        """
        model = folder_model_info(folder)
        engine = Engine.from_folder(
            folder, device=device, dtype=dtype, tier=tier, bits=bits, prefill_chunk=prefill_chunk
        )
        return cls(engine, store, model, folder=folder, limits=limits, pool_bytes=pool_bytes, host_bytes=host_bytes)

    def close(self) -> None:
        """Stop the scheduler (turns still in flight end as cancelled, storing nothing)."""
        self.scheduler.close()

    # ------------------------------------------------------------------ reporting
    @property
    def live_session(self) -> str | None:
        """The session used last whose rows are resident on the device (None when none is)."""
        resident = self.pool.most_recent()
        return resident.state[0] if resident is not None and resident.state else None

    def resident_cache(self, session_id: str, *, owner: str | None = None) -> LatentCache | None:
        """The cache holding a session's resident rows on the device (None when they are not)."""
        entry = self.pool.get(self.store.get(session_id, owner=owner).key)
        return entry.cache if entry is not None and entry.where == "device" else None

    def describe(self) -> dict[str, Any]:
        """The loaded model, cache, fingerprint, pool and scheduler (``GET /engine``)."""
        engine = self.engine
        return {
            "folder": str(self.folder) if self.folder is not None else None,
            "model": self.model.to_dict(),
            "geometry": dict(
                zip(("n_layers", "kv_lora", "qk_rope", "index_hd", "nic", "vocab"), self.geometry.words())
            ),
            "cache_tier": engine.cache.tier.name,
            "journal_tier": self.tier.describe(),
            "bytes_per_token": engine.cache.bytes_per_token,
            "device": str(engine.device),
            "dtype": str(engine.model.dtype).replace("torch.", ""),
            "tokenizer": engine.tokenizer is not None,
            "fingerprint": self.fingerprint.key(),
            "limits": asdict(self.limits),
            "pool": self.pool.usage(),
            "live_session": self.live_session,
        }

    # ------------------------------------------------------------------ sessions
    def create_session(self, owner: str, session_id: str | None = None, *, tags: Iterable[str] = ()) -> SessionInfo:
        """An empty session carrying this engine's full fingerprint."""
        return self.store.create(owner, self.geometry, self.tier, self.model, session_id=session_id, tags=tags)

    def _state_key(self, info: SessionInfo) -> tuple:
        """What must not have changed for resident rows to be the session's: id, creation, counts,
        fingerprint, last turn hash and owner (ids are per owner)."""
        last = self.store.last_turn_digest(info)
        return (info.id, info.created, info.n_records, info.watermark, info.fingerprint_key, last, info.owner)

    def _check(self, info: SessionInfo, override: frozenset[str]) -> frozenset[str]:
        """Refuse a session this engine must not continue; returns the fields not compared."""
        if info.state == "damaged":
            raise SessionDamaged(f"session {info.id!r} is damaged: {info.problem}")
        skip = set(override)
        if info.tier.version == 1 and self.tier.version != 1:
            skip.add("tier")  # f32 rows are lossless: quantized in memory, the file upgrades on the next append
        refuse_mismatch(info, self.fingerprint, skip)
        return frozenset(skip)

    def resume(
        self,
        session_id: str,
        *,
        owner: str | None = None,
        verify: bool = False,
        override: Iterable[str] = (),
    ) -> ResumeReport:
        """Bring a session's rows onto the device (restore them unless they are resident).

        Parameters
        ----------
        verify : re-hash the turns first; a bad turn is a miss (only the turns before it are served)
        override : fingerprint fields not to compare (``model.<field>``, ``tier``)

        Raises
        ------
        SessionNotFound, FingerprintMismatch, SessionDamaged, IntegrityError, PathRefused,
        RestoreFailed — in every case the pool and the session are as they were.
        """
        validate_session_id(session_id)
        skip = check_override(override)
        key = self.store.get(session_id, owner=owner).key
        self.pool.acquire(key)
        try:
            info = self.store.get(session_id, owner=owner)
            return self._bring(info, verify, self._check(info, skip), allow_requantize="tier" in skip)[0]
        finally:
            self.pool.release(key)

    def _bring(
        self, info: SessionInfo, verify: bool, skip: frozenset[str], *, allow_requantize: bool
    ) -> tuple[ResumeReport, Resident]:
        """Make the pool hold the session's served rows on the device (the session held); the report
        and the resident entry."""
        began = time.perf_counter()
        state = self._state_key(info)
        entry = self.pool.get(info.key)
        if entry is not None and entry.state == state and not verify and entry.cache.length == entry.served:
            source = "host" if entry.where == "host" else "live"
            if source == "host":  # back from the host tier: one copy, no read of the journal
                entry.cache = to_device(entry.cache, self.engine.device, HEADROOM)
            self.pool.put(entry)
            restored = entry.served if source == "host" else 0
            seconds = time.perf_counter() - began
            return ResumeReport(
                info.id, source, entry.served, restored, None, info.n_records - entry.served, seconds
            ), entry
        if info.watermark == 0 and not verify:
            entry = Resident(info.key, self._new_cache(info, 0), state, 0)
            self.pool.put(entry)
            seconds = time.perf_counter() - began
            return ResumeReport(info.id, "new", 0, 0, None, info.n_records, seconds), entry
        served = 0
        cache = self._new_cache(info, info.watermark)
        try:
            # info.owner, not owner: ids are per owner, so with owner None another owner's session
            # of the same id, created meanwhile, would make the id ambiguous (or be read instead)
            with self.store.reader(
                info.id, owner=info.owner, verify=verify, expect=self.fingerprint, override=skip
            ) as reader:
                served, damaged_from = reader.n_records, reader.damaged_from
                state = self._state_key(reader.info)
                # The device restore path: the served records read straight into the pinned ring
                # and uploaded chunk by chunk, split and sanitized on the engine's device into a new
                # cache, which enters the pool only once complete; a scale no encoder writes is
                # SessionDamaged, never a row of zeros.
                self.engine.restore_reader(reader, allow_requantize=allow_requantize, into=cache)
        except KVStoreError:
            raise
        except Exception as exc:  # device memory, an upload or decode failure: typed, with the reason
            raise RestoreFailed(
                f"restoring {served} rows of session {info.id!r} into the {self.engine.cache.tier.name} cache on "
                f"{self.engine.device} failed ({type(exc).__name__}: {exc}); the resident sessions and the "
                "session are unchanged"
            ) from exc
        entry = Resident(info.key, cache, state, served)
        self.pool.put(entry)
        if damaged_from is not None:
            log.warning(
                "session %s: turn hashes fail from record %d; served the %d records before it",
                info.id,
                damaged_from,
                served,
            )
        seconds = time.perf_counter() - began
        report = ResumeReport(
            info.id, self._stored_source, served, served, damaged_from, info.n_records - served, seconds
        )
        return report, entry

    def _new_cache(self, info: SessionInfo, rows: int) -> LatentCache:
        """An empty cache for a session's rows; what the device refuses is a typed RestoreFailed."""
        try:
            return self.engine.new_cache()
        except KVStoreError:
            raise
        except Exception as exc:
            raise RestoreFailed(
                f"a cache for the {rows} rows of session {info.id!r} could not be made on {self.engine.device} "
                f"({type(exc).__name__}: {exc}); the resident sessions and the session are unchanged"
            ) from exc

    # ------------------------------------------------------------------ turns
    def _new_tokens(self, prompt, *, first: bool) -> np.ndarray:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise GenerationError("this model folder has no tokenizer: send token ids, not text")
            # a continued conversation already starts with the tokenizer's special prefix
            prompt = self.engine.tokenizer(prompt, add_special_tokens=first)["input_ids"]
        ids = np.asarray(prompt if prompt is not None else [], dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise GenerationError("the new turn is empty: give at least one token (or some text)")
        vocab = self.engine.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise GenerationError(f"token ids must be in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")
        return ids

    def begin(
        self,
        session_id: str,
        prompt: str | Sequence[int],
        *,
        owner: str | None = None,
        create: bool = False,
        tags: Iterable[str] = (),
        max_new_tokens: int = 64,
        temperature: float | None = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_tokens: Sequence[int] | None = None,
        verify: bool = False,
        override: Iterable[str] = (),
    ) -> "Turn":
        """Start a turn: admit it, check and bring in the session; iterate the :class:`Turn` to generate.

        Parameters
        ----------
        session_id : the conversation
        prompt : the new turn only — text (the folder must carry a tokenizer) or token ids
        owner : act as this owner (another owner's session is missing); None: any owner
        create : create a missing session with this engine's fingerprint (owner ``owner`` or
            ``default``); a turn refused before it begins (an empty prompt, ids out of the
            vocabulary) creates nothing — no session, no journal, no lock file
        max_new_tokens : at most this many tokens (and at most the server's cap,
            ``limits.max_new_tokens``); temperature, top_p, top_k, seed, stop_tokens : see
            ``Engine.stream``
        verify : re-hash the turns before restoring; a bad turn is a miss
        override : fingerprint fields not to compare (``model.<field>``, ``tier``)

        The session is held for this turn until it is closed (``with`` or :meth:`Turn.close`): a
        second turn on it waits; turns on other sessions run together.

        Raises
        ------
        ServerBusy, SessionNotFound, FingerprintMismatch, SessionDamaged, IntegrityError,
        PathRefused, RestoreFailed, GenerationError, BudgetExceeded (creating)
        """
        validate_session_id(session_id)
        skip = check_override(override)
        params = SamplingParams(temperature, top_p, top_k, seed)
        params.validate()
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if max_new_tokens > self.limits.max_new_tokens:
            raise GenerationError(
                f"max_new_tokens {max_new_tokens} is over this server's cap of {self.limits.max_new_tokens} "
                "(kvstore serve --max-new-tokens)"
            )
        if isinstance(prompt, str) and self.engine.tokenizer is None:
            raise GenerationError("this model folder has no tokenizer: send token ids, not text")
        if not isinstance(prompt, str):
            self._new_tokens(prompt, first=True)  # refuse bad ids before anything is read
        admitted_as = owner or DEFAULT_OWNER
        self.scheduler.reserve(admitted_as)  # ServerBusy past the owner's or the server's limit
        created = False
        held: str | None = None
        try:
            try:
                info = self.store.get(session_id, owner=owner)
            except SessionNotFound:
                if not create:
                    raise SessionNotFound(
                        f"no session {session_id!r} (create it to start a conversation with this model: create=true)"
                    ) from None
                # A refused turn leaves no trace: the new turn (a first turn, on a new session) is
                # checked before the session exists, so an empty prompt creates nothing.
                self._new_tokens(prompt, first=True)
                info = self.create_session(owner or DEFAULT_OWNER, session_id, tags=tags)
                created = True
            self.pool.acquire(info.key)  # the session's previous turn ends first
            held = info.key
            info = self.store.get(info.id, owner=info.owner)  # as it is now that the session is ours
            try:
                full_skip = self._check(info, skip)
            except FingerprintMismatch as exc:
                if not create or created:
                    raise
                # create=true met an older session under this id: say so, or the mismatch reads as
                # if the new conversation's own session were wrong
                raise FingerprintMismatch(
                    f"{exc.reason}; session {session_id!r} was already there ({info.n_records} records, model "
                    f"{info.model.name!r}), not created by this turn: continue it with that model, or start this "
                    "conversation under a new id"
                ) from None
            report, entry = self._bring(info, verify, full_skip, allow_requantize="tier" in skip)
            ids = self._new_tokens(prompt, first=report.reused_tokens == 0)
            # the turn is stored on the session it began on, even when found for any owner (owner None)
            return Turn(self, info, entry, admitted_as, report, ids, created, params, max_new_tokens, stop_tokens)
        except BaseException:
            try:
                if held is not None:
                    self.pool.release(held)
                if created:  # nothing was appended yet: the session this call created goes again
                    self._discard_created(session_id, owner or DEFAULT_OWNER)
            finally:
                self.scheduler.unreserve(admitted_as)
            raise

    def _discard_created(self, session_id: str, owner: str) -> None:
        """Remove an empty session :meth:`begin` created for a turn that then could not begin."""
        try:
            self.store.delete(session_id, owner=owner)
        except KVStoreError as exc:  # the turn's own error is the one to report
            log.warning("session %s was created for a turn that failed; removing it failed too: %s", session_id, exc)

    def run(self, session_id: str, prompt: str | Sequence[int], **options) -> TurnResult:
        """:meth:`begin` and generate to the end; returns the :class:`TurnResult`."""
        with self.begin(session_id, prompt, **options) as turn:
            for _ in turn:
                pass
        return turn.final()
