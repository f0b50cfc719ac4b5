"""``/jobs``: progress and results of long work (park, unpark, migrate)."""

from __future__ import annotations

from fastapi import APIRouter

from kvstore.api.dependencies import Jobs, Owner
from kvstore.api.json_body import StrictJSONRoute
from kvstore.api.schemas import ErrorBody, JobOut

router = APIRouter(
    prefix="/jobs",
    tags=["jobs"],
    route_class=StrictJSONRoute,
    responses={401: {"model": ErrorBody}, 404: {"model": ErrorBody}},
)


@router.get("", response_model=list[JobOut], summary="The caller's jobs")
def list_jobs(owner: Owner, jobs: Jobs) -> list[dict]:
    return [job.to_dict() for job in jobs.list(owner)]


@router.get("/{job_id}", response_model=JobOut, summary="One job: state, done/total, result or error")
def get_job(job_id: str, owner: Owner, jobs: Jobs) -> dict:
    return jobs.get(job_id, owner).to_dict()
