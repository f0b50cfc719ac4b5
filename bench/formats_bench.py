"""Formats and journal benchmarks (issue 2): each figure is a ratio measured in this one run.

- load of a GLM-5-geometry v2 file + token access vs ``np.fromfile`` of the same file (raw read);
- dequantize of those rows vs torch's own float8_e4m3fn -> f32 conversion times the scale;
- append of 256-record turns with the fsync protocol vs a bare write + fsync of the same bytes;
- v1 -> v2 migration throughput (MB/s of source read), next to the raw read bandwidth.

Usage: python bench/formats_bench.py [--records 4096] [--dir /tmp/kvbench] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore import tiers
from kvstore.filerewrite import migrate_file
from kvstore.formats import coli_kv, fp8
from kvstore.formats.coli_kv import Geometry, Header, Tier
from kvstore.journal import KVFile

GLM5 = Geometry(n_layers=78, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=154880)


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up: page cache, allocator, imports
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def synthetic_rows(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, GLM5.vocab, n).astype(np.int32)
    L = rng.standard_normal((GLM5.n_layers, n, GLM5.kv_lora), dtype=np.float32)
    R = rng.standard_normal((GLM5.n_layers, n, GLM5.qk_rope), dtype=np.float32)
    return tokens, L, R


def write_file(path: Path, tier: Tier, n: int, chunk: int = 512) -> None:
    """Build a file of n records chunk by chunk (bounded memory)."""
    header = Header(GLM5, tier, n)
    with open(path, "wb") as f:
        f.write(header.to_bytes())
        for start in range(0, n, chunk):
            tokens, L, R = synthetic_rows(min(chunk, n - start), seed=start)
            f.write(coli_kv.encode_records(GLM5, tier, tokens, L, R).tobytes())


def bench_load(path: Path, repeat: int) -> dict:
    raw = median_time(lambda: np.fromfile(path, dtype=np.uint8), repeat)

    def load_and_touch():
        records = coli_kv.load(path)
        return int(records.tokens[-1]) + records.n

    ours = median_time(load_and_touch, repeat)
    size = path.stat().st_size
    return {"bytes": size, "fromfile_s": raw, "load_s": ours, "ratio": ours / raw, "raw_GBps": size / raw / 1e9}


def bench_dequantize(path: Path, repeat: int) -> dict:
    import torch

    records = coli_kv.load(path)
    L_codes, L_scales = records.quantized("L")
    R_codes, R_scales = records.quantized("R")
    tL, tLs = torch.from_numpy(L_codes), torch.from_numpy(L_scales)
    tR, tRs = torch.from_numpy(R_codes), torch.from_numpy(R_scales)

    def torch_dequant():
        a = tL.view(torch.float8_e4m3fn).to(torch.float32) * tLs[..., None]
        b = tR.view(torch.float8_e4m3fn).to(torch.float32) * tRs[..., None]
        return a, b

    def ours_contiguous():
        return fp8.dequantize_rows(L_codes, L_scales), fp8.dequantize_rows(R_codes, R_scales)

    t_torch = median_time(torch_dequant, repeat)
    t_ours = median_time(ours_contiguous, repeat)
    t_file = median_time(records.dequantize, repeat)
    a, b = torch_dequant()
    c, d = ours_contiguous()
    assert np.array_equal(a.numpy(), c) and np.array_equal(b.numpy(), d), "dequantize disagrees with torch"
    values = L_codes.size + R_codes.size
    return {
        "values": values,
        "torch_s": t_torch,
        "ours_s": t_ours,
        "ours_from_records_s": t_file,
        "ratio": t_ours / t_torch,
        "ratio_from_records": t_file / t_torch,
        "torch_threads": torch.get_num_threads(),
    }


def bench_append(directory: Path, turns: int, turn_records: int, trials: int = 5) -> dict:
    tier = tiers.FP8
    tokens, L, R = synthetic_rows(turn_records, seed=99)
    encoded = coli_kv.encode_records(GLM5, tier, tokens, L, R)
    payload = encoded.tobytes()

    def ours(validate: bool) -> float:
        path = directory / "append.coli_kv"
        path.unlink(missing_ok=True)
        with KVFile.create(path, GLM5, tier) as journal:
            started = time.perf_counter()
            for _ in range(turns):
                journal.append_records(encoded, validate=validate)
            return time.perf_counter() - started

    def bare() -> float:
        path = directory / "bare.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            started = time.perf_counter()
            for _ in range(turns):
                os.write(fd, payload)
                os.fsync(fd)
            return time.perf_counter() - started
        finally:
            os.close(fd)

    ours(False), bare()  # warm-up
    # Interleaved so that disk-state drift hits both sides alike.
    samples = {"ours": [], "validated": [], "bare": []}
    for _ in range(trials):
        samples["bare"].append(bare())
        samples["ours"].append(ours(False))
        samples["validated"].append(ours(True))
    t = {k: statistics.median(v) for k, v in samples.items()}
    total = turns * turn_records
    return {
        "turn_records": turn_records,
        "turn_bytes": len(payload),
        "ours_records_per_s": total / t["ours"],
        "validated_records_per_s": total / t["validated"],
        "bare_records_per_s": total / t["bare"],
        "ratio": t["bare"] / t["ours"],  # our throughput as a fraction of the bare one
        "validated_ratio": t["bare"] / t["validated"],
    }


def bench_migrate(directory: Path, n: int) -> dict:
    src = directory / "v1.coli_kv"
    write_file(src, tiers.F32, n)
    dst = directory / "v2.coli_kv"
    raw = median_time(lambda: np.fromfile(src, dtype=np.uint8), 2)
    report = migrate_file(src, dst, tiers.FP8, overwrite=True)  # warm
    report = migrate_file(src, dst, tiers.FP8, overwrite=True)
    return {
        "source_bytes": report["source_bytes"],
        "seconds": report["seconds"],
        "mb_per_s": report["mb_per_s"],
        "raw_read_mb_per_s": src.stat().st_size / raw / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=4096)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--turns", type=int, default=16)
    args = parser.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="kvbench-"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        v2 = directory / "glm5.v2.coli_kv"
        write_file(v2, tiers.FP8, args.records)
        load = bench_load(v2, args.repeat)
        deq = bench_dequantize(v2, args.repeat)
        app = bench_append(directory, args.turns, 256)
        mig = bench_migrate(directory, args.records)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"GLM-5 geometry (78 layers, kv_lora 512, qk_rope 64, no indexer), {args.records} records")
    print("| benchmark | ours | peer / limit | ratio | target |")
    print("|---|---|---|---|---|")
    print(
        f"| load v2 file ({load['bytes'] / 1e6:.0f} MB) + tokens | {load['load_s'] * 1e3:.1f} ms | "
        f"np.fromfile {load['fromfile_s'] * 1e3:.1f} ms ({load['raw_GBps']:.2f} GB/s) | {load['ratio']:.2f}x | <= 1.3x |"
    )
    print(
        f"| dequantize {deq['values'] / 1e6:.0f}M fp8 values (contiguous codes) | {deq['ours_s'] * 1e3:.1f} ms | "
        f"torch float8_e4m3fn->f32 * scale {deq['torch_s'] * 1e3:.1f} ms ({deq['torch_threads']} threads) | "
        f"{deq['ratio']:.2f}x | <= 1.5x |"
    )
    print(
        f"| dequantize straight from the record layout | {deq['ours_from_records_s'] * 1e3:.1f} ms | "
        f"same torch time | {deq['ratio_from_records']:.2f}x | - |"
    )
    print(
        f"| append 256-record turns ({app['turn_bytes'] / 1e6:.1f} MB each) | {app['ours_records_per_s']:.0f} rec/s | "
        f"bare write+fsync {app['bare_records_per_s']:.0f} rec/s | {app['ratio']:.2f}x of bare | >= 0.8x |"
    )
    print(
        f"| append, validating untrusted bytes first | {app['validated_records_per_s']:.0f} rec/s | "
        f"same bare | {app['validated_ratio']:.2f}x of bare | - |"
    )
    print(
        f"| migrate v1 -> v2 ({mig['source_bytes'] / 1e6:.0f} MB source) | {mig['mb_per_s']:.0f} MB/s | "
        f"raw read {mig['raw_read_mb_per_s']:.0f} MB/s | - | - |"
    )


if __name__ == "__main__":
    main()
