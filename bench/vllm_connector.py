"""The kvstore vLLM connector per tier (f32, fp8, int4), inside real vLLM processes.

One vLLM process per tier (CPU, the tests' tiny random DeepSeek-V3 in float32, embedded mode, a
fresh store folder), running one prompt after another:

1. a warm-up prompt (100 tokens);
2. a 2,000-token prompt, one generated token: **computed** (and saved), timed;
3. the same prompt again: **loaded** from the store (1,984 tokens), timed — time to first token,
   computed vs loaded, in the same run; and the first token's top-5 logprobs of both;
4. a 300-token prompt, 16 tokens generated, computed then loaded: the tokens compared.

Printed per tier: time to first token computed and loaded, the loads' throughput (the worker's
``loaded_bytes`` over its ``load_us``: read, check, decode and placement into vLLM's cache) beside a
raw read of the store's journals in the same run, the generated tokens that agree (loaded
vs computed, position by position until the first difference, and in all), the first token's
argmax agreement and max |Δ logprob| over the top-5 ids both runs report, and the bytes stored per
token (journal bytes on disk / stored tokens; per layer too). f32 is the control: its rows load
back exactly, so what differs there is vLLM's own arithmetic (the stored prefix is attended from
the cache, the computed one within the prefill).

The loaded prompt runs in the process that computed it, so its rows come from the connector's hot
tier (host memory); ``--disk`` adds f32 with the hot tier off, whose load reads the store.

``--service`` adds the f32 tier in service mode: the same process against a ``kvstore serve`` on
127.0.0.1 (rows over HTTP, verified by the server).

``--sglang`` measures the SGLang backend (``kvstore.connectors.sglang``) instead, against SGLang's
own file backend (``HiCacheFile``: one raw file per page, renamed into place, no fsync) as the peer:
in one process of vLLM's venv with SGLang's package (tests/vllm/setup_venv.sh), both backends made
by SGLang's factory store the same pages (DeepSeek-V3's geometry by default: 61 layers, 64-token
pages, bf16, 4.5 MB a page) with ``batch_set``, find them with ``batch_exists`` and read them back
with ``batch_get`` (best of 7; the files are in the page cache for both). Printed per backend and
tier: seconds and MB/s of page data (bf16 bytes) for each call, bytes on disk per page, and the
pages read back equal to the written ones (f32: bit for bit) or their relative error; f32 once more
with ``verify`` off, to show what checking each page before handing it back costs (its share of a
``batch_get`` is printed: issue 38 asks for at most 20%).

Needs vLLM's venv (tests/vllm/setup_venv.sh). Usage::

    python bench/vllm_connector.py [--tiers f32,fp8,int4] [--prompt-tokens 2000] [--service]
    python bench/vllm_connector.py --sglang [--tiers bf16,f32,fp8,int4] [--pages 16] [--layers 61]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore import config

ROOT = Path(__file__).resolve().parents[1]
VENV = config.VLLM_VENV.get() or ROOT / ".vllm-venv"
RUNNER = ROOT / "tests" / "vllm" / "run_vllm.py"


def make_model(folder: Path) -> Path:
    spec = importlib.util.spec_from_file_location("kvstore_tiny_vllm_model", ROOT / "tests" / "vllm" / "tiny_model.py")
    assert spec is not None and spec.loader is not None
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    return tiny.make_model(folder, seed=0)


def allow_positions(model: Path, positions: int) -> int:
    """Raise the tiny model's ``max_position_embeddings`` to ``positions`` when it is lower (rope
    frequencies do not depend on it); returns the context vLLM may then run (its max_model_len)."""
    config_path = model / "config.json"
    config_json = json.loads(config_path.read_text())
    if config_json["max_position_embeddings"] < positions:
        config_json["max_position_embeddings"] = positions
        config_path.write_text(json.dumps(config_json))
    return max(4096, positions)


def run(
    tmp: Path, model: Path, prompts: list[list[int]], limits: list[int], connector: dict, max_model_len: int = 4096
) -> list[dict]:
    spec, out = tmp / "spec.json", tmp / "out.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(model),
                "prompts": prompts,
                "max_tokens": limits,
                "connector": connector,
                "max_model_len": max_model_len,
            }
        )
    )
    in_vllm(RUNNER, spec, out, tmp)
    return json.loads(out.read_text())["results"]


def in_vllm(script: Path, spec: Path, out: Path, cwd: Path, *flags: str, **env: str) -> None:
    """``script [FLAGS] SPEC OUT`` run by vLLM's venv (offline, a 1 GiB CPU cache, this environment
    less PYTHONPATH, plus ``env``); its output's tail is the error when it fails."""
    environment = dict(
        os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env
    )
    environment.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(VENV / "bin" / "python"), str(script), *flags, str(spec), str(out)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environment,
    )
    if done.returncode != 0:
        raise SystemExit((done.stdout + done.stderr)[-4000:])


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(leading tokens equal, tokens equal in all)."""
    lead = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return lead, sum(x == y for x, y in zip(a, b))


def first_token_distance(computed: dict, loaded: dict) -> tuple[bool, float, int]:
    """(argmax equal, max |Δ logprob| over the top-k ids both report, how many ids they share)."""
    a, b = computed["first_logprobs"], loaded["first_logprobs"]
    shared = sorted(set(a) & set(b))
    delta = max((abs(a[k] - b[k]) for k in shared), default=float("nan"))
    return computed["tokens"][0] == loaded["tokens"][0], delta, len(shared)


def stored_bytes_per_token(store: Path) -> float:
    from kvstore.formats.coli_kv import HEADER_BYTES, read_header

    body = tokens = 0
    for path in (store / "journals").glob("*.coli_kv"):
        header, _ = read_header(path)
        body += path.stat().st_size - HEADER_BYTES
        tokens += header.nrec
    return body / tokens


def raw_read_rate(store: Path) -> float:
    """GB/s of reading the store's journals whole into one buffer (best of 3; in the page cache
    after the run): the peer of a load's throughput (the connector's ``loaded_bytes`` over its
    ``load_us``, which also checks, decodes and places the rows in vLLM's cache)."""
    paths = sorted((store / "journals").glob("*.coli_kv"))
    total = sum(p.stat().st_size for p in paths)
    buffer = np.empty(max(total, 1), dtype=np.uint8)
    best = float("inf")
    for _ in range(3):
        began, at = time.perf_counter(), 0
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                at += f.readinto(buffer.data[at:])
        best = min(best, time.perf_counter() - began)
    return total / best / 1e9


