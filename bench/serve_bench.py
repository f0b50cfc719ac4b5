"""Serving many conversations through HTTP against the engine's own batch, in one run.

    python bench/serve_bench.py [--device cpu] [--tier f32] [--clients 1 4 16 64] [--tokens 64] [--long 32768]

A real ``kvstore serve --model`` (a random ``tiny`` model folder, or ``--model DIR``) in a child
process; each client streams one turn on a session of its own (``POST /sessions/{id}/generate``,
server-sent events) and records when each token arrives. For every client count:

- **aggregate tok/s through HTTP**: tokens of every client / wall time from the first request to the
  last token (what the server delivers while every client waits on it);
- **in-process batch**: ``Engine.generate_batch`` on the same model, tier and prompts, in this
  process while the server is idle, wall time including the prompts' prefill — the ratio says what
  the scheduler and HTTP cost against the engine's own batch;
- the ratio to **one client** (the same table's first row);
- **time to first token**, p50 and p99 over the clients;
- the **server's CPU** over the timed round (every thread of its process, from ``/proc``): the cores
  it kept busy on average and its CPU microseconds per generated token — where the server, not the
  device, is what a round waits on (one core's worth for a Python process whose threads share the
  GIL). On a GPU it includes the scheduler thread's wait for each step's tokens, which spins on the
  CUDA stream: near one core whatever the host does (a py-spy profile, ``--profile``, says more);
- the **scheduler** over the round (from ``/metrics``): its steps, its prefill forwards and the
  prompts that ran inside decode steps instead (``--step-tokens``), the mean prefill forward and
  the mean step (a decode step's device time and the host's).

Then, with ``--long N``: a session of N stored rows (written straight into the store before the
server starts, so its first turn restores it from the journal) gets one turn while 15 other clients
decode: its time to first token, and the others' worst gap between two tokens meanwhile against
their median gap before it.

On a 2-core machine the clients and the server share the cores: report the figures, not a target.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_common import KEY, Server, percentile, process_cpu_seconds, server_metrics  # noqa: E402

OWNER = "bench"


def _stream_turn(
    url: str,
    session_id: str,
    tokens: list[int],
    max_new: int,
    marks: list[float],
    done: dict | None = None,
    ready: threading.Barrier | None = None,
) -> float:
    """One streamed turn; appends each token's arrival time to ``marks`` (and puts the turn's
    closing ``done`` event into ``done``); returns the request's start. With ``ready``, the client
    is made first and the request waits for every other client's: an ``httpx.Client`` takes ~10-20
    ms of this process's GIL to make (its TLS context), and 64 made one after another would spread
    the requests' starts over most of a second, a cost of this bench, not of the server."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=3600) as client:
        if ready is not None:
            ready.wait()
        began = time.perf_counter()
        body = {"tokens": tokens, "max_new_tokens": max_new, "stop": [], "stream": True}
        with client.stream("POST", f"/sessions/{session_id}/generate", json=body) as answer:
            if answer.status_code != 200:
                raise RuntimeError(f"{session_id}: {answer.status_code} {answer.read()!r}")
            last = ""
            for line in answer.iter_lines():
                if line.startswith("event: token"):
                    marks.append(time.perf_counter())
                elif line.startswith("data:") and last.startswith("event: done") and done is not None:
                    done.update(json.loads(line[5:]))
                last = line
        return began


