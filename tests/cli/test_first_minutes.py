"""What a new user meets in the first minutes with the command line (issue 39), checked the way they
met it: a bare ``kvstore``, a typo in ``--data``, an engine command on the core install, a port out
of range, the answer of ``generate`` and ``chat`` sharing a terminal with its report, an old tier
spelling on a journal of another tier."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore.store
from kvstore import tiers
from kvstore.cli import main
from kvstore.cli.engine import journal_tier_refusal
from kvstore.errors import InvalidRequest

#: Run ``kvstore`` as an install without the engine extra would: torch, transformers, safetensors
#: and tokenizers cannot be imported (an import hook refuses them, as a missing package is refused).
WITHOUT_ENGINE = """
import sys
class NoEngine:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers", "safetensors", "tokenizers", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoEngine())
from kvstore.cli import main
code = main(sys.argv[1:])
assert not [m for m in sys.modules if m.partition(".")[0] in ("torch", "transformers")], "torch was imported"
sys.exit(code)
"""


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def kvstore_process(*argv, cwd: Path, prelude: str | None = None, timeout: float = 120):
    """``kvstore ARGV`` in a child process, stdout and stderr apart, as a terminal without
    ``PYTHONUNBUFFERED`` runs it (``prelude``: a program to run instead of the plain command)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "KVSTORE_API_KEYS")}
    command = (
        [sys.executable, "-c", prelude, *map(str, argv)]
        if prelude
        else [sys.executable, "-m", "kvstore", *map(str, argv)]
    )
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------- a bare command
@pytest.mark.parametrize(
    "argv,listed",
    [
        ([], ["serve", "sessions", "new-model", "generate", "chat", "inspect", "keys"]),
        (["sessions"], ["list", "show", "create", "append", "resume", "verify"]),
        (["keys"], ["create", "list", "revoke"]),
    ],
)
def test_a_command_without_its_subcommand_lists_what_it_has(capsys, argv, listed):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"usage: kvstore {' '.join(argv)}".rstrip() + " "), err
    assert "positional arguments" in err and "the following arguments are required" not in err
    shown = set(re.findall(r"^    (\S+)", err, re.MULTILINE))
    assert set(listed) <= shown, shown


# ---------------------------------------------------------------------------- --data of a store that is not there
READ_ONLY = [
    ["sessions", "list"],
    ["sessions", "show", "chat-1"],
    ["sessions", "inspect", "chat-1"],
    ["sessions", "resume", "chat-1", "out.coli_kv"],
    ["sessions", "verify", "chat-1"],
    ["verify", "--repair"],
    ["sessions", "lookup", "--like-session", "chat-1", "--tokens", "1 2 3"],
    ["sessions", "delete", "chat-1"],
    ["sessions", "truncate", "chat-1", "3"],
    ["sessions", "fork", "chat-1"],
    ["sessions", "migrate", "chat-1", "--tier", "int4"],
]


@pytest.mark.parametrize("argv", READ_ONLY, ids=lambda argv: " ".join(argv[:2]))
def test_a_command_on_stored_sessions_never_creates_a_store(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv, "--data", "./dta")  # a typo of ./data
    assert code == 2 and out == "", (out, err)
    assert err == (
        "kvstore: error: --data ./dta: no session store there (no such folder); give the folder "
        "`kvstore serve` or `kvstore sessions create` used (default ./data)\n"
    )
    assert not (tmp_path / "dta").exists()
    # a folder that is there but holds no store is left as it was, whatever it holds
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("mine")
    code, _, err = run(capsys, *argv, "--data", tmp_path / "empty")
    assert code == 2 and "no session store there (a folder without a store's index/)" in err, err
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["notes.txt"]


def test_create_makes_the_store_the_others_then_find(tmp_path, capsys):
    data = tmp_path / "data"
    code, out, err = run(
        capsys, "sessions", "create", "--data", data, "--id", "chat-1", "--model-name", "m", "--model-revision", "r",
        "--geometry", "2,32,8,0,0,1000",
    )  # fmt: skip
    assert code == 0 and out.strip() == "chat-1", err
    code, out, err = run(capsys, "sessions", "list", "--data", data)
    assert code == 0 and out.startswith("chat-1  owner=default"), err


