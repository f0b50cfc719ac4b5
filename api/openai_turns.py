"""The turn behind one OpenAI-compatible request: its plan (which session, how much is reused), the
turn itself in a thread of its own, and the answer's text with its stop strings.

Used by :mod:`kvstore.api.routers.openai` (the routes, the answers' shapes); the module docstring
there says how a turn is planned, reused and refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from fastapi import Request
from starlette.requests import ClientDisconnect

from kvstore.api.chat_template import continuation, encode, first_turn_prefix, render
from kvstore.api.errors import InvalidParameter
from kvstore.api.routers.metrics import Metrics
from kvstore.api.streams import loop_poster
from kvstore.engine.errors import ConversationMismatch
from kvstore.errors import KVStoreError, SessionNotFound
from kvstore.store.values import MAX_TAGS

__all__ = ["Job", "Plan", "StopText", "TurnThread", "next_event", "split_headers"]

log = logging.getLogger("kvstore.api")

#: The tag of every session this API creates or forks; only these are continued in place.
TAG = "openai"
#: How often a non-streamed request checks that its client is still there (seconds).
DISCONNECT_POLL_S = 0.25
#: Plans a turn may go through when its session keeps moving on (each further one is a fork).
PLAN_ATTEMPTS = 4
# A prompt text of more characters than this many per token of the context it has left is probed
# before it is tokenized whole: its beginning alone, tokenized, that already holds clearly more
# tokens than fit is refused then (a 4 MB text took 9 s of a core to tokenize before its 400). Few
# texts that fit average this many characters a token, and those pay one probe.
PROBE_CHARS_PER_TOKEN = 8


# ---------------------------------------------------------------------------- the request
@dataclass(frozen=True)
class Job:
    """What one completion request asks, validated; ``messages`` for chat, ``prompt`` for completions."""

    chat: bool
    owner: str
    engine: Any  # a kvstore.engine.session.SessionEngine
    metrics: Metrics
    model: str
    messages: list[dict[str, str]] | None
    prompt: str | list[int] | None
    session_id: str | None
    max_tokens: int | None  # as asked; None: the server's cap, within the model's context
    cap: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stops: list[str]
    stream: bool
    include_usage: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


# ---------------------------------------------------------------------------- the answer's text
class StopText:
    """The answer's text handed out piece by piece, cut before the first stop string.

    Text that may be the start of a stop string is held back until the next piece shows it is not,
    so no part of a stop string is ever handed out; :attr:`stopped` once one appeared.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.shown = 0  # characters handed out; no stop string starts before it
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add ``piece``; the text now safe to hand out."""
        if self.stopped or not piece:
            return ""
        self.text += piece
        found = [at for at in (self.text.find(stop, self.shown) for stop in self.stops) if at >= 0]
        if found:
            end = min(found)
            out, self.shown, self.stopped = self.text[self.shown : end], end, True
            return out
        held = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self.text) - self.shown), held, -1):
                if self.text.endswith(stop[:length]):
                    held = length
                    break
        safe = len(self.text) - held
        out, self.shown = self.text[self.shown : safe], safe
        return out

    def finish(self) -> str:
        """What is still held back, at the end of the answer (nothing after a stop string)."""
        if self.stopped:
            return ""
        out, self.shown = self.text[self.shown :], len(self.text)
        return out


# ---------------------------------------------------------------------------- the turn's thread
@dataclass
class Plan:
    """Where a turn runs: the session, the new turn's ids, and the stored rows it continues."""

    session_id: str
    tokens: list[int]
    reuse: int  # the turn must find exactly these rows of the session (else it moved on: fork)
    create: bool = False
    how: str = "continued"


def _new_session_id() -> str:
    return f"oai-{uuid.uuid4().hex}"


def _fork_tags(tags: Sequence[str]) -> list[str]:
    if TAG in tags or len(tags) >= MAX_TAGS:
        return list(tags)
    return [*tags, TAG]


