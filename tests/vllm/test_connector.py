"""The kvstore connector inside real vLLM processes (vLLM's own venv, CPU, a tiny random DeepSeek-V3).

Every process runs vLLM's torch rotary op (``custom_ops: ["-rotary_embedding"]``, the configuration
docs/VLLM.md gives for CPU) unless it says otherwise: vLLM CPU's own rotary kernel ignores the rope
key's token stride, so the rows a prefill computes depend on how the prompt was chunked and a loaded
prefix is not what this process would have computed (``chunking``, below, shows it on the rows).

vLLM processes share one model folder (float32, so equal inputs give equal tokens):

0. ``baseline``: no connector; A, B and F computed from their first token: the tokens every run
   below must generate.

1. ``first`` (embedded mode, vLLM's own metrics on): an empty store folder; prompt A (300 tokens)
   is computed and saved, and when it finishes, its conversation (A and the tokens generated for
   it); prompt B (A's first 256 tokens, another suffix) loads A's stored prefix and computes the
   rest; F, the next turn of A's conversation (A, A's answer, 40 new tokens), loads the previous
   turn whole, answer included (304 tokens, not only the prompt's 288: the very rows of A's prefill
   and of its answer). vLLM's ``vllm:kvstore_*`` counters equal the connector's.
2. ``second`` (service mode): a **new process** reaching that store through ``kvstore serve`` with
   the key of the same owner (``vllm``): A and B each load 288 stored tokens.
3. ``bob`` (service mode, another key and owner, same server): A is a miss (owner isolation), is
   computed and saved as bob's; A again, in the same process, loads bob's own 288 tokens. The
   server's ``/metrics`` lookups, hits and misses equal the two processes' counters.
4. ``altered`` (embedded mode): a copy of the store whose rows were changed on disk, plus rows of
   prompt C stored under another model's fingerprint. Verification refuses the changed rows, so
   vLLM recomputes A, B and F, and quarantines their sessions; C's rows are refused by fingerprint.
5. ``chunking``: two processes (a fresh store each), with and without the torch rotary op: A, then
   A and 40 more tokens, which loads A's 288 tokens and computes the rest; rows 288..300 are
   computed in one chunk with A and in another chunk after the load. With the torch op they agree;
   with vLLM CPU's kernel they do not, and the connector warns at start.

vLLM's venv comes from tests/vllm/setup_venv.sh (``.vllm-venv``, or ``$KVSTORE_VLLM_VENV``); without
it these tests skip, except in CI (``KVSTORE_CI=1``), where they fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvstore import config
from served import ServeProcess

ROOT = Path(__file__).resolve().parents[2]
VENV = config.VLLM_VENV.get() or ROOT / ".vllm-venv"
PYTHON = VENV / "bin" / "python"
RUNNER = Path(__file__).resolve().parent / "run_vllm.py"
MAX_TOKENS = 12

if not PYTHON.exists():
    if config.CI.get():
        raise RuntimeError(f"vLLM's venv is missing at {VENV}: .ci/run creates it with tests/vllm/setup_venv.sh")
    pytest.skip("vLLM's venv is missing (tests/vllm/setup_venv.sh makes it)", allow_module_level=True)

RNG = np.random.default_rng(20)
PROMPT_A = RNG.integers(2, 512, size=300).tolist()
PROMPT_B = PROMPT_A[:256] + RNG.integers(2, 512, size=44).tolist()
PROMPT_C = RNG.integers(2, 512, size=200).tolist()
NEXT_TURN = {"after": 0, "extra": RNG.integers(2, 512, size=40).tolist()}  # F: A's conversation, continued


def run_vllm(
    tmp: Path,
    model: Path,
    prompts: list,
    connector: dict | None,
    metrics: bool = False,
    *,
    torch_rotary: bool = True,
    max_tokens: int = MAX_TOKENS,
) -> list[dict]:
    """Run ``prompts`` one after another in a new vLLM process; each result's tokens and first logprobs
    (with ``metrics``, vLLM's own ``vllm:kvstore_*`` counters are in ``tmp/out.json``; vLLM's log in
    ``tmp/vllm.log``)."""
    spec = tmp / "spec.json"
    out = tmp / "out.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(model),
                "prompts": prompts,
                "max_tokens": max_tokens,
                "connector": connector,
                "metrics": metrics,
                "torch_rotary": torch_rotary,
            }
        )
    )
    # vLLM on CPU reserves its cache from this (GiB); the tiny model needs little. No network.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(PYTHON), str(RUNNER), str(spec), str(out)], capture_output=True, text=True, timeout=400, cwd=tmp, env=env
    )
    (tmp / "vllm.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return json.loads(out.read_text())["results"]


def stats(folder: Path) -> dict[str, dict]:
    """The connector's counters per role (``scheduler``, ``worker``), summed over its processes."""
    total: dict[str, dict] = {}
    for path in sorted(folder.glob("*.json")):
        role = path.name.split("-")[0]
        counts = json.loads(path.read_text())
        counts.pop("errors")
        into = total.setdefault(role, {})
        for key, value in counts.items():
            into[key] = into.get(key, 0) + value
    return total


