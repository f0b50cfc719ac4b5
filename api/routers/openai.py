"""The OpenAI-compatible API: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

Served when the service runs with a model (``kvstore serve --model DIR``); without one every
``/v1`` route answers 503. Requests and answers follow OpenAI's API (docs/SERVE.md maps every
field; bodies in ``kvstore.api.openai_schemas``), so the official clients work with
``base_url=<server>/v1`` and a service API key as the OpenAI key.

**Reuse.** Every turn is stored as a session (tagged ``openai``), and the next request resumes
from the stored rows instead of prefilling the conversation again, in either of two ways:

- *named session* (extension ``session_id``): the session's stored rows are the conversation so
  far; the new turn is what the request's messages add after the last assistant message
  (:func:`kvstore.api.chat_template.continuation`), or, for completions, the prompt. A missing
  session is created with the whole prompt.
- *history resent*: the whole prompt is tokenized and the owner's session sharing its longest
  stored prefix is found (``Store.lookup``: whole 64-token blocks, then confirmed token by token).
  When the match is the whole session (and the prompt goes on), the turn continues it in place
  (sessions this API made only: another one is never appended to unasked); otherwise the session
  is forked at the match and the fork continued; with no match, a new session starts.

Either way the answer carries the session's id (``session_id``) and ``usage`` reports the reused
tokens as ``prompt_tokens_details.cached_tokens``. A session can move on between the plan and the
turn (another request continued it first): the turn then finds more rows than planned, is closed
unstarted, and runs on a fork at the planned point instead; a session changed while a non-streamed
turn ran (``ConversationMismatch``: nothing was stored) is generated again on such a fork. So each
answer is stored after exactly its own conversation.

**Errors** of every ``/v1`` route are OpenAI's error object ``{"error": {"message", "type",
"param", "code"}}`` (:class:`OpenAIRoute` converts whatever a route raises: validation, auth, a
``KVStoreError`` at the status ``kvstore.api.errors`` gives it — a 422 of the rest of the service
is a 400 here, as OpenAI answers —, anything unexpected as 500). An error after a stream started is
one last ``data: {"error": ...}`` event before ``data: [DONE]``.

**Turns** run in a thread of their own each (waiting for the engine does not hold a worker thread
of the other routes); a client that leaves, streamed or not, cancels its turn, and what was
generated until then is stored as the engine stores a cancelled turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstore.api.dependencies import AppSettings, LoadedEngine, Owner
from kvstore.api.errors import InvalidParameter, ModelNotFound
from kvstore.api.openai_errors import OpenAIRoute, openai_error
from kvstore.api.openai_schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIErrorBody,
)
from kvstore.api.openai_turns import Job, TurnThread, next_event
from kvstore.api.routers.metrics import Counters, Metrics
from kvstore.errors import InvalidSessionId
from kvstore.store import validate_session_id

log = logging.getLogger("kvstore.api")

EVENT_STREAM = "text/event-stream"


router = APIRouter(
    prefix="/v1",
    tags=["openai"],
    responses={status: {"model": OpenAIErrorBody} for status in (400, 401, 404, 409, 413, 429, 500, 503, 507)},
    route_class=OpenAIRoute,
)


# ---------------------------------------------------------------------------- models
def _model_card(engine) -> dict[str, Any]:
    folder = engine.folder
    created = int(folder.stat().st_mtime) if folder is not None and folder.exists() else 0
    return {"id": engine.model.name, "object": "model", "created": created, "owned_by": "kvstore"}


def _check_model(model: str, engine) -> None:
    if model != engine.model.name:
        raise ModelNotFound(
            f"The model '{model}' does not exist on this server; it serves '{engine.model.name}' (GET /v1/models)"
        )


@router.get("/models", response_model=ModelList, summary="The loaded model, as OpenAI's model list")
async def list_models(owner: Owner, engine: LoadedEngine) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(engine)]})


@router.get("/models/{model_id:path}", response_model=ModelCard, summary="The loaded model, by its id")
async def retrieve_model(model_id: str, owner: Owner, engine: LoadedEngine) -> JSONResponse:
    _check_model(model_id, engine)
    return JSONResponse(_model_card(engine))


# ---------------------------------------------------------------------------- the request
def job_for(body: ChatCompletionRequest | CompletionRequest, owner: str, engine, metrics: Metrics, settings) -> Job:
    body.refuse_unsupported()
    _check_model(body.model, engine)
    if engine.engine.tokenizer is None:
        raise InvalidParameter(
            "this server's model folder has no tokenizer, so it cannot read or write text: use POST "
            "/sessions/{id}/generate with token ids",
            "model",
            "model_without_tokenizer",
        )
    cap = settings.max_new_tokens
    if isinstance(body, ChatCompletionRequest):
        chat, messages, prompt, max_tokens = True, body.conversation(), None, body.max_new_tokens()
    else:
        chat, messages, prompt, max_tokens = False, None, body.single_prompt(), body.max_tokens
    if max_tokens is not None and max_tokens > cap:
        named = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise InvalidParameter(
            f"{named} is {max_tokens}; this server generates at most {cap} tokens per request",
            named,
            "max_tokens_exceeded",
        )
    if body.session_id is not None:
        try:
            validate_session_id(body.session_id)
        except InvalidSessionId as exc:
            raise InvalidParameter(f"session_id: {exc.reason}", "session_id") from None
    return Job(
        chat=chat,
        owner=owner,
        engine=engine,
        metrics=metrics,
        model=engine.model.name,
        messages=messages,
        prompt=prompt,
        session_id=body.session_id,
        max_tokens=max_tokens,
        cap=cap,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stops=body.stop_strings(),
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )


# ---------------------------------------------------------------------------- the answers
def _head(job: Job, kind: str) -> dict[str, Any]:
    return {
        "id": f"{'chatcmpl' if job.chat else 'cmpl'}-{job.id}",
        "object": kind,
        "created": job.created,
        "model": job.model,
        "system_fingerprint": job.engine.fingerprint.key(),
    }


def _answer_json(job: Job, answer: dict[str, Any]) -> dict[str, Any]:
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": answer["text"]}}
    else:
        choice = {"index": 0, "text": answer["text"]}
    choice.update(logprobs=None, finish_reason=answer["finish_reason"])
    return {
        **_head(job, "chat.completion" if job.chat else "text_completion"),
        "choices": [choice],
        "usage": answer["usage"],
        "session_id": answer["session_id"],
    }


def _chunk(job: Job, piece: str | None, finish_reason: str | None = None, **extra: Any) -> str:
    """One server-sent event of a stream: a piece of the answer (``None``: the first chunk of a chat,
    its role), or the last one with ``finish_reason``."""
    if job.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if piece is None else {}
        if piece:
            delta["content"] = piece
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": piece or ""}
    choice.update(logprobs=None, finish_reason=finish_reason)
    chunk = {**_head(job, "chat.completion.chunk" if job.chat else "text_completion"), "choices": [choice], **extra}
    if job.include_usage and "usage" not in chunk:
        chunk["usage"] = None  # as OpenAI: every chunk but the last carries a null usage
    return _event(chunk)


def _event(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _chunks(thread: TurnThread) -> AsyncIterator[str]:
    """The stream's events, from the first chunk to ``data: [DONE]``; a client that leaves cancels
    the turn (Starlette cancels this generator)."""
    job = thread.job
    try:
        if job.chat:
            yield _chunk(job, None)
        while True:
            kind, value = await thread.events.get()
            if kind == "text":
                yield _chunk(job, value)
            elif kind == "done":
                yield _chunk(job, "", value["finish_reason"], session_id=value["session_id"])
                if job.include_usage:
                    last = {**_head(job, "chat.completion.chunk" if job.chat else "text_completion"), "choices": []}
                    yield _event({**last, "usage": value["usage"], "session_id": value["session_id"]})
                yield _event("[DONE]")
                return
            elif kind == "error":
                yield _event(openai_error(value)[1])
                yield _event("[DONE]")
                return
    finally:
        thread.cancel()  # nothing once the turn ended


async def _complete(request: Request, job: Job) -> Response:
    thread = TurnThread(job, asyncio.get_running_loop())
    thread.start()
    try:
        kind, value = await next_event(thread, request)
        if job.stream and kind == "begun":
            headers = {**value, "Cache-Control": "no-cache"}
            return StreamingResponse(_chunks(thread), media_type=EVENT_STREAM, headers=headers)
        while kind == "begun":
            kind, value = await next_event(thread, request)
    except BaseException:
        thread.cancel()
        raise
    if kind == "error":
        raise value
    return JSONResponse(_answer_json(job, value), headers=value["split"])


_STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {EVENT_STREAM: {"schema": {"type": "string"}}}}}


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    summary="A chat turn; resumes stored conversations without prefilling them again",
    responses=_STREAMED,
)
async def chat_completions(
    request: Request,
    body: ChatCompletionRequest,
    owner: Owner,
    engine: LoadedEngine,
    metrics: Counters,
    settings: AppSettings,
) -> Response:
    return await _complete(request, job_for(body, owner, engine, metrics, settings))


@router.post(
    "/completions",
    response_model=Completion,
    summary="A text completion; resumes stored prompts without prefilling them again",
    responses=_STREAMED,
)
async def completions(
    request: Request,
    body: CompletionRequest,
    owner: Owner,
    engine: LoadedEngine,
    metrics: Counters,
    settings: AppSettings,
) -> Response:
    return await _complete(request, job_for(body, owner, engine, metrics, settings))


_ROUTES = ("models", "chat/completions", "completions")


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
async def not_served(path: str, request: Request) -> Response:
    """Any other ``/v1`` path or method, refused in OpenAI's shape (404, or 405 for a known path)."""
    if path in _ROUTES or path.startswith("models/"):
        raise StarletteHTTPException(405, f"{request.method} is not allowed on /v1/{path}")
    raise StarletteHTTPException(
        404, f"this server does not serve /v1/{path} (it serves models, chat/completions, completions)"
    )
