"""``POST /lookup``: the caller's session sharing the longest token prefix with a prompt."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from kvstore.api.dependencies import get_store, require_owner
from kvstore.api.schemas import ErrorBody, LookupIn, LookupMatch, LookupOut
from kvstore.sessions import SessionStore

router = APIRouter(
    prefix="/lookup",
    tags=["lookup"],
    responses={400: {"model": ErrorBody}, 401: {"model": ErrorBody}, 413: {"model": ErrorBody}},
)


@router.post("", response_model=LookupOut, summary="Find the session with the longest common token prefix")
async def lookup(body: LookupIn, owner: str = Depends(require_owner), store: SessionStore = Depends(get_store)) -> LookupOut:
    """Sessions match when model, geometry and tier are all equal; the match is capped at the
    session's watermark and is at least one 64-token block (else ``match`` is null)."""
    fingerprint = body.fingerprint()
    found = await run_in_threadpool(store.lookup, owner, fingerprint, body.tokens)
    return LookupOut(match=LookupMatch(**found.to_dict()) if found is not None else None)
