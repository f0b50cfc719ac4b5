"""``GET /metrics``: the service's Prometheus metrics, through ``prometheus_client``.

Served **without credentials**, like ``/health``: a scraper usually has no API key, and the page
holds process-wide totals only — no label carries a session id, an owner, a key, a token or text
(an owner label would tell anyone who uses the service and how much). Counters start at 0 when the
process starts (Prometheus handles the reset). Each app has its own registry (:class:`Metrics`), so
several apps in one process never share or clash.

Generation (``kvstore serve --model``), counted by the generate route:

============================================== =======================================================
``kvstore_generate_requests_total{outcome}``   generate calls, ``ok`` or ``error``
``kvstore_generate_errors_total{error}``       failed calls by error type (``FingerprintMismatch``, ...)
``kvstore_prefilled_tokens_total``             context tokens run through the model (the new turns)
``kvstore_reused_tokens_total``                context tokens whose stored rows were reused
``kvstore_generated_tokens_total``             tokens generated
``kvstore_restores_total{source}``             turns by where the reused rows came from: ``live``
                                               (resident), ``host`` (the host tier), ``journal`` /
                                               ``shared`` (restored from the store) or ``new``
``kvstore_restored_tokens_total``              rows brought in (host tier, journal, shared store)
``kvstore_appended_records_total``             records appended by generate calls
``kvstore_turns_cancelled_total``              turns whose client left before the end
``kvstore_turn_seconds{phase}`` (histogram)    seconds of a turn's ``restore``, ``prefill``, ``decode``,
                                               ``generate`` (submission to last token) and ``append``
``kvstore_engine_loaded`` (gauge)              1 when the server runs with ``--model``
``kvstore_scheduler_turns{phase}`` (gauge)     turns in the scheduler: ``prefill``, ``ready`` (waiting for
                                               a decode slot) and ``decode`` (in the batch)
``kvstore_scheduler_in_flight`` (gauge)        turns begun and not ended (queued included)
``kvstore_scheduler_steps_total``              scheduler steps (each: a prefill chunk, a batched step)
``kvstore_scheduler_tokens_total``             tokens the batched steps sampled
``kvstore_scheduler_prefill_forwards_total``   prefill forwards (each packs chunks of several prompts)
``kvstore_scheduler_step_prompts_total``       prompts that ran inside a decode step (``--step-tokens``)
``kvstore_scheduler_seconds_total{phase}``     seconds in ``prefill`` forwards and in ``decode`` steps
``kvstore_scheduler_preempted_total``          turns paused to give an owner with nothing decoding a slot
``kvstore_scheduler_refused_total``            turns refused with 429 (an owner's or the server's limit)
``kvstore_scheduler_arena_rows`` (gauge)       rows of the decode arena (``--arena-rows``, or grown past)
``kvstore_scheduler_arena_growths_total``      times the arena grew: each a slow step for every turn
``kvstore_pool_sessions{where}`` (gauge)       resident sessions on the ``device`` and the ``host`` tier
``kvstore_pool_bytes{where}`` (gauge)          their bytes; ``kvstore_pool_budget_bytes{where}`` the budgets
``kvstore_pool_evictions_total{to}``           sessions leaving the device: ``host`` or ``dropped``
============================================== =======================================================

The store (read from :class:`kvstore.store.stats.StoreStats` and the index at each scrape; the
index's counts are kept by every write, so a scrape reads a few keys whatever the store holds):

============================================== =======================================================
``kvstore_lookups_total``                      prefix lookups answered; ``kvstore_lookup_hits_total``
                                               + ``kvstore_lookup_misses_total`` equals it
``kvstore_restore_bytes`` (histogram)          record bytes read per restore (resume, download, turn)
``kvstore_restore_seconds`` (histogram)        seconds per restore (open, unpark, verify and reads)
``kvstore_append_seconds`` (histogram)         seconds per acknowledged append (fsyncs and commit)
``kvstore_lock_waits_total``                   calls that found their session busy and waited for it
``kvstore_lock_timeouts_total``                of those, the ones that gave up (409 JournalLocked)
``kvstore_evictions_total{action}``            sessions ``parked`` or ``deleted`` by the soft budget
``kvstore_evicted_bytes_total``                bytes those evictions freed
``kvstore_expired_sessions_total``             sessions the expiry sweep deleted (their time-to-live ran out)
``kvstore_expired_bytes_total``                bytes those deletions freed
``kvstore_store_used_bytes`` (gauge)           journal + archive bytes; also ``reserved``, ``budget``
                                               and ``hard_limit`` (when set)
``kvstore_store_tier_bytes{tier}`` (gauge)     journal + archive bytes per tier (``fp8``, ``int4``, ...)
``kvstore_store_tier_sessions{tier}`` (gauge)  sessions per tier
``kvstore_store_sessions{state}`` (gauge)      sessions by state: ``active``, ``parked``, ``damaged``
``kvstore_upload_bytes_held`` (gauge)          bytes of upload bodies held now; ``kvstore_upload_budget_bytes``
                                               bounds it (``--max-inflight-bytes``)
``kvstore_uploads_refused_total``              uploads refused to keep it (503 ``UploadsBusy``)
============================================== =======================================================

Plus the process's own (``process_cpu_seconds_total``, ``process_resident_memory_bytes``,
``process_open_fds``, ...) and ``python_info``.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterator

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from starlette.concurrency import run_in_threadpool

from kvstore.api.dependencies import get_metrics
from kvstore.api.json_body import StrictJSONRoute
from kvstore.store import Store
from kvstore.store.stats import EVICTION_ACTIONS, Distribution

router = APIRouter(tags=["metrics"], route_class=StrictJSONRoute)

RESTORE_SOURCES = ("live", "host", "journal", "shared", "new")
TURN_PHASES = ("restore", "prefill", "decode", "generate", "append")
SCHEDULER_PHASES = ("prefill", "ready", "decode")
# A turn's phases span a millisecond restore to a minute of CPU decoding.
TURN_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """The metrics of one app, on its own :class:`CollectorRegistry`.

    Parameters
    ----------
    state : the app's ``state``; the store, the engine and the session gates are read from it at
        each scrape (the store opens in the lifespan, after this is built)
    """

    def __init__(self, state: Any):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "kvstore_generate_requests", "Generate calls by outcome.", ["outcome"], registry=registry
        )
        self.errors = Counter(
            "kvstore_generate_errors", "Failed generate calls by error type.", ["error"], registry=registry
        )
        self.prefilled = Counter(
            "kvstore_prefilled_tokens", "Context tokens run through the model by generate calls.", registry=registry
        )
        self.reused = Counter(
            "kvstore_reused_tokens",
            "Context tokens whose stored rows generate calls reused (not prefilled).",
            registry=registry,
        )
        self.generated = Counter("kvstore_generated_tokens", "Tokens generated.", registry=registry)
        self.restores = Counter(
            "kvstore_restores", "Generate calls by where the reused rows came from.", ["source"], registry=registry
        )
        self.restored = Counter(
            "kvstore_restored_tokens", "Rows read from session journals into the engine's cache.", registry=registry
        )
        self.appended = Counter(
            "kvstore_appended_records", "Records appended to sessions by generate calls.", registry=registry
        )
        self.cancelled = Counter(
            "kvstore_turns_cancelled", "Streamed turns the client left before the end.", registry=registry
        )
        self.turn_seconds = Histogram(
            "kvstore_turn_seconds",
            "Seconds a generate turn spent per phase.",
            ["phase"],
            buckets=TURN_SECONDS_BUCKETS,
            registry=registry,
        )
        # label sets shown at 0 before anything happened, so dashboards and alerts see the series
        for outcome in ("ok", "error"):
            self.requests.labels(outcome=outcome)
        for source in RESTORE_SOURCES:
            self.restores.labels(source=source)
        for phase in TURN_PHASES:
            self.turn_seconds.labels(phase=phase)
        registry.register(ServiceCollector(state))
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)

    def record_turn(self, result) -> None:
        """Count one finished turn (a :class:`kvstore.engine.session.TurnResult`)."""
        self.requests.labels(outcome="ok").inc()
        self.prefilled.inc(result.prefilled_tokens)
        self.reused.inc(result.reused_tokens)
        self.generated.inc(len(result.tokens))
        self.restores.labels(source=result.source).inc()
        self.restored.inc(result.restored_tokens)
        self.appended.inc(result.appended)
        if result.finish_reason == "cancelled":
            self.cancelled.inc()
        for phase in TURN_PHASES:
            if phase in result.timings:
                self.turn_seconds.labels(phase=phase).observe(result.timings[phase])

    def record_failure(self, error: str) -> None:
        self.requests.labels(outcome="error").inc()
        self.errors.labels(error=error).inc()

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition page and its content type: Prometheus text (0.0.4), or OpenMetrics when
        ``accept`` (the request's Accept header) asks for it. Blocking: the store's index is read."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


def _histogram(name: str, text: str, values: Distribution) -> HistogramMetricFamily:
    buckets = [("+Inf" if bound == float("inf") else repr(float(bound)), n) for bound, n in values.cumulative()]
    return HistogramMetricFamily(name, text, buckets=buckets, sum_value=values.total)


class ServiceCollector:
    """The store's counts and sizes, the engine flag and the service's lock waits, read at each scrape."""

    def __init__(self, state: Any):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        engine_loaded = GaugeMetricFamily(
            "kvstore_engine_loaded", "1 when the service runs a model (kvstore serve --model)."
        )
        engine = getattr(self.state, "engine", None)
        engine_loaded.add_metric([], 1 if engine is not None else 0)
        yield engine_loaded
        if engine is not None:
            yield from _serving(engine)
        uploads = getattr(self.state, "uploads", None)
        if uploads is not None:  # kvstore.api.uploads: the bodies held at once, and the budget
            yield GaugeMetricFamily(
                "kvstore_upload_bytes_held",
                "Bytes of upload bodies held now (being read or decoded).",
                value=uploads.held,
            )
            yield GaugeMetricFamily(
                "kvstore_upload_budget_bytes", "Upload bytes held at once at most (--max-inflight-bytes).",
                value=uploads.budget_bytes,
            )  # fmt: skip
            yield CounterMetricFamily(
                "kvstore_uploads_refused",
                "Uploads refused (503 UploadsBusy) to keep the budget.",
                value=uploads.refused,
            )
        store = getattr(self.state, "store", None)
        if not isinstance(store, Store):  # before the lifespan opened the store
            return
        stats = store.stats.snapshot()
        gates = getattr(self.state, "gates", None)
        # The service waits for busy sessions itself (kvstore.api.session_gates); the store counts
        # the waits of calls that wait in a thread (jobs, eviction's neighbours, the CLI in-process).
        waits = stats.lock_waits + (gates.lock_waits if gates is not None else 0)
        timeouts = stats.lock_timeouts + (gates.lock_timeouts if gates is not None else 0)
        yield CounterMetricFamily("kvstore_lookups", "Prefix lookups answered (hits + misses).", value=stats.lookups)
        yield CounterMetricFamily(
            "kvstore_lookup_hits", "Prefix lookups that found a session sharing a prefix.", value=stats.lookup_hits
        )
        yield CounterMetricFamily(
            "kvstore_lookup_misses", "Prefix lookups that found no session sharing a block.", value=stats.lookup_misses
        )
        yield _histogram("kvstore_restore_bytes", "Record bytes read per session restore.", stats.restore_bytes)
        yield _histogram(
            "kvstore_restore_seconds",
            "Seconds per session restore: open (unpark, verify) and reads.",
            stats.restore_seconds,
        )
        yield _histogram(
            "kvstore_append_seconds",
            "Seconds per acknowledged append (journal fsyncs, index commit).",
            stats.append_seconds,
        )
        yield CounterMetricFamily(
            "kvstore_lock_waits", "Calls that found their session busy and waited for its lock.", value=waits
        )
        yield CounterMetricFamily(
            "kvstore_lock_timeouts", "Calls that gave up waiting for a busy session (JournalLocked).", value=timeouts
        )
        evictions = CounterMetricFamily(
            "kvstore_evictions", "Sessions evicted to keep the soft budget, by action.", labels=["action"]
        )
        for action in EVICTION_ACTIONS:
            evictions.add_metric([action], stats.evictions.get(action, 0))
        yield evictions
        yield CounterMetricFamily("kvstore_evicted_bytes", "Bytes freed by evictions.", value=stats.evicted_bytes)
        yield CounterMetricFamily(
            "kvstore_expired_sessions", "Sessions the expiry sweep deleted (time-to-live ran out).", value=stats.expired
        )
        yield CounterMetricFamily(
            "kvstore_expired_bytes", "Bytes freed by deleting expired sessions.", value=stats.expired_bytes
        )

        usage = store.usage()
        yield GaugeMetricFamily(
            "kvstore_store_used_bytes", "Bytes the store holds (journals and archives).", value=usage["used_bytes"]
        )
        yield GaugeMetricFamily(
            "kvstore_store_reserved_bytes", "Bytes reserved by writers in progress.", value=usage["reserved_bytes"]
        )
        if usage["budget_bytes"] is not None:
            yield GaugeMetricFamily(
                "kvstore_store_budget_bytes",
                "The soft disk budget (LRU eviction above it).",
                value=usage["budget_bytes"],
            )
        if usage["hard_limit_bytes"] is not None:
            yield GaugeMetricFamily(
                "kvstore_store_hard_limit_bytes",
                "The hard disk limit (writes past it are refused).",
                value=usage["hard_limit_bytes"],
            )
        cache = store.cache_counts()  # a replica's segment cache (None: the backend keeps none)
        if cache is not None:
            yield CounterMetricFamily(
                "kvstore_cache_hits", "Segment reads served by the local cache.", value=cache.hits
            )
            yield CounterMetricFamily(
                "kvstore_cache_misses", "Segment reads that went to the object store.", value=cache.misses
            )
            yield CounterMetricFamily(
                "kvstore_cache_damaged",
                "Local copies refused by length or digest (fetched again).",
                value=cache.damaged,
            )
            yield GaugeMetricFamily("kvstore_cache_bytes", "Bytes of the local segment cache.", value=cache.bytes)
            yield GaugeMetricFamily(
                "kvstore_cache_budget_bytes", "Size budget of the local segment cache.", value=cache.budget_bytes
            )
        counts = store.counts()  # kept by the index as it is written: never a scan of the sessions
        tier_bytes = GaugeMetricFamily(
            "kvstore_store_tier_bytes", "Journal and archive bytes of the sessions of each tier.", labels=["tier"]
        )
        tier_sessions = GaugeMetricFamily("kvstore_store_tier_sessions", "Sessions of each tier.", labels=["tier"])
        for tier, entry in counts.by_tier.items():
            tier_bytes.add_metric([tier], entry.bytes)
            tier_sessions.add_metric([tier], entry.sessions)
        yield tier_bytes
        yield tier_sessions
        by_state = GaugeMetricFamily("kvstore_store_sessions", "Sessions by state.", labels=["state"])
        for state, entry in counts.by_state.items():
            by_state.add_metric([state], entry.sessions)
        yield by_state


def _serving(engine) -> Iterator[Metric]:
    """The scheduler's turns and counters and the resident pool (kvstore.engine.session.SessionEngine)."""
    status = engine.scheduler.status()
    turns = GaugeMetricFamily("kvstore_scheduler_turns", "Turns in the scheduler, by phase.", labels=["phase"])
    for phase in SCHEDULER_PHASES:
        turns.add_metric([phase], status[phase])
    yield turns
    yield GaugeMetricFamily("kvstore_scheduler_in_flight", "Turns begun and not ended.", value=status["in_flight"])
    yield CounterMetricFamily("kvstore_scheduler_steps", "Scheduler steps run.", value=status["steps"])
    yield CounterMetricFamily("kvstore_scheduler_tokens", "Tokens sampled by batched steps.", value=status["tokens"])
    yield CounterMetricFamily(
        "kvstore_scheduler_prefill_chunks", "Prompt chunks prefilled.", value=status["prefill_chunks"]
    )
    yield CounterMetricFamily(
        "kvstore_scheduler_prefill_forwards",
        "Prefill forwards run (each packs the chunks of several prompts).",
        value=status["prefill_forwards"],
    )
    yield CounterMetricFamily(
        "kvstore_scheduler_step_prompts", "Prompts run inside a decode step.", value=status["step_prompts"]
    )
    seconds = CounterMetricFamily(
        "kvstore_scheduler_seconds", "Seconds in prefill forwards and in decode steps.", labels=["phase"]
    )
    for phase in ("prefill", "decode"):
        seconds.add_metric([phase], status[f"{phase}_seconds"])
    yield seconds
    yield CounterMetricFamily(
        "kvstore_scheduler_preempted", "Turns paused to give a waiting owner a slot.", value=status["preempted"]
    )
    yield CounterMetricFamily("kvstore_scheduler_refused", "Turns refused (429).", value=status["refused"])
    yield GaugeMetricFamily("kvstore_scheduler_arena_rows", "Rows of the decode arena.", value=status["arena_rows"])
    yield CounterMetricFamily(
        "kvstore_scheduler_arena_growths", "Times the decode arena grew.", value=status["arena_growths"]
    )
    pool = engine.pool.usage()
    sessions = GaugeMetricFamily("kvstore_pool_sessions", "Resident sessions.", labels=["where"])
    held = GaugeMetricFamily("kvstore_pool_bytes", "Bytes of resident sessions.", labels=["where"])
    budget = GaugeMetricFamily("kvstore_pool_budget_bytes", "Budgets of the resident pool.", labels=["where"])
    for where in ("device", "host"):
        sessions.add_metric([where], pool[f"{where}_sessions"])
        held.add_metric([where], pool[f"{where}_bytes"])
        budget.add_metric([where], pool[f"{where}_budget"])
    yield sessions
    yield held
    yield budget
    evictions = CounterMetricFamily("kvstore_pool_evictions", "Sessions leaving the device.", labels=["to"])
    evictions.add_metric(["host"], pool["evicted_to_host"])
    evictions.add_metric(["dropped"], pool["evicted"])
    yield evictions


Counters = Annotated[Metrics, Depends(get_metrics)]


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics (no credentials; totals only)",
    responses={200: {"content": {"text/plain": {}}}},
)
async def metrics(request: Request, counters: Counters) -> Response:
    page, content_type = await run_in_threadpool(counters.render, request.headers.get("accept"))
    return Response(page, media_type=content_type)
