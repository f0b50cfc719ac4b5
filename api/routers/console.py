"""The web console (``GET /``) and the API docs served without the internet (``GET /docs``).

The console is static files shipped in the package (``kvstore/api/console``): one HTML page, a
style sheet and JavaScript modules, no build step, nothing fetched from another host. It signs in
with an API key and calls the JSON API like any client. Three small routes under ``/console``
answer what no other route does:

- ``GET /console/me``: the owner the key belongs to (shown as "signed in as");
- ``GET /console/store``: the store's disk use (budget, hard limit) split into live journals and
  the archive tier, store-wide and the caller's own by tier (totals only, no other owner's names):
  the index's counts (``Store.counts``), kept as sessions are written, never a pass over them;
- ``GET /console/activity``: per session of the caller, the resumes, generate calls and verifies
  this process served (the console's "reuse history" and "verify status"). It lives in memory: a
  restart forgets it; the index's ``state``/``problem`` are what survives. It holds at most
  ``SESSIONS_PER_OWNER`` sessions per owner, which one index read checks are still there.

``/docs`` is FastAPI's Swagger UI page pointed at the Swagger UI files of the
``swagger-ui-bundle-v2`` package, served under ``/docs/assets``; the console page and its assets
carry a Content-Security-Policy that allows scripts, styles and requests from this origin only.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.staticfiles import StaticFiles

import kvstore
from kvstore.api.dependencies import Owner, Store, presented_owner
from kvstore.api.json_body import StrictJSONRoute
from kvstore.api.schemas import ARROW_MEDIA_TYPE, COLI_KV_MEDIA_TYPE, RAW_MEDIA_TYPE, ErrorBody

ASSETS = Path(__file__).resolve().parent.parent / "console"
SWAGGER_ASSETS_URL = "/docs/assets"
#: The console's files: name -> media type. Only these are served (no directory listing, no other file).
CONSOLE_FILES = {
    "console.css": "text/css; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "chart.js": "text/javascript; charset=utf-8",
    "dom.js": "text/javascript; charset=utf-8",
    "format.js": "text/javascript; charset=utf-8",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # the page is small and changes with each release: always revalidated, never stale after an upgrade
    "Cache-Control": "no-cache",
}
EVENTS_PER_SESSION = 20
SESSIONS_PER_OWNER = 1000

router = APIRouter(tags=["console"], route_class=StrictJSONRoute)


# ---------------------------------------------------------------------------- the page and its files
def _swagger_ui_folder() -> Path:
    from swagger_ui_bundle import swagger_ui_path  # swagger-ui-bundle-v2: Swagger UI's dist folder

    return Path(str(swagger_ui_path))


@router.get("/", include_in_schema=False)
@router.head("/", include_in_schema=False)  # curl -I http://127.0.0.1:8000/
async def console_page() -> Response:
    return Response((ASSETS / "index.html").read_bytes(), media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)


@router.get("/console/assets/{name}", include_in_schema=False)
async def console_asset(name: str) -> Response:
    media = CONSOLE_FILES.get(name)
    if media is None:
        return Response(
            json.dumps({"error": "NotFound", "reason": f"no console file {name[:80]!r}"}),
            status_code=404,
            media_type="application/json",
        )
    return Response((ASSETS / name).read_bytes(), media_type=media, headers=_PAGE_HEADERS)


@router.get("/docs", include_in_schema=False)
@router.head("/docs", include_in_schema=False)
async def api_docs(request: Request) -> HTMLResponse:
    """Swagger UI from this origin, under the console's Content-Security-Policy: scripts, styles,
    images and requests from this origin only, never framed. The one inline script (the page's
    ``SwaggerUIBundle({...})`` call) is allowed by its SHA-256, computed from the page sent, so no
    other inline script can run."""
    import base64
    import hashlib
    import re

    root = request.scope.get("root_path", "").rstrip("/")
    page = get_swagger_ui_html(
        openapi_url=root + (request.app.openapi_url or "/openapi.json"),
        title=f"{request.app.title} - API docs",
        swagger_js_url=f"{root}{SWAGGER_ASSETS_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{SWAGGER_ASSETS_URL}/swagger-ui.css",
        swagger_favicon_url=f"{root}{SWAGGER_ASSETS_URL}/favicon-32x32.png",
        # Swagger UI would send the schema to an online validator and show its badge
        swagger_ui_parameters={"validatorUrl": None},
    )
    inline = re.findall(rb"<script>(.*?)</script>", bytes(page.body), flags=re.DOTALL)
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(code).digest()).decode()}'" for code in inline)
    policy = CONTENT_SECURITY_POLICY.replace("script-src 'self'", f"script-src 'self' {hashes}".rstrip())
    page.headers.update({**_PAGE_HEADERS, "Content-Security-Policy": policy})
    return page


# ---------------------------------------------------------------------------- what this process served
class Activity:
    """Per owner and session: the last ``EVENTS_PER_SESSION`` resumes, generates and verifies served,
    and the last verify's outcome. In memory, bounded: ``SESSIONS_PER_OWNER`` sessions per owner, the
    least recently active forgotten first. Only the event loop touches it (no lock)."""

    def __init__(self) -> None:
        self._owners: dict[str, OrderedDict[str, dict[str, Any]]] = {}

    def _entry(self, owner: str, session_id: str) -> dict[str, Any]:
        sessions = self._owners.setdefault(owner, OrderedDict())
        entry = sessions.pop(session_id, None) or {"events": deque(maxlen=EVENTS_PER_SESSION), "last_verify": None}
        sessions[session_id] = entry
        while len(sessions) > SESSIONS_PER_OWNER:
            sessions.popitem(last=False)
        return entry

    def add(self, owner: str, session_id: str, event: dict[str, Any]) -> None:
        entry = self._entry(owner, session_id)
        entry["events"].append(event)
        if event.get("verified"):
            entry["last_verify"] = event

    def forget(self, owner: str, session_id: str) -> None:
        self._owners.get(owner, OrderedDict()).pop(session_id, None)

    def of(self, owner: str) -> dict[str, dict[str, Any]]:
        return {
            sid: {"events": list(entry["events"]), "last_verify": entry["last_verify"]}
            for sid, entry in self._owners.get(owner, OrderedDict()).items()
        }


_WATCHED = re.compile(r"^/sessions/([A-Za-z0-9][A-Za-z0-9_-]{0,63})(/resume|/generate|/verify)?$")
_WATCHED_CALLS = {("GET", "/resume"), ("POST", "/generate"), ("GET", "/verify"), ("DELETE", None)}
_VERIFY_BODY_BYTES = 64 << 10
_RESUME_FORMATS = {RAW_MEDIA_TYPE: "raw", ARROW_MEDIA_TYPE: "arrow", COLI_KV_MEDIA_TYPE: "coli_kv"}


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


class ActivityRecorder:
    """ASGI middleware: notes the successful resume, generate, verify and delete calls in :class:`Activity`.

    It reads response headers only (``X-KV-Reused-Tokens``, ``X-KV-Verified``, ...), and for a verify
    the small JSON report; the response passes through unchanged.
    """

    def __init__(self, app, activity: Activity):
        self.app = app
        self.activity = activity

    async def __call__(self, scope, receive, send):
        match = _WATCHED.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or (scope["method"], match.group(2)) not in _WATCHED_CALLS:
            return await self.app(scope, receive, send)
        session_id, call = match.group(1), match.group(2)
        owner: str | None = None
        status = 0
        headers: dict[str, str] = {}
        body = bytearray()

        async def watched_send(message):
            nonlocal owner, status, headers
            if message["type"] == "http.response.start" and message["status"] in (200, 204):
                # the key is looked up again only for calls that succeeded (they had a known key)
                owner = await presented_owner(Request(scope))
                status = message["status"] if owner is not None else 0
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", ())}
                if owner is not None and status == 204 and call is None:
                    self.activity.forget(owner, session_id)
                elif owner is not None and status == 200 and call in ("/resume", "/generate"):
                    self.activity.add(owner, session_id, self._served(call, headers))
            elif message["type"] == "http.response.body" and status == 200 and call == "/verify":
                if len(body) < _VERIFY_BODY_BYTES:
                    body.extend(message.get("body", b""))
                if not message.get("more_body", False) and owner is not None:
                    self._verified(owner, session_id, bytes(body))
            await send(message)

        await self.app(scope, receive, watched_send)

    @staticmethod
    def _served(call: str, headers: dict[str, str]) -> dict[str, Any]:
        event: dict[str, Any] = {
            "kind": call.lstrip("/"),
            "time": time.time(),
            "reused_tokens": _int_or_none(headers.get("x-kv-reused-tokens")),
        }
        if call == "/generate":
            event["prefilled_tokens"] = _int_or_none(headers.get("x-kv-prefilled-tokens"))
            event["source"] = headers.get("x-kv-source")
        else:
            media = headers.get("content-type", "").split(";")[0].strip()
            event["format"] = _RESUME_FORMATS.get(media, media or None)
        if call == "/resume" and headers.get("x-kv-verified") == "true":
            damaged_from = _int_or_none(headers.get("x-kv-damaged-from"))
            event.update(verified=True, ok=damaged_from is None, damaged_from=damaged_from)
        return event

    def _verified(self, owner: str, session_id: str, body: bytes) -> None:
        try:
            report = json.loads(body)
        except ValueError:
            return
        first_bad = report.get("first_bad")
        self.activity.add(
            owner,
            session_id,
            {
                "kind": "verify",
                "time": time.time(),
                "verified": True,
                "ok": bool(report.get("ok")),
                "turns_checked": report.get("turns_checked"),
                "good_records": report.get("good_records"),
                "damaged_from": first_bad.get("start") if isinstance(first_bad, dict) else None,
            },
        )


# ---------------------------------------------------------------------------- the console's JSON routes
class MeOut(BaseModel):
    owner: str
    version: str
    keys_destroyed_at: float | None = Field(
        None,
        description="on a store encrypted at rest, when this owner's data keys were destroyed (`kvstore crypto shred`)",
    )


class BytesCount(BaseModel):
    sessions: int
    bytes: int


class StoreOut(BaseModel):
    used_bytes: int = Field(description="journal + archive bytes the store holds (every owner)")
    reserved_bytes: int = Field(description="bytes reserved by writes in progress")
    budget_bytes: int | None = Field(description="the soft budget (LRU parking, then deletion, above it)")
    hard_limit_bytes: int | None = Field(description="writes past it are refused (507)")
    store: dict[str, BytesCount] = Field(
        description="every owner's sessions by state: active (journals), parked (archive), damaged"
    )
    mine: dict[str, BytesCount] = Field(description="the caller's sessions by state")
    mine_by_tier: dict[str, BytesCount] = Field(description="the caller's sessions by tier name")


class EventOut(BaseModel):
    kind: str = Field(description="resume, generate or verify")
    time: float
    reused_tokens: int | None = None
    prefilled_tokens: int | None = None
    source: str | None = None
    format: str | None = Field(default=None, description="resume: raw, arrow or coli_kv")
    verified: bool | None = None
    ok: bool | None = None
    damaged_from: int | None = None
    turns_checked: int | None = None
    good_records: int | None = None


class SessionActivityOut(BaseModel):
    events: list[EventOut] = Field(description="oldest first")
    last_verify: EventOut | None


class ActivityOut(BaseModel):
    since: float = Field(description="when this process started keeping activity (it is kept in memory)")
    sessions: dict[str, SessionActivityOut]


_JSON_ERRORS: dict[int | str, dict[str, Any]] = {401: {"model": ErrorBody}}


@router.get("/console/me", response_model=MeOut, responses=_JSON_ERRORS, summary="Who the presented key belongs to")
async def me(owner: Owner, store: Store) -> dict:
    destroyed = await run_in_threadpool(store.keys_destroyed_at, owner)  # a shared store asks PostgreSQL
    return {"owner": owner, "version": kvstore.__version__, "keys_destroyed_at": destroyed}


@router.get(
    "/console/store", response_model=StoreOut, responses=_JSON_ERRORS, summary="Disk use: budget, journals, archive"
)
def store_use(owner: Owner, store: Store) -> dict:
    usage = store.usage()
    everyone, mine = store.counts(), store.counts(owner=owner)
    return {
        "used_bytes": usage["used_bytes"],
        "reserved_bytes": usage["reserved_bytes"],
        "budget_bytes": usage["budget_bytes"],
        "hard_limit_bytes": usage["hard_limit_bytes"],
        "store": {state: entry.to_dict() for state, entry in everyone.by_state.items()},
        "mine": {state: entry.to_dict() for state, entry in mine.by_state.items()},
        "mine_by_tier": {tier: entry.to_dict() for tier, entry in mine.by_tier.items()},
    }


@router.get(
    "/console/activity",
    response_model=ActivityOut,
    responses=_JSON_ERRORS,
    summary="Resumes, generates and verifies this process served, per session of the caller",
)
async def activity(request: Request, owner: Owner, store: Store) -> dict:
    recorded = request.app.state.console_activity.of(owner)
    # a session deleted by another process (or the CLI) is dropped here, not shown with old activity;
    # only the sessions recorded (at most SESSIONS_PER_OWNER) are looked up, never the owner's list
    present = await run_in_threadpool(store.existing, list(recorded), owner=owner) if recorded else set()
    return {
        "since": request.app.state.console_started,
        "sessions": {sid: entry for sid, entry in recorded.items() if sid in present},
    }


def install(app: FastAPI) -> None:
    """Serve the console at ``/`` and the docs at ``/docs`` (create the app with ``docs_url=None``)."""
    app.state.console_activity = Activity()
    app.state.console_started = time.time()
    app.include_router(router)
    app.mount(SWAGGER_ASSETS_URL, StaticFiles(directory=_swagger_ui_folder()), name="swagger-ui")
    app.add_middleware(ActivityRecorder, activity=app.state.console_activity)