def sglang_pages(spec: dict) -> dict:
    """Inside vLLM's venv with SGLang's package: the page calls of each backend, timed."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import (  # pyright: ignore[reportMissingImports]
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
    from sglang.srt.mem_cache.storage.backend_factory import (  # pyright: ignore[reportMissingImports]
        StorageBackendFactory,
    )

    host_spec = importlib.util.spec_from_file_location(
        "kvstore_sglang_host", ROOT / "tests" / "vllm" / "sglang_host.py"
    )
    assert host_spec is not None and host_spec.loader is not None
    host = importlib.util.module_from_spec(host_spec)
    host_spec.loader.exec_module(host)
    layers, page, n = spec["layers"], spec["page_size"], spec["pages"]
    pool = host.HostPages(layer_num=layers, page_size=page, pages=1, dtype=torch.bfloat16)
    rng = np.random.default_rng(64)
    values = [
        torch.from_numpy(rng.standard_normal(layers * page * 576).astype(np.float32)).to(torch.bfloat16)
        for _ in range(n)
    ]
    keys = [f"{i:064x}" for i in range(1, n + 1)]
    page_mb = values[0].numel() * 2 / 1e6
    # Untimed: the same pages written 3 times over as raw files, then removed. On this VM the first
    # ~150 MB a process writes go 7x faster than every write after (16 pages: 0.024 s, then
    # 0.17 s, whatever the method): whichever backend ran first got that, so every timed write
    # starts in the steady state instead.
    durable_floor(values, Path(spec["floor_dir"]) / "warm-up", repeats=1)
    durable_floor(values, Path(spec["floor_dir"]) / "warm-up-2", repeats=1)
    out = {}
    for label, name, extra in spec["backends"]:
        config = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=True,
            enable_storage_metrics=False,
            is_page_first_layout=False,
            model_name="bench-mla",
            extra_config=extra,
        )
        storage = StorageBackendFactory.create_backend(name, config, pool)
        storage.register_mem_pool_host(pool)
        # every timed write starts with no dirty pages pending: the kernel throttles a writer behind
        # an earlier backend's backlog (seen: the same raw writes 5x slower after the others ran)
        os.sync()
        started = time.perf_counter()
        assert storage.batch_set(keys, values)
        set_s = time.perf_counter() - started
        started = time.perf_counter()
        found = storage.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=None))
        exists_s = time.perf_counter() - started
        get_s, pages = float("inf"), []
        for _ in range(7):
            targets = [pool.get_dummy_flat_data_page() for _ in range(n)]
            started = time.perf_counter()
            pages = storage.batch_get(keys, targets)
            get_s = min(get_s, time.perf_counter() - started)
        equal = sum(bool(p is not None and torch.equal(p, v)) for p, v in zip(pages, values))
        error = max(
            float(torch.linalg.norm(p.float() - v.float()) / torch.linalg.norm(v.float()))
            for p, v in zip(pages, values)
            if p is not None
        )
        checks = page_checks(storage, keys) if label == "kvstore f32" else None
        folder = Path(extra.get("store") or extra["file_storage_path"])
        disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.suffix in (".bin", ".coli_kv"))
        out[label] = {
            "set_s": set_s,
            "exists_s": exists_s,
            "get_s": get_s,
            "found": found,
            "equal": equal,
            "error": error,
            "disk_per_page": disk / n,
            "page_mb": page_mb,
            "checks": checks,
        }
    out["floor"] = durable_floor(values, Path(spec["floor_dir"]))
    return out


def durable_floor(values: list, folder: Path, repeats: int = 3) -> dict:
    """The same pages written as raw files, each fsynced, then the folder (best of ``repeats``):
    what any backend that acknowledges a page only once it is on disk pays at least. HiCacheFile
    skips both fsyncs, so its batch_set is a page-cache copy; this is the floor for a durable one."""
    import torch

    blobs = [v.contiguous().view(torch.int16).numpy().tobytes() for v in values]  # bf16 bytes as stored
    best = {"write_s": float("inf"), "durable_s": float("inf")}
    for attempt in range(repeats):
        for durable in (False, True):
            target = folder / f"{attempt}-{int(durable)}"
            target.mkdir(parents=True)
            os.sync()  # no earlier backlog to be throttled behind (as before each batch_set)
            started = time.perf_counter()
            for i, blob in enumerate(blobs):
                with open(target / f"{i}.bin", "wb") as f:
                    f.write(blob)
                    if durable:
                        f.flush()
                        os.fsync(f.fileno())
            if durable:
                fd = os.open(target, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            key = "durable_s" if durable else "write_s"
            best[key] = min(best[key], time.perf_counter() - started)
    return best


def page_checks(storage, keys: list[str], repeats: int = 5) -> dict:
    """The check before a load, alone, on the pages just stored (seconds for all pages, best of
    ``repeats``, in one loop so the machine's noise hits all alike): ``read`` serves the rows with no
    check; ``blake2b`` has the store re-hash the turns as it serves them (the check before issue 38);
    ``xxh3`` serves them and compares their XXH3-128 with the recorded tag (the check now)."""
    from kvstore.connectors.prefix_cache import recorded_digest, rows_digest

    cache = storage.cache
    ids = [cache.page_id(key) for key in keys]

    def read(session_id: str) -> None:
        cache.client.resume(session_id, cache.fingerprint, False)

    def blake2b(session_id: str) -> None:
        cache.client.resume(session_id, cache.fingerprint, True)

    def xxh3(session_id: str) -> None:
        stored = cache.client.stored(session_id)
        records = cache.client.resume(session_id, cache.fingerprint, False).records.records
        assert stored is not None and rows_digest(records) == recorded_digest(stored.tags)

    best = {name: float("inf") for name in ("read", "blake2b", "xxh3")}
    for _ in range(repeats):
        for name, call in (("read", read), ("blake2b", blake2b), ("xxh3", xxh3)):
            started = time.perf_counter()
            for session_id in ids:
                call(session_id)
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def sglang_main(args: argparse.Namespace) -> None:
    sglang = VENV / "sglang-0.5.23"
    if not (sglang / ".kvstore-sglang").exists():
        raise SystemExit(f"SGLang's package is missing at {sglang}: run tests/vllm/setup_venv.sh")
    with tempfile.TemporaryDirectory(prefix="kvstore-sglang-bench-") as tmp_name:
        tmp = Path(tmp_name)
        backends = [("HiCacheFile (SGLang)", "file", {"file_storage_path": str(tmp / "hicache")})]
        for tier in args.tiers.split(","):
            extra = {
                "backend_name": "kvstore",
                "module_path": "kvstore.connectors.sglang",
                "class_name": "KVStoreHiCacheStorage",
                "store": str(tmp / f"kv-{tier}"),
                "tier": tier,
            }
            backends.append((f"kvstore {tier}", "dynamic", extra))
        if "f32" in args.tiers.split(","):  # what verification costs: the same without the re-hash
            f32 = next(extra for label, _, extra in backends if label == "kvstore f32")
            extra = {**f32, "store": str(tmp / "kv-f32-noverify"), "verify": False}
            backends.append(("kvstore f32 no verify", "dynamic", extra))
        spec = {
            "layers": args.layers,
            "page_size": args.page_size,
            "pages": args.pages,
            "backends": backends,
            "floor_dir": str(tmp / "floor"),
        }
        (tmp / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONPATH=str(sglang))
        done = subprocess.run(
            [str(VENV / "bin" / "python"), __file__, "--sglang-inner", str(tmp / "spec.json"), str(tmp / "out.json")],
            capture_output=True,
            text=True,
            env=env,
        )
        if done.returncode != 0:
            raise SystemExit((done.stdout + done.stderr)[-4000:])
        results = json.loads((tmp / "out.json").read_text())
    floor = results.pop("floor")
    page_mb = next(iter(results.values()))["page_mb"]
    print(
        f"SGLang HiCache storage, {args.pages} pages of {args.page_size} tokens x {args.layers} layers x 576 bf16 "
        f"({page_mb:.2f} MB a page), one process, CPU"
    )
    print(
        "backend               | batch_set s (MB/s) | batch_exists ms | batch_get s (MB/s) | found | equal | max rel. error | disk/page MB"
    )
    for label, r in results.items():
        total = page_mb * args.pages
        print(
            f"{label:21} | {r['set_s']:7.3f} ({total / r['set_s']:6.0f}) | {r['exists_s'] * 1e3:15.1f} "
            f"| {r['get_s']:7.3f} ({total / r['get_s']:6.0f}) | {r['found']:5} | {r['equal']:5} | {r['error']:.2e} "
            f"| {r['disk_per_page'] / 1e6:.2f}"
        )
    checks = results.get("kvstore f32", {}).get("checks")
    if checks:
        # issue 38's limit: the check before a load costs at most 20% of the load. The check guards a
        # load from the store (a hot-tier hit was checked when it was kept, and batch_get above is
        # served from the hot tier), so its share is of the store's read with it; without the
        # placement into the page, which the load adds, the share printed is an upper bound.
        per_page = {name: seconds / args.pages * 1e3 for name, seconds in checks.items()}
        print(f"the check before a load, f32, per page: the store's read unchecked {per_page['read']:.2f} ms")
        for name, what in (("blake2b", "blake2b-256 turn hashes (before)"), ("xxh3", "XXH3-128 tag (now)")):
            cost = max(per_page[name] - per_page["read"], 0.0)
            share = cost / (per_page["read"] + cost)
            print(f"  {what:33}: +{cost:.2f} ms, at most {share:.0%} of a checked load from the store per page")
    total = page_mb * args.pages
    print(
        f"raw files of the same pages, written: {floor['write_s']:.3f} s ({total / floor['write_s']:.0f} MB/s); "
        f"written and fsynced (each file, then the folder): {floor['durable_s']:.3f} s ({total / floor['durable_s']:.0f} MB/s)"
    )
    # issue 38's limits: batch_get >= 0.5x HiCacheFile's speed, batch_set <= 2x its time
    file = results["HiCacheFile (SGLang)"]
    for label, r in results.items():
        if label.startswith("kvstore"):
            print(
                f"{label} vs HiCacheFile: batch_get {file['get_s'] / r['get_s']:.2f}x its speed, "
                f"batch_set {r['set_s'] / file['set_s']:.2f}x its time ({r['set_s'] / floor['durable_s']:.2f}x the fsynced "
                f"raw files'), {r['disk_per_page'] / file['disk_per_page']:.2f}x its bytes"
            )


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--sglang-inner":
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(sglang_pages(spec)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiers", default=None, help="comma-separated tiers to run (default f32,fp8,int4; --sglang: bf16,f32,fp8,int4)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="the timed prompt's length")
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens generated for the agreement check")
    parser.add_argument("--service", action="store_true", help="also f32 through a kvstore serve (service mode)")
    parser.add_argument(
        "--disk", action="store_true", help="also f32 with no hot tier (loads read the store, not host memory)"
    )
    parser.add_argument("--sglang", action="store_true", help="the SGLang backend against SGLang's HiCacheFile")
    parser.add_argument("--pages", type=int, default=16, help="--sglang: pages stored and read")
    parser.add_argument("--layers", type=int, default=61, help="--sglang: layers per page")
    parser.add_argument("--page-size", type=int, default=64, help="--sglang: tokens per page")
    args = parser.parse_args()
    if args.tiers is None:  # SGLang's pages are bf16: its default tier (bf16, v4) first
        args.tiers = "bf16,f32,fp8,int4" if args.sglang else "f32,fp8,int4"
    if args.sglang:
        sglang_main(args)
        return
    if not (VENV / "bin" / "python").exists():
        raise SystemExit(f"vLLM's venv is missing at {VENV}: run tests/vllm/setup_venv.sh")
    rng = np.random.default_rng(2000)
    warm = rng.integers(2, 512, size=100).tolist()
    long = rng.integers(2, 512, size=args.prompt_tokens).tolist()
    short = rng.integers(2, 512, size=300).tolist()
    prompts = [warm, long, long, short, short]
    limits = [1, 1, 1, args.decode_tokens, args.decode_tokens]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = make_model(tmp / "tiny-dsv3")
        max_model_len = allow_positions(model, args.prompt_tokens + 64)
        runs = [(tier, tier) for tier in args.tiers.split(",")] + ([("f32 service", "f32")] if args.service else [])
        runs += [("f32 disk", "f32")] if args.disk else []
        for label, tier in runs:
            work = tmp / label.replace(" ", "-")
            work.mkdir()
            connector = {"store": str(work / "kv"), "tier": tier, "stats_dir": str(work / "stats")}
            if label.endswith("disk"):  # no hot tier: the load reads the store (its files in the page cache)
                connector["hot_bytes"] = 0
            server = None
            if label.endswith("service"):
                sys.path.insert(0, str(ROOT / "tests"))
                from served import ServeProcess

                key = "bench-key-0123456789abcdefghij"
                server = ServeProcess(work / "kv", env={"KVSTORE_API_KEYS": f"{key}:bench"}).start()
                connector = {"url": server.url, "api_key": key, "tier": tier, "stats_dir": str(work / "stats")}
            try:
                _, computed, loaded, short_computed, short_loaded = run(
                    work, model, prompts, limits, connector, max_model_len
                )
            finally:
                if server is not None:
                    server.stop_cleanly()
            counts: dict[str, int] = {}
            for path in (work / "stats").glob("worker-*.json"):
                for key, value in json.loads(path.read_text()).items():
                    if isinstance(value, int):
                        counts[key] = counts.get(key, 0) + value
            same, delta, shared = first_token_distance(computed, loaded)
            lead, equal = agreement(short_computed["tokens"], short_loaded["tokens"])
            per_token = stored_bytes_per_token(work / "kv")
            raw = raw_read_rate(work / "kv")
            rows.append(
                (
                    label,
                    computed["seconds"],
                    loaded["seconds"],
                    counts,
                    same,
                    delta,
                    shared,
                    lead,
                    equal,
                    per_token,
                    raw,
                )
            )
    print(
        f"vLLM connector, tiny DeepSeek-V3 (2 layers, kv_lora 512, qk_rope 64), float32, CPU, {args.prompt_tokens}-token prompt"
    )
    print(
        "tier        | TTFT computed s | TTFT loaded s | loaded tok (both prompts) | first token same | max |Δlogprob| top-5 (shared) "
        f"| {args.decode_tokens} tokens: leading equal / equal | bytes/token (per layer) "
        "| load GB/s (raw read GB/s, ratio)"
    )
    for tier, t_comp, t_load, counts, same, delta, shared, lead, equal, per_token, raw in rows:
        seconds = counts.get("load_us", 0) / 1e6
        load = counts.get("loaded_bytes", 0) / seconds / 1e9 if seconds else float("nan")
        print(
            f"{tier:11} | {t_comp:15.3f} | {t_load:13.3f} | {counts.get('loaded_tokens', 0):25} | {str(same):16} "
            f"| {delta:.2e} ({shared}) | {lead} / {equal} of {args.decode_tokens} | {per_token:.0f} ({(per_token - 4) / 2:.0f}) "
            f"| {load:.2f} ({raw:.2f}, {load / raw:.2f})"
        )


if __name__ == "__main__":
    main()
