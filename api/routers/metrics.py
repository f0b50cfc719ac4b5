"""``GET /metrics``: Prometheus text-format counters of generation and reuse, and the store's disk use.

Served **without credentials**, like ``/health``: a scraper usually has no API key, and the page
holds process-wide totals only — no session id, owner, token or text appears in it. Counters start
at 0 when the process starts (Prometheus handles the reset).

=========================================== ==========================================================
``kvstore_generate_requests_total{outcome}`` generate calls, ``ok`` or ``error``
``kvstore_generate_errors_total{error}``     failed calls by error type (``FingerprintMismatch``, ...)
``kvstore_prefilled_tokens_total``           context tokens run through the model (the new turns)
``kvstore_reused_tokens_total``              context tokens whose stored rows were reused
``kvstore_generated_tokens_total``           tokens generated
``kvstore_restores_total{source}``           turns by where the reused rows came from: ``live`` cache,
                                             ``journal`` (restored) or ``new`` (nothing stored)
``kvstore_restored_tokens_total``            rows read from journals into the cache
``kvstore_appended_records_total``           records appended by generate calls
``kvstore_turns_cancelled_total``            streams the client left early
``kvstore_store_used_bytes`` (gauge)         journal + archive bytes; also ``reserved``, ``budget``
                                             and ``hard_limit`` (when set)
``kvstore_engine_loaded`` (gauge)            1 when the server runs with ``--model``
=========================================== ==========================================================
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from kvstore.api.dependencies import Store, get_metrics
from kvstore.api.json_body import StrictJSONRoute

router = APIRouter(tags=["metrics"], route_class=StrictJSONRoute)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help, the label sets shown even at 0)
FAMILIES: dict[str, tuple[str, str, list[dict[str, str]]]] = {
    "kvstore_generate_requests_total": (
        "counter",
        "Generate calls by outcome.",
        [{"outcome": "ok"}, {"outcome": "error"}],
    ),
    "kvstore_generate_errors_total": ("counter", "Failed generate calls by error type.", []),
    "kvstore_prefilled_tokens_total": ("counter", "Context tokens run through the model by generate calls.", [{}]),
    "kvstore_reused_tokens_total": (
        "counter",
        "Context tokens whose stored rows generate calls reused (not prefilled).",
        [{}],
    ),
    "kvstore_generated_tokens_total": ("counter", "Tokens generated.", [{}]),
    "kvstore_restores_total": (
        "counter",
        "Generate calls by where the reused rows came from.",
        [{"source": "live"}, {"source": "journal"}, {"source": "new"}],
    ),
    "kvstore_restored_tokens_total": ("counter", "Rows read from session journals into the engine's cache.", [{}]),
    "kvstore_appended_records_total": ("counter", "Records appended to sessions by generate calls.", [{}]),
    "kvstore_turns_cancelled_total": ("counter", "Streamed turns the client left before the end.", [{}]),
}


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


class Metrics:
    """Process-wide counters (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple], float] = defaultdict(float)

    def add(self, name: str, value: float = 1, **labels: str) -> None:
        if name not in FAMILIES:
            raise KeyError(f"unknown metric {name}")
        with self._lock:
            self._values[(name, tuple(sorted(labels.items())))] += value

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))), 0.0)

    def record_turn(self, result) -> None:
        """Count one finished turn (a :class:`kvstore.engine.session.TurnResult`)."""
        self.add("kvstore_generate_requests_total", outcome="ok")
        self.add("kvstore_prefilled_tokens_total", result.prefilled_tokens)
        self.add("kvstore_reused_tokens_total", result.reused_tokens)
        self.add("kvstore_generated_tokens_total", len(result.tokens))
        self.add("kvstore_restores_total", source=result.source)
        self.add("kvstore_restored_tokens_total", result.restored_tokens)
        self.add("kvstore_appended_records_total", result.appended)
        if result.finish_reason == "cancelled":
            self.add("kvstore_turns_cancelled_total")

    def record_failure(self, error: str) -> None:
        self.add("kvstore_generate_requests_total", outcome="error")
        self.add("kvstore_generate_errors_total", error=error)

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """The exposition text: every counter family (declared label sets at 0 included), then ``gauges``."""
        with self._lock:
            values = dict(self._values)
        lines = []
        for name, (kind, text, shown) in FAMILIES.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            series = {tuple(sorted(labels.items())): 0.0 for labels in shown}
            series.update({labels: v for (n, labels), v in values.items() if n == name})
            for labels, v in sorted(series.items()):
                lines.append(f"{name}{_labels(dict(labels))} {v:g}")
        for name, (text, v) in gauges.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {v:g}"]
        return "\n".join(lines) + "\n"


Counters = Annotated[Metrics, Depends(get_metrics)]


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (no credentials; totals only)")
async def metrics(request: Request, store: Store, counters: Counters) -> PlainTextResponse:
    usage = await run_in_threadpool(store.usage)
    gauges = {
        "kvstore_store_used_bytes": ("Bytes the store holds (journals and archives).", usage["used_bytes"]),
        "kvstore_store_reserved_bytes": ("Bytes reserved by writers in progress.", usage["reserved_bytes"]),
        "kvstore_engine_loaded": (
            "1 when the service runs a model (kvstore serve --model).",
            1 if getattr(request.app.state, "engine", None) else 0,
        ),
    }
    if usage["budget_bytes"] is not None:
        gauges["kvstore_store_budget_bytes"] = ("The soft disk budget (LRU eviction above it).", usage["budget_bytes"])
    if usage["hard_limit_bytes"] is not None:
        gauges["kvstore_store_hard_limit_bytes"] = (
            "The hard disk limit (writes past it are refused).",
            usage["hard_limit_bytes"],
        )
    return PlainTextResponse(counters.render(gauges), media_type=CONTENT_TYPE)
