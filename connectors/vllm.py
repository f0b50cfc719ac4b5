"""kvstore as a vLLM KV connector (``KVConnectorBase_V1``, vLLM 0.32; the API is experimental).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.connectors.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store": "/var/lib/kvstore"}}'

For an MLA model vLLM's paged cache is ``[blocks, block_size, kv_lora + qk_rope]`` per layer:
one ``.coli_kv`` row per token. The scheduler side asks the store for the longest stored prefix of
each new prompt (:class:`~kvstore.connectors.prefix_cache.PrefixCache`; whole vLLM blocks, at
least one prompt token left to compute) and plans the load; the worker side
(:class:`~kvstore.connectors.vllm_worker.PagedWorker`, which needs no vLLM) writes the stored rows
into the request's blocks before the forward pass, and gathers each prompt's rows, layer by
layer, in the step that completes its prefill, then hands them to a background writer
(:class:`~kvstore.connectors.save_writer.SaveWriter`: encoding, writing and fsync off the step; a
full queue skips the save, counted in ``save_skipped``) that saves them as one session; when the
request finishes, the whole conversation so far (prompt and generated tokens) is saved too, and the
request is reported finished only once that save is settled, so a next turn that continues it loads
the previous answer's rows as well. A load that fails
(missing, damaged, another fingerprint) marks its blocks through
:meth:`KVStoreConnector.get_block_ids_with_load_errors`, so vLLM recomputes them
(``kv_load_failure_policy: "recompute"``) rather than attend to wrong KV. The worker keeps the rows it
recently loaded or saved in a hot tier in host memory (``hot_bytes``,
:mod:`~kvstore.connectors.hot_tier`), shared by its requests: a load of those is a memory copy.

The counters reach vLLM's own metrics (``get_kv_connector_stats``: the ``vllm:kvstore_*`` counters
of its Prometheus ``/metrics`` and its periodic "KV Transfer metrics" log line). The store is a
folder every vLLM process on the machine may share (``store``: embedded mode) or a running
``kvstore serve`` (``url`` and an API key: service mode, shared across machines). See docs/VLLM.md.

On vLLM's CPU platform, loads are exact only with vLLM's torch rotary op
(``compilation_config={"custom_ops": ["-rotary_embedding"]}``): vLLM CPU's own rotary kernel ignores
the token stride of MLA's rope key (a strided view), so the rows a prefill computes depend on how the
prompt was chunked, and a process that loads a prefix then computes the rest gets other rows than
one that computes it all. The connector warns at start when that kernel is on.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # pyright: ignore[reportMissingImports]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # pyright: ignore[reportMissingImports]
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvstore.connectors.hot_tier import HotTier
from kvstore.connectors.prefix_cache import CacheConfig, PrefixCache, model_fingerprint, open_client
from kvstore.connectors.prefix_cache import sampled_weights_hash as _sampled_weights_hash
from kvstore.connectors.save_writer import SaveWriter
from kvstore.connectors.vllm_worker import LoadSpec, PagedWorker, SaveSpec
from kvstore.errors import ConfigError
from kvstore.formats.coli_kv import Geometry

if TYPE_CHECKING:
    from vllm.config import VllmConfig  # pyright: ignore[reportMissingImports]

logger = logging.getLogger(__name__)

# What the rows are: vLLM's MLA cache entries (normed latent, then the roped key as vLLM's rope
# lays it out), in the engine's cache dtype. The bundled engine records "transformers-latent".
ATTENTION_VARIANT = "vllm-mla"
# The counters handed to vLLM's metrics (CacheStats' numeric fields); each side reports its own.
COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "refused",
    "matched_tokens",
    "loads",
    "loaded_tokens",
    "load_errors",
    "quarantined",
    "saves",
    "saved_tokens",
    "save_errors",
    "save_skipped",
    "hot_hits",
    "hot_misses",
    "hot_evictions",
)


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # finished requests whose conversation (prompt + generated tokens) is saved this step; vLLM
    # keeps their blocks until the worker reports them through get_finished
    finished: list[SaveSpec] = field(default_factory=list)


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Increments of the connector's counters since the last report (``data``: name -> count);
    the scheduler's and the workers' add up."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVStoreConnectorStats":
        for name, count in other.data.items():
            self.data[name] = self.data.get(name, 0) + count
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The counters as Prometheus counters ``vllm:kvstore_<name>_total`` of vLLM's ``/metrics``."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:kvstore_{name}",
                documentation=f"kvstore connector: {name.replace('_', ' ')} (docs/VLLM.md)",
                labelnames=labelnames,
            )
            for name in COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, count in transfer_stats_data.items():
            if name in self._counters and count:
                self._counters[name].labels(*labels).inc(count)


@dataclass
class _Tracked:
    """A running request, scheduler side: its prompt and blocks, until its prefill is saved."""

    prompt: list[int]
    block_ids: list[int]
    stored_tokens: int  # the stored prefix the lookup found (0: none)
    saved: bool = False


def _geometry(vllm_config: "VllmConfig") -> Geometry:
    hf = vllm_config.model_config.hf_text_config
    kv_lora = getattr(hf, "kv_lora_rank", None)
    qk_rope = getattr(hf, "qk_rope_head_dim", None)
    if not vllm_config.model_config.use_mla or not kv_lora or not qk_rope:
        raise ConfigError("the kvstore connector stores MLA latent rows: the model must use MLA (DeepSeek-V2/V3 style)")
    return Geometry(int(hf.num_hidden_layers), int(kv_lora), int(qk_rope), 0, 0, int(hf.vocab_size))


# What docs/VLLM.md asks CPU users to set: vLLM's torch rotary op instead of its CPU kernel.
TORCH_ROTARY = {"custom_ops": ["-rotary_embedding"]}


def cpu_rotary_kernel_on(vllm_config: Any) -> bool:
    """Whether vLLM runs on its CPU platform with its own rotary kernel (custom op ``rotary_embedding``
    on, as ``CustomOp.enabled`` decides it): that kernel ignores the rope key's token stride, so
    loaded and computed rows disagree (docs/VLLM.md)."""
    try:
        from vllm.platforms import current_platform  # pyright: ignore[reportMissingImports]
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    ops = list(getattr(vllm_config.compilation_config, "custom_ops", None) or [])
    if "-rotary_embedding" in ops:
        return False
    return "+rotary_embedding" in ops or "none" not in ops


class KVStoreConnector(KVConnectorBase_V1):
    """Stores prompts' MLA rows in a kvstore and loads the longest stored prefix into vLLM's cache."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = CacheConfig.from_extra(transfer.kv_connector_extra_config)
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning(
                "kvstore connector: kv_load_failure_policy is %r; with 'recompute' a failed load is recomputed "
                "instead of failing the request",
                transfer.kv_load_failure_policy,
            )
        if cpu_rotary_kernel_on(vllm_config):
            logger.warning(
                "kvstore connector: vLLM's CPU rotary kernel is on; it ignores the rope key's stride, so rows "
                "loaded from the store differ from the rows this process would compute and generated tokens "
                "can differ. Set compilation_config=%s (vLLM's torch rotary op) for exact loads (docs/VLLM.md)",
                json.dumps(TORCH_ROTARY),
            )
        self.block_size = vllm_config.cache_config.block_size
        self.geometry = _geometry(vllm_config)
        model = vllm_config.model_config
        weights = self.config.weights_hash or _sampled_weights_hash(model.model)
        self.cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if self.cache_dtype == "auto":
            self.cache_dtype = str(model.dtype).removeprefix("torch.")
        fingerprint = model_fingerprint(
            name=self.config.model_name or str(model.model),
            revision=self.config.revision or model.revision or "main",
            geometry=self.geometry,
            tier=self.config.tier_for(self.cache_dtype),
            attention_variant=f"{ATTENTION_VARIANT}:{self.cache_dtype}",
            weights_hash=weights,
        )
        role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        stats_path = None
        if self.config.stats_dir:
            stats_path = Path(self.config.stats_dir) / f"{role_name}-{os.getpid()}.json"
        # the worker loads and saves: its requests share one hot tier (the scheduler only looks up)
        hot = HotTier(self.config.hot_bytes) if role != KVConnectorRole.SCHEDULER and self.config.hot_bytes else None
        self.cache = PrefixCache(
            open_client(self.config),
            None,
            fingerprint,
            verify=self.config.verify,
            min_tokens=self.config.min_tokens,
            stats_path=stats_path,
            hot=hot,
        )
        # scheduler side
        self._planned: dict[str, tuple[str, int, int]] = {}  # req -> (session, start, stop), lookup done
        self._tracked: dict[str, _Tracked] = {}
        self._to_load: dict[str, LoadSpec] = {}
        self._finished_saves: list[SaveSpec] = []
        self._reported: dict[str, int] = {}  # the counters at the last get_kv_connector_stats
        # worker side (encoding, writing and fsync off the step; save_queue 0: in the step)
        writer = None
        if role != KVConnectorRole.SCHEDULER and self.config.save_queue > 0:
            writer = SaveWriter(self.cache, self.config.save_queue)
        self.worker = PagedWorker(self.cache, self.geometry, self.block_size, writer)
        logger.info(
            "kvstore connector (%s): store %s, owner %s, tier %s, fingerprint %s",
            role_name,
            self.config.store or self.config.url,
            self.cache.owner,
            self.cache.fingerprint.tier.name,
            fingerprint.key()[:16],
        )

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self._planned.get(request.request_id)
        if plan is None:  # vLLM may ask again for the same request: one lookup, one count
            prompt = list(request.prompt_token_ids or [])
            found = self.cache.lookup(prompt)
            # whole blocks only, and at least one prompt token left for vLLM to compute
            usable = min(found.tokens, len(prompt) - 1) if found is not None else 0
            usable -= usable % self.block_size
            plan = (found.session_id if found is not None else "", num_computed_tokens, usable)
            self._planned[request.request_id] = plan
        _, _, usable = plan
        return max(usable - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        session_id, _, usable = self._planned[request.request_id]
        start = usable - num_external_tokens
        self._to_load[request.request_id] = LoadSpec(request.request_id, session_id, start, usable, [])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KVStoreMetadata(finished=self._finished_saves)
        self._finished_saves = []
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = list(new.block_ids[0])
            prompt = list(new.prompt_token_ids or [])
            plan = self._planned.get(new.req_id)
            self._tracked[new.req_id] = _Tracked(prompt, block_ids, plan[2] if plan else 0)
            load = self._to_load.pop(new.req_id, None)
            if load is not None:
                load.block_ids = block_ids
                meta.loads.append(load)
            self._maybe_save(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # preempted and resumed: its blocks are all new, its earlier load is gone
                tracked.block_ids = list(new_blocks[0]) if new_blocks else []
                load = self._to_load.pop(req_id, None)
                if load is not None:
                    load.block_ids = tracked.block_ids
                    meta.loads.append(load)
            elif new_blocks:
                tracked.block_ids.extend(new_blocks[0])
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _maybe_save(self, meta: KVStoreMetadata, req_id: str, computed: int, scheduler_output: Any) -> None:
        """Plan the save of a prompt whose prefill completes in this step (once, if not stored yet)."""
        tracked = self._tracked[req_id]
        if tracked.saved:
            return
        scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
        n = len(tracked.prompt)
        if computed + scheduled < n:
            return
        tracked.saved = True
        if n >= self.config.min_tokens and tracked.stored_tokens < n:
            meta.saves.append(SaveSpec(req_id, tracked.prompt, list(tracked.block_ids)))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Plan the save of the conversation so far (prompt + generated tokens whose rows exist);
        True keeps the request's blocks until the worker has saved them (get_finished)."""
        self._forget(request.request_id)
        save = self._conversation(request, block_ids)
        if save is None:
            return False, None
        self._finished_saves.append(save)
        self.cache.count(finished_planned=1)
        return True, None

    def _conversation(self, request: Any, block_ids: list[int]) -> SaveSpec | None:
        prompt = len(request.prompt_token_ids or [])
        tokens = list(request.all_token_ids)
        # rows exist for the computed tokens: the last sampled token was never fed back; tokens
        # still in flight (async scheduling) are not in the cache yet
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        n = min(computed, len(tokens) - 1, len(block_ids) * self.block_size)
        if n <= prompt or n < self.config.min_tokens:
            return None  # nothing generated has rows: the prompt's save covers it
        tokens = tokens[:n]
        try:  # stored already (the same conversation, another process): not again
            if self.cache.client.stored(self.cache.session_id_for(np.asarray(tokens, dtype=np.int32))) is not None:
                return None
        except Exception as exc:  # the store unreachable: the save would fail too; counted there
            logger.debug("kvstore connector: could not check %s: %s", request.request_id, exc)
        return SaveSpec(request.request_id, tokens, list(block_ids))

    def _forget(self, req_id: str) -> None:
        self._planned.pop(req_id, None)
        self._tracked.pop(req_id, None)
        self._to_load.pop(req_id, None)

    def get_stats(self) -> dict[str, Any]:
        """This process's counters (lookups, hits, misses, refused, loaded and saved tokens, errors)."""
        return self.cache.stats.to_dict()

    # ================================================================== vLLM's metrics (both sides)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counter increments since the last call (vLLM sums the sides and workers)."""
        now = self.cache.stats.to_dict()
        delta = {name: now[name] - self._reported.get(name, 0) for name in COUNTERS}
        self._reported = {name: now[name] for name in COUNTERS}
        delta = {name: count for name, count in delta.items() if count}
        return KVStoreConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================================================================== worker side (PagedWorker)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVStoreMetadata):
            self.worker.start_load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # on a GPU the engine's stream waits for this layer's copies; on the CPU they are done
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVStoreMetadata) and meta.saves:
            self.worker.save_layer(meta.saves, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVStoreMetadata):
            self.worker.wait_for_save(meta.saves, meta.finished)

    def shutdown(self) -> None:
        """Write the saves still queued, then stop the writer (vLLM calls this as it stops)."""
        self.worker.shutdown()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose conversation is saved: vLLM frees their blocks now."""
        return (self.worker.get_finished(finished_req_ids) or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()