def _py_spy(pid: int, out: Path) -> subprocess.Popen:
    """py-spy sampling the server's threads while they hold the GIL (collapsed stacks, one per
    thread): which thread the others wait on, and what it does then."""
    exe = shutil.which("py-spy") or "/tmp/site/bin/py-spy"
    spy = subprocess.Popen(
        [
            exe,
            "record",
            "--pid",
            str(pid),
            "--gil",
            "--threads",
            "--nonblocking",
            "--rate",
            "500",
            "--format",
            "raw",
            "-o",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # attached before the round starts
    return spy


SCHEDULER_METRICS = {
    "kvstore_scheduler_steps_total": "steps",
    "kvstore_scheduler_prefill_forwards_total": "forwards",
    "kvstore_scheduler_step_prompts_total": "step_prompts",
    'kvstore_scheduler_seconds_total{phase="prefill"}': "prefill_s",
    'kvstore_scheduler_seconds_total{phase="decode"}': "decode_s",
}


def scheduler_counts(url: str) -> dict[str, float]:
    """The scheduler's counters from ``/metrics`` (steps, prefill forwards, prompts run inside
    steps, seconds in prefill forwards and in decode steps)."""
    page = server_metrics(url)
    return {short: page[name] for name, short in SCHEDULER_METRICS.items() if name in page}


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, vocab, n).tolist()


def http_round(
    url: str,
    clients: int,
    prompt_len: int,
    tokens: int,
    vocab: int,
    round_id: int,
    server_pid: int | None = None,
    profile: Path | None = None,
) -> dict:
    sessions = [f"r{round_id}c{i}" for i in range(clients)]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as client:
        for sid in sessions:  # the sessions exist (and are resident) before the timed turns
            made = client.post(
                f"/sessions/{sid}/generate", json={"tokens": [2], "create": True, "max_new_tokens": 0, "stop": []}
            )
            made.raise_for_status()
    marks: list[list[float]] = [[] for _ in sessions]
    starts = [0.0] * clients
    errors: list[str] = []
    ready = threading.Barrier(clients + 1)  # every client made before the round's clock starts

    def run(i: int) -> None:
        try:
            starts[i] = _stream_turn(url, sessions[i], _prompt(i, prompt_len, vocab), tokens, marks[i], ready=ready)
        except Exception as exc:  # reported below
            errors.append(str(exc))
            ready.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    counts_before = scheduler_counts(url)
    spy = _py_spy(server_pid, profile) if profile is not None and server_pid else None
    for thread in threads:
        thread.start()
    cpu_before = process_cpu_seconds(server_pid) if server_pid else 0.0
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass  # a client failed: reported below
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    cpu = process_cpu_seconds(server_pid) - cpu_before if server_pid else float("nan")
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
        spy.wait(timeout=60)
    if errors:
        raise RuntimeError(errors[0])
    counts = {k: v - counts_before.get(k, 0.0) for k, v in scheduler_counts(url).items()}
    first, last = min(starts), max(m[-1] for m in marks)
    ttft = [m[0] - s for m, s in zip(marks, starts)]
    total = sum(len(m) for m in marks)
    return {
        "tok_s": total / (last - first),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        # the server's CPU over the round (every thread: scheduler, readers, event loop, appends):
        # cores busy on average, and CPU time per generated token
        "server_cores": cpu / wall,
        "server_us_per_token": cpu / max(1, total) * 1e6,
        # the scheduler over the round: its steps, the prefill forwards and the prompts that ran
        # inside decode steps instead, and the mean time of a prefill forward and of a decode step
        "steps": counts.get("steps", 0.0),
        "forwards": counts.get("forwards", 0.0),
        "step_prompts": counts.get("step_prompts", 0.0),
        "prefill_ms": counts.get("prefill_s", 0.0) / max(1.0, counts.get("forwards", 0.0)) * 1e3,
        "step_ms": counts.get("decode_s", 0.0) / max(1.0, counts.get("steps", 0.0)) * 1e3,
    }


def in_process(model, tier: str, clients: int, prompt_len: int, tokens: int, vocab: int) -> float:
    from kvstore.engine import BatchSequence, Engine

    engine = Engine(model, tier=tier)
    batch = [BatchSequence(engine.new_cache(), [2, *_prompt(i, prompt_len, vocab)]) for i in range(clients)]
    began = time.perf_counter()
    result = engine.generate_batch(batch, max_new_tokens=tokens, stop_tokens=())
    return result.generated / (time.perf_counter() - began)


def random_folder(folder: Path, args) -> Path:
    """A random model folder of ``args.preset`` in ``args.dtype``, its weights drawn on ``args.device``
    (V2-Lite's 15.7 B parameters take seconds on a GPU, minutes on a CPU)."""
    from kvstore.engine.config import preset
    from kvstore.engine.tokenizer import write_byte_tokenizer
    from kvstore.engine.weights import random_model, save_model

    began = time.perf_counter()
    cfg = preset(args.preset)
    model = random_model(cfg, seed=0, device=args.device, dtype=args.dtype)
    save_model(model, folder, dtype=args.dtype)
    write_byte_tokenizer(folder, cfg)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    print(f"serve_bench: wrote a random {args.preset} model folder in {time.perf_counter() - began:.1f} s")
    return folder


def write_long_session(data: Path, folder: Path, tier: str, rows: int) -> None:
    """A session of ``rows`` stored rows with the folder's fingerprint (random rows: a restore reads
    and uploads them all the same)."""
    from kvstore import tiers
    from kvstore.engine.config import ModelConfig
    from kvstore.engine.fingerprint import folder_model_info
    from kvstore.store import open as open_store

    config = ModelConfig.from_file(folder / "config.json")
    geometry = config.coli_geometry()
    tier_of = tiers.get(tier).file_tier
    with open_store(data) as store:
        store.create(OWNER, geometry, tier_of, folder_model_info(folder), session_id="long")
        rng = np.random.default_rng(0)
        for start in range(0, rows, 4096):
            k = min(4096, rows - start)
            L = rng.standard_normal((geometry.n_layers, k, geometry.kv_lora)).astype(np.float32)
            R = rng.standard_normal((geometry.n_layers, k, geometry.qk_rope)).astype(np.float32)
            store.append("long", rng.integers(2, geometry.vocab, k).astype(np.int32), L, R, owner=OWNER)


def long_resume(url: str, others: int, vocab: int) -> dict:
    """A turn on the long session while ``others`` clients decode: its TTFT, their worst gap."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as client:
        for i in range(others):
            client.post(
                f"/sessions/o{i}/generate", json={"tokens": [2], "create": True, "max_new_tokens": 0, "stop": []}
            ).raise_for_status()
    marks: list[list[float]] = [[] for _ in range(others)]
    threads = [
        threading.Thread(target=_stream_turn, args=(url, f"o{i}", _prompt(i, 8, vocab), 1000, marks[i]))
        for i in range(others)
    ]
    for thread in threads:
        thread.start()
    while any(len(m) < 20 for m in marks):  # every other client decodes steadily
        time.sleep(0.01)
    long_marks: list[float] = []
    before = [b - a for m in marks for a, b in zip(m[-10:-1], m[-9:])]
    done: dict = {}
    began = _stream_turn(url, "long", [5, 6, 7], 4, long_marks, done)
    window = (began, long_marks[0])
    gaps = [b - a for m in marks for a, b in zip(m, m[1:]) if window[0] <= b <= window[1] + 0.001]
    for thread in threads:
        thread.join()
    return {
        "ttft": long_marks[0] - began,
        "worst_gap": max(gaps) if gaps else float("nan"),
        "median_gap_before": statistics.median(before),
        "source": done.get("source"),
        "timings": done.get("timings", {}),
    }


def report_long(long: dict, rows: int) -> None:
    print(
        f"\n{rows}-row session resumed from its journal while 15 others decode: time to first token "
        f"{long['ttft'] * 1e3:.1f} ms; the others' worst gap between tokens meanwhile "
        f"{long['worst_gap'] * 1e3:.1f} ms (median gap before: {long['median_gap_before'] * 1e3:.1f} ms); "
        f"the turn's rows from {long['source']}, its server-side phases "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in long["timings"].items()),
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder (default: a random one of --preset)")
    parser.add_argument(
        "--preset", default="tiny", help="the random model's preset (tiny, v2-lite); its weights drawn on --device"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--tier", default=None, help="cache tier (default f32 on the CPU, fp8 elsewhere)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=64, help="tokens each client generates")
    parser.add_argument("--prompt", type=int, default=32, help="new-turn tokens each client sends")
    parser.add_argument("--long", type=int, default=32768, help="rows of the long session (0: skip that part)")
    parser.add_argument(
        "--long-first",
        action="store_true",
        help="run the long session's part before the client rounds (a device call short of time gets it first)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads of the server and of the in-process batch (default: the server's, 1 on the CPU)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="a folder: py-spy samples of the server's GIL holder over each timed round (serve-N.txt)",
    )
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=None,
        help="the server's --step-tokens (0: every prompt takes prefill forwards; default: the server's)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="the server interpreter's GIL switch interval in seconds (default: Python's 5 ms)",
    )
    args = parser.parse_args()
    tier = args.tier or ("f32" if args.device == "cpu" else "fp8")
    if args.torch_threads is None and args.device == "cpu":
        args.torch_threads = 1  # what `kvstore serve` runs the CPU engine with: both sides alike

    from kvstore.engine.weights import load_model

    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        folder = Path(args.model) if args.model else random_folder(Path(tmp) / args.preset, args)
        data = Path(tmp) / "data"
        if args.long:
            write_long_session(data, folder, tier, args.long)
        slots = str(max(max(args.clients), 16))
        extra = ["--model", str(folder), "--tier", tier, "--device", args.device, "--max-batch", slots]
        extra += ["--max-turns-per-owner", slots, "--max-queue", slots]
        if args.dtype:
            extra += ["--dtype", args.dtype]
        if args.step_tokens is not None:
            extra += ["--step-tokens", str(args.step_tokens)]
        if args.torch_threads:
            extra += ["--torch-threads", str(args.torch_threads)]
            torch.set_num_threads(args.torch_threads)
        server = Server(data, *extra, keys=f"{KEY}:{OWNER}", start_timeout=900, switch_interval=args.switch_interval)
        print(f"serve_bench: the server answered /health {server.started_s:.1f} s after it was started")
        model = load_model(folder, device=args.device, dtype=args.dtype)
        vocab = model.config.vocab_size
        try:
            http_round(server.url, 1, args.prompt, 4, vocab, round_id=0)  # warm-up (first-call costs)
            threads = torch.get_num_threads()
            print(
                f"serve_bench: {folder.name} on {args.device}, {tier} cache, {args.tokens} tokens per client, "
                f"{threads} torch threads (server and in-process batch)"
            )
            print(
                "| clients | HTTP tok/s | in-process batch tok/s | HTTP / batch | HTTP / one client | TTFT p50 ms "
                "| TTFT p99 ms | first round's TTFT p50 ms | server cores busy | server CPU µs / token "
                "| steps | prefill forwards | prompts in steps | ms / prefill forward | ms / step |"
            )
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            if args.long and args.long_first:
                report_long(long_resume(server.url, 15, vocab), args.long)
            one = None
            for round_id, clients in enumerate(args.clients, start=1):
                # an untimed round first on both sides: a new batch size captures its CUDA graphs and
                # compiles its step (seconds on a GPU); its time to first token is reported apart
                cold = http_round(server.url, clients, args.prompt, 4, vocab, 100 + round_id)
                in_process(model, tier, clients, args.prompt, 4, vocab)
                profile = args.profile / f"serve-{clients}.txt" if args.profile else None
                http = http_round(
                    server.url, clients, args.prompt, args.tokens, vocab, round_id, server.process.pid, profile
                )
                batch = in_process(model, tier, clients, args.prompt, args.tokens, vocab)
                one = one or http["tok_s"]
                print(
                    f"| {clients} | {http['tok_s']:.1f} | {batch:.1f} | {http['tok_s'] / batch:.2f} | "
                    f"{http['tok_s'] / one:.2f} | {http['ttft_p50'] * 1e3:.1f} | {http['ttft_p99'] * 1e3:.1f} | "
                    f"{cold['ttft_p50'] * 1e3:.1f} | {http['server_cores']:.2f} | {http['server_us_per_token']:,.0f} | "
                    f"{http['steps']:.0f} | {http['forwards']:.0f} | {http['step_prompts']:.0f} | "
                    f"{http['prefill_ms']:.1f} | {http['step_ms']:.1f} |"
                )
            if args.long and not args.long_first:
                report_long(long_resume(server.url, 15, vocab), args.long)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
