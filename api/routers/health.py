"""``GET /health``: liveness without credentials (reveals no session data)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

import kvstore
from kvstore.api.dependencies import Store
from kvstore.api.schemas import HealthOut

router = APIRouter(prefix="/health", tags=["health"])


@router.get("", response_model=HealthOut, summary="Is the service up")
async def health(store: Store) -> HealthOut:
    version = await run_in_threadpool(store.index.version)
    return HealthOut(status="ok", version=kvstore.__version__, schema_version=version)
