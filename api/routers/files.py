"""``/sessions/{id}/file``: the session journal's file tools — inspect, repair, migrate."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from kvstore.api.dependencies import Gates, Jobs, Owner, SessionId, Store
from kvstore.api.json_body import StrictJSONRoute
from kvstore.api.schemas import ErrorBody, JobOut, MigrateIn, RepairOut
from kvstore.api.tier_fields import mark_deprecated

router = APIRouter(
    prefix="/sessions/{session_id}/file",
    tags=["files"],
    route_class=StrictJSONRoute,
    responses={status: {"model": ErrorBody} for status in (400, 401, 404, 409, 413, 422, 429, 507)},
)


@router.get("/inspect", response_model=dict[str, Any], summary="Header, sizes and what a loader would neutralize")
async def inspect(session_id: SessionId, owner: Owner, store: Store, gates: Gates) -> dict:
    return await gates.call(owner, session_id, store.inspect, session_id, owner=owner, exclusive=False)


@router.post("/repair", response_model=RepairOut, summary="Drop torn, unacknowledged or damaged tails")
async def repair(
    session_id: SessionId,
    *,
    dry_run: Annotated[bool, Query(description="report what would be done, change nothing")] = False,
    owner: Owner,
    store: Store,
    gates: Gates,
) -> dict:
    report = await gates.call(owner, session_id, store.repair, session_id, owner=owner, dry_run=dry_run)
    return report.to_dict()


@router.post("/migrate", status_code=202, response_model=JobOut, summary="Convert the journal to another tier (a job)")
def migrate(body: MigrateIn, response: Response, session_id: SessionId, owner: Owner, store: Store, jobs: Jobs) -> dict:
    """``{"tier": "int4"}``: lossy unless the target is ``f32``. The turns are verified first; a
    damaged session fails the job with IntegrityError (repair it first)."""
    tier, note = body.read_tier()
    info = store.get(session_id, owner=owner)

    def work(progress):
        return store.migrate(session_id, tier, owner=owner, progress=progress).to_dict()

    # migrate counts records: its progress in bytes is of the journal it reads
    job = jobs.submit(owner, "migrate", session_id, work, bytes_per_unit=info.record_bytes)
    mark_deprecated(response, note)
    return job.to_dict()
