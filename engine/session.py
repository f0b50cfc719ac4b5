# Over 500 lines: the turn protocol (fingerprint, restore, generate, append, report) reads in one place.
"""Conversations on stored sessions: the bundled engine joined to the session store.

A :class:`SessionEngine` owns one :class:`~kvstore.engine.generate.Engine` (one model, one live
latent cache) and a session store (:class:`~kvstore.store.Store`: the embedded one, or a replica's
shared one). A turn on a session
(:meth:`SessionEngine.begin` / :meth:`SessionEngine.run`) does, in order:

1. **Fingerprint.** The session's fingerprint (geometry words, tier, model: name, revision,
   weights/tokenizer/chat-template hashes, attention variant) is compared with the engine's
   (:mod:`kvstore.engine.fingerprint`); a difference is refused with ``FingerprintMismatch``
   naming the field, unless the caller overrides that field explicitly. A v1 (f32) session is
   accepted by a quantized engine without an override: its rows are lossless (see 3).
2. **Restore**, only when the live cache does not already hold this session's state (same session,
   same records, same last turn hash, as this engine left it). The records up to the turn watermark
   are read (``Store.reader``; with ``verify`` the turn hashes are checked first and a bad
   turn is a miss: only the turns before it are served) and swapped into the cache **all or
   nothing**: on any failure (missing or truncated journal, a header that no longer matches,
   decode, device upload or allocation, out of memory) the live cache and the session are left
   exactly as they were and the error says why (``RestoreFailed`` wraps what is not a
   ``KVStoreError`` already).
3. **Generate.** The context is the served tokens plus the new turn; the engine reuses the cached
   prefix, so only the new tokens are prefilled. A v1 session in a quantized engine is quantized in
   memory (docs/FORMAT.md section 4, lazy upgrade).
4. **Append.** The last generated token is run once (the cache then holds the whole conversation)
   and the turn's rows (prompt + answer) are appended as one complete turn. Before that, records
   the restore did not serve (a partial turn past the watermark, or a damaged tail found by
   ``verify``) are cut, and a v1 session written by a quantized engine is upgraded to the engine's
   tier (``Store.migrate``: an atomic rewrite). If the session changed while the turn ran
   (another writer), nothing is appended (``ConversationMismatch``).
5. **Report** ``reused_tokens`` / ``prefilled_tokens`` (and where the reused rows came from:
   ``live``, ``journal`` or ``new``) in the :class:`TurnResult` and in the log.

One turn runs at a time per engine (a lock); turns of different sessions take turns on the one
cache, each restoring its session when the cache holds another.

Examples
--------
>>> import kvstore.store                                          # doctest: +SKIP
>>> store = kvstore.store.open("./data")                            # doctest: +SKIP
>>> chat = SessionEngine.from_folder("models/tiny", store, tier="fp8")   # doctest: +SKIP
>>> first = chat.run("chat-1", "Hello", create=True, owner="me")     # doctest: +SKIP
>>> again = chat.run("chat-1", " and again", owner="me")             # doctest: +SKIP
>>> again.reused_tokens == first.session.n_records                  # doctest: +SKIP
True
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np

from kvstore import DEFAULT_OWNER
from kvstore.engine.errors import CacheError, ConversationMismatch, GenerationError, RestoreFailed
from kvstore.engine.fingerprint import check_override, folder_model_info, refuse_mismatch
from kvstore.engine.generate import DEFAULT_PREFILL_CHUNK, Engine, SamplingParams
from kvstore.errors import FingerprintMismatch, KVStoreError, SessionDamaged, SessionNotFound
from kvstore.store import Fingerprint, ModelInfo, SessionInfo, Store, validate_session_id

if TYPE_CHECKING:
    import torch

    from kvstore.tiers import Tier

__all__ = ["DEFAULT_OWNER", "ResumeReport", "SessionEngine", "TextDeltas", "Turn", "TurnResult"]

log = logging.getLogger(__name__)

SOURCES = ("new", "live", "journal")


@dataclass(frozen=True)
class ResumeReport:
    """What bringing a session into the live cache did.

    Attributes
    ----------
    session_id : the session
    source : ``"live"`` (the cache already held it), ``"journal"`` (restored) or ``"new"`` (nothing stored)
    reused_tokens : rows the cache holds for the session (the next turn does not prefill them)
    restored_tokens : rows read from the journal by this call (0 for ``live``/``new``)
    damaged_from : first record of the first bad turn when ``verify`` found one (not served)
    unserved_records : stored records past what is served (a partial turn, or a damaged tail);
        the next turn's append replaces them
    seconds : wall time of the restore
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


