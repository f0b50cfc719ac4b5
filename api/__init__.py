"""kvstore's HTTP service (FastAPI, served by uvicorn): sessions, rows in binary forms, jobs.

``create_app(store_or_settings)`` builds the application; ``kvstore serve`` runs it. The layout
follows FastAPI's "Bigger Applications": ``main.py`` (factory), ``dependencies.py`` (store handle,
auth, bodies), ``routers/*.py`` (one ``APIRouter`` each), ``schemas.py`` (pydantic models),
``errors.py`` (the service's own errors and the HTTP status of every kvstore error),
``tier_fields.py`` (tiers in requests and responses: canonical names, the deprecated forms),
``settings.py`` (configuration, read when built), ``keys.py`` (API keys), ``jobs.py`` (background
jobs), ``arrow.py`` (rows as Arrow IPC), ``json_body.py`` (JSON bodies parsed strictly: a repeated
key is refused).
"""

from __future__ import annotations

import importlib

_LAZY = {"create_app": "kvstore.api.main", "Settings": "kvstore.api.settings"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore.api' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
