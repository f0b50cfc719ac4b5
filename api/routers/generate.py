"""``POST /sessions/{id}/generate`` and ``GET /engine``: conversation turns on the loaded model.

Served when the service runs with ``kvstore serve --model DIR``; without a model both answer
``503 EngineNotLoaded`` with how to start one. A call sends **the new turn only** (token ids, or
text when the model folder has a tokenizer); the service restores the session into the engine's
cache when the cache does not already hold it, prefills only the new tokens, generates, and
appends the turn (prompt + answer) to the session as one complete turn
(:mod:`kvstore.engine.session`).

Every answer reports the split: ``reused_tokens`` (stored rows reused) and ``prefilled_tokens``
(run through the model), in the body, in the ``X-KV-Reused-Tokens`` / ``X-KV-Prefilled-Tokens`` /
``X-KV-Source`` headers, in the log (``kvstore.engine.session``) and in ``GET /metrics``.

Streaming (``"stream": true`` or ``Accept: text/event-stream``): server-sent events ``token``
(``{"token": id, "text": piece}``; characters split over tokens are held back until complete), a
``text`` event with any characters still held back at the end, then one ``done`` with the whole
JSON result — or one ``error`` (``{"error", "reason"}``). Errors found before the first token (unknown session, fingerprint,
restore) are plain JSON error responses, not streams. A client that leaves mid-stream stops the
turn after the current token; what was generated is appended (``finish_reason: cancelled``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvstore.api.dependencies import LoadedEngine, Owner, SessionId
from kvstore.api.json_body import StrictJSONRoute
from kvstore.api.routers.metrics import Counters, Metrics
from kvstore.api.schemas import EngineOut, ErrorBody, GenerateIn, GenerateOut
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
    responses={200: {"content": {EVENT_STREAM: {"schema": {"type": "string"}}}}},
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
    # Turns wait for the one engine here, in the event loop, not in worker threads the other
    # endpoints need (the engine's own lock is then never contended).
    gate: asyncio.Lock = request.app.state.generate_gate
    await gate.acquire()
    if not streaming:
        try:
            result = await run_in_threadpool(lambda: engine.run(session_id, prompt, **options))
        except KVStoreError as exc:
            metrics.record_failure(type(exc).__name__)
            raise
        finally:
            gate.release()
        metrics.record_turn(result)
        return JSONResponse(
            _turn_json(result), headers=_split_headers(result.reused_tokens, result.prefilled_tokens, result.source)
        )

    events: queue.Queue = queue.Queue()
    loop = asyncio.get_running_loop()
    once = threading.Lock()

    def release() -> None:  # exactly once: when the turn ends, or when it could not begin
        if once.acquire(blocking=False):
            loop.call_soon_threadsafe(gate.release)

    def start():  # runs to its end even if this request is cancelled meanwhile
        try:
            turn = engine.begin(session_id, prompt, **options)
        except BaseException:
            release()
            raise
        try:
            threading.Thread(
                target=_produce, args=(turn, events, metrics, release), name=f"generate-{session_id}", daemon=True
            ).start()
        except BaseException:
            turn.close()
            release()
            raise
        return turn

    try:
        turn = await run_in_threadpool(start)
    except KVStoreError as exc:
        metrics.record_failure(type(exc).__name__)
        raise
    headers = _split_headers(turn.reused_tokens, turn.prefilled_tokens, turn.source)
    headers["Cache-Control"] = "no-cache"
    return StreamingResponse(_events(turn, events), media_type=EVENT_STREAM, headers=headers)


def _produce(turn, events: queue.Queue, metrics: Metrics, release) -> None:
    """Run the turn to its end in this thread (it owns the engine), queueing the events; ``release``
    lets the next turn in when it is done."""
    from kvstore.engine.session import TextDeltas

    try:
        with turn:
            pieces = TextDeltas(turn.tokenizer)
            texts = turn.tokenizer is not None
            for token in turn:
                events.put(("token", {"token": token, "text": pieces.delta(turn.tokens) if texts else None}))
            tail = pieces.rest(turn.tokens) if texts else ""
            if tail:
                events.put(("text", {"text": tail}))
        metrics.record_turn(turn.result)
        events.put(("done", _turn_json(turn.result)))
    except KVStoreError as exc:
        metrics.record_failure(type(exc).__name__)
        events.put(("error", {"error": type(exc).__name__, "reason": exc.reason}))
    except Exception as exc:
        log.exception("generate on %s failed", turn.session_id)
        metrics.record_failure("InternalError")
        events.put(
            (
                "error",
                {"error": "InternalError", "reason": f"{type(exc).__name__}: the turn failed; see the service log"},
            )
        )
    finally:
        release()
        events.put(None)


async def _events(turn, events: queue.Queue):
    """The queued events as server-sent events; a client that leaves cancels the turn."""
    try:
        while True:
            item = await run_in_threadpool(events.get)
            if item is None:
                return
            name, data = item
            yield f"event: {name}\ndata: {json.dumps(data)}\n\n"
    finally:
        turn.cancel()  # a no-op once the turn ended
