"""How a restore's reads of an encrypted session scale with threads, beside a plaintext one's.

A plaintext and an encrypted store (``kvstore.store.open(kek=...)``) get the same session (valid fp8
records of a GLM-4.5-style geometry, 45,556 B a token). Each is read the way a device restore fills
its ring — ``reader.read_into`` of ring-sized chunks (``reader.chunk_starts``: ending on the
encrypted journal's frames) by N threads into N x 2 reused buffers — and the throughput printed for
N = 1, 2, 4, ... up to the cores. Beside it, the host's own limits with the same threads: AES-256-GCM
(``cryptography``'s streaming interface, one 64 MiB buffer a thread) and memcpy.

    PYTHONPATH=. python3 bench/sealed_read.py                  # 8192 tokens (373 MB)
    PYTHONPATH=. python3 bench/sealed_read.py --tokens 32768
    PYTHONPATH=. python3 bench/sealed_read.py --tokens 32768 --device cuda
    PYTHONPATH=. python3 bench/sealed_read.py --tokens 32768 --threads 8 --device cuda --stages 8

With ``--device cuda`` it also restores each session into an fp8 ``LatentCache`` on the GPU the
way the engine does (``restore_body(ReaderBody(reader))``: the reads above, each chunk uploaded
from the pinned ring and placed as it arrives) with the same threads, and then the encrypted
restore again under two variants that isolate where its time goes: the interpreter's switch
interval cut from 5 ms to 0.2 ms (reader threads waiting for the GIL behind the uploading thread)
and each range read into a buffer and decrypted from there, as before ranges were mapped
(``sealed.MAP_BYTES``); the first table has that column too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_common import GLM, MODEL, TIER, v2_records  # noqa: E402

import kvstore.store  # noqa: E402
from kvstore.crypto.kek import write_kek_file  # noqa: E402
from kvstore.engine.restore import CHUNK_BYTES  # noqa: E402


def best_of(repeat: int, work) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return min(times)


def ring_read(store, threads: int) -> tuple[float, int]:
    """Seconds of the best of 3 ring reads of the session, each through a reader of its own (as a
    restore opens one), and the bytes read."""
    with store.reader("s", owner="bench") as reader:
        per = max(1, CHUNK_BYTES // reader.record_bytes)
        starts = reader.chunk_starts(per) or list(range(0, reader.n_records, per))
        counts = [b - a for a, b in zip(starts, [*starts[1:], reader.n_records])]
        size, chunk_bytes = reader.body_bytes, per * reader.record_bytes
    ring = [np.ones(chunk_bytes, dtype=np.uint8) for _ in range(2 * threads)]

    def work() -> None:
        with store.reader("s", owner="bench") as reader, ThreadPoolExecutor(threads) as pool:
            read = lambda i: reader.read_into(ring[i % len(ring)], starts[i], counts[i])  # noqa: E731
            assert sum(pool.map(read, range(len(starts)))) == reader.n_records

    return best_of(3, work), size


def device_restore(store, threads: int, device: str) -> float:
    """Seconds of the best of 3 restores of the session into an fp8 cache on ``device``."""
    import torch

    from kvstore.engine.cache import LatentCache
    from kvstore.engine.restore import ReaderBody

    cache = LatentCache(TIER, GLM, device)

    def work() -> None:
        with store.reader("s", owner="bench") as reader:
            cache.restore_body(ReaderBody(reader), headroom=0, threads=threads)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    work()  # the pinned ring and the device buffers into torch's caching allocators
    return best_of(3, work)


def host_limits(threads: int) -> tuple[float, float]:
    """GB/s of AES-256-GCM and of memcpy with ``threads`` threads, 64 MiB each."""
    key, nonce = os.urandom(32), os.urandom(12)
    sources = [np.frombuffer(os.urandom(64 << 20), dtype=np.uint8) for _ in range(threads)]
    outs = [np.ones(64 << 20, dtype=np.uint8) for _ in range(threads)]

    def aes(i: int) -> None:
        Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor().update_into(sources[i][:-16], outs[i])

    def copy(i: int) -> None:
        np.copyto(outs[i], sources[i])

    rates = []
    for one in (aes, copy):
        with ThreadPoolExecutor(threads) as pool:
            took = best_of(3, lambda one=one: list(pool.map(one, range(threads))))
        rates.append(threads * (64 << 20) / took / 1e9)
    return rates[0], rates[1]


@contextlib.contextmanager
def per_range() -> Iterator[None]:
    """Each encrypted range read maps and unmaps its own bytes (the way before a reader held one
    mapping of its journal: ``SealedKVFile.map_for_reads``)."""
    from kvstore.sealed import SealedKVFile

    held = SealedKVFile.map_for_reads
    SealedKVFile.map_for_reads = lambda self: None
    try:
        yield
    finally:
        SealedKVFile.map_for_reads = held


@contextlib.contextmanager
def unmapped() -> Iterator[None]:
    """Encrypted ranges read into a buffer, then decrypted (the way before they were mapped)."""
    import kvstore.sealed

    threshold = kvstore.sealed.MAP_BYTES
    kvstore.sealed.MAP_BYTES = 1 << 62
    try:
        yield
    finally:
        kvstore.sealed.MAP_BYTES = threshold


def device_table(stores: dict, counts: list[int], size: int, device: str) -> None:
    print(f"\n# restore into an fp8 cache on {device} (restore_body(ReaderBody(reader)), best of 3)")
    print(
        "threads  plaintext GB/s  encrypted GB/s  ratio   enc. map per range   enc. 0.2 ms switch   enc. read, no map"
    )
    for n in counts:
        plain_s, sealed_s = device_restore(stores["plain"], n, device), device_restore(stores["sealed"], n, device)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(0.0002)
        try:
            switch_s = device_restore(stores["sealed"], n, device)
        finally:
            sys.setswitchinterval(interval)
        with per_range():
            range_s = device_restore(stores["sealed"], n, device)
        with unmapped():
            read_s = device_restore(stores["sealed"], n, device)
        print(
            f"{n:7d} {size / plain_s / 1e9:15.2f} {size / sealed_s / 1e9:15.2f} {plain_s / sealed_s:6.2f} "
            f"{size / range_s / 1e9:20.2f} {size / switch_s / 1e9:20.2f} {size / read_s / 1e9:18.2f}"
        )


def stage_table(store, device: str, threads: int) -> None:
    """The plaintext restore's parts apart, on ``device`` (``--stages``): the ring's reads alone,
    the uploads alone (16 MiB chunks from pinned memory into one device stage, one stream), the
    placement alone (chunks already on the device split into the cache's fields), uploads and
    placement in turn without reads (the old pipeline's device side), the same overlapped (two
    stages, uploads on a copy stream: the pipeline's now; CUDA only), then the whole restore with
    one device stage and with the default — what bounds the restore where its reads alone run
    twice as fast (issue 41)."""
    import torch

    from kvstore.engine import restore
    from kvstore.engine.cache import LatentCache
    from kvstore.engine.restore import Placement

    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with store.reader("s", owner="bench") as reader:
        n, rec = reader.n_records, reader.record_bytes
        per = max(1, CHUNK_BYTES // rec)
        starts = list(range(0, n, per))
        host = torch.empty(n * rec, dtype=torch.uint8, pin_memory=cuda)
        reader.read_into(host.numpy(), 0, n)
    size = n * rec
    cache = LatentCache(TIER, GLM, device)
    placement = Placement(GLM, TIER, native=cache._record_fields(TIER))
    full = cache._allocate(n, zeros=False)
    stage = torch.empty(per * rec, dtype=torch.uint8, device=dev)
    whole = host.to(dev)

    def upload() -> None:
        for a in starts:
            got = min(per, n - a)
            stage[: got * rec].copy_(host[a * rec : (a + got) * rec], non_blocking=True)
        sync()

    def place() -> None:
        for a in starts:
            got = min(per, n - a)
            placement.apply(whole[a * rec : (a + got) * rec].view(got, rec), full, a)
        sync()

    host_s = [0.0]

    def both() -> None:
        began = time.perf_counter()
        for a in starts:
            got = min(per, n - a)
            raw = stage[: got * rec]
            raw.copy_(host[a * rec : (a + got) * rec], non_blocking=True)
            placement.apply(raw.view(got, rec), full, a)
        host_s[0] = time.perf_counter() - began  # the loop's own time, before waiting for the device
        sync()

    def overlapped() -> None:  # as the restore now queues them: two stages, uploads on a copy stream
        copies = restore._DeviceStages(per * rec, 2)
        done = torch.cuda.Event()
        for a in starts:
            got = min(per, n - a)
            raw = copies.upload(host[a * rec : (a + got) * rec], done)
            placement.apply(raw.view(got, rec), full, a)
            copies.placed()
        sync()

    works = (upload, place, both, overlapped) if cuda else (upload, place, both)
    for work in works:
        work()  # first-call costs
    reads_s, _ = ring_read(store, threads)
    upload_s, place_s, both_s = best_of(3, upload), best_of(3, place), best_of(3, both)
    overlapped_s = best_of(3, overlapped) if cuda else float("nan")
    stages = restore.DEVICE_STAGES
    restore.DEVICE_STAGES = 1
    try:
        one_stage_s = device_restore(store, threads, device)
    finally:
        restore.DEVICE_STAGES = stages
    restore_s = device_restore(store, threads, device)
    print(f"\n# the plaintext restore's parts on {device}, {size / 1e6:.0f} MB in {len(starts)} chunks (best of 3)")
    print("| part | GB/s | ms |")
    print("|---|---:|---:|")
    for name, took in (
        (f"ring reads alone, {threads} threads", reads_s),
        ("uploads alone (pinned -> one device stage, one stream)", upload_s),
        ("placement alone (chunks already on the device)", place_s),
        ("uploads and placement in turn, no reads", both_s),
        ("  of which the host's loop, before the device is waited for", host_s[0]),
        ("uploads on a copy stream beside the placement, two stages, no reads", overlapped_s),
        (f"the whole restore, one device stage (the old pipeline), {threads} threads", one_stage_s),
        (f"the whole restore, {restore.DEVICE_STAGES} device stages, {threads} threads", restore_s),
    ):
        print(f"| {name} | {size / took / 1e9:.2f} | {took * 1e3:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, nargs="+", help="thread counts (default 1, 2, 4, ... up to the cores)")
    parser.add_argument("--device", default=None, help="also restore into a cache on this device (cuda)")
    parser.add_argument("--where", default=None, help="folder for the stores (default: a temporary one)")
    parser.add_argument(
        "--stages",
        type=int,
        default=0,
        metavar="THREADS",
        help="with --device: also time the plaintext restore's parts apart (reads, uploads, placement) with THREADS readers",
    )
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    counts = args.threads or [n for n in (1, 2, 4, 8, 16, 32) if n <= cores]
    with tempfile.TemporaryDirectory(dir=args.where) as folder:
        root = Path(folder)
        kek = write_kek_file(root / "kek")
        records = v2_records(args.tokens, 1)
        stores = {"plain": kvstore.store.open(root / "plain"), "sealed": kvstore.store.open(root / "sealed", kek=kek)}
        try:
            for store in stores.values():
                store.create("bench", GLM, TIER, MODEL, session_id="s")
                store.append_records("s", records)
                ring_read(store, 1)  # the journal's pages into the page cache
            print(f"# {args.tokens} tokens, {records.nbytes / 1e6:.0f} MB; ring chunks of {CHUNK_BYTES >> 20} MiB")
            print(
                "threads  plaintext GB/s  encrypted GB/s  ratio   enc. map per range  enc. read, no map"
                "  AES-GCM GB/s  memcpy GB/s"
            )
            for n in counts:
                (plain_s, size), (sealed_s, _) = ring_read(stores["plain"], n), ring_read(stores["sealed"], n)
                with per_range():
                    range_s, _ = ring_read(stores["sealed"], n)
                with unmapped():
                    read_s, _ = ring_read(stores["sealed"], n)
                aes, copy = host_limits(n)
                print(
                    f"{n:7d} {size / plain_s / 1e9:15.2f} {size / sealed_s / 1e9:15.2f} {plain_s / sealed_s:6.2f} "
                    f"{size / range_s / 1e9:19.2f} {size / read_s / 1e9:18.2f} {aes:13.1f} {copy:12.1f}"
                )
            if args.device:
                device_table(stores, counts, records.nbytes, args.device)
                if args.stages:
                    stage_table(stores["plain"], args.device, args.stages)
        finally:
            for store in stores.values():
                store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
