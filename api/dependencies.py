"""Request-scoped dependencies: the store handle, the caller's owner (auth), bounded bodies.

Routes take them as annotated parameters (``owner: Owner``, ``store: Store``, ...), FastAPI's
``Annotated`` form: the dependency is named once here, not as a call in every signature. Those that
only read ``app.state`` or check a string are ``async``: FastAPI runs a plain ``def`` dependency in
a worker thread, a round trip through the event loop that a busy loop makes slow.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from kvstore.api.errors import BodyTooLarge, EngineNotLoaded, Unauthorized, UnsupportedMediaType
from kvstore.api.jobs import JobRunner
from kvstore.api.keys import KeyTable
from kvstore.api.session_gates import SessionGates
from kvstore.api.settings import Settings
from kvstore.errors import InvalidRequest, Unavailable
from kvstore.store import Store as StoreInterface
from kvstore.store import validate_session_id

_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <API key>")
_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="the API key, as an alternative to Bearer")


async def get_store(request: Request) -> StoreInterface:
    """The app's store: either backend, through the interface (``kvstore.store.Store``)."""
    return request.app.state.store


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_jobs(request: Request) -> JobRunner:
    return request.app.state.jobs


async def get_gates(request: Request) -> SessionGates:
    return request.app.state.gates


async def get_engine(request: Request):
    """The loaded :class:`kvstore.engine.session.SessionEngine` (503 when the service has no model)."""
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise EngineNotLoaded(
            "this server has no model loaded, so it cannot generate: start it with "
            "`kvstore serve --model DIR [--tier fp8]` (the session endpoints work without one)"
        )
    return engine


async def get_metrics(request: Request):
    return request.app.state.metrics


def require_owner(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    api_key: Annotated[str | None, Depends(_api_key)],
) -> str:
    """The owner the presented API key maps to (401 without a known key; 503 while a replica's
    index, which holds its keys, has not answered since the replica started)."""
    key = bearer.credentials if bearer is not None else api_key
    if not key:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
    table: KeyTable = request.app.state.keys
    owner = table.owner_for(key)
    if owner is None:
        raise Unauthorized("unknown API key")
    return owner


async def presented_owner(request: Request) -> str | None:
    """The owner of the API key the request carries (None without a known key): :func:`require_owner`
    without raising, for code that runs before the route's dependencies."""
    try:
        return require_owner(request, await _bearer(request), await _api_key(request))
    except (Unauthorized, Unavailable):  # the route's own check answers (401, or 503 while the index is down)
        return None


async def session_id_param(session_id: str) -> str:
    """The ``{session_id}`` path parameter, validated (400 for anything that is not an id)."""
    return validate_session_id(session_id)


Owner = Annotated[str, Depends(require_owner)]
Store = Annotated[StoreInterface, Depends(get_store)]
SessionId = Annotated[str, Depends(session_id_param)]
Jobs = Annotated[JobRunner, Depends(get_jobs)]
Gates = Annotated[SessionGates, Depends(get_gates)]
AppSettings = Annotated[Settings, Depends(get_settings)]
LoadedEngine = Annotated[Any, Depends(get_engine)]  # a kvstore.engine.session.SessionEngine (imports torch)


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def require_media_type(request: Request, *allowed: str) -> str:
    kind = media_type(request)
    if kind not in allowed:
        raise UnsupportedMediaType(
            f"Content-Type {kind or '(none)'!r} is not accepted here; send one of {list(allowed)}"
        )
    return kind


async def read_body(request: Request, limit: int, accepts: str = "this service accepts") -> bytearray | memoryview:
    """The whole request body, refused with 413 as soon as it passes ``limit`` bytes.

    With a Content-Length the body is read into one buffer of that size (no regrowth copies).
    ``accepts`` names who sets the limit in the 413's reason (``"POST /lookup accepts"``).
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("Content-Length is not a number")
        expected = int(declared)
        if expected > limit:
            raise BodyTooLarge(f"the body is {expected} bytes; {accepts} at most {limit}")
        body = bytearray(expected)  # calloc'd: pages are touched once, by the copy below
        view = memoryview(body)
        got = 0
        async for chunk in request.stream():
            if got + len(chunk) > expected:
                raise InvalidRequest("the body is longer than its Content-Length")
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        if got != expected:
            raise InvalidRequest(f"the body ended after {got} of its {expected} bytes")
        return body
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(f"the body passed {limit} bytes, the most {accepts}")
    return body
