"""One turn of a conversation in progress (:class:`Turn`), what it reports (:class:`TurnResult`), and
its text as it grows (:class:`TextDeltas`): the reader's side of :mod:`kvstore.engine.session`.

A :class:`Turn` hands its work to the scheduler when iterated and yields the tokens as the batched
steps produce them; at the end it appends the turn to its session, in the reader's thread (never on
the scheduler's, so a journal's fsync never holds up a decode step).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from kvstore.engine.errors import CacheError, ConversationMismatch, GenerationError, RestoreFailed
from kvstore.engine.generate import SamplingParams
from kvstore.engine.pool import Resident
from kvstore.engine.scheduler import Outcome, TurnWork
from kvstore.store import SessionInfo

if TYPE_CHECKING:
    from kvstore.engine.session import ResumeReport, SessionEngine

__all__ = ["TextDeltas", "Turn", "TurnResult"]

log = logging.getLogger("kvstore.engine.session")


@dataclass
class TurnResult:
    """One turn on a session.

    Attributes
    ----------
    session_id : the session
    created : the session was created by this turn
    tokens : generated ids (a stop token that ended the turn is included)
    text : their decoded text when the model folder has a tokenizer
    finish_reason : ``"stop"``, ``"length"``, ``"cancelled"`` (the reader left: it keeps the tokens it
        took) or ``"deadline"`` (the server's turn deadline passed)
    prompt_tokens : ids of the new turn (after tokenization)
    prefilled_tokens : context tokens run through the model by this turn (the new ones)
    reused_tokens : context tokens whose cached rows were reused (the stored conversation)
    source : where the reused rows came from: ``live`` (resident on the device), ``host`` (the pinned
        host tier), ``journal`` (the embedded store), ``shared`` (a shared store) or ``new``
    restored_tokens : rows this turn brought in (from the host tier, the journal or the shared store)
    damaged_from : first record of a bad turn ``verify`` found (that tail was not served)
    dropped_records : stored records cut before appending (partial or damaged tail)
    upgraded : ``"f32 (v1, f32 values) -> fp8 (v2, e4m3 codes + f32 scale)"`` (``Tier.describe`` of
        each) when this turn upgraded the session's file
    appended : records appended (prompt + answer)
    session : the session's index record after the append
    seed : the sampling seed (None when greedy)
    timings : seconds spent in ``restore``, ``prefill``, ``decode`` (the batched steps the turn took
        part in), ``generate`` (from its submission to its last token) and ``append``
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

    A byte-level tokenizer can split one character over several tokens: a piece ending in a
    replacement character (an incomplete UTF-8 sequence) is held back until the next token completes
    it, or until :meth:`rest` at the end. Only a short window of tokens is decoded per call — the
    tokens since the last piece, behind the ones before it, so that a tokenizer that spells a token
    by its left neighbour (a leading space) spells it the same — so a long answer costs the same per
    token as a short one.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._prefix = 0  # the window starts here: the tokens of the last piece given out
        self._read = 0  # tokens whose text has been given out

    def _text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True) if self.tokenizer is not None else ""

    def delta(self, tokens: Sequence[int]) -> str:
        """The new complete characters of ``tokens``' text since the last call."""
        shown = self._text(tokens[self._prefix : self._read])
        text = self._text(tokens[self._prefix :])
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(tokens)
        return text[len(shown) :]

    def rest(self, tokens: Sequence[int]) -> str:
        """Whatever is left of the text (held-back characters included), at the end."""
        shown = self._text(tokens[self._prefix : self._read])
        text = self._text(tokens[self._prefix :])
        self._prefix = self._read = len(tokens)
        return text[len(shown) :]