class TurnThread:
    """Plan, begin and run one request's turn in a thread of its own, reporting to the event loop.

    Events (``events``, an asyncio queue): ``("begun", split)``, then for a stream ``("text",
    piece)`` as they come, and ``("done", answer)`` — or ``("error", exception)`` at any point.
    """

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop):
        self.job = job
        self.engine = job.engine
        self.store = job.engine.store
        self.tokenizer = job.engine.engine.tokenizer
        self.events: asyncio.Queue = asyncio.Queue()
        self._post = loop_poster(loop)  # with the other turns' events of a step: one wake-up of the loop
        self._lock = threading.Lock()
        self._cancelled = False
        self._turn = None
        self._whole: list[int] | None = None  # the whole prompt's ids, when the plan came from a lookup

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"openai-{self.job.id[:8]}", daemon=True).start()

    def cancel(self) -> None:
        """The client left: stop the turn (what was generated is stored), or never start it."""
        with self._lock:
            self._cancelled = True
            turn = self._turn
        if turn is not None:
            turn.cancel()

    def _emit(self, kind: str, value: Any) -> None:
        try:
            self._post(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop closed (the server stopped): nobody is there to read it
            pass

    # -------------------------------------------------------------- the prompt
    def _ids(self, ids: list[int]) -> list[int]:
        vocab = self.engine.engine.config.vocab_size
        array = np.asarray(ids, dtype=np.int64)
        if array.size and (int(array.min()) < 0 or int(array.max()) >= vocab):
            raise InvalidParameter(
                f"token ids must be in [0, {vocab}) for this model; got {int(array.min())}..{int(array.max())}",
                "prompt",
            )
        return ids

    def _whole_prompt(self) -> list[int]:
        """The whole prompt's ids, as the first turn of a conversation."""
        job, tokenizer = self.job, self.tokenizer
        if job.messages is not None:
            text = render(tokenizer, job.messages)
            return self._encode(text, special_prefix=first_turn_prefix(tokenizer), stored=0)
        if isinstance(job.prompt, str):
            return self._encode(job.prompt, special_prefix=True, stored=0)
        return self._ids(list(job.prompt or []))

    def _continuing_prompt(self, stored: int) -> list[int]:
        """The ids of what the request adds to a stored conversation of ``stored`` tokens."""
        job, tokenizer = self.job, self.tokenizer
        if job.messages is not None:
            return self._encode(continuation(tokenizer, job.messages), special_prefix=False, stored=stored)
        if isinstance(job.prompt, str):
            return self._encode(job.prompt, special_prefix=False, stored=stored)
        return self._ids(list(job.prompt or []))

    def _encode(self, text: str, *, special_prefix: bool, stored: int) -> list[int]:
        """:func:`encode`, after a probe of a text too long to be likely to fit (see
        :data:`PROBE_CHARS_PER_TOKEN`): one whose beginning alone holds more tokens than the
        context has room for, by a margin no ending could take back, is refused without the rest."""
        window = getattr(self.engine.engine.config, "max_position_embeddings", None)
        if window is not None:
            asked = self.job.max_tokens if self.job.max_tokens is not None else 1
            room = max(0, window - stored - asked)
            probe = max(room, 1024) * PROBE_CHARS_PER_TOKEN
            if len(text) > probe:
                head = len(encode(self.tokenizer, text[:probe], special_prefix=special_prefix))
                if head > room + max(64, room // 8):
                    raise InvalidParameter(
                        f"This model's maximum context length is {window} tokens; this request holds "
                        f"{stored} stored tokens of conversation, asks for {asked} more, and the first {probe} "
                        f"characters of its new text alone hold {head} tokens: shorten the conversation"
                        + (" or max_tokens" if self.job.max_tokens is not None else ""),
                        "messages" if self.job.chat else "prompt",
                        "context_length_exceeded",
                    )
        return encode(self.tokenizer, text, special_prefix=special_prefix)

    def _max_new(self, context: int) -> int:
        """``max_tokens``, checked against the model's context (``context``: the prompt's tokens
        with the stored ones); by default the server's cap, within the context."""
        job = self.job
        window = getattr(self.engine.engine.config, "max_position_embeddings", None)
        if window is None:
            return job.max_tokens if job.max_tokens is not None else job.cap
        asked = job.max_tokens if job.max_tokens is not None else 1
        if context + asked > window:
            raise InvalidParameter(
                f"This model's maximum context length is {window} tokens; this request holds {context} tokens of "
                f"conversation and asks for {asked} more: shorten the conversation"
                + (" or max_tokens" if job.max_tokens is not None else ""),
                "messages" if job.chat else "prompt",
                "context_length_exceeded",
            )
        return job.max_tokens if job.max_tokens is not None else min(job.cap, window - context)

    # -------------------------------------------------------------- the plan
    def _plan(self) -> Plan:
        if self.job.session_id is not None:
            return self._plan_named(self.job.session_id)
        self._whole = self._whole_prompt()
        self._max_new(len(self._whole))  # refused before any session is looked up or forked
        return self._plan_by_prefix(self._whole, in_place=True)

    def _plan_named(self, session_id: str) -> Plan:
        try:
            info = self.store.get(session_id, owner=self.job.owner)
        except SessionNotFound:
            tokens = self._whole_prompt()
            self._max_new(len(tokens))
            return Plan(session_id, tokens, 0, create=True, how="new")
        if info.watermark == 0:  # an empty session: this is its first turn
            tokens = self._whole_prompt()
        else:
            tokens = self._continuing_prompt(info.watermark)
        self._max_new(info.watermark + len(tokens))
        return Plan(info.id, tokens, info.watermark)

    def _plan_by_prefix(self, tokens: list[int], *, in_place: bool) -> Plan:
        """The owner's session sharing the longest stored prefix with ``tokens``: continued (when it
        is all of it, and ``in_place``), forked at the match, or none (a new session)."""
        owner = self.job.owner
        found = self.store.lookup(owner, self.engine.fingerprint, tokens)
        # at least one new token: the model reads the last one to answer
        reuse = min(found.matched_tokens, len(tokens) - 1) if found is not None else 0
        if found is None or reuse <= 0:
            return Plan(_new_session_id(), tokens, 0, create=True, how="new")
        try:
            info = self.store.get(found.session_id, owner=owner)
            if in_place and reuse == info.n_records == info.watermark and TAG in info.tags:
                return Plan(info.id, tokens[reuse:], reuse)
            forked = self.store.fork(
                info.id, at=reuse, new_id=_new_session_id(), owner=owner, tags=_fork_tags(info.tags)
            )
        except SessionNotFound:  # deleted since the lookup: nothing to reuse after all
            return Plan(_new_session_id(), tokens, 0, create=True, how="new")
        return Plan(forked.id, tokens[reuse:], reuse, how=f"forked from {info.id}")

    def _fork(self, plan: Plan) -> Plan:
        """A plan on a session of its own: the session ``plan`` continues moved on meanwhile."""
        if self._whole is not None:  # the stored prefix is found again, confirmed token by token
            return self._plan_by_prefix(self._whole, in_place=False)
        owner = self.job.owner
        info = self.store.get(plan.session_id, owner=owner)
        if info.watermark < plan.reuse:
            raise ConversationMismatch(
                f"session {plan.session_id!r} no longer holds the {plan.reuse} tokens this turn continues (it holds "
                f"{info.watermark} now): send the request again"
            )
        forked = self.store.fork(
            info.id, at=plan.reuse, new_id=_new_session_id(), owner=owner, tags=_fork_tags(info.tags)
        )
        return Plan(forked.id, plan.tokens, plan.reuse, how=f"forked from {info.id}")

    def _begin(self, plan: Plan):
        """Begin the turn ``plan`` describes; a session that moved on since is forked at the plan's
        point and the turn begun there."""
        job = self.job
        for attempt in range(PLAN_ATTEMPTS):
            try:
                turn = self.engine.begin(
                    plan.session_id,
                    plan.tokens,
                    owner=job.owner,
                    create=plan.create,
                    tags=(TAG,),
                    max_new_tokens=self._max_new(plan.reuse + len(plan.tokens)),
                    temperature=job.temperature,
                    top_p=job.top_p,
                    top_k=job.top_k,
                    seed=job.seed,
                )
            except SessionNotFound:
                if plan.create or attempt == PLAN_ATTEMPTS - 1:
                    raise
                plan = self._plan()  # deleted since it was planned
                continue
            if turn.reused_tokens == plan.reuse:
                log.info(
                    "openai: %s session %s (reused %d, new %d)", plan.how, plan.session_id, plan.reuse, len(plan.tokens)
                )
                return turn, plan
            log.info(
                "openai: session %s moved on since the plan (%d rows to continue, not %d): the turn goes to a fork",
                plan.session_id,
                turn.reused_tokens,
                plan.reuse,
            )
            turn.close()  # not iterated: nothing is stored
            plan = self._fork(plan)
        raise ConversationMismatch(
            f"the session this turn continues kept changing ({PLAN_ATTEMPTS} tries); send the request again"
        )

    # -------------------------------------------------------------- the turn
    def _run(self) -> None:
        job = self.job
        try:
            turn, plan = self._begin(self._plan())
            self._emit("begun", split_headers(turn))
            mismatches = 0
            while True:
                with self._lock:
                    if self._cancelled:  # the client left before the turn started: it stores nothing
                        turn.close()
                        return
                    self._turn = turn
                try:
                    answer = self._generate(turn)
                    break
                except ConversationMismatch:
                    # the session changed under the turn and nothing was stored: a stream's text is
                    # out already, so it ends with the error; an answer not yet sent is generated
                    # again on a session of its own
                    mismatches += 1
                    if job.stream or mismatches >= PLAN_ATTEMPTS:
                        raise
                    log.info(
                        "openai: session %s changed under the turn: generating it again on a fork", plan.session_id
                    )
                    turn, plan = self._begin(self._fork(plan))
            job.metrics.record_turn(answer.pop("result"))
            self._emit("done", answer)
        except KVStoreError as exc:
            job.metrics.record_failure(type(exc).__name__)
            self._emit("error", exc)
        except BaseException as exc:  # logged where it is answered (error_response)
            job.metrics.record_failure("InternalError")
            self._emit("error", exc)

    def _generate(self, turn) -> dict[str, Any]:
        """Run ``turn`` to its end; its text (cut at a stop string), finish reason and usage."""
        from kvstore.engine.session import TextDeltas

        job = self.job
        deltas, text = TextDeltas(self.tokenizer), StopText(job.stops)
        pieces: list[str] = []

        def hand_out(piece: str) -> None:
            if piece:
                pieces.append(piece)
                if job.stream:
                    self._emit("text", piece)

        with turn:
            for _ in turn:
                if text.stopped:
                    continue
                hand_out(text.feed(deltas.delta(turn.tokens)))
                if text.stopped:
                    turn.cancel()  # the answer ends here; the tokens taken so far are stored
            result = turn.final()
        if not text.stopped:
            hand_out(text.feed(deltas.rest(turn.tokens)))
            hand_out(text.finish())
        reused, prompt = turn.reused_tokens, turn.reused_tokens + turn.prefilled_tokens
        generated = len(result.tokens)
        return {
            "text": "".join(pieces),
            "finish_reason": "stop" if text.stopped or result.finish_reason == "stop" else "length",
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": generated,
                "total_tokens": prompt + generated,
                "prompt_tokens_details": {"cached_tokens": reused},
            },
            "session_id": result.session_id,
            "split": split_headers(turn),
            "result": result,
        }


def split_headers(turn) -> dict[str, str]:
    """The reuse headers the service's other generate route sends too."""
    return {
        "X-KV-Reused-Tokens": str(turn.reused_tokens),
        "X-KV-Prefilled-Tokens": str(turn.prefilled_tokens),
        "X-KV-Source": str(turn.source),
    }


async def next_event(thread: TurnThread, request: Request) -> tuple[str, Any]:
    """The turn's next event; a client that left meanwhile cancels the turn (ClientDisconnect)."""
    getter = asyncio.ensure_future(thread.events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
            if done:
                return getter.result()
            if await request.is_disconnected():
                thread.cancel()
                raise ClientDisconnect()
    finally:
        if not getter.done():
            getter.cancel()
