"""``GET /health``: liveness without credentials (reveals no session data); ``HEAD /health`` answers
the same status and headers without the body (``curl -I``)."""

from __future__ import annotations

from fastapi import APIRouter

import kvstore
from kvstore.api.dependencies import Store
from kvstore.api.json_body import StrictJSONRoute
from kvstore.api.schemas import HealthOut

router = APIRouter(prefix="/health", tags=["health"], route_class=StrictJSONRoute)


@router.get("", response_model=HealthOut, summary="Is the service up")
@router.head("", response_model=HealthOut, include_in_schema=False)
async def health(store: Store) -> HealthOut:
    # On the event loop: one LMDB read (MVCC, never waits for a writer) answers faster than a trip
    # through a worker thread, and a liveness check must not queue behind a busy thread pool.
    return HealthOut(status="ok", version=kvstore.__version__, schema_version=store.schema_version())