def test_the_store_factory_refuses_a_folder_without_a_store_when_told_not_to_create(tmp_path):
    with pytest.raises(InvalidRequest, match=r"no session store there \(no such folder\); nothing was created"):
        kvstore.store.open(tmp_path / "dta", create=False)
    assert not (tmp_path / "dta").exists()
    with kvstore.store.open(tmp_path / "data"):
        pass  # created (the default)
    with kvstore.store.open(tmp_path / "data", create=False) as store:
        assert store.list() == []


# ---------------------------------------------------------------------------- the engine is an extra
@pytest.mark.parametrize(
    "argv,command",
    [
        (["new-model", "models/tiny"], "new-model"),
        (["generate", "models/tiny", "--prompt", "Hello", "--journal", "chat.coli_kv"], "generate"),
        (["chat", "models/tiny", "--session", "chat-1", "--prompt", "Hello", "--data", "./data"], "chat"),
        (["hf-chat", "models/tiny", "--session", "chat-1", "--prompt", "Hello", "--data", "./data"], "hf-chat"),
        (["serve", "--model", "models/tiny", "--data", "./data", "--port", "0"], "serve --model"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_an_engine_command_without_the_engine_says_how_to_add_it(tmp_path, argv, command):
    done = kvstore_process(*argv, cwd=tmp_path, prelude=WITHOUT_ENGINE)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith(
        f"kvstore: error: `kvstore {command}` runs the engine, which is not installed (no torch, "
    )
    assert "pip install 'kvstore[engine]'" in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert list(tmp_path.iterdir()) == []  # no model folder, journal or data folder was made


def test_an_engine_module_missing_past_the_check_is_the_same_one_line(capsys, monkeypatch):
    import kvstore.cli.engine

    def needs_transformers(args):
        raise ModuleNotFoundError("No module named 'transformers.models'", name="transformers.models")

    monkeypatch.setattr(kvstore.cli.engine, "cmd_new_model", needs_transformers)
    code, out, err = run(capsys, "new-model", "x")
    assert code == 2 and out == ""
    assert err.startswith(
        "kvstore: error: `kvstore new-model` runs the engine, which is not installed (no transformers)"
    )

    def needs_something_else(args):
        raise ModuleNotFoundError("No module named 'frobnicate'", name="frobnicate")

    monkeypatch.setattr(kvstore.cli.engine, "cmd_new_model", needs_something_else)
    with pytest.raises(ModuleNotFoundError):  # a bug, not a missing extra: not dressed up as one
        main(["new-model", "x"])


def test_the_service_and_the_store_commands_need_no_engine(tmp_path):
    data = tmp_path / "data"
    created = kvstore_process(
        "sessions", "create", "--data", data, "--id", "c", "--model-name", "m", "--model-revision", "r",
        "--geometry", "2,32,8,0,0,1000", cwd=tmp_path, prelude=WITHOUT_ENGINE,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    listed = kvstore_process("sessions", "list", "--data", data, cwd=tmp_path, prelude=WITHOUT_ENGINE)
    assert listed.returncode == 0 and listed.stdout.startswith("c  owner=default"), listed.stderr
    helped = kvstore_process("serve", "--help", cwd=tmp_path, prelude=WITHOUT_ENGINE)
    assert helped.returncode == 0 and "--model" in helped.stdout, helped.stderr


# ---------------------------------------------------------------------------- serve's port
@pytest.mark.parametrize(
    "port,reason",
    [
        ("99999", "a TCP port is 0..65535, got 99999"),
        ("-1", "a TCP port is 0..65535, got -1"),
        ("http", "a TCP port is a number 0..65535, got 'http'"),
    ],
)
def test_a_port_out_of_range_is_one_line_and_exit_2(tmp_path, port, reason):
    done = kvstore_process("serve", "--port", port, "--data", "./data", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"kvstore: error: serve: argument --port: {reason}\n"
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- generate and chat in one terminal
def test_generate_ends_its_answer_before_the_report_in_a_shared_terminal(model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["OMP_NUM_THREADS"] = "1"
    argv = [
        sys.executable,
        "-m",
        "kvstore",
        "generate",
        str(model_dir),
        "--prompt",
        "Hello",
        "--journal",
        "chat.coli_kv",
    ]
    for _ in ("a new journal", "the journal resumed"):
        # one pipe for both streams, as a terminal (or 2>&1) shows them
        done = subprocess.run(
            [*argv, "--tier", "fp8", "--max-new-tokens", "8"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout
        lines = done.stdout.splitlines()
        assert re.fullmatch(r"\[8 tokens, length; prefilled \d+, reused \d+; tier fp8\]", lines[-1]), done.stdout
        assert len(lines) >= 2 and not lines[-2].endswith("]"), done.stdout


def test_chat_ends_its_answer_before_the_report_in_a_shared_terminal(model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "kvstore", "chat", str(model_dir), "--session", "chat-1", "--prompt", "Hello"]
        + ["--tier", "fp8", "--max-new-tokens", "8", "--data", "./data"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    assert lines[0].startswith("[created session chat-1 for "), done.stdout
    assert re.fullmatch(
        r"\[chat-1: 8 tokens \(length\); prefilled \d+, reused 0 \(new\); \d+ records, fp8 .*\]", lines[-1]
    )
    assert len(lines) == 3, done.stdout  # the created note, the answer, the report: each on its own line


# ---------------------------------------------------------------------------- a journal of another tier
def test_a_journal_of_another_tier_is_refused_with_the_tier_that_continues_it(model_dir, tmp_path, capsys):
    journal = tmp_path / "chat.coli_kv"
    base = ["generate", model_dir, "--ids", "5 6 7", "--journal", journal, "--max-new-tokens", "2"]
    assert run(capsys, *base, "--tier", "fp8")[0] == 0
    before = journal.read_bytes()
    code, out, err = run(capsys, *base, "--tier", "int8")  # the old spelling of q8
    assert code == 2 and out == ""
    warning, error = err.splitlines()
    assert warning == "kvstore: warning: tier 'int8' is deprecated: use 'q8'"
    assert error == (
        f"kvstore: error: {journal} holds fp8 (v2, e4m3 codes + f32 scale) rows and a q8 cache journals f32 rows: "
        f"continue it with --tier fp8, or convert it first (kvstore migrate {journal} OUT.coli_kv --tier f32, then "
        f"--journal OUT.coli_kv)"
    )
    assert "active tier" not in err and journal.read_bytes() == before


def test_which_journals_a_cache_tier_continues():
    f32, fp8, int4, q8, bf16 = (tiers.get(name) for name in ("f32", "fp8", "int4", "q8", "bf16"))
    assert journal_tier_refusal("j", fp8, fp8) is None
    assert journal_tier_refusal("j", f32, fp8) is None  # f32 rows are upgraded on the first append
    assert journal_tier_refusal("j", f32, q8) is None and journal_tier_refusal("j", f32, bf16) is None
    refused = journal_tier_refusal("j", int4, fp8)
    assert (
        refused is not None and refused.startswith("j holds int4 (v3, ") and "--tier fp8 journals fp8 rows" in refused
    )
    assert "continue it with --tier int4" in refused
    refused = journal_tier_refusal("j", fp8, bf16)
    assert refused is not None and "--tier bf16 journals bf16 rows" in refused  # v4: a bf16 cache's own
    refused = journal_tier_refusal("j", fp8, q8)
    assert refused is not None and "a q8 cache journals f32 rows" in refused
    refused = journal_tier_refusal("j", bf16, f32)  # f32 rows would be rounded into a bf16 journal
    assert refused is not None and "continue it with --tier bf16" in refused


# ---------------------------------------------------------------------------- a tier name that is no tier
def test_a_file_command_lists_the_tiers_it_takes(tmp_path, capsys):
    code, _, err = run(
        capsys, "sessions", "create", "--data", tmp_path / "data", "--model-name", "m", "--model-revision", "r",
        "--geometry", "2,32,8,0,0,1000", "--tier", "fp16",
    )  # fmt: skip
    assert code == 2
    assert err == "kvstore: error: unknown tier 'fp16' (this command takes f32, bf16, fp8, int4, polar2..polar6)\n"
    code, _, err = run(capsys, "generate", "models/tiny", "--ids", "1", "--tier", "fp16")
    assert code == 2 and "known: f32, bf16, fp8" in err  # the engine takes its cache tiers too
