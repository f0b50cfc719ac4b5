"""kvstore as SGLang's hierarchical-cache storage (``HiCacheStorage``, tested against SGLang 0.5.23).

SGLang loads it as its ``dynamic`` storage backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCacheStorage",
        "store": "/var/lib/kvstore", "tier": "f32"}'

SGLang names each page of its host cache (``page_size`` tokens) by a chain hash and calls
``batch_exists`` (how many leading pages are stored), ``batch_get``/``get`` (read pages into host
page tensors), ``batch_set``/``set`` (write pages) and ``exists``; with ``"interface_v1": 1`` in the
extra configuration, ``batch_get_v1``/``batch_set_v1`` (pages addressed by host-pool indices). For an
MLA model a page holds, per layer and token, one row of ``kv_lora_rank`` latent values and
``qk_rope_head_dim`` rope-key values: exactly ``.coli_kv`` rows. Each page is stored as one session
by :class:`~kvstore.connectors.page_cache.PageCache` (fingerprint and owner salting, tiers,
verification, counters), in a local store folder (``store``) or through a running ``kvstore serve``
(``url`` and an API key): the same code path as the vLLM connector (``kvstore.connectors.vllm``).

A page that is missing, damaged (verification) or stored under another fingerprint is not handed
back: ``get`` answers None and SGLang computes those tokens. See docs/VLLM.md ("SGLang").

When SGLang is installed the class subclasses SGLang's own ``HiCacheStorage`` (its factory checks
``issubclass``); without it, the same methods stand alone (the tests drive both).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kvstore.connectors.hot_tier import HotTier
from kvstore.connectors.page_cache import PAGE_VOCAB, PageCache
from kvstore.connectors.prefix_cache import (
    CacheConfig,
    LoadFailed,
    model_fingerprint,
    open_client,
    sampled_weights_hash,
)
from kvstore.connectors.store_client import StoreClient
from kvstore.connectors.tensors import rows_tensor
from kvstore.errors import ConfigError
from kvstore.formats.coli_kv import Geometry

logger = logging.getLogger(__name__)

# What the rows are: SGLang's MLA cache entries (latent, then the rope key as SGLang lays it out),
# in its cache dtype. Another engine's rows (vLLM's "vllm-mla", the bundled engine's) never load.
ATTENTION_VARIANT = "sglang-mla"
# Keys of SGLang's extra configuration that SGLang itself reads (the backend ignores them).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
# Host pool layouts whose flat page is [layers, page, row] or [page, layers, row].
LAYER_MAJOR = frozenset({"layer_first", "page_first_direct"})
PAGE_MAJOR = frozenset({"page_first"})
# Pages of one batch_get / batch_set handled at once (page-cache reads and fsyncs scale to about four)
BATCH_THREADS = max(2, min(4, os.cpu_count() or 1))
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _sglang_base() -> Any:
    """SGLang's ``HiCacheStorage`` when SGLang is installed, else ``object``."""
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # pyright: ignore[reportMissingImports]
    except ImportError:
        return object
    return HiCacheStorage


_Base: Any = _sglang_base()


