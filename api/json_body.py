"""JSON request bodies, parsed strictly: a key given twice in one object is refused (422).

``json.loads`` keeps the last of duplicate keys, so ``{"n_records": 100, "n_records": 0}`` truncated
a session to 0 records while a proxy or a log that keeps the first saw 100. Every router of the
service is an ``APIRouter(route_class=StrictJSONRoute)``: its requests parse JSON with
:func:`loads`, which raises :class:`~kvstore.api.errors.DuplicateJSONKey` for any object, at any
depth, that names a key more than once (``tests/api/test_json_body.py`` checks every route).

Bounded, and off the event loop: a route with a JSON body reads it itself, refused with 413 as
soon as it passes the body model's ``max_body_bytes`` (``kvstore.api.schemas``: 64 KiB for small
bodies, 8 MiB for token lists; ``--max-body`` if smaller), then parses *and validates* it in a
worker thread. FastAPI is handed the validated model (which it passes through without validating
again), so neither ``json.loads`` nor pydantic ever runs a large body on the event loop. A request
without a known API key gets its 401 before any of its body is read.

A worker thread still holds the GIL while C code runs: ``json.loads`` of 8 MiB of token ids held it
for its whole ~0.2 s, and the event loop waited. Bodies over :data:`BIG_BODY_BYTES` (64 KiB: bodies
only the token-list routes take) are therefore parsed with ``loads(yielding=True)`` and one at a
time (``app.state.big_json``, a semaphore: eight threads parsing at once would take the GIL from the
loop eight times as often). Numbers go through Python hooks there, so they yield; arrays, objects,
strings and ``null``/``true``/``false`` are built in C, and millions of arrays or objects make the
garbage collector stop everything: 8 MiB of empty lists (``[[],[],...]``) held the GIL for ~2 s
(``/health`` p99 2.8 s under 8 such clients), 1 MiB of them for 0.25 s, 8 MiB of empty objects for
0.1 s at a time, of empty strings for ~0.13 s. So a big body may hold at most
:data:`BIG_BODY_VALUES` such values (:func:`unyielding_values` counts them on the bytes before
parsing; a long text prompt is one string, whatever brackets it holds), else it is refused with
413: its bulk must be what a big body is for, a list of token ids. (Validating millions of wrong
items is bounded in ``kvstore.api.schemas.only_integers``.)
"""

from __future__ import annotations

import json
from typing import Any, Callable, Coroutine

import numpy as np
from fastapi import Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from kvstore.api.dependencies import presented_owner, read_body, require_owner
from kvstore.api.errors import BodyTooLarge, DuplicateJSONKey
from kvstore.api.schemas import JSON_BODY_BYTES
from kvstore.errors import InvalidRequest, KVStoreError

__all__ = [
    "BIG_BODY_BYTES",
    "BIG_BODY_VALUES",
    "ReadJSONRequest",
    "StrictJSONRequest",
    "StrictJSONRoute",
    "unyielding_values",
    "loads",
]

BIG_BODY_BYTES = JSON_BODY_BYTES  # bodies past this are parsed one at a time, yielding the GIL as they go
BIG_BODY_VALUES = 1 << 14  # values a big body may hold that parse without yielding: ~10 ms of GIL at most
_SCAN_CHUNK = 1 << 20
_VALUE_START = np.zeros(256, bool)
_VALUE_START[list(b"[{ntfN")] = True


def unyielding_values(body: bytes) -> int:
    """The values of a JSON document that ``json.loads`` builds in C, never calling back into Python:
    arrays, objects, strings and the literals ``null``, ``true``, ``false``, counted on its bytes
    without parsing it. ``NaN`` and ``Infinity`` (no body has a use for them) count 2 and 4, for the
    bytes ``N``, ``n``, ``f``, ``t`` they hold: more than they are, so they are refused sooner.

    What is inside strings is not counted (a long text prompt is one string, whatever it holds).
    A quote opens or closes a string unless an odd run of backslashes precedes it. Array operations
    over a MiB at a time (~30 ms for 8 MiB of token ids, ~70 ms for text full of escapes), with the
    GIL given up between them. An invalid document may count differently only past its first error,
    where the parser stops.

    >>> unyielding_values(b'{"text": "a [b] \\\\\\" null", "tokens": [1, 2.5], "x": [[], {}, true, null]}')
    11
    """
    octets = np.frombuffer(body, np.uint8)
    found = 0
    quotes = 0
    inside = 0  # 1: the chunk starts inside a string
    carried = 0  # backslashes that end the previous chunk
    for start in range(0, octets.size, _SCAN_CHUNK):
        part = octets[start : start + _SCAN_CHUNK]
        at = np.flatnonzero(part == 34)
        backslash = part == 92
        if backslash.any():
            # the last position at or before each one that is not a backslash (-1: none in this chunk)
            plain = np.maximum.accumulate(np.where(backslash, np.int32(-1), np.arange(part.size, dtype=np.int32)))
            before = np.where(at > 0, plain[np.maximum(at - 1, 0)], -1)
            run = at - 1 - before + np.where(before < 0, carried, 0)  # backslashes right before each quote
            real = at[run % 2 == 0]
            carried = part.size - 1 - int(plain[-1]) + (carried if plain[-1] < 0 else 0)
        else:
            real = at[1:] if at.size and at[0] == 0 and carried % 2 else at
            carried = 0
        # the first byte of an array, an object or a literal: [ { n t f (and N)
        starts = np.flatnonzero(_VALUE_START[part])
        # outside every string when an even number of string quotes precede it
        found += int(np.count_nonzero(((np.searchsorted(real, starts) + inside) & 1) == 0))
        quotes += real.size
        inside = (inside + real.size) & 1
    return found + quotes // 2


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: the object as a dict, refused if a key repeats."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        times = sum(1 for key, _ in pairs if key == repeated)
        shown = repeated if len(repeated) <= 64 else repeated[:64] + "..."
        raise DuplicateJSONKey(
            f"the JSON body gives the key {shown!r} {times} times in one object; give every key once"
        )
    return obj


