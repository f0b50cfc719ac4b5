"""``/sessions``: create, list, append rows, resume, truncate, fork, park/unpark, verify, delete.

The list is paged (``limit``, ``cursor``; the answer's ``next_cursor`` leads to the next page, null
after the last): a page costs its own sessions whatever the owner holds. A create or fork past the
owner's cap (``kvstore serve --max-sessions-per-owner``) is ``409 TooManySessions``, nothing made.

Rows travel in binary only:

- ``application/octet-stream``: raw ``.coli_kv`` record bytes of the session's tier (no header),
  exactly as they sit in the journal (``record_bytes`` per token, see the session's JSON).
- ``application/vnd.apache.arrow.stream``: Arrow IPC, one row per token (``kvstore.api.arrow``).
- ``application/x-coli-kv`` (resume only): a whole ``.coli_kv`` file of the served records.

Resume responses carry ``X-KV-Reused-Tokens`` (records served: what the engine need not prefill),
``X-KV-Records``, ``X-KV-Record-Bytes``, ``X-KV-Geometry``, ``X-KV-Tier-Name`` (the tier's canonical
name), ``X-KV-Tier`` (its old spelling, ``v2`` or ``v3:int4:4``, kept one release for clients that
read it), ``X-KV-Verified`` and, when a verify found damage, ``X-KV-Damaged-From``.

A tier given the old way (see :mod:`kvstore.api.tier_fields`) is answered with ``Deprecation`` and
``Warning`` headers.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvstore.api import arrow
from kvstore.api.dependencies import (
    AppSettings,
    Gates,
    Jobs,
    Owner,
    SessionId,
    Store,
    read_body,
    require_media_type,
)
from kvstore.api.json_body import StrictJSONRoute
from kvstore.api.schemas import (
    ARROW_MEDIA_TYPE,
    COLI_KV_MEDIA_TYPE,
    DEFAULT_PAGE,
    MAX_PAGE,
    RAW_MEDIA_TYPE,
    AppendOut,
    CreateSession,
    ErrorBody,
    ForkIn,
    JobOut,
    SessionList,
    SessionOut,
    SessionPatch,
    TruncateIn,
    VerifyOut,
)
from kvstore.api.session_gates import Admission
from kvstore.api.settings import Settings
from kvstore.api.tier_fields import (
    MAX_TIER_CHARS,
    SESSION_TIERS,
    deprecation_headers,
    mark_deprecated,
    read_tier,
)
from kvstore.api.uploads import UploadBudget, declared_bytes
from kvstore.errors import InvalidRequest
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Tier
from kvstore.store import AppendResult, Fingerprint, ListCursor, ModelInfo, Reader, SessionInfo
from kvstore.store import Store as StoreInterface
from kvstore.store.results import refuse_nonfinite

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (400, 401, 404, 409, 413, 415, 422, 429, 507)
}
ARROW_BATCH_RECORDS = 256

router = APIRouter(prefix="/sessions", tags=["sessions"], responses=ERRORS, route_class=StrictJSONRoute)

_BINARY_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            RAW_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
            ARROW_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
        },
    }
}
_BINARY_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the served records (see the module docs for the headers)",
        "content": {
            RAW_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
            ARROW_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
            COLI_KV_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


def _out(info) -> dict[str, Any]:
    return info.to_dict()


@router.post("", status_code=201, response_model=SessionOut, summary="Create a session")
async def create_session(body: CreateSession, response: Response, owner: Owner, store: Store, gates: Gates) -> dict:
    tier, note = body.read_tier()
    info = await gates.call(
        owner,
        body.id,
        store.create,
        owner,
        body.geometry.to_geometry(),
        tier,
        body.model.to_model(),
        session_id=body.id,
        tags=body.tags,
        ttl_s=body.ttl_s,
    )
    mark_deprecated(response, note)
    return _out(info)


@router.get("", response_model=SessionList, summary="List the caller's sessions, a page at a time")
def list_sessions(
    *,
    model: Annotated[str | None, Query(max_length=256, description="model name")] = None,
    tag: Annotated[list[str], Query(default_factory=list, description="sessions holding every tag given")],
    state: Literal["active", "parked", "damaged"] | None = None,
    limit: Annotated[
        int, Query(ge=1, le=MAX_PAGE, description=f"sessions per page (at most {MAX_PAGE})")
    ] = DEFAULT_PAGE,
    cursor: Annotated[
        str | None,
        Query(max_length=ListCursor.MAX_CHARS, description="the next_cursor of the page before (none: the first page)"),
    ] = None,
    owner: Owner,
    store: Store,
) -> Response:
    # One more than the page is read, so the last page says so (next_cursor null) without a request
    # that comes back empty. The page is read from the index's order (kvstore.store.Store.list), and
    # its JSON is made here, in the worker thread: the event loop (and /health) never encodes it.
    found = store.list(owner=owner, model_name=model, tags=tag, state=state, limit=limit + 1, after=cursor)
    page = found[:limit]
    more = len(found) > limit
    return JSONResponse({"sessions": [_out(i) for i in page], "next_cursor": page[-1].cursor if more else None})


@router.get("/{session_id}", response_model=SessionOut, summary="One session")
def get_session(session_id: SessionId, owner: Owner, store: Store) -> dict:
    return _out(store.get(session_id, owner=owner))


@router.patch("/{session_id}", response_model=SessionOut, summary="Replace a session's tags, set its time-to-live")
def update_session(body: SessionPatch, session_id: SessionId, owner: Owner, store: Store) -> dict:
    """``tags`` replaces the tags; ``ttl_s`` sets the session's own time-to-live, counted from now
    (null drops it: its owner's applies, if any). An expired session is 404, as a missing one."""
    if body.tags is not None:
        store.set_tags(session_id, body.tags, owner=owner)
    if "ttl_s" in body.model_fields_set:
        store.set_ttl(session_id, body.ttl_s, owner=owner)
    return _out(store.get(session_id, owner=owner))


@router.delete("/{session_id}", status_code=204, response_class=Response, summary="Delete a session and its files")
async def delete_session(session_id: SessionId, owner: Owner, store: Store, gates: Gates) -> Response:
    await gates.call(owner, session_id, store.delete, session_id, owner=owner)
    return Response(status_code=204)


@router.post(
    "/{session_id}/append",
    response_model=AppendOut,
    summary="Append rows (raw record bytes or Arrow)",
    openapi_extra=_BINARY_BODY,
)
async def append_rows(
    request: Request,
    session_id: SessionId,
    *,
    complete_turn: Annotated[bool, Query(description="the rows end a turn: resume will serve them")] = True,
    owner: Owner,
    store: Store,
    settings: AppSettings,
    gates: Gates,
) -> dict:
    """Raw bytes are validated (whole records, tokens in the vocabulary, no corrupt scale or NaN
    code) before anything is written; Arrow rows are encoded into the session's tier. The call
    returns after the rows and the index are both durable.

    NaN and infinite values are stored by the tier's rule (f32 and indexer values become 0; fp8
    stores a NaN as 0 and a row holding an infinity as zeros; int4/polar a row holding either as
    zeros) and counted in ``sanitized``; a server started with ``--reject-nonfinite`` refuses them
    instead (422 ``NonFiniteValues`` naming the count and the first one, nothing written)."""
    kind = require_media_type(request, RAW_MEDIA_TYPE, ARROW_MEDIA_TYPE)
    info = await run_in_threadpool(store.get, session_id, owner=owner)  # 404 before reading a big body
    uploads: UploadBudget = request.app.state.uploads
    # 429 (this session's waiters) or 503 (the service's upload budget) before reading it, too
    async with gates.admitted(owner, session_id) as admission:
        with uploads.holding(declared_bytes(request, settings.max_body_bytes)):
            body = await read_body(request, settings.max_body_bytes)
            if kind == RAW_MEDIA_TYPE:
                result = await admission.call(
                    store.append_records,
                    session_id,
                    body,
                    complete_turn=complete_turn,
                    owner=owner,
                    reject_nonfinite=settings.reject_nonfinite,
                )
            else:
                result = await _append_arrow(body, session_id, info, complete_turn, owner, store, settings, admission)
    return {
        "session": _out(result.info),
        "appended": result.appended,
        "turn": list(result.turn) if result.turn else None,
        "sanitized": result.sanitized.to_dict(),
    }


async def _append_arrow(
    body: bytearray | memoryview,
    session_id: str,
    info: SessionInfo,
    complete_turn: bool,
    owner: str,
    store: StoreInterface,
    settings: Settings,
    admission: Admission,
) -> AppendResult:
    """Encode an Arrow upload in the session's tier a record batch at a time (the rows are never
    copied out of the body), then append the records (a tier a migrate changed since is refused by
    the store's validation, nothing written). Non-finite values are counted as encoded."""
    records, found = await run_in_threadpool(
        lambda: arrow.records_from_stream(body, info.geometry, info.tier, max_decoded_bytes=settings.max_body_bytes)
    )
    if settings.reject_nonfinite:
        refuse_nonfinite(found)
    result = await admission.call(
        store.append_records,
        session_id,
        records,
        complete_turn=complete_turn,
        owner=owner,
        reject_nonfinite=settings.reject_nonfinite,
    )
    return dataclasses.replace(result, sanitized=found)  # the store found them zeroed already


def _expected(info, params: dict[str, str | None], tier: Tier | None, geometry: str | None) -> Fingerprint | None:
    """The fingerprint the client states: the session's own, with the fields the client gave."""
    given = {name: value for name, value in params.items() if value is not None}
    if not given and tier is None and geometry is None:
        return None
    model = dataclasses.replace(info.model, **given)
    expected_geometry = info.geometry
    if geometry is not None:
        words = geometry.split(",")
        if len(words) != 6 or not all(w.strip().isdigit() and len(w.strip()) <= 10 for w in words):
            raise InvalidRequest(
                "geometry is six comma-separated non-negative integers (n_layers,kv_lora,qk_rope,index_hd,nic,vocab)"
            )
        expected_geometry = Geometry(*(int(w) for w in words))
    return Fingerprint(ModelInfo.from_dict(model.to_dict()), expected_geometry, tier if tier is not None else info.tier)


def _old_tier_spelling(tier: Tier) -> str:
    """``v2``, ``v3:int4:4``: the ``X-KV-Tier`` value of earlier releases (``X-KV-Tier-Name`` has the name)."""
    if tier.version != 3:
        return f"v{tier.version}"
    return f"v3:{tier.codec_name}:{tier.bits}"


async def _drain(reader: Reader, chunks):
    """Yield ``chunks`` (a blocking iterator) from a worker thread; the reader closes when done or cut off."""
    iterator = iter(chunks)
    sentinel = object()
    try:
        while True:
            chunk = await run_in_threadpool(next, iterator, sentinel)
            if chunk is sentinel:
                return
            yield chunk
    finally:
        reader.close()


@router.get(
    "/{session_id}/resume",
    summary="Download the rows to restore, trimmed to the watermark",
    response_class=Response,
    responses=_BINARY_RESPONSE,
)
async def resume(
    request: Request,
    session_id: SessionId,
    *,
    format: Annotated[
        Literal["raw", "arrow", "coli_kv"] | None, Query(description="default: from Accept, else raw")
    ] = None,
    verify: Annotated[bool, Query(description="re-hash the turns first; damage is a miss, never served")] = False,
    model_name: Annotated[str | None, Query(max_length=256)] = None,
    model_revision: Annotated[str | None, Query(max_length=256)] = None,
    weights_hash: Annotated[str | None, Query(max_length=256)] = None,
    tokenizer_hash: Annotated[str | None, Query(max_length=256)] = None,
    chat_template_hash: Annotated[str | None, Query(max_length=256)] = None,
    attention_variant: Annotated[str | None, Query(max_length=256)] = None,
    tier: Annotated[
        str | None,
        Query(min_length=1, max_length=MAX_TIER_CHARS, description=f"expected tier: {', '.join(SESSION_TIERS)}"),
    ] = None,
    geometry: Annotated[
        str | None, Query(max_length=80, description="expected n_layers,kv_lora,qk_rope,index_hd,nic,vocab")
    ] = None,
    override: Annotated[
        str | None, Query(max_length=512, description="comma-separated fields not to compare, e.g. model.weights_hash")
    ] = None,
    owner: Owner,
    store: Store,
    settings: AppSettings,
    gates: Gates,
) -> Response:
    """Fingerprint fields given as query parameters are compared with the session's; a difference
    is refused (409) naming the field, unless listed in ``override``."""
    if format is None:
        accept = request.headers.get("accept", "")
        format = "arrow" if ARROW_MEDIA_TYPE in accept else "coli_kv" if COLI_KV_MEDIA_TYPE in accept else "raw"
    info = await run_in_threadpool(store.get, session_id, owner=owner)
    expected_tier, note = read_tier(tier) if tier is not None else (None, None)
    expect = _expected(
        info,
        {
            "name": model_name,
            "revision": model_revision,
            "weights_hash": weights_hash,
            "tokenizer_hash": tokenizer_hash,
            "chat_template_hash": chat_template_hash,
            "attention_variant": attention_variant,
        },
        expected_tier,
        geometry,
    )
    skip = [field.strip() for field in (override or "").split(",") if field.strip()]
    reader = await gates.call(
        owner,
        session_id,
        lambda: store.reader(session_id, owner=owner, verify=verify, expect=expect, override=skip),
        exclusive=False,
    )
    try:
        headers = {
            "X-KV-Reused-Tokens": str(reader.reused_tokens),
            "X-KV-Records": str(reader.n_records),
            "X-KV-Record-Bytes": str(reader.record_bytes),
            "X-KV-Geometry": ",".join(str(w) for w in reader.info.geometry.words()),
            "X-KV-Tier-Name": reader.info.tier.name,
            "X-KV-Tier": _old_tier_spelling(reader.info.tier),
            "X-KV-Verified": "true" if reader.verified else "false",
            **deprecation_headers(note),
        }
        if reader.damaged_from is not None:
            headers["X-KV-Damaged-From"] = str(reader.damaged_from)
        chunk_bytes = settings.stream_chunk_bytes
        if format == "raw":
            headers["Content-Length"] = str(reader.body_bytes)
            body = _drain(reader, reader.iter_bytes(chunk_bytes))
            media = RAW_MEDIA_TYPE
        elif format == "coli_kv":
            headers["Content-Length"] = str(coli_kv.HEADER_BYTES + reader.body_bytes)
            headers["Content-Disposition"] = f'attachment; filename="{session_id}.coli_kv"'
            body = _drain(reader, _with_header(reader, chunk_bytes))
            media = COLI_KV_MEDIA_TYPE
        else:
            batches = reader.iter_batches(ARROW_BATCH_RECORDS)
            body = _drain(reader, arrow.stream_messages(reader.info.geometry, reader.info.tier, batches))
            media = ARROW_MEDIA_TYPE
    except BaseException:
        reader.close()
        raise
    # the first rows are read before the answer starts (after the header or schema in those formats):
    # a store failing on them (S3 past its retries) answers a typed 503, not a 200 cut short
    body = await _started(body, 1 if format == "raw" else 2)
    return StreamingResponse(body, media_type=media, headers=headers)


async def _started(chunks, n: int):
    """The first ``n`` items of the async iterator ``chunks`` taken now (an error raises here, and
    ``_drain`` has closed the reader), then the rest as the response asks for them."""
    first = []
    for _ in range(n):
        try:
            first.append(await chunks.__anext__())
        except StopAsyncIteration:
            break

    async def joined():
        try:
            for chunk in first:
                yield chunk
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    return joined()


def _with_header(reader: Reader, chunk_bytes: int):
    yield reader.header_bytes()
    yield from reader.iter_bytes(chunk_bytes)


@router.post("/{session_id}/truncate", response_model=SessionOut, summary="Keep the first n records")
async def truncate(body: TruncateIn, session_id: SessionId, owner: Owner, store: Store, gates: Gates) -> dict:
    return _out(await gates.call(owner, session_id, store.truncate, session_id, body.n_records, owner=owner))


@router.post("/{session_id}/fork", status_code=201, response_model=SessionOut, summary="A new session sharing a prefix")
async def fork(body: ForkIn, session_id: SessionId, owner: Owner, store: Store, gates: Gates) -> dict:
    # a reader of the source (its appends go on meanwhile); the new id is the store's to lock
    info = await gates.call(
        owner,
        session_id,
        store.fork,
        session_id,
        at=body.at,
        new_id=body.id,
        owner=owner,
        tags=body.tags,
        exclusive=False,
    )
    return _out(info)


@router.get("/{session_id}/verify", response_model=VerifyOut, summary="Re-hash every turn; report the first bad one")
async def verify_session(session_id: SessionId, owner: Owner, store: Store, gates: Gates) -> dict:
    report = await gates.call(owner, session_id, store.verify, session_id, owner=owner, exclusive=False)
    return report.to_dict()


@router.post("/{session_id}/park", status_code=202, response_model=JobOut, summary="Compress into the archive (a job)")
def park(session_id: SessionId, owner: Owner, store: Store, jobs: Jobs) -> dict:
    store.get(session_id, owner=owner)  # 404 now, not as a failed job
    job = jobs.submit(
        owner, "park", session_id, lambda progress: _out(store.park(session_id, owner=owner, progress=progress))
    )
    return job.to_dict()


@router.post("/{session_id}/unpark", status_code=202, response_model=JobOut, summary="Restore from the archive (a job)")
def unpark(session_id: SessionId, owner: Owner, store: Store, jobs: Jobs) -> dict:
    store.get(session_id, owner=owner)
    job = jobs.submit(
        owner, "unpark", session_id, lambda progress: _out(store.unpark(session_id, owner=owner, progress=progress))
    )
    return job.to_dict()
