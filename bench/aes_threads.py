"""How AES-256-GCM decryption through ``cryptography`` scales with threads, by frame size.

An encrypted journal is a run of frames, each its own AEAD message (docs/SECURITY.md): opening one
costs a cipher context (key schedule, GHASH table) and a few calls that hold the GIL, then one
``update_into`` that releases it. This measures, with N threads each decrypting its own 256 MiB of
frames held in memory (no file, no page cache), the GB/s for frames of 256 KiB .. 16 MiB, beside
the one-shot ``AESGCM.decrypt_into`` per frame and one context over the whole buffer — so a drop
with threads can be told apart from the host's AES and memory limits.

A second table reads the frames from a file (in the page cache) as a restore does: ``preadv`` of
a few frames into a small buffer, then each frame decrypted from there, and prints the mean time
inside one ``preadv`` and one ``update_into`` beside the throughput: calls that get slower with
threads are a shared resource (memory, the kernel); calls as fast as alone but a lower throughput
are waits for the GIL between them.

    python3 bench/aes_threads.py [--threads 1 4 8 16] [--mib 256] [--where /tmp]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY = os.urandom(32)
NONCE = os.urandom(12)
BLOCK = 16


def sealed(size: int, frame: int) -> tuple[np.ndarray, list[bytes]]:
    """``size`` bytes encrypted as frames of ``frame`` bytes (one nonce for all: a benchmark only)."""
    plain = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)
    tags = []
    for a in range(0, size, frame):
        enc = Cipher(algorithms.AES(KEY), modes.GCM(NONCE)).encryptor()
        piece = enc.update(plain[a : a + frame])
        enc.finalize()
        out[a : a + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        tags.append(enc.tag)
    return out, tags


def open_streaming(ct: np.ndarray, tags: list[bytes], frame: int, out: np.ndarray) -> None:
    view, dst = ct.data, out.data
    for k, a in enumerate(range(0, ct.size, frame)):
        dec = Cipher(algorithms.AES(KEY), modes.GCM(NONCE, tags[k])).decryptor()
        n = min(frame, ct.size - a)
        dec.update_into(view[a : a + n], dst[a : a + n + BLOCK - 1])
        dec.finalize()


def open_oneshot(ct: np.ndarray, tags: list[bytes], frame: int, out: np.ndarray) -> None:
    aead = AESGCM(KEY)
    view, dst = ct.data, out.data
    for k, a in enumerate(range(0, ct.size, frame)):
        n = min(frame, ct.size - a)
        joined = bytes(view[a : a + n]) + tags[k]  # the one-shot call takes ciphertext || tag
        aead.decrypt_into(NONCE, joined, None, dst[a : a + n])


def open_from_file(fd: int, offset: int, size: int, tags: list[bytes], frame: int, stage_bytes: int, out, clock):
    """Frames ``[offset, offset + size)`` of ``fd`` read ``stage_bytes`` at a time, then decrypted."""
    stage = np.empty(stage_bytes + BLOCK, dtype=np.uint8)
    view, dst = stage.data, out.data
    spent = clock
    for s0 in range(0, size, stage_bytes):
        n = min(stage_bytes, size - s0)
        began = time.perf_counter()
        os.preadv(fd, [view[:n]], offset + s0)
        spent[0] += time.perf_counter() - began
        spent[2] += 1
        for a in range(0, n, frame):
            m = min(frame, n - a)
            began = time.perf_counter()
            dec = Cipher(algorithms.AES(KEY), modes.GCM(NONCE, tags[(s0 + a) // frame])).decryptor()
            dec.update_into(view[a : a + m], dst[s0 + a : s0 + a + m + BLOCK - 1])
            dec.finalize()
            spent[1] += time.perf_counter() - began
            spent[3] += 1


def file_table(threads: list[int], size: int, where: str | None) -> None:
    import tempfile

    frame, stage_bytes = 1 << 20, 2 << 20
    print(f"\n# from a file in the page cache: preadv of {stage_bytes >> 20} MiB, then its {frame >> 20} MiB frames")
    print("threads     GB/s   us per preadv   us per frame decrypt   busy share")
    most = max(threads)
    ct, tags = sealed(size, frame)
    with tempfile.TemporaryDirectory(dir=where) as folder:
        path = os.path.join(folder, "frames")
        with open(path, "wb") as f:
            for _ in range(most):
                f.write(ct.tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            outs = [np.empty(size + BLOCK, dtype=np.uint8) for _ in range(most)]
            for n in threads:
                best, clocks = float("inf"), []
                with ThreadPoolExecutor(n) as pool:
                    for _ in range(3):
                        round_clocks = [[0.0, 0.0, 0, 0] for _ in range(n)]
                        began = time.perf_counter()
                        list(
                            pool.map(
                                lambda i, rc=round_clocks: open_from_file(
                                    fd, i * size, size, tags, frame, stage_bytes, outs[i], rc[i]
                                ),
                                range(n),
                            )
                        )
                        took = time.perf_counter() - began
                        if took < best:
                            best, clocks = took, round_clocks
                pread_us = sum(c[0] for c in clocks) / sum(c[2] for c in clocks) * 1e6
                frame_us = sum(c[1] for c in clocks) / sum(c[3] for c in clocks) * 1e6
                busy = sum(c[0] + c[1] for c in clocks) / (n * best)
                print(f"{n:7d} {n * size / best / 1e9:8.2f} {pread_us:15.0f} {frame_us:22.0f} {busy:12.2f}")
        finally:
            os.close(fd)


def rate(threads: int, work, inputs) -> float:
    outs = [np.empty(inputs[0][0].size + BLOCK, dtype=np.uint8) for _ in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        best = float("inf")
        for _ in range(3):
            began = time.perf_counter()
            list(pool.map(lambda i: work(*inputs[i], outs[i]), range(threads)))
            best = min(best, time.perf_counter() - began)
    return threads * inputs[0][0].size / best / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--mib", type=int, default=256, help="MiB each thread decrypts")
    parser.add_argument("--where", default=None, help="folder for the file of frames (default: a temporary one)")
    args = parser.parse_args()
    size = args.mib << 20
    frames = [256 << 10, 1 << 20, 4 << 20, 16 << 20, size]
    most = max(args.threads)
    print(f"# AES-256-GCM decrypt, {args.mib} MiB a thread; GB/s over all threads (best of 3)")
    print("threads " + "".join(f"{f'frame {f >> 10} KiB':>16}" for f in frames) + "   one-shot 1 MiB")
    cases = {f: [sealed(size, f) for _ in range(most)] for f in frames}
    for n in args.threads:
        row = [rate(n, lambda ct, tags, out, f=f: open_streaming(ct, tags, f, out), cases[f]) for f in frames]
        one = rate(n, lambda ct, tags, out: open_oneshot(ct, tags, 1 << 20, out), cases[1 << 20])
        print(f"{n:7d} " + "".join(f"{r:16.2f}" for r in row) + f"{one:18.2f}")
    file_table(args.threads, size, args.where)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
