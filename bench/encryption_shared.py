"""Encryption at rest on the shared store: an encrypted shared store against a plaintext one, same run.

One PostgreSQL cluster and one moto S3 server (the test servers of ``tests/shared``) hold two
stores side by side — two databases, two buckets — one opened with a KEK
(``kvstore.store.open(index_url=..., blobs_url=..., kek=...)``), one without. Both get the same
valid fp8 records of a GLM-4.5-style MLA geometry (78 layers, 45,556 B a token). Every measure
alternates plaintext and encrypted, ``--repeat`` times; the ratio is encrypted throughput ÷
plaintext throughput, the median over the back-to-back pairs (the issue's target: at least 0.8).

- append, prefill: ``--tokens`` tokens in one ``append_records`` (one sealed segment: intent,
  upload, fenced commit), tokens per second;
- append, turns: ``--turns`` appends of ``--turn`` tokens each (the decode loop's shape on a
  replica: a lease, an upload and a commit each), appends per second;
- resume, cold: ``SharedSessionStore.resume`` of the whole session by a replica without a cache
  (every object fetched from S3, opened, digest-checked), tokens per second;
- resume, from the replica's cache: the same with a warm segment cache (the copies are ciphertext
  on the encrypted store, opened at each read), tokens per second.

    PYTHONPATH=. python3 bench/encryption_shared.py                    # BENCHMARKS.md's figures
    PYTHONPATH=. python3 bench/encryption_shared.py --tokens 512 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import boto3

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from api_common import GLM, MODEL, TIER, v2_records  # noqa: E402

import kvstore.store  # noqa: E402
from kvstore.crypto import LocalKEK  # noqa: E402
from kvstore.store.shared.sessions import SharedSessionStore  # noqa: E402
from shared.servers import MotoServer, PostgresCluster, postgres_bin  # noqa: E402

OWNER = "bench"


def paired_ratio(plain_s: list[float], sealed_s: list[float]) -> float:
    """Median over runs of plaintext seconds / encrypted seconds (each pair back to back)."""
    return statistics.median(p / s for p, s in zip(plain_s, sealed_s))


def timed(work) -> float:
    began = time.perf_counter()
    work()
    return time.perf_counter() - began


def one_run(writer: SharedSessionStore, reader: SharedSessionStore, sid: str, prefill, turns) -> dict[str, float]:
    """Seconds of each measure on one store: a new session ``sid`` written by ``writer``, resumed
    cold by it (no cache), then by ``reader`` from its warm segment cache."""
    writer.create(OWNER, GLM, TIER, MODEL, session_id=sid)
    out = {"prefill": timed(lambda: writer.append_records(sid, prefill, owner=OWNER))}

    def decode() -> None:
        for rows in turns:
            writer.append_records(sid, rows, owner=OWNER)

    out["turns"] = timed(decode)
    out["cold"] = timed(lambda: writer.resume(sid, owner=OWNER))
    reader.resume(sid, owner=OWNER)  # fills the replica's cache
    reader.shared.reads.flush()
    out["cached"] = timed(lambda: reader.resume(sid, owner=OWNER))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the prefill (and of the session resumed)")
    parser.add_argument("--turns", type=int, default=16, help="appends of --turn tokens after the prefill")
    parser.add_argument("--turn", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"})
    bindir = postgres_bin()
    if bindir is None:
        print("PostgreSQL binaries not found (/usr/lib/postgresql/*/bin)", file=sys.stderr)
        return 2
    cluster, moto = PostgresCluster(bindir), MotoServer()
    os.environ["AWS_ENDPOINT_URL"] = moto.endpoint
    folder = Path(tempfile.mkdtemp(prefix="kvstore-enc-shared-"))
    kek = LocalKEK(os.urandom(32), "the bench's KEK")
    try:
        s3 = boto3.client("s3", endpoint_url=moto.endpoint)
        urls = {}
        for mode in ("plain", "sealed"):
            bucket = f"kv-{uuid.uuid4().hex[:8]}"
            s3.create_bucket(Bucket=bucket)
            urls[mode] = {"index_url": cluster.new_database(), "blobs_url": f"s3://{bucket}/kv"}
        keks = {"plain": None, "sealed": kek}

        def store(mode: str, cache: str | None = None) -> SharedSessionStore:
            opened = kvstore.store.open(
                folder / cache if cache else None, **urls[mode], kek=keks[mode], cache_bytes=(4 << 30) if cache else 0
            )
            assert isinstance(opened, SharedSessionStore) and opened.encrypted == (mode == "sealed")
            return opened

        prefill = v2_records(args.tokens, seed=1)
        turns = [v2_records(args.turn, seed=10 + i) for i in range(args.turns)]
        times: dict[str, dict[str, list[float]]] = {
            m: {"prefill": [], "turns": [], "cold": [], "cached": []} for m in urls
        }
        writers = {mode: store(mode) for mode in urls}
        readers = {mode: store(mode, cache=f"replica-{mode}") for mode in urls}
        try:
            for rep in range(args.repeat):
                for mode in ("plain", "sealed") if rep % 2 == 0 else ("sealed", "plain"):
                    for name, seconds in one_run(writers[mode], readers[mode], f"s{rep}", prefill, turns).items():
                        times[mode][name].append(seconds)
            n_resumed = args.tokens + args.turns * args.turn
            rows = [
                ("append: prefill in one call (tokens/s)", "prefill", args.tokens),
                (f"append: {args.turn}-token turns (appends/s)", "turns", args.turns),
                ("resume, cold: every object from S3 (tokens/s)", "cold", n_resumed),
                ("resume from the replica's segment cache (tokens/s)", "cached", n_resumed),
            ]
            print(
                f"shared store, {args.tokens}-token prefill + {args.turns} x {args.turn}-token turns "
                f"({n_resumed * prefill.dtype.itemsize / 1e6:.1f} MB), {args.repeat} runs alternating"
            )
            print("| measure | plaintext | encrypted | ratio | best |\n|---|---:|---:|---:|---:|")
            for label, name, amount in rows:
                plain_s, sealed_s = times["plain"][name], times["sealed"][name]
                print(
                    f"| {label} | {amount / statistics.median(plain_s):,.0f} | {amount / statistics.median(sealed_s):,.0f} "
                    f"| {paired_ratio(plain_s, sealed_s):.2f} | {min(plain_s) / min(sealed_s):.2f} |"
                )
            plain_bytes = sum(u["used_bytes"] for u in [writers["plain"].usage()])
            sealed_bytes = sum(u["used_bytes"] for u in [writers["sealed"].usage()])
            print(f"bytes held: {plain_bytes:,} plaintext vs {sealed_bytes:,} encrypted")
        finally:
            for opened in (*writers.values(), *readers.values()):
                opened.close()
    finally:
        moto.close()
        cluster.close()
        shutil.rmtree(folder, ignore_errors=True)  # ~1 GB of replica caches a run
    return 0


if __name__ == "__main__":
    sys.exit(main())