@dataclass
class TurnResult:
    """One turn on a session.

    Attributes
    ----------
    session_id : the session
    created : the session was created by this turn
    tokens : generated ids (a stop token that ended the turn is included)
    text : their decoded text when the model folder has a tokenizer
    finish_reason : ``"stop"``, ``"length"`` or ``"cancelled"`` (the caller stopped reading)
    prompt_tokens : ids of the new turn (after tokenization)
    prefilled_tokens : context tokens run through the model by this turn (the new ones)
    reused_tokens : context tokens whose cached rows were reused (the stored conversation)
    source : where the reused rows came from: ``live``, ``journal`` or ``new``
    restored_tokens : rows read from the journal by this turn
    damaged_from : first record of a bad turn ``verify`` found (that tail was not served)
    dropped_records : stored records cut before appending (partial or damaged tail)
    upgraded : ``"f32 (v1, f32 values) -> fp8 (v2, e4m3 codes + f32 scale)"`` (``Tier.describe`` of
        each) when this turn upgraded the session's file
    appended : records appended (prompt + answer)
    session : the session's index record after the append
    seed : the sampling seed (None when greedy)
    timings : seconds spent in ``restore``, ``prefill``, ``decode`` and ``append``
    """

    session_id: str
    created: bool = False
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str = "length"
    prompt_tokens: list[int] = field(default_factory=list)
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    source: str = "new"
    restored_tokens: int = 0
    damaged_from: int | None = None
    dropped_records: int = 0
    upgraded: str | None = None
    appended: int = 0
    session: SessionInfo | None = None
    seed: int | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the API's response body and ``kvstore chat --json``)."""
        return {
            "session_id": self.session_id,
            "created": self.created,
            "tokens": list(self.tokens),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_tokens),
            "prefilled_tokens": self.prefilled_tokens,
            "reused_tokens": self.reused_tokens,
            "source": self.source,
            "restored_tokens": self.restored_tokens,
            "damaged_from": self.damaged_from,
            "dropped_records": self.dropped_records,
            "upgraded": self.upgraded,
            "appended": self.appended,
            "seed": self.seed,
            "timings": dict(self.timings),
            "session": self.session.to_dict() if self.session is not None else None,
        }


class TextDeltas:
    """Text of a growing token list, piece by piece, never repeating what was shown.

    A byte-level tokenizer can split one character over several tokens: trailing replacement
    characters (an incomplete UTF-8 sequence) are held back until the next token completes them,
    or until :meth:`rest` at the end.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.shown = 0  # characters handed out so far

    def _text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True) if self.tokenizer is not None else ""

    def delta(self, tokens: Sequence[int]) -> str:
        """The new complete characters of ``tokens``' text since the last call."""
        text = self._text(tokens)
        stable = len(text)
        while stable > self.shown and text[stable - 1] == "\ufffd":
            stable -= 1
        piece = text[self.shown : stable]
        self.shown = max(self.shown, stable)
        return piece

    def rest(self, tokens: Sequence[int]) -> str:
        """Whatever is left of the text (held-back characters included), at the end."""
        text = self._text(tokens)
        piece = text[self.shown :]
        self.shown = max(self.shown, len(text))
        return piece


# The state a live cache is known to hold: (session id, created, n_records, watermark,
# fingerprint key, last turn hash, owner) at the moment this engine restored or appended it
# (ids are per owner: two owners' "chat-1" are two sessions).
_Key = tuple


@dataclass
class _Live:
    key: _Key
    served: int  # the first `served` records of that state are the cache's rows


