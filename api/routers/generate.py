"""``POST /sessions/{id}/generate`` and ``GET /engine``: conversation turns on the loaded model.

Served when the service runs with ``kvstore serve --model DIR``; without a model both answer
``503 EngineNotLoaded`` with how to start one. A call sends **the new turn only** (token ids, or
text when the model folder has a tokenizer); the service brings the session's rows onto the device
when they are not resident, prefills only the new tokens, generates — in one batch with every
other turn in flight (:mod:`kvstore.engine.scheduler`) — and appends the turn (prompt + answer) to
the session as one complete turn (:mod:`kvstore.engine.session`). Past the owner's or the server's
turns in flight the answer is 429 ``ServerBusy`` with ``Retry-After`` (docs/SERVE.md).

Every answer reports the split: ``reused_tokens`` (stored rows reused) and ``prefilled_tokens``
(run through the model), in the body, in the ``X-KV-Reused-Tokens`` / ``X-KV-Prefilled-Tokens`` /
``X-KV-Source`` headers, in the log (``kvstore.engine.session``) and in ``GET /metrics``.

Streaming (``"stream": true`` or ``Accept: text/event-stream``): server-sent events ``token``
(``{"token": id, "text": piece}``; characters split over tokens are held back until complete), a
``text`` event with any characters still held back at the end, then one ``done`` with the whole
JSON result — or one ``error`` (``{"error", "reason"}``). Errors found before the first token (unknown session, fingerprint,
restore) are plain JSON error responses, not streams. A client that leaves — mid-stream, or while
waiting for a non-streamed answer — stops the turn at the scheduler's next step; the tokens
generated for it are appended (``finish_reason: cancelled``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvstore.api.dependencies import LoadedEngine, Owner, SessionId
from kvstore.api.json_body import StrictJSONRoute
from kvstore.api.routers.metrics import Counters, Metrics
from kvstore.api.schemas import EngineOut, ErrorBody, GenerateIn, GenerateOut
from kvstore.api.streams import EventPipe
from kvstore.errors import InvalidRequest, KVStoreError

log = logging.getLogger("kvstore.api")

router = APIRouter(
    tags=["generate"],
    responses={status: {"model": ErrorBody} for status in (400, 401, 404, 409, 413, 422, 503, 507)},
    route_class=StrictJSONRoute,
)

EVENT_STREAM = "text/event-stream"


def _options(body: GenerateIn, owner: str) -> dict[str, Any]:
    return {
        "owner": owner,
        "create": body.create,
        "tags": body.tags,
        "max_new_tokens": body.max_new_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "stop_tokens": body.stop,
        "verify": body.verify,
        "override": body.override,
    }


def _prompt(body: GenerateIn):
    if (body.tokens is None) == (body.text is None):
        raise InvalidRequest("send the new turn as either 'tokens' (ids) or 'text', not both and not neither")
    return body.text if body.text is not None else body.tokens


def _turn_json(result) -> dict[str, Any]:
    """A :class:`~kvstore.engine.session.TurnResult` as ``GenerateOut`` (the session's tier with its name)."""
    body = result.to_dict()
    if result.session is not None:
        body["session"] = result.session.to_dict()
    return body


def _split_headers(reused: int, prefilled: int, source: str) -> dict[str, str]:
    return {"X-KV-Reused-Tokens": str(reused), "X-KV-Prefilled-Tokens": str(prefilled), "X-KV-Source": source}


@router.get("/engine", response_model=EngineOut, summary="The loaded model, cache tier and fingerprint")
def engine_info(owner: Owner, engine: LoadedEngine) -> dict:
    described = engine.describe()
    described.pop("live_session", None)  # another owner's session id is not the caller's business
    return described


@router.post(
    "/sessions/{session_id}/generate",
    response_model=GenerateOut,
    summary="Run one turn on a session (restore, prefill the new tokens only, generate, append)",
    responses={200: {"content": {EVENT_STREAM: {"schema": {"type": "string"}}}}, 429: {"model": ErrorBody}},
)
async def generate(
    request: Request,
    body: GenerateIn,
    session_id: SessionId,
    owner: Owner,
    engine: LoadedEngine,
    metrics: Counters,
):
    prompt = _prompt(body)
    options = _options(body, owner)
    streaming = body.stream or EVENT_STREAM in request.headers.get("accept", "")
    # Admission (ServerBusy: 429), the session's hold and the restore happen in a worker thread;
    # the turn then runs on the engine's scheduler with every other turn in flight.
    try:
        turn = await run_in_threadpool(lambda: engine.begin(session_id, prompt, **options))
    except KVStoreError as exc:
        metrics.record_failure(type(exc).__name__)
        raise
    if not streaming:
        try:
            result = await _run_to_end(request, turn)
        except KVStoreError as exc:
            metrics.record_failure(type(exc).__name__)
            raise
        metrics.record_turn(result)
        return JSONResponse(
            _turn_json(result), headers=_split_headers(result.reused_tokens, result.prefilled_tokens, result.source)
        )

    events = EventPipe()
    try:
        threading.Thread(
            target=_produce, args=(turn, events, metrics), name=f"generate-{session_id}", daemon=True
        ).start()
    except BaseException:
        turn.close()
        raise
    headers = _split_headers(turn.reused_tokens, turn.prefilled_tokens, turn.source)
    headers["Cache-Control"] = "no-cache"
    return StreamingResponse(_events(turn, events), media_type=EVENT_STREAM, headers=headers)


#: How often a non-streamed turn checks that its client is still there (a step or so).
DISCONNECT_POLL_S = 0.05


async def _run_to_end(request: Request, turn):
    """Iterate ``turn`` to its end in a worker thread; a client that leaves meanwhile cancels it at the
    scheduler's next step (what was generated is stored, as for a streamed turn)."""

    def consume():
        with turn:
            for _ in turn:
                pass
        return turn.final()

    task = asyncio.ensure_future(run_in_threadpool(consume))
    cancelled = False
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if not cancelled and await request.is_disconnected():
            turn.cancel()
            cancelled = True


def _produce(turn, events: EventPipe, metrics: Metrics) -> None:
    """Run the turn to its end in this thread (the reader's side: tokens from the scheduler, then the
    append), queueing its events in groups (one write for the tokens of several steps when the
    client or this thread fell behind)."""
    from kvstore.engine.session import TextDeltas

    try:
        with turn:
            pieces = TextDeltas(turn.tokenizer)
            texts = turn.tokenizer is not None
            for batch in turn.batches():  # every token the scheduler produced since the last write
                first = len(turn.tokens) - len(batch)
                events.put(
                    [
                        (
                            "token",
                            {"token": token, "text": pieces.delta(turn.tokens[: first + i + 1]) if texts else None},
                        )
                        for i, token in enumerate(batch)
                    ]
                )
            tail = pieces.rest(turn.tokens) if texts else ""
            if tail:
                events.put([("text", {"text": tail})])
        metrics.record_turn(turn.result)
        events.put([("done", _turn_json(turn.result))])
    except KVStoreError as exc:
        metrics.record_failure(type(exc).__name__)
        events.put([("error", {"error": type(exc).__name__, "reason": exc.reason})])
    except Exception as exc:
        log.exception("generate on %s failed", turn.session_id)
        metrics.record_failure("InternalError")
        reason = f"{type(exc).__name__}: the turn failed; see the service log"
        events.put([("error", {"error": "InternalError", "reason": reason})])
    finally:
        events.close()


async def _events(turn, events: EventPipe):
    """The queued events as server-sent events (those that arrived together in one write); a client
    that leaves cancels the turn."""
    try:
        async for batch in events.batches():  # lists of (event, data), as the producer put them
            yield "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for group in batch for name, data in group)
    finally:
        turn.cancel()  # a no-op once the turn ended
