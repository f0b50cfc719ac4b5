"""``/sessions/{id}/file``: the session journal's file tools — inspect, repair, migrate."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query

from kvstore.api.dependencies import get_jobs, get_store, require_owner, session_id_param
from kvstore.api.jobs import JobRunner
from kvstore.api.schemas import ErrorBody, JobOut, MigrateIn, RepairOut
from kvstore.sessions import SessionStore

router = APIRouter(
    prefix="/sessions/{session_id}/file",
    tags=["files"],
    responses={status: {"model": ErrorBody} for status in (400, 401, 404, 409, 422, 507)},
)


@router.get("/inspect", response_model=dict[str, Any], summary="Header, sizes and what a loader would neutralize")
def inspect(session_id: str = Depends(session_id_param), owner: str = Depends(require_owner), store: SessionStore = Depends(get_store)) -> dict:
    return store.inspect(session_id, owner=owner)


@router.post("/repair", response_model=RepairOut, summary="Drop torn, unacknowledged or damaged tails")
def repair(
    session_id: str = Depends(session_id_param),
    dry_run: bool = Query(default=False, description="report what would be done, change nothing"),
    owner: str = Depends(require_owner),
    store: SessionStore = Depends(get_store),
) -> dict:
    return store.repair(session_id, owner=owner, dry_run=dry_run).to_dict()


@router.post("/migrate", status_code=202, response_model=JobOut, summary="Convert the journal to another tier (a job)")
def migrate(
    body: MigrateIn,
    session_id: str = Depends(session_id_param),
    owner: str = Depends(require_owner),
    store: SessionStore = Depends(get_store),
    jobs: JobRunner = Depends(get_jobs),
) -> dict:
    """Lossy unless the target is v1. The turns are verified first; a damaged session fails the
    job with IntegrityError (repair it first)."""
    tier = body.to_tier()
    store.get(session_id, owner=owner)
    job = jobs.submit(
        owner, "migrate", session_id, lambda progress: store.migrate(session_id, tier, owner=owner, progress=progress).to_dict()
    )
    return job.to_dict()
