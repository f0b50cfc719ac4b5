"""``kvstore new-model`` / ``kvstore generate``: a conversation journaled and resumed across calls.

``model_dir`` (conftest) is written by ``kvstore new-model``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.formats import coli_kv


def _generate_json(capsys, *args) -> dict:
    assert main(["generate", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("tier,version", [("f32", 1), ("fp8", 2), ("int4", 3), ("q8", 1)])
def test_a_journaled_conversation_resumes_without_re_prefill(model_dir, tmp_path, capsys, tier, version):
    journal = tmp_path / "talk.coli_kv"
    first = _generate_json(
        capsys, model_dir, "--ids", "5,6,7,8,9", "--journal", journal, "--tier", tier, "--max-new-tokens", 6, "--stop"
    )
    assert (first["prefilled_tokens"], first["reused_tokens"]) == (5, 0)
    records = coli_kv.load(journal)
    assert records.header.version == version
    # the whole turn is journaled, the last generated token included
    assert records.tokens.tolist() == [5, 6, 7, 8, 9, *first["tokens"]]
    second = _generate_json(
        capsys, model_dir, "--ids", "10 11", "--journal", journal, "--tier", tier, "--max-new-tokens", 4, "--stop"
    )
    assert (second["prefilled_tokens"], second["reused_tokens"]) == (2, 11)
    assert coli_kv.load(journal).n == 11 + 2 + 4


def test_resumed_turn_equals_one_uninterrupted_context(model_dir, tmp_path, capsys):
    journal = tmp_path / "talk.coli_kv"
    first = _generate_json(
        capsys, model_dir, "--ids", "20 21 22", "--journal", journal, "--max-new-tokens", 5, "--stop"
    )
    resumed = _generate_json(capsys, model_dir, "--ids", "23", "--journal", journal, "--max-new-tokens", 6, "--stop")
    context = [20, 21, 22, *first["tokens"], 23]
    cold = _generate_json(capsys, model_dir, "--ids", " ".join(map(str, context)), "--max-new-tokens", 6, "--stop")
    assert resumed["tokens"] == cold["tokens"]


def test_text_prompt_streams_text(model_dir, capsys):
    assert main(["generate", str(model_dir), "--prompt", "hi", "--max-new-tokens", "3", "--stop"]) == 0
    captured = capsys.readouterr()
    assert "prefilled 2, reused 0" in captured.err


def test_bad_input_exits_2_with_a_reason(model_dir, tmp_path, capsys):
    journal = tmp_path / "talk.coli_kv"
    assert (
        main(
            [
                "generate",
                str(model_dir),
                "--ids",
                "1 2",
                "--journal",
                str(journal),
                "--tier",
                "fp8",
                "--max-new-tokens",
                "1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    # the journal is fp8: resuming it under another quantized tier is refused, the file untouched
    before = journal.read_bytes()
    assert main(["generate", str(model_dir), "--ids", "3", "--journal", str(journal), "--tier", "int4"]) == 2
    assert "migrate" in capsys.readouterr().err
    assert journal.read_bytes() == before
    assert main(["generate", str(model_dir), "--ids", "1 x"]) == 2
    assert "--ids" in capsys.readouterr().err
    assert main(["generate", str(model_dir), "--ids", "100000"]) == 2
    assert "token ids" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "nowhere"), "--ids", "1"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert np.array_equal(coli_kv.load(journal).tokens[:2], [1, 2])


@pytest.mark.parametrize(
    "old,tier,note",
    [
        (["--tier", "tq-polar", "--bits", "3"], "polar3", "tier 'tq-polar' (bits 3) is deprecated: use 'polar3'"),
        (["--tier", "tq-int4"], "int4", "tier 'tq-int4' is deprecated: use 'int4'"),
        (["--tier", "int8"], "q8", "tier 'int8' is deprecated: use 'q8'"),
    ],
)
def test_old_engine_tier_spellings_warn_once_and_still_work(model_dir, tmp_path, capsys, old, tier, note):
    from kvstore import tiers

    journal = tmp_path / "talk.coli_kv"
    argv = [
        "generate",
        str(model_dir),
        "--ids",
        "5 6 7",
        "--journal",
        str(journal),
        "--max-new-tokens",
        "2",
        "--stop",
        *old,
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("kvstore: warning: ") == 1 and f"kvstore: warning: {note}" in err
    assert f"tier {tier}]" in err  # the summary names the canonical tier
    assert coli_kv.load(journal).tier == tiers.get(tier).file_tier


def test_an_empty_turn_continues_the_journal_without_running_it_again(model_dir, tmp_path, capsys):
    # Issue 21 for the engine: no new tokens continues the conversation; the cache holds every row,
    # so only the last token is re-run (for its logits) and the answer is the uninterrupted one.
    journal = tmp_path / "talk.coli_kv"
    first = _generate_json(
        capsys, model_dir, "--ids", "20 21 22", "--journal", journal, "--max-new-tokens", 5, "--stop"
    )
    more = _generate_json(capsys, model_dir, "--ids", "", "--journal", journal, "--max-new-tokens", 6, "--stop")
    assert (more["prefilled_tokens"], more["reused_tokens"]) == (1, 3 + 5 - 1)
    context = [20, 21, 22, *first["tokens"]]
    cold = _generate_json(capsys, model_dir, "--ids", " ".join(map(str, context)), "--max-new-tokens", 6, "--stop")
    assert more["tokens"] == cold["tokens"]
    assert coli_kv.load(journal).tokens.tolist() == [*context, *more["tokens"]]
    fresh = tmp_path / "fresh.coli_kv"
    assert main(["generate", str(model_dir), "--ids", "", "--journal", str(fresh)]) == 2
    assert "nothing to generate from" in capsys.readouterr().err and not fresh.exists()