@dataclass(frozen=True)
class PageFormat:
    """How SGLang's host pool lays out one page: ``n_layers`` x ``page_size`` rows of ``width``
    values of ``dtype``, layer-major (``layer_first``) or token-major (``page_first``)."""

    n_layers: int
    page_size: int
    kv_lora: int
    qk_rope: int
    dtype: torch.dtype
    page_major: bool

    @classmethod
    def of_host_pool(cls, pool: Any) -> "PageFormat":
        """Read from SGLang's MLA host pool (``MLATokenToKVPoolHost``); ConfigError when unsupported."""
        kv_lora, qk_rope = getattr(pool, "kv_lora_rank", None), getattr(pool, "qk_rope_head_dim", None)
        if not kv_lora or not qk_rope:
            raise ConfigError("the kvstore backend stores MLA latent rows: SGLang's host pool is not an MLA pool")
        width = getattr(pool, "kv_cache_dim", kv_lora + qk_rope)
        if width != kv_lora + qk_rope:
            raise ConfigError(
                f"the kvstore backend stores rows of kv_lora + qk_rope = {kv_lora + qk_rope} values; "
                f"SGLang's host pool packs {width} per row"
            )
        layout = str(pool.layout)
        if layout not in LAYER_MAJOR | PAGE_MAJOR:
            raise ConfigError(
                f"the kvstore backend reads host layouts {sorted(LAYER_MAJOR | PAGE_MAJOR)}, not {layout!r}"
            )
        if pool.dtype not in CACHE_DTYPES:
            raise ConfigError(f"the kvstore backend reads caches of {[str(d) for d in CACHE_DTYPES]}, not {pool.dtype}")
        return cls(
            int(pool.layer_num), int(pool.page_size), int(kv_lora), int(qk_rope), pool.dtype, layout in PAGE_MAJOR
        )

    @property
    def width(self) -> int:
        return self.kv_lora + self.qk_rope

    @property
    def values(self) -> int:
        return self.n_layers * self.page_size * self.width

    def rows(self, page: torch.Tensor) -> np.ndarray:
        """A page tensor (any shape of :attr:`values` values) as f32 ``[n_layers, page_size, width]``."""
        if page.numel() != self.values:
            raise ValueError(f"a page holds {self.values} values, got {page.numel()}")
        if self.page_major:
            ordered = page.reshape(self.page_size, self.n_layers, self.width).transpose(0, 1)
        else:
            ordered = page.reshape(self.n_layers, self.page_size, self.width)
        return ordered.to(device="cpu", dtype=torch.float32).numpy()

    def fill(self, rows: np.ndarray, out: torch.Tensor | None) -> torch.Tensor:
        """Rows ``[n_layers, page_size, width]`` — f32, or a bf16 tier's bit patterns (u16) — written
        into ``out`` (a page tensor; a new flat one when None) in the pool's order and dtype."""
        ordered = rows_tensor(rows)
        if self.page_major:
            ordered = ordered.transpose(0, 1)
        if out is None:  # one copy, always a new page: ``rows`` may be a view of a hot-tier entry
            return torch.empty(ordered.shape, dtype=self.dtype).copy_(ordered).flatten()
        if out.numel() != self.values:
            raise ValueError(f"a page holds {self.values} values, the target {out.numel()}")
        if out.is_contiguous():  # one pass: copy_ converts the dtype and follows the strides
            out.view(ordered.shape).copy_(ordered)
        else:
            out.copy_(ordered.reshape(out.shape).to(device=out.device, dtype=out.dtype))
        return out


def _config(extra: dict[str, Any] | None) -> CacheConfig:
    extra = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
    if "min_tokens" in extra:
        raise ConfigError("kvstore backend: 'min_tokens' is for the vLLM connector; SGLang stores whole pages")
    if "save_queue" in extra:
        raise ConfigError("kvstore backend: 'save_queue' is for the vLLM connector; SGLang's own threads call set")
    if "url" not in extra:
        extra.setdefault("owner", "sglang")
    return CacheConfig.from_extra(extra)


class KVStoreHiCacheStorage(_Base):
    """SGLang ``HiCacheStorage`` over a kvstore (embedded folder or ``kvstore serve``).

    Parameters
    ----------
    storage_config : SGLang's ``HiCacheStorageConfig`` (``is_mla_model``, ``model_name``,
        ``extra_config`` — the keys of :class:`~kvstore.connectors.prefix_cache.CacheConfig`
        but ``min_tokens``; the owner defaults to ``sglang``)
    kwargs : what SGLang's factory passes to a dynamic backend (unused)

    The page format and the fingerprint are known once SGLang registers its host pool
    (:meth:`register_mem_pool_host`, right after construction).
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None):
        if not getattr(storage_config, "is_mla_model", False):
            raise ConfigError(
                "the kvstore backend stores MLA latent rows: the model must use MLA (DeepSeek-V2/V3 style)"
            )
        self.storage_config = storage_config
        self.config = _config(getattr(storage_config, "extra_config", None))
        # a refused key or an unreachable service stops SGLang here, at start
        self.client: StoreClient = open_client(self.config)
        self.format: PageFormat | None = None
        self._cache: PageCache | None = None
        self._pool: ThreadPoolExecutor | None = None  # a batch's pages, made on the first batch
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool: fixes the page format and the fingerprint."""
        self.mem_pool_host = mem_pool_host
        page = PageFormat.of_host_pool(mem_pool_host)
        name = self.config.model_name or getattr(self.storage_config, "model_name", None) or "sglang-model"
        weights = self.config.weights_hash or sampled_weights_hash(name)
        dtype = str(page.dtype).removeprefix("torch.")
        fingerprint = model_fingerprint(
            name=name,
            revision=self.config.revision or "main",
            geometry=Geometry(page.n_layers, page.kv_lora, page.qk_rope, 0, 0, PAGE_VOCAB),
            tier=self.config.tier_for(dtype),
            attention_variant=f"{ATTENTION_VARIANT}:{dtype}",
            weights_hash=weights,
        )
        stats_path = None
        if self.config.stats_dir:
            rank = getattr(self.storage_config, "tp_rank", 0)
            stats_path = Path(self.config.stats_dir) / f"sglang-{os.getpid()}-tp{rank}.json"
        self.format = page
        self._cache = PageCache(
            self.client,
            None,
            fingerprint,
            page_size=page.page_size,
            id_prefix="sglang",
            verify=self.config.verify,
            stats_path=stats_path,
            hot=HotTier(self.config.hot_bytes) if self.config.hot_bytes else None,
        )
        logger.info(
            "kvstore HiCache storage: store %s, owner %s, tier %s, %d layers x %d-token pages, fingerprint %s",
            self.config.store or self.config.url,
            self._cache.owner,
            fingerprint.tier.name,
            page.n_layers,
            page.page_size,
            fingerprint.key()[:16],
        )

    @property
    def cache(self) -> PageCache:
        if self._cache is None:
            raise ConfigError("kvstore backend: SGLang has not registered its host pool yet")
        return self._cache

    @property
    def page_format(self) -> PageFormat:
        if self.format is None:
            raise ConfigError("kvstore backend: SGLang has not registered its host pool yet")
        return self.format

    def counters(self) -> dict[str, Any]:
        """This process's counters (pages looked up, hits, misses, refused, loaded, saved, errors)."""
        return self.cache.stats.to_dict()

    # ------------------------------------------------------------------ exists
    def exists(self, key: str) -> bool:
        return self.cache.count_present([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` are stored (SGLang loads that prefix)."""
        return self.cache.count_present(keys)

    # ------------------------------------------------------------------ get
    def get(
        self, key: str, target_location: torch.Tensor | None = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Page ``key`` written into ``target_location`` (returned), or None when it is missing,
        damaged or of another fingerprint (never partly written)."""
        try:
            rows = self.cache.load_page(key, view=True, native=True)  # only read: copied into the page
        except LoadFailed as exc:
            logger.warning("kvstore backend: page %s not loaded: %s", key, exc)
            return None
        return self.page_format.fill(rows, target_location)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return self._each(self.get, keys, targets)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Pages read straight into the host pool at ``host_indices`` (``interface_v1``)."""
        pool, size = self.mem_pool_host, self.page_format.page_size

        def get_one(key: str, index: int) -> bool:
            page = self.get(key, pool.get_dummy_flat_data_page())
            if page is not None:  # pages go to distinct slots of the pool: the threads never overlap
                pool.set_from_flat_data_page(index, page)
            return page is not None

        return self._each(get_one, keys, [int(host_indices[i * size]) for i in range(len(keys))])

    # ------------------------------------------------------------------ set
    def set(
        self, key: str, value: torch.Tensor | None = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store page ``key`` (True also when it was stored before); False when it could not be."""
        if value is None:
            return False
        return self.cache.save_page(key, self.page_format.rows(value))

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None:
            return False
        return all(self._each(self.set, keys, list(values)))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Pages written from the host pool at ``host_indices`` (``interface_v1``)."""
        pool, size = self.mem_pool_host, self.page_format.page_size
        pages = [pool.get_data_page(int(host_indices[i * size]), flat=True) for i in range(len(keys))]
        return self._each(self.set, keys, pages)

    def _each(self, call: Callable[[str, Any], Any], keys: list[str], values: list[Any]) -> list[Any]:
        """``call(key, value)`` for each pair, in order of the keys: a batch's pages on a few threads
        (each page is its own session: their fsyncs wait together, their encodes and copies run
        outside the GIL), one page on the caller's thread."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} pages")
        if len(keys) < 2:
            return [call(key, value) for key, value in zip(keys, values)]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=BATCH_THREADS, thread_name_prefix="kvstore-hicache")
        return list(self._pool.map(call, keys, values))

    # ------------------------------------------------------------------ housekeeping
    def clear(self) -> None:
        """Leaves the store as it is: other SGLang or vLLM instances may share it; the store's budget
        evicts, ``kvstore sessions delete`` removes."""
        logger.info("kvstore backend: clear() leaves the shared store alone (its budget evicts)")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        close = getattr(self.client, "close", None)
        if close is not None:
            close()


__all__ = ["KVStoreHiCacheStorage", "PageFormat"]
