"""Encryption at rest (docs/SECURITY.md): an encrypted store against a plaintext one, in the same run.

Both stores live side by side on the same disk and get the same records (valid fp8 records of a
GLM-4.5-style MLA geometry, 78 layers, ~45 KB a token). Each figure is the median of ``--repeat``
runs, plaintext and encrypted alternating, and the ratio is encrypted throughput / plaintext
throughput (the issue's target: at least 0.8 for each).

- append: a prefill of ``--prefill`` tokens in one call, then ``--decode`` one-token appends
  (each durable: frames fsynced, then the commit point), records per second.
- resume over HTTP: ``GET /sessions/{id}/resume`` (raw bytes) of the whole session from a real
  ``kvstore serve`` (``--encrypt --kek-file`` for the encrypted one), bytes per second.
- engine restore from the store: ``SessionStore.reader`` -> ``LatentCache.restore_body`` on the
  CPU (the engine's restore pipeline; fp8 rows dequantized on the device), tokens per second.
- park and unpark of the whole session, bytes of journal per second.

    PYTHONPATH=. python3 bench/encryption.py                 # the CPU box figures in BENCHMARKS.md
    PYTHONPATH=. python3 bench/encryption.py --tokens 2048 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_common import GLM, KEY, MODEL, TIER, Server, v2_records  # noqa: E402

import kvstore.store  # noqa: E402
from kvstore.crypto import LocalKEK  # noqa: E402
from kvstore.crypto.kek import write_kek_file  # noqa: E402


def median_rate(samples: list[float], amount: float) -> float:
    return amount / statistics.median(samples)


def open_store(data: Path, kek: LocalKEK | None):
    return kvstore.store.open(data, kek=kek)


def bench_append(data: Path, kek, prefill: np.ndarray, decode: np.ndarray, sid: str) -> tuple[float, float]:
    with open_store(data, kek) as store:
        store.create("bench", GLM, TIER, MODEL, session_id=sid)
        began = time.perf_counter()
        store.append_records(sid, prefill)
        prefill_s = time.perf_counter() - began
        began = time.perf_counter()
        for i in range(decode.shape[0]):
            store.append_records(sid, decode[i : i + 1])
        decode_s = time.perf_counter() - began
    return prefill_s, decode_s


def bench_restore(data: Path, kek, sid: str) -> float:
    from kvstore.engine.cache import CacheGeometry, LatentCache
    from kvstore.engine.restore import ReaderBody

    with open_store(data, kek) as store:
        began = time.perf_counter()
        with store.reader(sid) as reader:
            cache = LatentCache(TIER, CacheGeometry.of(GLM), "cpu")
            cache.restore_body(ReaderBody(reader))
        elapsed = time.perf_counter() - began
        assert cache.length == reader.n_records
    return elapsed


def bench_park(data: Path, kek, sid: str) -> tuple[float, float]:
    with open_store(data, kek) as store:
        began = time.perf_counter()
        store.park(sid)
        park_s = time.perf_counter() - began
        began = time.perf_counter()
        store.unpark(sid)
        unpark_s = time.perf_counter() - began
    return park_s, unpark_s


def bench_http(data: Path, extra: list[str], sid: str, repeat: int, expect: int) -> list[float]:
    server = Server(data, *extra, keys=f"{KEY}:bench")
    try:
        samples = []
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as client:
            for _ in range(repeat + 1):  # the first warms the server's imports and page cache
                began = time.perf_counter()
                got = 0
                with client.stream("GET", f"/sessions/{sid}/resume") as response:
                    assert response.status_code == 200, response.read()
                    for chunk in response.iter_raw():
                        got += len(chunk)
                samples.append(time.perf_counter() - began)
                assert got == expect, (got, expect)
        return samples[1:]
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the prefill (default 4096)")
    parser.add_argument("--decode", type=int, default=64, help="one-token appends after it (default 64)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each measure (default 5)")
    parser.add_argument("--where", default=None, help="folder for the stores (default: a temporary one)")
    args = parser.parse_args()

    prefill = v2_records(args.tokens, 1)
    decode = v2_records(args.decode, 2)
    rec_bytes = prefill.dtype.itemsize
    body_bytes = (args.tokens + args.decode) * rec_bytes
    rows: dict[str, dict[str, list[float]]] = {
        m: {"plain": [], "sealed": []} for m in ("prefill", "decode", "restore", "park", "unpark")
    }
    http: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.where) as folder:
        root = Path(folder)
        kek_path = root / "kek"
        kek = write_kek_file(kek_path)
        modes = {"plain": (root / "plain", None), "sealed": (root / "sealed", kek)}
        for run in range(args.repeat):
            for mode, (data, key) in modes.items():
                sid = f"s{run}"
                prefill_s, decode_s = bench_append(data, key, prefill, decode, sid)
                rows["prefill"][mode].append(prefill_s)
                rows["decode"][mode].append(decode_s)
                rows["restore"][mode].append(bench_restore(data, key, sid))
                park_s, unpark_s = bench_park(data, key, sid)
                rows["park"][mode].append(park_s)
                rows["unpark"][mode].append(unpark_s)
        for mode, (data, _) in modes.items():
            extra = ["--encrypt", "--kek-file", str(kek_path)] if mode == "sealed" else []
            http[mode] = bench_http(data, extra, "s0", args.repeat, body_bytes)
        sizes = {
            mode: sum(p.stat().st_size for p in (data / "journals").glob("*.coli_kv"))
            for mode, (data, _) in modes.items()
        }

    amounts = {
        "prefill": (args.tokens, "tokens/s"),
        "decode": (args.decode, "appends/s"),
        "restore": (args.tokens + args.decode, "tokens/s"),
        "park": (body_bytes / 1e6, "MB/s"),
        "unpark": (body_bytes / 1e6, "MB/s"),
    }
    print(
        f"# {GLM.n_layers} layers x ({GLM.kv_lora}+{GLM.qk_rope}) fp8, {rec_bytes} B/token; prefill {args.tokens}, "
        f"{args.decode} one-token appends; median of {args.repeat}; {os.cpu_count()} CPUs"
    )
    print(f"{'measure':<34} {'plaintext':>14} {'encrypted':>14} {'ratio':>7}")
    table = [
        ("append: prefill (one call)", "prefill"),
        ("append: one-token appends", "decode"),
        ("engine restore from the store", "restore"),
        ("park", "park"),
        ("unpark", "unpark"),
    ]
    for label, key in table:
        amount, unit = amounts[key]
        plain, sealed = median_rate(rows[key]["plain"], amount), median_rate(rows[key]["sealed"], amount)
        print(f"{label + ' (' + unit + ')':<34} {plain:>14,.1f} {sealed:>14,.1f} {sealed / plain:>7.2f}")
    plain, sealed = median_rate(http["plain"], body_bytes / 1e6), median_rate(http["sealed"], body_bytes / 1e6)
    print(f"{'resume over HTTP (MB/s)':<34} {plain:>14,.1f} {sealed:>14,.1f} {sealed / plain:>7.2f}")
    print(f"journal bytes on disk: plaintext {sizes['plain']:,}, encrypted {sizes['sealed']:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