class SessionEngine:
    """An engine whose conversations live in a session store.

    Parameters
    ----------
    engine : the model and its live cache (any tier, any device)
    store : the session store turns are read from and appended to
    model : the model part of the fingerprint (:func:`kvstore.engine.fingerprint.folder_model_info`)
    folder : the model folder (reported only)

    Attributes
    ----------
    fingerprint : Fingerprint — what sessions this engine writes carry, and what restores compare
    """

    def __init__(self, engine: Engine, store: Store, model: ModelInfo, *, folder: str | os.PathLike | None = None):
        self.engine = engine
        self.store = store
        self.model = ModelInfo.from_dict(model)
        self.folder = Path(folder).resolve() if folder is not None else None
        self.geometry = engine.config.coli_geometry()
        self.tier = engine.cache.tier.file_tier
        self.fingerprint = Fingerprint(self.model, self.geometry, self.tier)
        self._lock = threading.Lock()
        self._live: _Live | None = None

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
    ) -> "SessionEngine":
        """Load a model folder (and its tokenizer) with a ``tier`` cache on ``device``.

        The weights hash is computed once per folder and cached (see
        :func:`kvstore.engine.fingerprint.weights_hash`).
        """
        model = folder_model_info(folder)
        engine = Engine.from_folder(
            folder, device=device, dtype=dtype, tier=tier, bits=bits, prefill_chunk=prefill_chunk
        )
        return cls(engine, store, model, folder=folder)

    # ------------------------------------------------------------------ reporting
    @property
    def live_session(self) -> str | None:
        """The session whose rows the live cache holds (None when it holds no stored session's state)."""
        live = self._live
        return live.key[0] if live is not None else None

    def describe(self) -> dict[str, Any]:
        """The loaded model, cache and fingerprint (``GET /engine``)."""
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
            "live_session": self.live_session,
        }

    # ------------------------------------------------------------------ sessions
    def create_session(self, owner: str, session_id: str | None = None, *, tags: Iterable[str] = ()) -> SessionInfo:
        """An empty session carrying this engine's full fingerprint."""
        return self.store.create(owner, self.geometry, self.tier, self.model, session_id=session_id, tags=tags)

    def _state_key(self, info: SessionInfo) -> _Key:
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
        """Bring a session into the live cache (restore it unless the cache already holds it).

        Parameters
        ----------
        verify : re-hash the turns first; a bad turn is a miss (only the turns before it are served)
        override : fingerprint fields not to compare (``model.<field>``, ``tier``)

        Raises
        ------
        SessionNotFound, FingerprintMismatch, SessionDamaged, IntegrityError, PathRefused,
        RestoreFailed — in every case the live cache and the session are as they were.
        """
        validate_session_id(session_id)
        skip = check_override(override)
        with self._lock:
            info = self.store.get(session_id, owner=owner)
            return self._bring(info, verify, self._check(info, skip), allow_requantize="tier" in skip)[0]

    def _bring(
        self, info: SessionInfo, verify: bool, skip: frozenset[str], *, allow_requantize: bool
    ) -> tuple[ResumeReport, _Live]:
        """Make the live cache hold the session's served rows (lock held); the report, and what the
        cache now holds (also ``self._live``)."""
        began = time.perf_counter()
        key = self._state_key(info)
        live = self._live
        if live is not None and live.key == key and not verify and self.engine.cache.length == live.served:
            report = ResumeReport(
                info.id, "live", live.served, 0, None, info.n_records - live.served, time.perf_counter() - began
            )
            return report, live
        if info.watermark == 0 and not verify:
            self.engine.cache.clear()
            self._live = live = _Live(key, 0)
            return ResumeReport(info.id, "new", 0, 0, None, info.n_records, time.perf_counter() - began), live
        served = 0
        try:
            # info.owner, not owner: ids are per owner, so with owner None another owner's session
            # of the same id, created meanwhile, would make the id ambiguous (or be read instead)
            with self.store.reader(
                info.id, owner=info.owner, verify=verify, expect=self.fingerprint, override=skip
            ) as reader:
                served, damaged_from = reader.n_records, reader.damaged_from
                key = self._state_key(reader.info)
                # The device restore path: the served records read straight into the pinned ring
                # and uploaded chunk by chunk, split and sanitized on the engine's device into new
                # capacity buffers, swapped in only once complete; a scale no encoder writes is
                # SessionDamaged, never a row of zeros.
                self.engine.restore_reader(reader, allow_requantize=allow_requantize)
        except KVStoreError:
            raise
        except Exception as exc:  # device memory, an upload or decode failure: typed, with the reason
            raise RestoreFailed(
                f"restoring {served} rows of session {info.id!r} into the {self.engine.cache.tier.name} cache on "
                f"{self.engine.device} failed ({type(exc).__name__}: {exc}); the live cache and the session are unchanged"
            ) from exc
        self._live = live = _Live(key, served)
        if damaged_from is not None:
            log.warning(
                "session %s: turn hashes fail from record %d; served the %d records before it",
                info.id,
                damaged_from,
                served,
            )
        report = ResumeReport(
            info.id, "journal", served, served, damaged_from, info.n_records - served, time.perf_counter() - began
        )
        return report, live

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
        """Start a turn: check and restore the session; iterate the returned :class:`Turn` to generate.

        Parameters
        ----------
        session_id : the conversation
        prompt : the new turn only — text (the folder must carry a tokenizer) or token ids
        owner : act as this owner (another owner's session is missing); None: any owner
        create : create a missing session with this engine's fingerprint (owner ``owner`` or
            ``default``); a turn refused before it begins (an empty prompt, ids out of the
            vocabulary) creates nothing — no session, no journal, no lock file
        max_new_tokens, temperature, top_p, top_k, seed, stop_tokens : see ``Engine.stream``
        verify : re-hash the turns before restoring; a bad turn is a miss
        override : fingerprint fields not to compare (``model.<field>``, ``tier``)

        The engine's lock is held until the turn is closed (``with`` or :meth:`Turn.close`).

        Raises
        ------
        SessionNotFound, FingerprintMismatch, SessionDamaged, IntegrityError, PathRefused,
        RestoreFailed, GenerationError, BudgetExceeded (creating)
        """
        validate_session_id(session_id)
        skip = check_override(override)
        params = SamplingParams(temperature, top_p, top_k, seed)
        params.validate()
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if isinstance(prompt, str) and self.engine.tokenizer is None:
            raise GenerationError("this model folder has no tokenizer: send token ids, not text")
        if not isinstance(prompt, str):
            self._new_tokens(prompt, first=True)  # refuse bad ids before anything is read
        self._lock.acquire()
        created = False
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
            report, live = self._bring(info, verify, full_skip, allow_requantize="tier" in skip)
            ids = self._new_tokens(prompt, first=report.reused_tokens == 0)
            # the turn is stored on the session it began on, even when found for any owner (owner None)
            return Turn(self, info, live.key, info.owner, report, ids, created, params, max_new_tokens, stop_tokens)
        except BaseException:
            try:
                if created:  # nothing was appended yet: the session this call created goes again
                    self._discard_created(session_id, owner or DEFAULT_OWNER)
            finally:
                self._lock.release()
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


