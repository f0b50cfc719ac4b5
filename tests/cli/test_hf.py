"""``kvstore hf-chat``: a conversation continued across processes, with the reuse reported.

``hf_folder`` (conftest) is a tiny DeepseekV3ForCausalLM saved by transformers, with a byte tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from kvstore.cli import main
from kvstore.engine import hf
from kvstore.engine.tokenizer import load_tokenizer
from kvstore.store import SessionStore

TURNS = ("Hello", "How are you?", "Fine.")
NEW = 6


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _reference(folder, data):
    """The same three turns in one process that never stops (its own store)."""
    model, tokenizer = _load(folder), load_tokenizer(folder)
    cache, history, answers = hf.new_cache(model), torch.empty(0, dtype=torch.int64), []
    with SessionStore(data) as store:
        for text in TURNS:
            ids = torch.tensor(tokenizer(text, add_special_tokens=history.numel() == 0)["input_ids"])
            context = torch.cat([history, ids])[None]
            out = model.generate(context, max_new_tokens=NEW, do_sample=False, **hf.cache_kwargs(model, cache))
            hf.save(store, "ref", model, cache, out[0], owner="default")
            answers.append(out[0, context.shape[1] :].tolist())
            history = out[0]
    return answers


def test_hf_chat_continues_a_conversation_in_a_new_process(hf_folder, tmp_path, capsys):
    data = tmp_path / "data"
    args = ["hf-chat", str(hf_folder), "--session", "demo", "--data", str(data), "--max-new-tokens", str(NEW), "--json"]
    assert main([*args, "--prompt", TURNS[0]]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (first["reused_tokens"], first["tier"], first["records"]) == (
        0,
        "f32 (v1, f32 values)",
        first["prefilled_tokens"] + NEW,
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args],
        input="\n".join(TURNS[1:]) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    second, third = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert second["reused_tokens"] == first["records"]  # the whole first turn came from the store
    assert second["prefilled_tokens"] == len(TURNS[1].encode())  # byte tokenizer: one token per byte
    assert third["reused_tokens"] == second["records"] and third["prefilled_tokens"] == len(TURNS[2].encode())
    assert [first["tokens"], second["tokens"], third["tokens"]] == _reference(hf_folder, tmp_path / "ref")
    assert isinstance(third["text"], str)


def test_hf_chat_refuses_bad_input_with_exit_code_2(hf_folder, tmp_path, capsys):
    data = tmp_path / "data"
    base = ["hf-chat", str(hf_folder), "--session", "demo", "--data", str(data), "--max-new-tokens", "2"]
    assert main([*base, "--ids", "5 6 7"]) == 0
    capsys.readouterr()
    assert main([*base, "--ids", "8", "--tier", "fp8"]) == 2
    assert "tier: session f32 (v1, f32 values), expected fp8 (v2, e4m3 codes + f32 scale)" in capsys.readouterr().err
    assert main([*base, "--ids", "8 x"]) == 2
    assert "token ids must be integers" in capsys.readouterr().err
    assert main(["hf-chat", str(tmp_path / "nowhere"), "--session", "demo", "--data", str(data), "--ids", "1"]) == 2
    assert "not a model folder" in capsys.readouterr().err
    assert main([*base, "--ids", "9999"]) == 2
    assert "[0, 512)" in capsys.readouterr().err


def test_hf_chat_owner_defaults_to_any_owner_and_creates_as_default(hf_folder, tmp_path, capsys):
    data = tmp_path / "data"
    base = ["hf-chat", str(hf_folder), "--data", str(data), "--max-new-tokens", "2", "--json"]
    assert main([*base, "--session", "mine", "--ids", "5 6"]) == 0
    assert main([*base, "--session", "hers", "--ids", "5 6", "--owner", "alice", "--tier", "fp8"]) == 0
    capsys.readouterr()
    with SessionStore(data) as store:
        assert (store.get("mine").owner, store.get("hers").owner) == ("default", "alice")
        assert store.get("hers").tier.name == "fp8"
    assert main([*base, "--session", "hers", "--ids", "7"]) == 0  # no --owner: any owner's session continues
    turn = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert turn["reused_tokens"] == 4 and turn["records"] == 7
    # Ids are per owner: alice's "hers" is invisible to bob, who gets a new "hers" of his own.
    assert main([*base, "--session", "hers", "--ids", "8", "--owner", "bob"]) == 0
    turn = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (turn["reused_tokens"], turn["records"]) == (0, 3)
    with SessionStore(data) as store:
        assert store.get("hers", owner="bob").n_records == 3 and store.get("hers", owner="alice").n_records == 7
    # Now two owners have "hers": without --owner the command refuses to pick one, naming them.
    assert main([*base, "--session", "hers", "--ids", "9"]) == 2
    assert "2 owners have a session 'hers' (alice, bob); name the owner (--owner)" in capsys.readouterr().err
    assert main([*base, "--session", "hers", "--ids", "9", "--owner", "alice"]) == 0
    turn = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (turn["reused_tokens"], turn["records"]) == (7, 10)
    with SessionStore(data) as store:
        assert store.get("hers", owner="bob").n_records == 3
    assert main([*base, "--session", "old", "--ids", "5 6", "--tier", "v2"]) == 0
    assert "kvstore: warning: tier 'v2' is deprecated: use 'fp8'" in capsys.readouterr().err


def test_hf_chat_with_an_empty_turn_continues_without_running_the_conversation_again(hf_folder, tmp_path, capsys):
    # Issue 21: a turn with no new tokens continues the stored conversation. The cache already holds
    # every token, so the last one is handed back and re-run — never the whole conversation on top.
    data = tmp_path / "data"
    args = ["hf-chat", str(hf_folder), "--session", "demo", "--data", str(data), "--max-new-tokens", str(NEW), "--json"]
    assert main([*args, "--prompt", TURNS[0]]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, "--ids", ""]) == 0
    more = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (more["reused_tokens"], more["prefilled_tokens"]) == (first["records"] - 1, 1)
    assert more["records"] == first["records"] + NEW
    model, tokenizer = _load(hf_folder), load_tokenizer(hf_folder)
    prompt = torch.tensor(tokenizer(TURNS[0])["input_ids"])[None]
    uninterrupted = model.generate(prompt, max_new_tokens=2 * NEW, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert first["tokens"] + more["tokens"] == uninterrupted
    assert main([*args[:3], "fresh", *args[4:], "--ids", ""]) == 2
    assert "nothing to continue" in capsys.readouterr().err
