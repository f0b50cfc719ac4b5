"""Resume vs re-prefill, decode speed per cache tier, KV bytes per token — the engine's headline.

A conversation of N tokens is continued with one new token, two ways:

* **re-prefill**: a cold engine runs all N+1 tokens (what an engine without a stored cache does);
* **resume**: the N stored rows are loaded from a ``.coli_kv`` file into the tier's cache
  (``Engine.restore_file``: the body read into pinned memory, uploaded once and split into the
  tier's fields on the device, no dequantize/requantize when the file is the tier's version)
  and only the new token is run.

Both end with the logits of the next token; the ratio of their times is the headline, and the
distance between the two logit vectors (max |Δ| and KL of the resume against the uninterrupted run
in the same tier, whose rows it stored) says whether the resume is that run (argmax equality alone
flips on near-ties of random weights). "KL vs f32" is the tier's own effect: the resume against the
f32 re-prefill. The stored
rows of each tier are those of an uninterrupted run in that tier. Restore throughput is compared with a host memcpy of the
same number of bytes measured in the same run (the physical peer).

Decode tokens/s per tier (after a resume at the first length) is reported with its ratio to the
f32 tier, and KV bytes per token per tier with the ratio to f32.

``--rows`` also resumes from rows already in host memory (``Engine.restore(StoredRows)``, a fresh
engine with its graphs warmed) beside ``restore_file`` of the same rows.

``--host-path`` also times the host restore the device path replaced (``coli_kv.load`` +
``StoredRows.from_records`` + ``restore``) on the same files, in a table of its own, and checks that
both paths leave the same rows in the cache.

Usage::

    python bench/engine_resume.py                                   # CPU, tiny model, 1k/8k/32k
    python bench/engine_resume.py --device cuda --preset v2-lite    # H200: DeepSeek-V2-Lite geometry
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from kvstore import tiers
from kvstore.engine import CacheGeometry, Engine, StoredRows, make_cache, preset, random_model, restore
from kvstore.formats import coli_kv

DEFAULT_TIERS = ("f32", "bf16", "fp8", "q8", "int4", "polar4")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def logit_distance(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, bool]:
    """(max |got - want|, KL(want || got) in nats, same argmax) of two next-token logit vectors.

    On random weights the logits are nearly flat, so a near-tie flips the argmax on rounding noise
    alone: the distance of the distributions is what says whether a resume is the re-prefill."""
    got64, want64 = got.double().cpu(), want.double().cpu()
    p_log, q_log = torch.log_softmax(want64, -1), torch.log_softmax(got64, -1)
    kl = float((p_log.exp() * (p_log - q_log)).sum())
    return float((got64 - want64).abs().max()), kl, int(got64.argmax()) == int(want64.argmax())


def _timed(device: torch.device, fn):
    _sync(device)
    began = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - began, out


def _memcpy_gbps(n_bytes: int) -> float:
    """Host memcpy throughput for a buffer of ``n_bytes`` (best of 3)."""
    source = np.ones(max(n_bytes, 1 << 20), dtype=np.uint8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - began)
    return source.nbytes / best / 1e9


def _fmt_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms" if seconds < 1 else f"{seconds:8.2f} s "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny", choices=("tiny", "tiny-yarn", "tiny-512", "v2-lite"))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="weights (default f32 on cpu, bf16 elsewhere)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--tiers", nargs="+", default=list(DEFAULT_TIERS), choices=tiers.names())
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument(
        "--prefill-chunk", type=int, help="tokens per prefill forward (default: the engine's, by device)"
    )
    parser.add_argument("--layers", type=int, help="override the preset's layer count (smoke runs)")
    parser.add_argument("--experts", type=int, help="override the preset's routed experts (smoke runs)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads on CPU")
    parser.add_argument("--workdir", help="where the .coli_kv files go (default: a temporary folder)")
    parser.add_argument("--host-path", action="store_true", help="also time the host restore path (before/after table)")
    parser.add_argument(
        "--rows",
        action="store_true",
        help="also resume from rows held in host memory (Engine.restore(StoredRows)) beside restore_file",
    )
    parser.add_argument(
        "--store",
        action="store_true",
        help="also resume through a session store (SessionStore.reader -> Engine.restore_reader), as a server does",
    )
    parser.add_argument(
        "--encrypt",
        action="store_true",
        help="with --store, also through a store encrypted at rest (docs/SECURITY.md), the same rows",
    )
    parser.add_argument(
        "--read-threads", type=int, help="chunks a restore reads at once (default: restore.read_threads, by decryption)"
    )
    parser.add_argument(
        "--chunk-mib", type=int, help="MiB per chunk of a restore's ring (default: restore.CHUNK_BYTES)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="with --store --encrypt: also N rounds of the first token through both stores in turn, the encrypted "
        "one with each --sealed-threads count, in one engine (an A/B where the host's drift falls on every column)",
    )
    parser.add_argument(
        "--sealed-threads",
        type=int,
        nargs="+",
        default=[8, 16],
        help="reading threads of the encrypted restores in --rounds",
    )
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.read_threads:  # every restore of this run (file, rows, store, encrypted) reads with these threads
        count = args.read_threads
        restore.read_threads = lambda *, decrypting=False: count
    if args.chunk_mib:
        restore.CHUNK_BYTES = args.chunk_mib << 20
    device = torch.device(args.device)
    dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    cfg = preset(args.preset)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    if args.experts:
        cfg = cfg.replace(n_routed_experts=args.experts, num_experts_per_tok=min(cfg.num_experts_per_tok, args.experts))
    model = random_model(cfg, seed=0, device=device, dtype=dtype)
    geometry = cfg.coli_geometry()
    backend = make_cache("fp8", cfg, device).decode_choice.backend
    print(
        f"engine_resume: {args.preset} ({cfg.n_layers} layers, hidden {cfg.hidden_size}, kv_lora {cfg.kv_lora_rank}, "
        f"qk_rope {cfg.qk_rope_head_dim}, {cfg.n_routed_experts} experts), weights {dtype} on {device}, "
        f"torch threads {torch.get_num_threads()}, fp8 decode backend: {backend}"
    )
    rng = np.random.default_rng(0)
    # warm-up: lazy initializations (BLAS handles, each tier's decode kernels, compiled on first
    # use) are not the engine's cost
    for tier in dict.fromkeys(["f32", *args.tiers]):
        Engine(model, tier=tier).generate(rng.integers(2, cfg.vocab_size, 64), max_new_tokens=2, stop_tokens=())

    workdir_context = tempfile.TemporaryDirectory() if args.workdir is None else None
    workdir = Path(args.workdir or workdir_context.name)
    workdir.mkdir(parents=True, exist_ok=True)
    resume_rows = []
    warmups = []
    decode_rows = {}
    host_rows = []
    store_rows = []
    round_rows = []
    memory_rows = []
    store = sealed = None
    try:
        for length in args.lengths:
            context = rng.integers(2, cfg.vocab_size, length + 1)
            cold = Engine(model, tier="f32", prefill_chunk=args.prefill_chunk)
            cold_seconds, (cold_logits, _, _) = _timed(device, partial(cold.prefill, context))
            stored_f32 = cold.export_rows(0, length)
            del cold
            # the same prefill again: a first prompt of a new length also pays for planning its
            # attention kernels (cuDNN builds a plan per shape); a server sees the second figure
            again = Engine(model, tier="f32", prefill_chunk=args.prefill_chunk)
            again_seconds, _ = _timed(device, partial(again.prefill, context))
            del again
            row = {"length": length, "prefill": cold_seconds, "again": again_seconds, "tiers": {}}
            for tier in args.tiers:
                # The tier's stored rows are those of an uninterrupted run in that tier (its
                # re-prefill), written as a journal: the resume must give that run's logits.
                if tier == "f32":
                    tier_logits, stored = cold_logits, stored_f32
                else:
                    uninterrupted = Engine(model, tier=tier, prefill_chunk=args.prefill_chunk)
                    tier_logits = uninterrupted.prefill(context)[0]
                    stored = uninterrupted.export_rows(0, length)
                    del uninterrupted
                path = workdir / f"{length}.{tier}.coli_kv"
                path.write_bytes(stored.encode_file(geometry))
                engine = Engine(model, tier=tier, prefill_chunk=args.prefill_chunk)
                # a server captures its decode graphs once, at start (CUDA only; 0 s elsewhere)
                warm_seconds, captured = _timed(device, partial(engine.warm_graphs, length + 1))
                warmups.append((length, tier, warm_seconds, captured))
                restore_seconds, _ = _timed(device, partial(engine.restore_file, path))
                step_seconds, (logits, prefilled, reused) = _timed(device, partial(engine.prefill, context))
                if (prefilled, reused) != (1, length):
                    raise RuntimeError(f"resume prefilled {prefilled} and reused {reused}, expected 1 and {length}")
                same_next = (*logit_distance(logits, tier_logits), logit_distance(logits, cold_logits)[1])
                row["tiers"][tier] = (restore_seconds, step_seconds, path.stat().st_size, same_next)
                if args.host_path:
                    host = Engine(model, tier=tier, prefill_chunk=args.prefill_chunk)

                    def host_restore(host=host, path=path):
                        host.restore(StoredRows.from_records(coli_kv.load(path)))

                    host_seconds, _ = _timed(device, host_restore)
                    same_rows = (
                        host.export_rows().record_array(geometry).tobytes()
                        == engine.export_rows(0, length).record_array(geometry).tobytes()
                    )
                    host_rows.append((length, tier, host_seconds, restore_seconds, path.stat().st_size, same_rows))
                    del host
                if args.rows:
                    memory_rows.append(
                        _rows_resume(model, tier, length, stored, path, engine, args.prefill_chunk, device)
                    )
                if args.store:
                    store = store or _store(workdir)
                    stores = [("plain", store)]
                    if args.encrypt:
                        sealed = sealed or _store(workdir, encrypted=True)
                        stores.append(("sealed", sealed))
                    if args.rounds and sealed is not None:
                        round_rows.extend(
                            _first_token_rounds(
                                store, sealed, model, geometry, tier, length, stored, context, args, device
                            )
                        )
                    for label, each in stores:
                        store_rows.append(
                            (
                                label,
                                *_store_resume(
                                    each,
                                    model,
                                    geometry,
                                    tier,
                                    length,
                                    stored,
                                    context,
                                    engine,
                                    args.prefill_chunk,
                                    device,
                                ),
                            )
                        )
                if length == args.lengths[0]:
                    result = engine.generate(
                        np.concatenate([context, [int(torch.argmax(logits))]]),
                        max_new_tokens=args.decode_tokens,
                        stop_tokens=(),
                    )
                    steps = max(1, len(result.tokens) - 1)
                    decode_rows[tier] = steps / result.timings["decode"]
                del engine
                path.unlink()
            resume_rows.append(row)
    finally:
        for each in (store, sealed):
            if each is not None:
                each.close()
        if workdir_context is not None:
            workdir_context.cleanup()

    memcpy = _memcpy_gbps(max(size for r in resume_rows for _, _, size, _ in r["tiers"].values()))
    print(
        "\nResume = load the .coli_kv + restore into the tier's cache (restore) + run the 1 new token (step),"
        f"\nvs re-prefill of all tokens; restore GB/s = file bytes / restore time (host memcpy: {memcpy:.1f} GB/s)"
    )
    print(
        f"{'tokens':>7s} {'re-prefill':>11s} {'tier':>9s} {'restore':>11s} {'step':>11s} {'speed-up':>9s} "
        f"{'file MB':>8s} {'GB/s':>6s} {'/memcpy':>7s} {'max|dlogit|':>11s} {'KL':>8s} {'argmax':>6s} {'KL vs f32':>9s}"
    )
    for row in resume_rows:
        for i, (tier, (restore_seconds, step_seconds, size, same_next)) in enumerate(row["tiers"].items()):
            head = f"{row['length']:7d} {_fmt_seconds(row['prefill']):>11s}" if i == 0 else f"{'':7s} {'':11s}"
            gbps = size / restore_seconds / 1e9
            speedup = row["prefill"] / (restore_seconds + step_seconds)
            print(
                f"{head} {tier:>9s} {_fmt_seconds(restore_seconds):>11s} {_fmt_seconds(step_seconds):>11s} {speedup:8.0f}x "
                f"{size / 1e6:8.1f} {gbps:6.2f} {gbps / memcpy:7.0%} {same_next[0]:11.4f} {same_next[1]:8.1e} "
                f"{'same' if same_next[2] else 'flips':>6s} {same_next[3]:9.1e}"
            )
    print("\nRe-prefill, first run of the length vs the same prompt again (kernels planned):")
    for row in resume_rows:
        print(f"{row['length']:7d} {_fmt_seconds(row['prefill']):>11s} {_fmt_seconds(row['again']):>11s}")
    if any(captured for *_, captured in warmups):
        print("\nCUDA-graph warm-up before each resume (a server's start-up; not counted above):")
        for length, tier, warm_seconds, captured in warmups:
            print(f"{length:7d} {tier:>9s} {captured} graphs in {_fmt_seconds(warm_seconds)}")
    if host_rows:
        print("\nRestore, host path (load + StoredRows.from_records + restore) vs device path (restore_file)")
        print(
            f"{'tokens':>7s} {'tier':>9s} {'host':>11s} {'GB/s':>6s} {'device':>11s} {'GB/s':>6s} {'faster':>7s} {'rows':>8s}"
        )
        for length, tier, host_seconds, device_seconds, size, same_rows in host_rows:
            print(
                f"{length:7d} {tier:>9s} {_fmt_seconds(host_seconds):>11s} {size / host_seconds / 1e9:6.2f} "
                f"{_fmt_seconds(device_seconds):>11s} {size / device_seconds / 1e9:6.2f} {host_seconds / device_seconds:6.1f}x "
                f"{'same' if same_rows else 'DIFFER':>8s}"
            )
    if store_rows:
        print("\nResume through a session store (SessionStore.reader -> Engine.restore_reader: the served records")
        print("read straight into the pinned ring), as a server's turn does, beside restore_file on the same rows;")
        print("'sealed' is a store encrypted at rest (--encrypt), its first token against the plaintext store's")
        print(
            f"{'tokens':>7s} {'tier':>9s} {'store':>7s} {'restore':>11s} {'GB/s':>6s} {'+ step':>11s} "
            f"{'= first token':>13s} {'vs plain':>8s} {'file':>11s} {'rows':>8s}"
        )
        plain_first = {}
        for label, length, tier, seconds, step_seconds, file_seconds, size, same_rows in store_rows:
            first = seconds + step_seconds
            if label == "plain":
                plain_first[length, tier] = first
            versus = first / plain_first[length, tier] if (length, tier) in plain_first else float("nan")
            file_text = _fmt_seconds(file_seconds) if file_seconds is not None else "-"
            print(
                f"{length:7d} {tier:>9s} {label:>7s} {_fmt_seconds(seconds):>11s} {size / seconds / 1e9:6.2f} "
                f"{_fmt_seconds(step_seconds):>11s} {_fmt_seconds(first):>13s} {versus:7.2f}x {file_text:>11s} "
                f"{'same' if same_rows else 'DIFFER':>8s}"
            )
    if round_rows:
        _print_rounds(round_rows, args.sealed_threads)
    if memory_rows:
        print("\nResume from rows in host memory (a fresh engine, graphs warmed: Engine.restore(StoredRows))")
        print("beside restore_file of the same rows; first call of each, then the best of 3 more")
        print(
            f"{'tokens':>7s} {'tier':>9s} {'rows 1st':>11s} {'rows':>11s} {'GB/s':>6s} {'file 1st':>11s} {'file':>11s} "
            f"{'rows/file':>9s} {'rows':>8s}"
        )
        for length, tier, rows_first, rows_best, file_first, file_best, size, same_rows in memory_rows:
            print(
                f"{length:7d} {tier:>9s} {_fmt_seconds(rows_first):>11s} {_fmt_seconds(rows_best):>11s} "
                f"{size / rows_best / 1e9:6.2f} {_fmt_seconds(file_first):>11s} {_fmt_seconds(file_best):>11s} "
                f"{rows_best / file_best:8.2f}x {'same' if same_rows else 'DIFFER':>8s}"
            )
    f32_rate = decode_rows.get("f32")
    print(f"\nDecode after a resume at {args.lengths[0]} tokens ({args.decode_tokens} tokens, greedy)")
    print(f"{'tier':>9s} {'tokens/s':>9s} {'vs f32':>7s} {'KV B/token':>11s} {'vs f32':>7s}")
    cache_geometry = CacheGeometry.of(cfg)
    f32_bytes = cache_geometry.bytes_per_token("f32")
    for tier in args.tiers:
        rate = decode_rows[tier]
        kv = cache_geometry.bytes_per_token(tier)
        ratio = f"{rate / f32_rate:6.2f}x" if f32_rate else "    -"
        print(f"{tier:>9s} {rate:9.1f} {ratio:>7s} {kv:11d} {f32_bytes / kv:6.2f}x")
    return 0


def _rows_resume(model, tier, length, stored, path, reference, prefill_chunk, device):
    """Restore ``stored`` (host StoredRows) into a fresh warmed engine, and ``path`` (the same rows as
    a file) into another: (length, tier, rows first s, rows best s, file first s, file best s, file
    bytes, same rows as ``reference``'s)."""
    engines = []
    for _ in range(2):
        engine = Engine(model, tier=tier, prefill_chunk=prefill_chunk)
        engine.warm_graphs(length + 1)
        engines.append(engine)
    rows_engine, file_engine = engines
    rows_times = [_timed(device, partial(rows_engine.restore, stored))[0] for _ in range(4)]
    file_times = [_timed(device, partial(file_engine.restore_file, path))[0] for _ in range(4)]
    same = rows_engine.export_rows(0, length).record_array(reference.config.coli_geometry()).tobytes() == (
        reference.export_rows(0, length).record_array(reference.config.coli_geometry()).tobytes()
    )
    size = path.stat().st_size
    return length, tier, rows_times[0], min(rows_times[1:]), file_times[0], min(file_times[1:]), size, same


def _store(workdir: Path, encrypted: bool = False):
    import kvstore.store

    if not encrypted:
        return kvstore.store.open(workdir / "store", map_size=1 << 32)
    from kvstore.crypto.kek import write_kek_file

    kek = write_kek_file(workdir / "kek.hex")
    return kvstore.store.open(workdir / "sealed-store", map_size=1 << 32, kek=kek)


def _store_session(store, session_id: str, geometry, stored) -> None:
    """``stored`` (StoredRows) as the session ``session_id`` of ``store``, owner "bench"."""
    store.create("bench", geometry, stored.tier, {"name": "bench", "revision": "1"}, session_id=session_id)
    store.append_records(session_id, stored.record_array(geometry))


def _best_reader_restore(store, session_id: str, engine, device) -> float:
    """Seconds of the best of 3 ``Engine.restore_reader`` of the session, each through a reader of
    its own, as a server's turn opens one (the first restore of a process also maps the pages)."""
    times = []
    for _ in range(3):
        with store.reader(session_id) as reader:
            times.append(_timed(device, partial(engine.restore_reader, reader))[0])
    return min(times)


def _first_token_rounds(store, sealed, model, geometry, tier, length, stored, context, args, device):
    """The first token through the plaintext store (its default reading threads) and the encrypted
    one (each of ``args.sealed_threads``), one after the other in each of ``args.rounds`` rounds,
    into one warmed engine: per round and column the best of 3 restores, then the step.
    Returns [(length, tier, round, label, threads, restore s, step s, bytes)]."""
    session_id = f"rounds-{length}-{tier}"
    for each in (store, sealed):
        _store_session(each, session_id, geometry, stored)
    sizes = {
        label: each.journal_path(session_id).stat().st_size for label, each in (("plain", store), ("sealed", sealed))
    }
    engine = Engine(model, tier=tier, prefill_chunk=args.prefill_chunk)
    engine.warm_graphs(length + 1)
    default_threads = restore.read_threads
    columns = [("plain", store, None)] + [("sealed", sealed, n) for n in args.sealed_threads]
    rows = []
    try:
        for round_index in range(args.rounds):
            for label, each, threads in columns:
                restore.read_threads = (
                    default_threads if threads is None else (lambda *, decrypting=False, n=threads: n)
                )
                seconds = _best_reader_restore(each, session_id, engine, device)
                step_seconds, _ = _timed(device, partial(engine.prefill, context))
                shown = threads if threads is not None else default_threads(decrypting=False)
                rows.append((length, tier, round_index, label, shown, seconds, step_seconds, sizes[label]))
    finally:
        restore.read_threads = default_threads
        for each in (store, sealed):
            each.delete(session_id)
    return rows


def _print_rounds(rows, sealed_threads) -> None:
    print("\nFirst token through the plaintext store and the encrypted one in turn, each round in one engine")
    print("(restore best of 3 + one step, ms; 'x' = encrypted first token / the same round's plaintext one)")
    head = f"{'tokens':>7s} {'tier':>5s} {'round':>5s} {'plain':>14s}"
    for n in sealed_threads:
        head += f" {f'sealed, {n} thr':>22s}"
    print(head)
    by_round: dict[tuple, list] = {}
    for length, tier, round_index, label, threads, seconds, step, size in rows:
        by_round.setdefault((length, tier, round_index), []).append((label, threads, seconds, step, size))
    ratios: dict[tuple, list[float]] = {}
    for (length, tier, round_index), cells in by_round.items():
        plain = cells[0][2] + cells[0][3]
        line = f"{length:7d} {tier:>5s} {round_index + 1:5d} {cells[0][2] * 1e3:6.1f}+{cells[0][3] * 1e3:4.1f} ({cells[0][1]})"
        for _label, threads, seconds, step, size in cells[1:]:
            ratio = (seconds + step) / plain
            ratios.setdefault((length, tier, threads), []).append(ratio)
            line += f" {seconds * 1e3:6.1f}+{step * 1e3:4.1f} {size / seconds / 1e9:5.2f}GB/s {ratio:4.2f}x"
        print(line)
    for (length, tier, threads), values in ratios.items():
        values = sorted(values)
        print(
            f"{length:7d} {tier:>5s} sealed {threads:2d} threads: first token vs plain, median {values[len(values) // 2]:.2f}x "
            f"(range {values[0]:.2f}-{values[-1]:.2f}x over {len(values)} rounds)"
        )


def _store_resume(store, model, geometry, tier, length, stored, context, reference, prefill_chunk, device):
    """Store the rows as a session, then resume it into a fresh engine (graphs warmed first, as a
    server does) and run the new token: (length, tier, restore s, step s, restore_file s, bytes,
    same rows as the file's restore)."""
    session_id = f"bench-{length}-{tier}"
    _store_session(store, session_id, geometry, stored)
    engine = Engine(model, tier=tier, prefill_chunk=prefill_chunk)
    engine.warm_graphs(length + 1)
    restore_seconds = _best_reader_restore(store, session_id, engine, device)
    step_seconds, _ = _timed(device, partial(engine.prefill, context))
    path = store.journal_path(session_id)
    file_seconds = None  # an encrypted journal is no .coli_kv file: restore_file refuses it
    if not store.encrypted:
        file_engine = Engine(model, tier=tier, prefill_chunk=prefill_chunk)
        file_engine.warm_graphs(length + 1)
        file_seconds = min(_timed(device, partial(file_engine.restore_file, path))[0] for _ in range(3))
    same = engine.export_rows(0, length).record_array(geometry).tobytes() == (
        reference.export_rows(0, length).record_array(geometry).tobytes()
    )
    size = path.stat().st_size
    store.delete(session_id)
    return length, tier, restore_seconds, step_seconds, file_seconds, size, same


if __name__ == "__main__":
    raise SystemExit(main())