def lookup_metrics(url: str) -> tuple[int, int, int]:
    """The server's (lookups, hits, misses) from ``GET /metrics``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = [
        re.search(rf"^kvstore_{name}_total (\S+)$", text, re.MULTILINE)
        for name in ("lookups", "lookup_hits", "lookup_misses")
    ]
    assert all(found), text[:2000]
    lookups, hits, misses = (int(float(m.group(1))) for m in found if m is not None)
    return lookups, hits, misses


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    # by path: this folder is not a package (a package named vllm would shadow vLLM itself)
    spec = importlib.util.spec_from_file_location("kvstore_tiny_vllm_model", Path(__file__).parent / "tiny_model.py")
    assert spec is not None and spec.loader is not None
    tiny_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_model)
    return tiny_model.make_model(tmp_path_factory.mktemp("model") / "tiny-dsv3", seed=0)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("store") / "kv"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, model):
    """A, B and F computed by vLLM alone (no connector)."""
    return run_vllm(tmp_path_factory.mktemp("baseline"), model, [PROMPT_A, PROMPT_B, NEXT_TURN], None)


@pytest.fixture(scope="module")
def first(tmp_path_factory, model, store):
    tmp = tmp_path_factory.mktemp("first")
    connector = {"store": str(store), "stats_dir": str(tmp / "stats")}
    results = run_vllm(tmp, model, [PROMPT_A, PROMPT_B, NEXT_TURN], connector, metrics=True)
    return results, stats(tmp / "stats"), json.loads((tmp / "out.json").read_text())["vllm_metrics"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, model, store, first):
    """``second`` and ``bob``: two vLLM processes, one after the other, against one ``kvstore serve``
    over the store ``first`` filled; and the server's lookup counters after them."""
    key_vllm, key_bob = "vllm-test-key-0123456789abcdef", "bob-test-key-0123456789abcdefgh"
    server = ServeProcess(store, env={"KVSTORE_API_KEYS": f"{key_vllm}:vllm,{key_bob}:bob"}).start()
    try:
        out = {}
        for name, key, prompts in (("second", key_vllm, [PROMPT_A, PROMPT_B]), ("bob", key_bob, [PROMPT_A, PROMPT_A])):
            tmp = tmp_path_factory.mktemp(name)
            connector = {"url": server.url, "api_key": key, "stats_dir": str(tmp / "stats")}
            out[name] = (run_vllm(tmp, model, prompts, connector), stats(tmp / "stats"))
        out["metrics"] = lookup_metrics(server.url)
    finally:
        server.stop_cleanly()
    return out


@pytest.fixture(scope="module")
def second(served):
    return served["second"]


@pytest.fixture(scope="module")
def altered(tmp_path_factory, model, store, served):
    """A copy of the store with one value of every stored row set changed, and C under another model."""
    from kvstore import tiers
    from kvstore.connectors.prefix_cache import PrefixCache, model_fingerprint
    from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, read_header
    from kvstore.store import SessionStore

    tmp = tmp_path_factory.mktemp("altered")
    copy = tmp / "kv"
    shutil.copytree(store, copy)
    journals = sorted((copy / "journals").glob("*.coli_kv"))
    assert len(journals) == 8  # owner vllm: A, B, F and their conversations; bob: A and its conversation
    for path in journals:
        header, _ = read_header(path)
        with open(path, "r+b") as f:  # record 100, layer 0, latent value 3: a plausible, wrong value
            offset = HEADER_BYTES + 100 * header.rec_bytes + 4 + 3 * 4
            f.seek(offset)
            value = np.frombuffer(f.read(4), dtype="<f4")[0]
            f.seek(offset)
            f.write(np.float32(value + 0.5).tobytes())
    other = model_fingerprint(
        name=str(model),
        revision="main",
        geometry=Geometry(2, 512, 64, 0, 0, 512),
        tier=tiers.F32,
        attention_variant="vllm-mla:float32",
        weights_hash="sampled-blake2b:another-model",
    )
    with SessionStore(copy) as opened:
        rows = np.random.default_rng(1).standard_normal((2, len(PROMPT_C), 576)).astype(np.float32)
        assert PrefixCache(opened, "vllm", other).save(PROMPT_C, rows) is not None
    results = run_vllm(
        tmp, model, [PROMPT_A, PROMPT_B, PROMPT_C, NEXT_TURN], {"store": str(copy), "stats_dir": str(tmp / "stats")}
    )
    return results, stats(tmp / "stats")


