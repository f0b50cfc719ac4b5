"""OpenAI's error object on the OpenAI-compatible routes: ``{"error": {"message", "type", "param",
"code"}}`` for whatever a ``/v1`` route raises (:class:`OpenAIRoute`), at the status the rest of the
service gives it (``kvstore.api.errors``), a 422 there answered as a 400 here, as OpenAI answers.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvstore.api.errors import ModelNotFound, Unauthorized, http_status, retry_after
from kvstore.api.json_body import StrictJSONRoute
from kvstore.errors import KVStoreError

__all__ = ["OpenAIRoute", "error_response", "openai_error"]

log = logging.getLogger("kvstore.api")


# ---------------------------------------------------------------------------- errors
_TYPES = {401: "authentication_error", 403: "permission_error", 409: "conflict_error", 429: "rate_limit_error"}
_CODES = {ModelNotFound: "model_not_found", Unauthorized: "invalid_api_key"}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def _snake(name: str) -> str:
    """``DuplicateJSONKey`` -> ``duplicate_json_key``: an error class as an OpenAI error code."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _error_json(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _error_type(status), "param": param, "code": code}}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """One message for a body that failed validation, the parameter it names first, and a code."""
    problems = list(exc.errors())
    parts, params = [], []
    for problem in problems[:5]:
        loc = [p for p in problem.get("loc", ()) if p != "body"]
        if problem.get("type") == "json_invalid":
            error = (problem.get("ctx") or {}).get("error", "invalid JSON")
            return f"the body is not valid JSON: {error} (at character {loc[0] if loc else 0})", None, "invalid_json"
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
        params.append(param)
        if problem.get("type") == "extra_forbidden":
            parts.append(f"Unrecognized request argument supplied: {param} (this server does not implement it)")
        elif problem.get("type") == "missing" and param is None:
            parts.append("the request needs a JSON body")
        else:
            parts.append(f"{param or 'body'}: {problem.get('msg', 'invalid')}")
    if len(problems) > 5:
        parts.append(f"and {len(problems) - 5} more")
    unknown = bool(problems) and problems[0].get("type") == "extra_forbidden"
    message = "; ".join(parts) or "the request is not valid"
    return message, params[0] if params else None, "unknown_parameter" if unknown else "invalid_value"


def openai_error(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """An exception as OpenAI's error object: its status, the body, and the headers that go with it
    (``Retry-After``, ``WWW-Authenticate``)."""
    headers: dict[str, str] = {}
    if isinstance(exc, StarletteHTTPException) and isinstance(exc.__cause__, KVStoreError):
        exc = exc.__cause__  # raised while FastAPI read a JSON body (BodyTooLarge)
    if isinstance(exc, KVStoreError):
        status = http_status(exc)
        status = 400 if status == 422 else status  # OpenAI answers a request it cannot process with 400
        code = getattr(exc, "code", None) or _CODES.get(type(exc)) or _snake(type(exc).__name__)
        body = _error_json(status, exc.reason, getattr(exc, "param", None), code)
        wait = retry_after(exc)
        if wait is not None:
            headers["Retry-After"] = str(wait)
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
    elif isinstance(exc, RequestValidationError):
        status = 400
        body = _error_json(status, *_validation_message(exc))
    elif isinstance(exc, StarletteHTTPException):
        status = exc.status_code
        body = _error_json(status, str(exc.detail), None, _HTTP_CODES.get(status))
        headers.update(getattr(exc, "headers", None) or {})
    elif isinstance(exc, ClientDisconnect):
        status = 400
        body = _error_json(status, "the client closed the connection before the answer", None, "client_disconnected")
    else:
        log.error("unhandled error on an OpenAI-compatible route", exc_info=exc)
        status = 500
        body = _error_json(status, f"{type(exc).__name__}: the service failed; see its log", None, "internal_error")
    return status, body, headers


def error_response(exc: BaseException) -> JSONResponse:
    """:func:`openai_error` as a response."""
    status, body, headers = openai_error(exc)
    return JSONResponse(body, status_code=status, headers=headers or None)


class OpenAIRoute(StrictJSONRoute):
    """A :class:`~kvstore.api.json_body.StrictJSONRoute` whose every failure answers in OpenAI's
    error shape (:func:`error_response`), so the rest of the service keeps its own."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return error_response(exc)

        return openai_handler