class Turn:
    """One turn in progress: iterate for the generated ids; ``result`` once the iteration ended.

    Holds its session until closed. Iterating submits the turn to the scheduler and yields its
    tokens as they come; the end appends the turn to the session. :meth:`cancel` (from any thread)
    stops it at the scheduler's next step, and exactly the tokens the reader took are kept and
    appended (``finish_reason == "cancelled"``); a turn cancelled before its first decode step, or
    closed before it was iterated, appends nothing. The planned split is known before generating:
    ``reused_tokens`` (the stored conversation) and ``prefilled_tokens`` (the new turn).
    """

    def __init__(
        self,
        chat: SessionEngine,
        info: SessionInfo,
        entry: Resident,
        admitted_as: str,
        report: ResumeReport,
        ids: np.ndarray,
        created: bool,
        params: SamplingParams,
        max_new_tokens: int,
        stop_tokens,
    ):
        self._chat = chat
        self._info = info
        self._entry = entry
        self._start_state = entry.state  # the session state the rows were brought to
        self._admitted_as = admitted_as
        self.report = report
        self.prompt_ids = ids
        self.created = created
        self._params = params
        self._max_new = max_new_tokens
        self._stops = stop_tokens
        self._work: TurnWork | None = None
        self._lock = threading.Lock()  # a cancel and a token taken by the reader, one at a time
        self._cancel_requested = False
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
        """Stop at the scheduler's next step, keeping the tokens taken so far (safe from any thread)."""
        with self._lock:
            if self._cancel_requested:
                return
            self._cancel_requested = True
            taken = len(self.tokens)
        work = self._work
        if work is not None:
            work.cancel(taken)
            self._chat.scheduler.wake()

    def __iter__(self) -> Iterator[int]:
        for batch in self._read(grouped=False):
            yield batch[0]

    def batches(self) -> Iterator[list[int]]:
        """The generated ids in groups, each every token produced since the previous group (a
        reader that falls behind catches up in one group); iterate the turn for one id at a time."""
        return self._read(grouped=True)

    def _read(self, *, grouped: bool) -> Iterator[list[int]]:
        """Submit the turn, then yield its tokens (a group, or one at a time), counting as taken only
        what was yielded; at the end, append the turn."""
        if self._started or self._closed:
            raise GenerationError("a turn can be iterated only once")
        self._started = True
        chat, entry = self._chat, self._entry
        try:
            work = TurnWork(
                owner=self._admitted_as,
                cache=entry.cache,
                ids=self.prompt_ids,
                params=self._params,
                max_new=self._max_new,
                stops=chat.engine.stops(self._stops),
            )
            self._work = work
            with self._lock:
                if self._cancel_requested:
                    work.cancel(len(self.tokens))
            entry.state = ()  # from here the cache holds rows no stored state has yet
            chat.scheduler.submit(work)
            outcome = None
            while outcome is None:
                events = [work.events.get()]
                while grouped and not work.events.empty():
                    events.append(work.events.get_nowait())
                taken = []
                with self._lock:
                    for kind, value in events:
                        if kind == "end":
                            outcome = value
                        elif not self._cancel_requested:  # tokens past a cancel are not the reader's
                            self.tokens.append(value)
                            taken.append(value)
                if taken:
                    yield taken
            self._finish(outcome)
        finally:
            self.close()

    def _finish(self, outcome: Outcome) -> None:
        chat, entry = self._chat, self._entry
        if outcome.error is not None:
            chat.pool.drop(entry.key)
            raise RestoreFailed(
                f"the turn on session {self.session_id!r} failed on the device ({type(outcome.error).__name__}: "
                f"{outcome.error}); nothing was stored"
            ) from outcome.error
        if not outcome.decoded:  # ended before its first decode step: the rows are as they were
            entry.state = self._start_state
        del self.tokens[len(outcome.tokens) :]
        served = self.report.reused_tokens
        result = TurnResult(
            session_id=self.session_id,
            created=self.created,
            tokens=list(outcome.tokens),
            finish_reason=outcome.finish_reason,
            prompt_tokens=self.prompt_ids.tolist(),
            prefilled_tokens=self.prefilled_tokens,
            reused_tokens=served,
            source=self.report.source,
            restored_tokens=self.report.restored_tokens,
            damaged_from=self.report.damaged_from,
            seed=outcome.seed,
            timings={"restore": self.report.seconds, **outcome.timings},
        )
        if chat.engine.tokenizer is not None:
            result.text = chat.engine.tokenizer.decode(result.tokens, skip_special_tokens=True)
        if outcome.decoded:
            try:
                self._append(result, served)
            except BaseException:
                chat.pool.drop(entry.key)  # rows the session does not hold: the next turn restores
                raise
        self.result = result
        log.info(
            "turn session=%s source=%s reused=%d prefilled=%d generated=%d appended=%d dropped=%d finish=%s%s",
            result.session_id,
            result.source,
            result.reused_tokens,
            result.prefilled_tokens,
            len(result.tokens),
            result.appended,
            result.dropped_records,
            result.finish_reason,
            f" upgraded={result.upgraded}" if result.upgraded else "",
        )

    def _append(self, result: TurnResult, served: int) -> None:
        """Journal the turn (prompt + answer) as one complete turn (the session held)."""
        chat, store, entry = self._chat, self._chat.store, self._entry
        began = time.perf_counter()
        expected = served + self.prefilled_tokens + len(result.tokens)
        if entry.cache.length != expected:
            chat.pool.drop(entry.key)
            raise CacheError(
                f"the cache holds {entry.cache.length} rows after the turn, expected {expected}; the turn was not stored"
            )
        sid, owner = self.session_id, self._info.owner
        current = store.get(sid, owner=owner)
        if chat._state_key(current) != self._start_state:
            chat.pool.drop(entry.key)  # its rows are not the session's any more: the next turn restores
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
        rows = entry.cache.export_rows(served)
        if current.tier == rows.tier:
            appended = store.append_records(sid, rows.record_array(chat.geometry), complete_turn=True, owner=owner)
        else:  # an overridden tier: the rows are encoded in the session's own tier
            g = entry.cache.geometry
            L, R = rows.dequantize(g.kv_lora, g.qk_rope)
            appended = store.append(sid, rows.tokens, L, R, complete_turn=True, owner=owner)
        result.appended, result.session = appended.appended, appended.info
        result.timings["append"] = time.perf_counter() - began
        entry.state, entry.served = chat._state_key(appended.info), appended.info.n_records
        chat.pool.touch(entry.key)

    def final(self) -> TurnResult:
        """The :class:`TurnResult` of a turn iterated to its end (``result`` is None before)."""
        if self.result is None:
            raise GenerationError("the turn was not iterated to its end")
        return self.result

    def close(self) -> None:
        """Release the session (idempotent). A turn closed before it was iterated appends nothing;
        one left mid-iteration is stopped first (nothing of it is stored)."""
        if self._closed:
            return
        self._closed = True
        work = self._work
        try:
            if work is not None and work.phase != "done":
                work.cancel(0)
                self._chat.scheduler.wake()
                while work.events.get()[0] != "end":
                    pass
                self._chat.pool.drop(self._entry.key)  # its rows may hold tokens no one stored
        finally:
            self._chat.pool.release(self._entry.key)
            self._chat.scheduler.unreserve(self._admitted_as)

    def __enter__(self) -> "Turn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
