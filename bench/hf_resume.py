"""Resume a transformers conversation from kvstore vs re-running its prompt through transformers.

For each context length T, a random-weight DeepSeek-V3-architecture model (``transformers``'
``DeepseekV3ForCausalLM``) holds a conversation of T tokens; a new turn of ``--new`` tokens then
arrives and the next token is wanted. Two ways to get it:

- **re-run**: prefill all ``T + new`` tokens through transformers (in chunks of ``--chunk`` tokens,
  as a server bounds its memory; ``--chunk 0`` = one pass) and take the arg-max of the last logits;
- **restore**: read the T stored rows (kvstore session, or a bare ``.coli_kv`` journal through
  ``hf.cache_from_file`` when lmdb is not installed), upload them as stored and decode them on the
  device into a ``DynamicCache``, run the ``new`` tokens, take the arg-max.

Printed per length and tier: the re-run time, the restore time (read + decode + copy + cache
build), the first forward after it, the ratio re-run / (restore + first), the stored size and
whether both ways pick the same next token (they must in f32 up to chunking numerics; quantized
tiers may differ). Ratios are measured in this one run, after a warm-up pass; the restore is
repeated ``--repeat`` times and the re-run ``--rerun-repeat`` times (medians).

``--host-path`` also times the restore this replaced (load the records, re-lay them out per layer
on the host — sanitized code copies for fp8/TQ —, upload each layer, decode there) on the same rows,
in a table of its own, and checks that both caches hold the same rows.

Examples::

    python bench/hf_resume.py                                   # CPU, tiny, 1k/8k/32k, f32 and fp8
    python bench/hf_resume.py --device cuda --preset v2-lite    # DeepSeek-V2-Lite geometry, bf16
    python bench/hf_resume.py --preset v2-lite --layers 2 --lengths 256 --dtype bfloat16   # smoke
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # a checkout that was not pip-installed (the GPU machine)

import kvstore  # noqa: E402, F401  (maps the part folders into the namespace)
from kvstore import tiers  # noqa: E402
from kvstore.engine import hf  # noqa: E402
from kvstore.engine.config import preset  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OWNER = "bench"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="tiny", choices=("tiny", "tiny-yarn", "v2-lite"))
    p.add_argument("--layers", type=int, help="keep only this many decoder layers (smoke runs)")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--lengths", default="1024,8192,32768", help="context lengths T, comma separated")
    p.add_argument(
        "--tiers",
        default="f32,fp8",
        help="stored tiers to restore from: f32, fp8, int4, polar2..polar6 (kvstore.tiers names)",
    )
    p.add_argument("--new", type=int, default=16, help="tokens of the new turn")
    p.add_argument("--chunk", type=int, default=4096, help="re-run prefill chunk (0: one pass)")
    p.add_argument("--repeat", type=int, default=3, help="restores per measurement (median)")
    p.add_argument("--rerun-repeat", type=int, default=1, help="re-runs per length (median)")
    p.add_argument("--store", choices=("auto", "sessions", "kvfile"), default="auto", help="sessions needs lmdb")
    p.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default 1 on cpu: the tiny model is per-op bound, and spinning threads on a shared box distort both sides)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-path", action="store_true", help="also time the host restore path (before/after table)")
    return p.parse_args(argv)


def build_model(args, device: torch.device, dtype: torch.dtype):
    """transformers' DeepseekV3ForCausalLM of the preset's geometry, random weights, on the device."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fields = preset(args.preset).to_hf_dict()
    for key in ("architectures", "model_type", "dtype"):
        fields.pop(key)
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    config = DeepseekV3Config(**fields)
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialize on the device: a 16B-parameter model never sits in host memory
        try:
            model = DeepseekV3ForCausalLM._from_config(config, dtype=dtype)
        except TypeError:  # older keyword
            model = DeepseekV3ForCausalLM._from_config(config, torch_dtype=dtype)
    return model.to(device).eval()  # a no-op when the weights were created there


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def next_token(model, ids, cache, **extra) -> int:
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **hf.cache_kwargs(model, cache), **extra)
    return int(out.logits[0, -1].argmax())