@pytest.fixture(scope="module")
def chunking(tmp_path_factory, model):
    """Per rotary setting: (max |difference| of rows 288..300 of A computed with A vs after loading
    A's 288 tokens, the largest |value| there, vLLM's log)."""
    from kvstore.store import SessionStore

    out = {}
    for torch_rotary in (True, False):
        tmp = tmp_path_factory.mktemp("torch-rotary" if torch_rotary else "cpu-rotary")
        longer = PROMPT_A + NEXT_TURN["extra"]
        connector = {"store": str(tmp / "kv"), "stats_dir": str(tmp / "stats")}
        run_vllm(tmp, model, [PROMPT_A, longer], connector, torch_rotary=torch_rotary, max_tokens=1)
        assert stats(tmp / "stats")["worker"]["loaded_tokens"] == 288
        with SessionStore(tmp / "kv") as opened:
            rows = {}
            for info in opened.list(owner="vllm"):
                records = opened.resume(info.id, owner="vllm").records
                L, R, _ = records.dequantize()
                rows[records.n] = np.concatenate([L, R], axis=-1)
        with_a, after_load = rows[len(PROMPT_A)][:, 288:300], rows[len(longer)][:, 288:300]
        out[torch_rotary] = (
            float(np.abs(with_a - after_load).max()),
            float(np.abs(with_a).max()),
            (tmp / "vllm.log").read_text(),
        )
    return out


def test_a_new_process_loads_the_stored_prefix_and_generates_the_same_tokens(baseline, first, second, altered):
    (computed_a, _, _), first_stats, _ = first
    (loaded_a, _), second_stats = second
    (recomputed_a, _, _, _), _ = altered
    # A, B, F and their three conversations; the new process stores nothing it found stored
    assert first_stats["scheduler"]["misses"] == 1 and first_stats["worker"]["saves"] == 6
    # the saves ran on the background writer: none skipped, and each finished request was reported
    # (its blocks freed) only once its conversation's save had settled
    assert first_stats["worker"]["save_skipped"] == 0 and first_stats["worker"]["save_pending"] == 0
    assert first_stats["scheduler"]["finished_planned"] == first_stats["worker"]["finished_done"] == 3
    assert second_stats["worker"]["saves"] == 0
    sched, worker = second_stats["scheduler"], second_stats["worker"]
    assert sched["hits"] == 2 and sched["lookups"] == sched["hits"] + sched["misses"]
    assert worker["loads"] == 2 and worker["loaded_tokens"] == 288 + 288 and worker["load_errors"] == 0
    # every load went through the hot tier: a hit from memory or a miss read from the store
    for counts in (first_stats["worker"], worker):
        assert counts["hot_hits"] + counts["hot_misses"] == counts["loads"] and counts["hot_evictions"] == 0
    assert loaded_a["tokens"] == computed_a["tokens"] == recomputed_a["tokens"] == baseline[0]["tokens"]
    assert len(loaded_a["tokens"]) == MAX_TOKENS


def test_a_shared_prefix_with_another_suffix_loads_the_shared_blocks(baseline, first, second, altered):
    (_, loaded_b, _), first_stats, _ = first
    (_, computed_b, _, _), _ = altered
    (_, loaded_b_again), _ = second
    # B shares A's first 256 tokens: those are loaded, its own 44 computed (F loads 304, below)
    assert first_stats["scheduler"]["hits"] == 2 and first_stats["worker"]["loaded_tokens"] == 256 + 304
    # the same tokens as vLLM alone, whether 256 (first) or 288 (second) of them were loaded
    assert loaded_b["tokens"] == loaded_b_again["tokens"] == computed_b["tokens"] == baseline[1]["tokens"]


def test_a_next_turn_loads_the_previous_answers_rows_too(baseline, first, store, altered):
    from kvstore.store import SessionStore

    (a, _, next_turn), first_stats, _ = first
    (_, _, _, recomputed_next_turn), _ = altered
    assert next_turn["prompt"] == a["prompt"] + a["tokens"] + NEXT_TURN["extra"]
    assert len(next_turn["tokens"]) == MAX_TOKENS
    # 304 tokens loaded (the previous turn and its answer), the rest computed: the tokens of vLLM alone
    assert next_turn["prompt"] == recomputed_next_turn["prompt"] == baseline[2]["prompt"]
    assert next_turn["tokens"] == recomputed_next_turn["tokens"] == baseline[2]["tokens"]
    # A's conversation was saved with the rows of A and of its answer but the last token (never fed
    # back): 311 tokens, whole blocks of 16 of them loaded, past A's prompt of 300
    assert first_stats["worker"]["saved_tokens"] == 300 + 311 + 300 + 311 + 352 + 363
    assert first_stats["worker"]["loaded_tokens"] - 256 == (300 + MAX_TOKENS - 1) // 16 * 16 == 304
    with SessionStore(store) as opened:  # every fixture's process and server has finished with it
        stored = {}
        for info in opened.list(owner="vllm"):
            records = opened.resume(info.id, owner="vllm").records
            L, R, _ = records.dequantize()
            stored[tuple(records.tokens.tolist())] = np.concatenate([L, R], axis=-1)
    prompt = stored[tuple(a["prompt"])]
    conversation = stored[tuple(a["prompt"] + a["tokens"][:-1])]
    next_prompt = stored[tuple(next_turn["prompt"])]
    # the conversation holds the very rows of the prompt's prefill, then the answer's
    assert np.array_equal(conversation[:, :300], prompt)
    # and the next turn attended to exactly those rows: its own stored prompt begins with them
    assert np.array_equal(next_prompt[:, :304], conversation[:, :304])


def test_vllms_own_metrics_carry_the_connectors_counters(first):
    _, counted, in_vllm = first
    both = {name: counted["scheduler"][name] + counted["worker"][name] for name in counted["scheduler"]}
    names = ("lookups", "hits", "misses", "refused", "matched_tokens", "loads", "loaded_tokens", "load_errors")
    for name in names + ("hot_hits", "hot_misses"):
        assert in_vllm.get(name, 0) == both[name], name
    assert in_vllm["lookups"] == in_vllm["hits"] + in_vllm["misses"] == 3
    # the last request's two saves (its prompt's, written after the step that ended its prefill, and
    # its conversation's, at its finish) may settle after vLLM's last step: generate() returns
    # without another step, so vLLM's metrics may never carry them
    assert both["saves"] - 2 <= in_vllm["saves"] <= both["saves"]


def test_altered_rows_are_refused_by_verification_and_recomputed(altered):
    _, counts = altered
    sched, worker = counts["scheduler"], counts["worker"]
    # the index still finds A, B and F (their tokens are intact); their rows fail the turn hashes,
    # and each failing session is quarantined so that the next save of its prompt replaces it
    assert sched["hits"] == 3 and worker["load_errors"] == 3 and worker["loaded_tokens"] == 0
    assert worker["quarantined"] == 3


def test_another_owner_never_loads_the_prefix_and_the_server_counts_every_lookup(first, served):
    (computed_a, _, _), _, _ = first
    (bob_computed, bob_loaded), bob = served["bob"]
    sched, worker = bob["scheduler"], bob["worker"]
    # bob's first A missed (vllm's A is not his); his second A found his own save
    assert (sched["lookups"], sched["hits"], sched["misses"], sched["refused"]) == (2, 1, 1, 0)
    assert worker["saves"] == 2 and worker["loads"] == 1 and worker["loaded_tokens"] == 288  # A, its conversation
    assert bob_computed["tokens"] == bob_loaded["tokens"] == computed_a["tokens"]
    # the server answered exactly the two service-mode processes' lookups
    mine = [served[name][1]["scheduler"] for name in ("second", "bob")]
    lookups, hits, misses = served["metrics"]
    assert (lookups, hits, misses) == tuple(sum(s[k] for s in mine) for k in ("lookups", "hits", "misses"))
    assert lookups == hits + misses == 4


def test_rows_of_another_model_are_refused_by_fingerprint(altered):
    (_, _, other, _), counts = altered
    sched = counts["scheduler"]
    assert sched["refused"] == 1 and sched["lookups"] == 4 and sched["hits"] + sched["misses"] == 4
    assert len(other["tokens"]) == MAX_TOKENS


def test_rows_after_a_load_equal_rows_computed_in_one_chunk_only_with_the_torch_rotary_op(chunking):
    torch_diff, torch_scale, torch_log = chunking[True]
    kernel_diff, kernel_scale, kernel_log = chunking[False]
    print(f"rows 288..300, max |with A - after load|: torch rotary {torch_diff:.3g}, CPU kernel {kernel_diff:.3g}")
    assert torch_diff <= 1e-5 * torch_scale
    assert kernel_diff > 1e-2 * kernel_scale  # the chunk-dependent rows the connector warns about
    warning = "vLLM's CPU rotary kernel is on"
    assert warning in kernel_log and warning not in torch_log
