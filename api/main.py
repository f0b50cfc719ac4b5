"""The application factory: ``create_app(store_or_settings)``.

Every error is JSON ``{"error": <type>, "reason": <text>}`` with the HTTP status
``kvstore.api.errors`` maps the error's class to; bodies
over the configured limit are refused (413) before they are read; every route but ``/health``,
``/metrics`` (process totals only), the docs and the console's page (``/``, whose data calls carry
the key) needs an API key (see ``kvstore.api.keys``).
With ``Settings.model_dir`` the bundled engine is loaded at startup and ``POST
/sessions/{id}/generate`` runs turns on it (``kvstore.api.routers.generate``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import kvstore
import kvstore.store
from kvstore import config
from kvstore.api.errors import BodyTooLarge, http_status, retry_after
from kvstore.api.expiry import ExpirySweeper
from kvstore.api.jobs import JobRunner
from kvstore.api.keys import KEYS_FILE, KeyTable, ensure_keys_file
from kvstore.api.replica import IdempotencyKeys, IndexJobs, IndexKeyTable
from kvstore.api.routers import console, files, generate, health, jobs, lookup, metrics, openai, sessions
from kvstore.api.routers.metrics import Metrics
from kvstore.api.session_gates import SessionGates
from kvstore.api.settings import Settings
from kvstore.api.uploads import UploadBudget
from kvstore.crypto.keyring import Keyring, KeyringWatcher
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.store import Store

log = logging.getLogger("kvstore.api")

_HTTP_NAMES = {
    404: "NotFound",
    405: "MethodNotAllowed",
    400: "InvalidRequest",
    413: "BodyTooLarge",
    401: "Unauthorized",
}


def _error(status: int, error: str, reason: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "reason": reason}, status_code=status, headers=headers)


async def _kvstore_error(request: Request, exc: KVStoreError) -> JSONResponse:
    status = http_status(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    wait = retry_after(exc)  # 429 busy, 503 a shared store's server down, 409 another replica's lease
    if wait is not None:
        headers = {"Retry-After": str(wait)}
    if isinstance(exc, BodyTooLarge):
        # the rest of the body is never read: closing stops the server draining it for keep-alive
        headers = {"Connection": "close"}
    return _error(status, type(exc).__name__, exc.reason, headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts = []
    for problem in exc.errors()[:5]:
        where = ".".join(str(p) for p in problem.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {problem.get('msg', 'invalid')}")
    return _error(422, "InvalidRequest", "; ".join(parts) or "the request is not valid")


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    cause = exc.__cause__
    if isinstance(cause, KVStoreError):  # raised while FastAPI read a JSON body (BodyTooLarge)
        return await _kvstore_error(request, cause)
    return _error(
        exc.status_code, _HTTP_NAMES.get(exc.status_code, "HTTPError"), str(exc.detail), getattr(exc, "headers", None)
    )


async def _disconnected(request: Request, exc: ClientDisconnect) -> JSONResponse:
    # The client left mid-body: nothing was written, and nobody is there to read a reply.
    return _error(400, "ClientDisconnect", "the client closed the connection before sending the whole body")


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error(500, "InternalError", f"{type(exc).__name__}: the service failed; see its log")


def _takes_many(schema: dict) -> bool:
    return schema.get("type") == "array" or any(_takes_many(part) for part in schema.get("anyOf", ()))


async def _single_valued_query(request: Request) -> None:
    """Refuse a query parameter the operation takes once but the request repeats (400).

    Starlette would silently keep the last value, so ``?model=a&model=b`` filtered by ``b`` alone.
    Which parameters take a list is read from the service's own OpenAPI schema.
    """
    names = [name for name, _ in request.query_params.multi_items()]
    if len(names) == len(set(names)):
        return
    route = request.scope.get("route")
    operation = (
        request.app.openapi().get("paths", {}).get(getattr(route, "path", None), {}).get(request.method.lower(), {})
    )
    for parameter in operation.get("parameters", ()):
        name = parameter.get("name")
        if parameter.get("in") == "query" and names.count(name) > 1 and not _takes_many(parameter.get("schema", {})):
            raise InvalidRequest(f"query parameter {name!r} is given {names.count(name)} times; it takes one value")


class BodyLimit:
    """Refuse bodies over ``max_bytes``: by Content-Length before reading, else while streaming."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit():
                    return await _error(400, "InvalidRequest", "Content-Length is not a number")(scope, receive, send)
                if int(value) > self.max_bytes:
                    reason = f"the body is {int(value)} bytes; this service accepts at most {self.max_bytes}"
                    return await _error(413, "BodyTooLarge", reason, {"Connection": "close"})(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(f"the body passed {self.max_bytes} bytes, the most this service accepts")
            return message

        await self.app(scope, limited, send)


def open_store(settings: Settings) -> Store:
    """The store the settings name, from the one factory (:func:`kvstore.store.open`): the data
    folder's, or, with ``index_url`` and ``blobs_url``, the shared store this service is a replica
    of (``data_dir`` then holds its segment cache; psycopg and boto3 are imported only then)."""
    limits = {
        "budget_bytes": settings.budget_bytes,
        "hard_limit_bytes": settings.hard_limit_bytes,
        "lock_timeout": settings.lock_timeout,
        "max_sessions_per_owner": settings.max_sessions_per_owner,
    }
    kek = None
    if settings.encrypt or settings.kek_file is not None:  # else the store and KVSTORE_ENCRYPT decide
        from kvstore.crypto import provider_from_settings

        kek = provider_from_settings(settings.kek_file)
    if settings.index_url is not None and settings.blobs_url is not None:  # Settings checks both or neither
        return kvstore.store.open(
            settings.data_dir,
            index_url=settings.index_url,
            blobs_url=settings.blobs_url,
            lease_ttl=settings.lease_ttl,
            cache_bytes=settings.cache_bytes,
            kek=kek,  # the shared store's data keys are in its index; each replica brings the KEK
            **limits,
        )
    return kvstore.store.open(settings.data_dir, map_size=settings.map_size, kek=kek, **limits)


def create_app(
    store_or_settings: Store | Settings | str | os.PathLike | None = None, *, first_key: bool = True
) -> FastAPI:
    """Build the service.

    Parameters
    ----------
    store_or_settings : an open :class:`~kvstore.store.Store` (the caller keeps closing it), or
        :class:`Settings` / a data folder path (the app opens the store at startup, through
        :func:`open_store`, and closes it at shutdown). ``keys.json`` is created in the data folder
        if missing; its fresh key is printed once to stderr.
    first_key : False leaves a missing ``keys.json`` to the caller (``kvstore serve`` creates it,
        and prints its key, only once the server listens); the file is read when it appears.
    """
    if isinstance(store_or_settings, Store):
        given_store: Store | None = store_or_settings
        settings = Settings(data_dir=store_or_settings.data_dir)
    else:
        given_store = None
        if isinstance(store_or_settings, Settings):
            settings = store_or_settings
        else:
            settings = Settings(
                data_dir=Path(store_or_settings) if store_or_settings is not None else Path(config.DATA_DIR.value)
            )
    # a replica of a shared store reads its keys from the index (kvstore keys create --index ...)
    # keys given in KVSTORE_API_KEYS make no keys.json (as `kvstore serve` does)
    created_key = (
        ensure_keys_file(settings.data_dir) if first_key and not settings.shared and not settings.api_keys_env else None
    )
    if created_key is not None:
        print(
            f"kvstore: created {settings.data_dir / KEYS_FILE} with an API key for owner 'default' "
            f"(shown once, keep it): {created_key}",
            file=sys.stderr,
            flush=True,
        )
    keys = (
        IndexKeyTable(settings.api_keys_env) if settings.shared else KeyTable(settings.data_dir, settings.api_keys_env)
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        store = given_store or open_store(settings)
        try:
            if given_store is None and isinstance(keys, IndexKeyTable) and settings.index_url is not None:
                keys.attach(settings.index_url)
            mirror = IndexJobs.of(store) if settings.shared else None  # GET /jobs/{id} through any replica
        except BaseException:
            if given_store is None:
                store.close()
            raise
        for line in store.reconcile_actions:
            log.warning("reconcile: %s", line)
        runner = JobRunner(
            settings.job_workers,
            max_pending=settings.max_jobs,
            max_pending_per_owner=settings.max_jobs_per_owner,
            mirror=mirror,
        )
        app.state.store, app.state.jobs = store, runner
        app.state.engine = None
        if settings.model_dir is not None:
            try:
                app.state.engine = _load_engine(settings, settings.model_dir, store)
            except BaseException:
                runner.shutdown()
                if given_store is None:
                    store.close()
                raise
        sweeper = ExpirySweeper(store, settings.expiry_sweep).start() if settings.expiry_sweep > 0 else None
        watcher = _watch_keyring(store, app.state.engine)  # a shred drops the owner's rows held in memory
        try:
            yield
        finally:
            if watcher is not None:
                watcher.stop()
            if sweeper is not None:
                sweeper.stop()
            if app.state.engine is not None:
                app.state.engine.close()  # the scheduler stops; turns in flight end as cancelled
            runner.shutdown()
            if given_store is None:
                store.close()
            if isinstance(keys, IndexKeyTable):
                keys.close()

    app = FastAPI(
        title="kvstore",
        version=kvstore.__version__,
        description="Resumable LLM conversations: MLA latent KV rows journaled as .coli_kv, indexed, served.",
        lifespan=lifespan,
        docs_url=None,  # served by kvstore.api.routers.console with local Swagger UI files
        redoc_url=None,  # ReDoc would load its script from a CDN
        dependencies=[Depends(_single_valued_query)],
    )
    app.state.settings = settings
    app.state.keys = keys
    app.state.metrics = Metrics(app.state)
    app.state.engine = None
    app.state.gates = SessionGates(settings.lock_timeout, settings.session_waiters)
    app.state.uploads = UploadBudget(settings.max_inflight_bytes or 0)  # bodies held at once (--max-inflight-bytes)
    app.state.big_json = asyncio.Semaphore(1)  # JSON bodies over 64 KiB are parsed one at a time
    # the decorator form: each handler takes the error class it is registered for
    app.exception_handler(KVStoreError)(_kvstore_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(ClientDisconnect)(_disconnected)
    app.exception_handler(Exception)(_unexpected)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.shared:
        app.add_middleware(IdempotencyKeys)
    for module in (health, sessions, files, lookup, jobs, generate, metrics, openai):
        app.include_router(module.router)
    console.install(app)
    app.openapi = lambda: _openapi(app)
    return app


def _load_engine(settings: Settings, model_dir: Path, store: Store):
    """The bundled engine on ``model_dir`` (``settings.model_dir``; weights hash computed once per
    folder, cached)."""
    from kvstore.engine.session import SessionEngine

    threads = (
        settings.torch_threads if settings.torch_threads is not None else (1 if settings.device == "cpu" else None)
    )
    if threads is not None:
        import torch

        # On the CPU torch's worker threads spin after every operation and take the cores the
        # scheduler, the event loop and the turns' readers need between steps (docs/SERVE.md).
        torch.set_num_threads(threads)
    engine = SessionEngine.from_folder(
        model_dir,
        store,
        tier=settings.tier,
        device=settings.device,
        dtype=settings.dtype,
        limits=settings.scheduler_limits(settings.device),
        pool_bytes=settings.pool_bytes,
        host_bytes=settings.host_pool_bytes,
    )
    described = engine.describe()
    log.info(
        "engine: %s (%s) on %s, %s cache (journals %s), weights %s",
        described["folder"],
        described["dtype"],
        described["device"],
        described["cache_tier"],
        described["journal_tier"],
        engine.model.weights_hash,
    )
    return engine


def _watch_keyring(store: Store, engine: object) -> KeyringWatcher | None:
    """An encrypted store's keyring watched (``kvstore.crypto.keyring.KeyringWatcher``): when
    ``kvstore crypto shred`` destroys an owner's keys, the sessions of that owner resident in the
    engine's pool (device or host tier) are dropped within half a second; every later read of the
    owner's files is refused by the keyring itself (docs/SECURITY.md)."""
    keyring = getattr(store, "keyring", None)
    if keyring is None or (not isinstance(keyring, Keyring) and not hasattr(keyring, "on_change")):
        return None  # a plaintext store (a shared store's keyring, kvstore.store.shared.keys, has the same members)

    pool = getattr(engine, "pool", None)  # the SessionEngine's ResidentPool (device and host tiers)

    def forget(owners: set[str]) -> None:
        if pool is not None:
            for resident in pool.resident():
                if resident.key.rsplit("~", 1)[-1] in owners:
                    pool.drop(resident.key)
        for owner in owners:
            log.warning("keyring: the data keys of owner %r were destroyed; its rows held here are dropped", owner)

    keyring.on_change.append(forget)
    return KeyringWatcher(cast(Keyring, keyring)).start()  # it calls refresh() only, which both have


def _openapi(app: FastAPI) -> dict:
    """The generated schema, with validation errors described as the ErrorBody they really are."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        error_ref = {"$ref": "#/components/schemas/ErrorBody"}
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                response = operation.get("responses", {}).get("422")
                if response is not None:
                    response["content"] = {"application/json": {"schema": error_ref}}
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema
