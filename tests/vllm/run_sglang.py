"""Drives kvstore's SGLang backend through SGLang's own classes, for test_sglang_interface.py.

Run with vLLM's venv's Python and SGLang's package on PYTHONPATH (tests/vllm/setup_venv.sh):
``python run_sglang.py SPEC.json OUT.json``. SPEC holds ``extra`` (the backend's extra
configuration), ``model_name``, ``layout``, ``tokens`` (a token sequence, split into pages and
hashed with SGLang's own page hash), ``seed`` (the rows), ``write`` (store the pages first) and
``interface_v1``. The backend is made by SGLang's ``StorageBackendFactory`` (``dynamic``, as
``--hicache-storage-backend dynamic`` makes it) from a real ``HiCacheStorageConfig``; then the
script makes the calls SGLang's cache controller makes: ``batch_set`` of flat host pages (or
``batch_set_v1`` of host indices), ``batch_exists`` with ``HiCacheStorageExtraInfo``, ``batch_get``
into the pool's dummy pages then ``set_from_flat_data_page`` (or ``batch_get_v1``). OUT gets what
came back: the classes, the hit count, whether each page's rows equal the written ones, counters.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    import numpy as np
    import torch
    from sglang.srt.mem_cache.hicache_storage import (  # pyright: ignore[reportMissingImports]
        STORAGE_BATCH_SIZE,
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
    from sglang.srt.mem_cache.storage.backend_factory import (  # pyright: ignore[reportMissingImports]
        StorageBackendFactory,
    )
    from sglang.srt.mem_cache.utils import get_storage_hash_str  # pyright: ignore[reportMissingImports]

    here = Path(__file__).resolve().parent
    loader = importlib.util.spec_from_file_location("kvstore_sglang_host", here / "sglang_host.py")
    assert loader is not None and loader.loader is not None
    host_module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(host_module)

    spec = json.loads(Path(spec_path).read_text())
    page_size = 16
    tokens = spec["tokens"]
    n_pages = len(tokens) // page_size
    pool = host_module.HostPages(page_size=page_size, pages=2 * n_pages + 1, layout=spec["layout"])
    extra = {
        "backend_name": "kvstore",
        "module_path": "kvstore.connectors.sglang",
        "class_name": "KVStoreHiCacheStorage",
        "interface_v1": int(spec["interface_v1"]),
        **spec["extra"],
    }
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=spec["layout"] == "page_first",
        model_name=spec["model_name"],
        extra_config=extra,
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)  # as the cache controller does right after creating it
    keys = list(get_storage_hash_str(tokens, None, page_size=page_size))
    assert len(keys) == n_pages and len(keys) <= STORAGE_BATCH_SIZE

    rng = np.random.default_rng(spec["seed"])
    rows = torch.from_numpy(rng.standard_normal((n_pages, 2, page_size, 576)).astype(np.float32))
    written = None
    if spec["write"]:
        for i in range(n_pages):  # the pages sit in the pool's first slots, as after a device backup
            pool.rows(i * page_size).copy_(rows[i])
        host_indices = torch.arange(0, n_pages * page_size)
        if spec["interface_v1"]:
            written = storage.batch_set_v1(keys, host_indices, HiCacheStorageExtraInfo(prefix_keys=None))
            written = all(written)
        else:
            values = [pool.get_data_page(int(host_indices[i * page_size])) for i in range(n_pages)]
            written = storage.batch_set(keys, values)

    hits = storage.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=None))
    into = torch.arange(n_pages * page_size, (n_pages + hits) * page_size)  # other slots
    if spec["interface_v1"]:
        read = storage.batch_get_v1(keys[:hits], into)
    else:
        pages = storage.batch_get(keys[:hits], [pool.get_dummy_flat_data_page() for _ in range(hits)])
        read = []
        for i, page in enumerate(pages):
            if page is not None:
                pool.set_from_flat_data_page(int(into[i * page_size]), page)
            read.append(page is not None)
    equal = [bool(torch.equal(pool.rows(int(into[i * page_size])), rows[i])) for i in range(hits)]
    result = {
        "base_is_sglangs": isinstance(storage, HiCacheStorage),
        "class": f"{type(storage).__module__}.{type(storage).__name__}",
        "written": written,
        "pages": n_pages,
        "hits": hits,
        "read": read,
        "equal": equal,
        "counters": storage.counters(),
    }
    storage.close()
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