def _int_yielding(digits: str) -> int:
    # A Python function, so the parser's thread runs bytecode per integer and lets other threads
    # (the event loop) take the GIL; json's own int parsing holds it for the whole document.
    return int(digits)


def _float_yielding(text: str) -> float:
    return float(text)  # as _int_yielding: 8 MiB of floats held the GIL for ~0.4 s in C


def loads(body: bytes | bytearray | str, *, yielding: bool = False) -> Any:
    """Parse a JSON document, refusing duplicate keys.

    ``yielding``: parse numbers through Python functions (about twice the time) so that a parse in
    a worker thread gives the GIL up as it goes: 8 MiB of token ids otherwise keep the event loop
    waiting for the whole parse (~0.2 s).

    Raises
    ------
    json.JSONDecodeError : not JSON (FastAPI answers 422 ``json_invalid``)
    DuplicateJSONKey : an object names a key twice (422)

    >>> loads(b'{"n_records": 3}')
    {'n_records': 3}
    >>> loads(b'{"n": 100, "n": 0}')
    Traceback (most recent call last):
    ...
    kvstore.api.errors.DuplicateJSONKey: the JSON body gives the key 'n' 2 times in one object; give every key once
    """
    if not yielding:
        return json.loads(body, object_pairs_hook=_unique_keys)
    return json.loads(body, object_pairs_hook=_unique_keys, parse_int=_int_yielding, parse_float=_float_yielding)


class StrictJSONRequest(Request):
    """A request whose ``json()`` is :func:`loads` (what FastAPI calls to read a JSON body)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class ReadJSONRequest(StrictJSONRequest):
    """A request whose body was read (bounded) and parsed and validated in a worker thread: FastAPI's
    ``body()`` and ``json()`` return what was read, never reading or parsing on the event loop."""

    def __init__(self, request: Request, body: bytes, value: Any):
        super().__init__(request.scope, request.receive)
        self._read_body = body
        self._read_value = value

    async def body(self) -> bytes:
        return self._read_body

    async def json(self) -> Any:
        return self._read_value


def _is_json(request: Request) -> bool:
    """FastAPI's test for a JSON body: ``application/json`` or ``application/*+json``."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    maintype, _, subtype = kind.partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


def _parse_and_validate(body: bytes, field: Any) -> Any:
    """:func:`loads` ``body``, then validate it as ``field`` (FastAPI's ModelField) — in a worker thread."""
    big = len(body) > BIG_BODY_BYTES
    if big:
        costly = unyielding_values(body)
        if costly > BIG_BODY_VALUES:
            raise BodyTooLarge(
                f"the JSON body is {len(body)} bytes and holds {costly} arrays, objects, strings and literals; "
                f"a body over {BIG_BODY_BYTES} bytes may hold at most {BIG_BODY_VALUES}: only a token list (or "
                "one text) may be large"
            )
    try:
        parsed = loads(body, yielding=big)
    except json.JSONDecodeError as exc:  # the error FastAPI itself answers with (422 json_invalid)
        problem = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**problem, "ctx": {"error": exc.msg}}]) from None
    except KVStoreError:
        raise
    except RecursionError:
        raise InvalidRequest("the JSON body nests arrays or objects too deeply to be read") from None
    except ValueError as exc:  # not UTF-8, an integer of more than 4300 digits
        raise InvalidRequest(f"the JSON body cannot be read: {exc}") from None
    value, errors = field.validate(parsed, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors)
    return value


def _calls(dependant: Dependant, call: Callable) -> bool:
    return dependant.call is call or any(_calls(sub, call) for sub in dependant.dependencies)


class StrictJSONRoute(APIRoute):
    """An ``APIRoute`` whose endpoint reads its request as a :class:`StrictJSONRequest`; a JSON body
    is read bounded and parsed and validated off the event loop (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        params = self.dependant.body_params
        field = params[0] if len(params) == 1 and not getattr(params[0].field_info, "embed", False) else None
        model = getattr(field.field_info, "annotation", None) if field is not None else None
        route_limit = getattr(model, "max_body_bytes", JSON_BODY_BYTES)
        keyed = _calls(self.dependant, require_owner)
        accepts = f"{'/'.join(sorted(self.methods or ()))} {self.path} accepts"

        async def strict_handler(request: Request) -> Response:
            if field is None:
                return await handler(StrictJSONRequest(request.scope, request.receive))
            if keyed and await presented_owner(request) is None:
                # the route's own key check answers 401; nothing of the body is read for it
                return await handler(ReadJSONRequest(request, b"", None))
            limit = min(route_limit, request.app.state.settings.max_body_bytes)
            body = bytes(await read_body(request, limit, accepts))
            value = None
            if body and _is_json(request):
                if len(body) > BIG_BODY_BYTES:
                    async with request.app.state.big_json:  # one big parse at a time (see the docstring)
                        value = await run_in_threadpool(_parse_and_validate, body, field)
                else:
                    value = await run_in_threadpool(_parse_and_validate, body, field)
            return await handler(ReadJSONRequest(request, body, value))

        return strict_handler