class Turn:
    """One turn in progress: iterate for the generated ids; ``result`` once the iteration ended.

    Holds the engine's lock until closed. Iterating to the end appends the turn to the session;
    :meth:`cancel` (from any thread) stops after the current token, and what was generated so far
    is appended (``finish_reason == "cancelled"``). Closing a turn that was never iterated appends
    nothing. The planned split is known before generating: ``reused_tokens`` (the stored
    conversation) and ``prefilled_tokens`` (the new turn).
    """

    def __init__(
        self,
        chat: SessionEngine,
        info: SessionInfo,
        start_key: _Key,
        owner: str | None,
        report: ResumeReport,
        ids: np.ndarray,
        created: bool,
        params: SamplingParams,
        max_new_tokens: int,
        stop_tokens,
    ):
        self._chat = chat
        self._info = info
        self._start_key = start_key  # the session state the cache was brought to
        self._owner = owner
        self.report = report
        self.prompt_ids = ids
        self.created = created
        self._params = params
        self._max_new = max_new_tokens
        self._stops = stop_tokens
        self._cancelled = threading.Event()
        self._started = False
        self._closed = False
        self.tokens: list[int] = []
        self.result: TurnResult | None = None

    @property
    def session_id(self) -> str:
        return self._info.id

    @property
    def reused_tokens(self) -> int:
        return self.report.reused_tokens

    @property
    def prefilled_tokens(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def source(self) -> str:
        return self.report.source

    @property
    def tokenizer(self):
        """The model folder's tokenizer (None: ids only)."""
        return self._chat.engine.tokenizer

    def cancel(self) -> None:
        """Stop after the current token (safe from another thread)."""
        self._cancelled.set()

    def __iter__(self) -> Iterator[int]:
        if self._started or self._closed:
            raise GenerationError("a turn can be iterated only once")
        self._started = True
        chat, engine = self._chat, self._chat.engine
        try:
            served = self.report.reused_tokens
            context = np.concatenate([engine.cache.tokens.astype(np.int64), self.prompt_ids])
            p = self._params
            stream = engine.stream(
                context,
                max_new_tokens=self._max_new,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=p.seed,
                stop_tokens=self._stops,
            )
            chat._live = None  # from here the cache holds rows no session has yet
            finish = None
            began = time.perf_counter()
            for token in stream:
                self.tokens.append(token)
                yield token
                if self._cancelled.is_set():
                    stream.close()
                    finish = "cancelled"
                    break
            generated = stream.result
            elapsed = time.perf_counter() - began
            result = TurnResult(
                session_id=self.session_id,
                created=self.created,
                tokens=list(self.tokens),
                finish_reason=finish if finish is not None else stream.final().finish_reason,
                prompt_tokens=self.prompt_ids.tolist(),
                prefilled_tokens=generated.prefilled_tokens if generated else context.shape[0] - served,
                reused_tokens=generated.reused_tokens if generated else served,
                source=self.report.source,
                restored_tokens=self.report.restored_tokens,
                damaged_from=self.report.damaged_from,
                seed=generated.seed if generated else None,
                timings={"restore": self.report.seconds, **(generated.timings if generated else {"generate": elapsed})},
            )
            if engine.tokenizer is not None:
                result.text = engine.tokenizer.decode(self.tokens, skip_special_tokens=True)
            self._append(result, context.shape[0], served)
            self.result = result
            log.info(
                "turn session=%s source=%s reused=%d prefilled=%d generated=%d appended=%d dropped=%d%s",
                result.session_id,
                result.source,
                result.reused_tokens,
                result.prefilled_tokens,
                len(result.tokens),
                result.appended,
                result.dropped_records,
                f" upgraded={result.upgraded}" if result.upgraded else "",
            )
        finally:
            self.close()

    def _append(self, result: TurnResult, context_length: int, served: int) -> None:
        """Journal the turn (prompt + answer) as one complete turn (lock held)."""
        chat, engine, store = self._chat, self._chat.engine, self._chat.store
        began = time.perf_counter()
        expected = context_length + max(len(self.tokens) - 1, 0)
        if engine.cache.length != expected:
            raise CacheError(
                f"the cache holds {engine.cache.length} rows after the turn, expected {expected}; the turn was not stored"
            )
        if self.tokens:
            engine.extend([self.tokens[-1]])  # its row too: the journal holds the whole conversation
        sid, owner = self.session_id, self._owner
        current = store.get(sid, owner=owner)
        if chat._state_key(current) != self._start_key:
            raise ConversationMismatch(
                f"session {sid!r} changed while this turn was generated (it held {self._info.n_records} records, "
                f"now {current.n_records}); the turn was not stored — send it again"
            )
        if current.n_records > served:
            store.truncate(sid, served, owner=owner)
            result.dropped_records = current.n_records - served
        if current.tier != chat.tier and current.tier.version == 1 and chat.tier.version != 1:
            upgraded = store.migrate(sid, chat.tier, owner=owner)
            result.upgraded = f"{current.tier.describe()} -> {upgraded.tier.describe()}"
            current = upgraded
        rows = engine.export_rows(served)
        if current.tier == rows.tier:
            appended = store.append_records(sid, rows.record_array(chat.geometry), complete_turn=True, owner=owner)
        else:  # an overridden tier: the rows are encoded in the session's own tier
            g = engine.cache.geometry
            L, R = rows.dequantize(g.kv_lora, g.qk_rope)
            appended = store.append(sid, rows.tokens, L, R, complete_turn=True, owner=owner)
        result.appended, result.session = appended.appended, appended.info
        result.timings["append"] = time.perf_counter() - began
        chat._live = _Live(chat._state_key(appended.info), appended.info.n_records)

    def final(self) -> TurnResult:
        """The :class:`TurnResult` of a turn iterated to its end (``result`` is None before)."""
        if self.result is None:
            raise GenerationError("the turn was not iterated to its end")
        return self.result

    def close(self) -> None:
        """Release the engine (idempotent). A turn closed before it was iterated appends nothing."""
        if not self._closed:
            self._closed = True
            self._chat._lock.release()

    def __enter__(self) -> "Turn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