def rerun(model, ids, chunk: int):
    """Prefill ``ids`` [1, S] from nothing; returns (next token, the cache it built)."""
    cache = hf.new_cache(model)
    step = chunk or ids.shape[1]
    for start in range(0, ids.shape[1] - step, step):
        model(input_ids=ids[:, start : start + step], use_cache=True, logits_to_keep=1, **hf.cache_kwargs(model, cache))
    last = ((ids.shape[1] - 1) // step) * step
    return next_token(model, ids[:, last:], cache), cache


class SessionsBackend:
    """Rows kept in a kvstore session (LMDB index + journal)."""

    name = "kvstore session"

    def __init__(self, folder: Path):
        from kvstore.store import ModelInfo, SessionStore

        self.store = SessionStore(folder / "data")
        # explicit model info: hashing a random 16B-parameter model's tensors is not what is measured
        self.info = ModelInfo(name="bench-random", revision="seed")

    def save(self, key, model, cache, tokens, tier) -> int:
        saved = hf.save(
            self.store, key, model, cache, tokens, owner=OWNER, tier=tier, model_info=self.info, extend=False
        )
        return saved.info.size_bytes

    def restore(self, key, model, upto, device, dtype):
        return hf.restore(self.store, key, model, device, dtype, owner=OWNER, upto=upto, model_info=self.info).cache

    def close(self):
        self.store.close()


class KVFileBackend:
    """Rows kept in a bare ``.coli_kv`` journal (no index: the GPU machine has no lmdb)."""

    name = "KVFile journal"

    def __init__(self, folder: Path):
        self.folder = folder

    def save(self, key, model, cache, tokens, tier) -> int:
        from kvstore.journal import KVFile

        geometry = hf.check_cache_layout(model).geometry
        L, R = hf.cache_rows(model, cache)
        with KVFile.create(self.folder / f"{key}.coli_kv", geometry, tier) as journal:
            journal.append(np.asarray(tokens[: L.shape[1]], dtype=np.int32), L, R)
        return os.stat(self.folder / f"{key}.coli_kv").st_size

    def restore(self, key, model, upto, device, dtype):
        return hf.cache_from_file(model, self.folder / f"{key}.coli_kv", upto=upto, device=device, dtype=dtype).cache

    def records(self, key, upto):
        from kvstore.journal import KVFile

        with KVFile.open(self.folder / f"{key}.coli_kv") as journal:
            return journal.load().slice(0, upto)

    def close(self):
        pass


def host_path_cache(model, records, device, dtype):
    """The restore before kvstore.engine.restore: per layer, a host copy out of the records (codes
    sanitized on the host for fp8/TQ), a pageable upload, a decode on the device, ``cache.update``."""
    from kvstore.gpu import codecs

    geometry = records.geometry
    cache = hf.new_cache(model)
    if records.n == 0:
        return cache
    if records.tier.version == 1:
        layers = records.records["layers"]
        rows = {"L": layers["Lc"], "R": layers["Rc"]}
    else:
        codes = {which: records.quantized(which) for which in ("L", "R")}
    for layer in range(geometry.n_layers):
        out = []
        for which, width in (("L", geometry.kv_lora), ("R", geometry.qk_rope)):
            if records.tier.version == 1:
                out.append(torch.from_numpy(np.array(rows[which][:, layer], dtype=np.float32, order="C")).to(device))
                continue
            layer_codes = torch.from_numpy(codes[which][0][layer]).to(device)
            layer_scales = torch.from_numpy(codes[which][1][layer]).to(device)
            out.append(codecs.decode_tier(records.tier, layer_codes, layer_scales, width))
        cache.update(out[0].to(dtype)[None, None], out[1].to(dtype)[None, None], layer)
    return cache


def host_restore(backend, key, length: int, model, device, dtype):
    """The host path of one stored conversation, the read of its records included."""
    return host_path_cache(model, backend.records(key, length), device, dtype)


def same_rows(a, b) -> bool:
    """Both caches hold the same rows (NaN-safe: by bits; decoded rows within 1e-6 for int4/polarB)."""
    for x, y in zip(a.layers, b.layers):
        for p, q in ((x.keys, y.keys), (x.values, y.values)):
            if p.shape != q.shape or not torch.allclose(p.float(), q.float(), rtol=1e-6, atol=1e-6, equal_nan=True):
                return False
    return True


def pick_backend(kind: str, folder: Path):
    if kind in ("auto", "sessions"):
        try:
            return SessionsBackend(folder)
        except ImportError:
            if kind == "sessions":
                raise
    return KVFileBackend(folder)


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    stored_tiers = [tiers.parse(x) for x in args.tiers.split(",") if x.strip()]
    model = build_model(args, device, dtype)
    geometry = hf.check_cache_layout(model).geometry
    generator = torch.Generator().manual_seed(args.seed + 1)
    described = {tier: tier.name for tier in stored_tiers}
    host_rows = []
    with tempfile.TemporaryDirectory(prefix="hf-resume-") as tmp:
        backend = pick_backend(args.store, Path(tmp))
        print(
            f"# {args.preset}{f' ({args.layers} layers)' if args.layers else ''} on {device} ({dtype}), "
            f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"rows in a {backend.name}; new turn {args.new} tokens; re-run chunk {args.chunk or 'one pass'}"
        )
        with torch.no_grad():  # warm-up: first-call costs (kernels, allocator, MoE paths) are not measured
            warm = torch.randint(2, geometry.vocab, (1, 64 + args.new), generator=generator).to(device)
            _, warm_cache = rerun(model, warm, args.chunk)
            backend.save(
                "warm", model, _history_cache(model, warm_cache, 64), warm[0, :64].cpu().numpy(), stored_tiers[0]
            )
            next_token(model, warm[:, 64:], backend.restore("warm", model, 64, device, dtype))
            del warm_cache
        header = f"{'T':>6} {'tier':<20} {'re-run s':>9} {'restore ms':>11} {'first ms':>9} {'speedup':>8} {'stored MB':>10} {'same':>5}"
        print(header)
        print("-" * len(header))
        for length in lengths:
            ids = torch.randint(2, geometry.vocab, (1, length + args.new), generator=generator).to(device)
            with torch.no_grad():
                rerun_times = []
                for _ in range(args.rerun_repeat):
                    (reference, cache), rerun_s = timed(functools.partial(rerun, model, ids, args.chunk), device)
                    rerun_times.append(rerun_s)
                rerun_s = statistics.median(rerun_times)
                history = ids[0, :length].cpu().numpy()
                for tier in stored_tiers:
                    key = f"t{length}-{tier.name}"
                    crop = _history_cache(model, cache, length)
                    stored = backend.save(key, model, crop, history, tier)
                    del crop
                    restore_times, first_times, tokens = [], [], []
                    for _ in range(args.repeat):
                        restored, restore_s = timed(
                            functools.partial(backend.restore, key, model, length, device, dtype), device
                        )
                        token, first_s = timed(functools.partial(next_token, model, ids[:, length:], restored), device)
                        restore_times.append(restore_s)
                        first_times.append(first_s)
                        tokens.append(token)
                        del restored
                    restore_s, first_s = statistics.median(restore_times), statistics.median(first_times)
                    if args.host_path and hasattr(backend, "records"):
                        host_times = []
                        for _ in range(args.repeat):
                            host_cache, host_s = timed(
                                functools.partial(host_restore, backend, key, length, model, device, dtype), device
                            )
                            host_times.append(host_s)
                        device_cache = backend.restore(key, model, length, device, dtype)
                        host_rows.append(
                            (
                                length,
                                described[tier],
                                statistics.median(host_times),
                                restore_s,
                                stored,
                                same_rows(host_cache, device_cache),
                            )
                        )
                        del host_cache, device_cache
                    print(
                        f"{length:>6} {described[tier]:<20} {rerun_s:>9.2f} {restore_s * 1e3:>11.1f} {first_s * 1e3:>9.1f} "
                        f"{rerun_s / (restore_s + first_s):>7.0f}x {stored / 2**20:>10.1f} {'yes' if tokens[0] == reference else 'no':>5}",
                        flush=True,
                    )
            del cache
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        backend.close()
    if host_rows:
        print("\nRestore, host path (per-layer host copies + pageable uploads) vs device path")
        print(
            f"{'T':>6} {'tier':<20} {'host ms':>9} {'GB/s':>6} {'device ms':>10} {'GB/s':>6} {'faster':>7} {'rows':>6}"
        )
        for length, tier, host_s, device_s, stored, same in host_rows:
            print(
                f"{length:>6} {tier:<20} {host_s * 1e3:>9.1f} {stored / host_s / 1e9:>6.2f} {device_s * 1e3:>10.1f} "
                f"{stored / device_s / 1e9:>6.2f} {host_s / device_s:>6.1f}x {'same' if same else 'DIFFER':>6}"
            )
    return 0


def _history_cache(model, cache, length: int):
    """A cache holding the first ``length`` rows of ``cache`` (the conversation before the new turn)."""
    L, R = hf.cache_rows(model, cache, 0, length)
    return hf.build_cache(model, L[:, None], R[:, None])


if __name__ == "__main__":
    sys.exit(main())
