"""``POST /lookup``: the caller's session sharing the longest token prefix with a prompt."""

from __future__ import annotations

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from kvstore.api.dependencies import Owner, Store
from kvstore.api.json_body import StrictJSONRoute
from kvstore.api.schemas import ErrorBody, LookupIn, LookupMatch, LookupOut, token_array
from kvstore.api.tier_fields import mark_deprecated

router = APIRouter(
    prefix="/lookup",
    tags=["lookup"],
    route_class=StrictJSONRoute,
    responses={400: {"model": ErrorBody}, 401: {"model": ErrorBody}, 413: {"model": ErrorBody}},
)


@router.post("", response_model=LookupOut, summary="Find the session with the longest common token prefix")
async def lookup(body: LookupIn, response: Response, owner: Owner, store: Store) -> LookupOut:
    """Sessions match when model, geometry and tier are all equal; the match is capped at the
    session's watermark and is at least one 64-token block (else ``match`` is null)."""
    tier, note = body.read_tier()
    tokens = await run_in_threadpool(token_array, body.tokens)
    found = await run_in_threadpool(store.lookup, owner, body.fingerprint(tier), tokens)
    mark_deprecated(response, note)
    # a connector's hot tier learns of a shred here (off the event loop: a shared store asks PostgreSQL)
    destroyed = await run_in_threadpool(store.keys_destroyed_at, owner)
    return LookupOut(match=LookupMatch(**found.to_dict()) if found is not None else None, keys_destroyed_at=destroyed)
