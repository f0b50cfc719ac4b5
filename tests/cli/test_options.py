"""The CLI's one vocabulary and one policy: ``--tier`` (canonical names, old spellings warned once),
``--owner`` defaults, ``--data``/``--json`` everywhere, ``--version``, one-line errors with exit 2,
the entry points (``kvstore``, ``python -m kvstore``, ``python -m kvstore.cli``) and the promise that
a file tool imports neither torch nor the web stack."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import kvstore
from kvstore.cli import build_parser, main
from kvstore.engine.config import PRESETS
from kvstore.formats import coli_kv


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def leaf_parsers(parser: argparse.ArgumentParser, prefix: str = ""):
    """(command words, parser) of every runnable subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from leaf_parsers(child, f"{prefix} {name}".strip())
            return
    yield prefix, parser


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in parser._actions if flag in a.option_strings), None)


# ---------------------------------------------------------------------------- entry points
def test_version_flag(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out == f"kvstore {kvstore.__version__}\n"


@pytest.mark.parametrize("module", ["kvstore", "kvstore.cli"])
def test_python_dash_m_runs_the_same_command(module, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert done.returncode == 0 and done.stdout == f"kvstore {kvstore.__version__}\n", done.stderr
    bad = subprocess.run(
        [sys.executable, "-m", module, "inspect", str(tmp_path / "absent.coli_kv")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("kvstore: error: ") and len(bad.stderr.splitlines()) == 1


def test_a_file_tool_imports_neither_torch_nor_the_web_stack(vectors):
    heavy = ["torch", "transformers", "fastapi", "starlette", "uvicorn", "pydantic", "lmdb", "kvstore.api"]
    code = (
        "import sys\n"
        "from kvstore.cli import main\n"
        f"assert main(['inspect', {str(vectors / 'small.v2.coli_kv')!r}, '--json']) == 0\n"
        f"print(sorted(name for name in {heavy!r} if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------------------- errors
def test_usage_errors_are_one_line_naming_the_command(capsys):
    code, out, err = run(capsys, "migrate")
    assert code == 2 and out == ""
    assert err.splitlines() == ["kvstore: error: migrate: the following arguments are required: src, dst"]
    code, _, err = run(capsys, "sessions", "show")
    assert code == 2 and err.splitlines() == ["kvstore: error: sessions show: the following arguments are required: id"]
    code, _, err = run(capsys, "no-such-command")
    assert code == 2 and len(err.splitlines()) == 1 and "invalid choice: 'no-such-command'" in err


# ---------------------------------------------------------------------------- --tier
def test_tier_help_lists_the_canonical_names_and_hides_the_old_options():
    parser = build_parser()
    for words, leaf in leaf_parsers(parser):
        tier = option(leaf, "--tier")
        if tier is None:
            continue
        engine = words in ("generate", "chat", "serve")
        expected = "f32, bf16, fp8, int4, polar2..polar6, q8" if engine else "f32, bf16, fp8, int4, polar2..polar6"
        assert expected in tier.help and tier.metavar == "NAME", words
        if not engine:
            assert "q8" not in tier.help, words
        for old in ("--codec", "--bits", "--to"):
            hidden = option(leaf, old)
            assert hidden is None or hidden.help == argparse.SUPPRESS, (words, old)


def test_canonical_tier_migrates_without_a_warning(tmp_path, vectors, capsys):
    dst = tmp_path / "out.coli_kv"
    code, _, err = run(capsys, "migrate", vectors / "small.v1.coli_kv", dst, "--tier", "polar3", "--allow-damaged")
    assert code == 0 and "deprecated" not in err  # the one warning: the reference source's NaN (damage)
    assert dst.read_bytes() == (vectors / "small.v3c0b3.coli_kv").read_bytes()


@pytest.mark.parametrize(
    "old,variant,notes",
    [
        (["--to", "v2"], "v2", ["--to is deprecated: use --tier", "tier 'v2' is deprecated: use 'fp8'"]),
        (
            ["--to", "v3", "--codec", "int4"],
            "v3c1b4",
            ["--to is deprecated: use --tier", "tier 'v3' (codec int4) is deprecated: use 'int4'"],
        ),
        (["--tier", "tq-polar", "--bits", "3"], "v3c0b3", ["tier 'tq-polar' (bits 3) is deprecated: use 'polar3'"]),
        (["--tier", "v3:polar:2"], "v3c0b2", ["tier 'v3:polar:2'"]),
        (["--tier", "polar-6"], "v3c0b6", ["tier 'polar-6'"]),
        (["--tier", "v1"], "v1", ["tier 'v1' is deprecated: use 'f32'"]),
    ],
)
def test_old_tier_spellings_still_work_and_warn_once_on_stderr(tmp_path, vectors, capsys, old, variant, notes):
    dst = tmp_path / "out.coli_kv"
    # --allow-damaged: the reference source holds a NaN on purpose (tests/vectors/README.md)
    code, _, err = run(capsys, "migrate", vectors / "small.v1.coli_kv", dst, *old, "--allow-damaged")
    assert code == 0, err
    if variant == "v1":  # a same-tier copy of the damaged source is sanitized (the NaN reads 0)
        assert coli_kv.load(dst).tier.name == "f32" and coli_kv.load(dst).n == 7
    else:
        assert dst.read_bytes() == (vectors / f"small.{variant}.coli_kv").read_bytes()
    warnings = [line for line in err.splitlines() if line.startswith("kvstore: warning: ") and "damaged" not in line]
    assert len(warnings) == len(notes) and all(note in line for note, line in zip(notes, warnings)), err
    assert "deprecated" in warnings[-1] and warnings[-1].endswith(f"use {dst_name(variant)!r}")


def dst_name(variant: str) -> str:
    return {"v1": "f32", "v2": "fp8", "v3c1b4": "int4"}.get(variant) or f"polar{variant[-1]}"


def test_the_warning_is_shown_again_by_the_next_command(tmp_path, vectors, capsys):
    for name in ("a", "b"):  # one process, two commands: each says it (no global once-only registry)
        code, _, err = run(
            capsys, "migrate", vectors / "small.v2.coli_kv", tmp_path / f"{name}.coli_kv", "--tier", "v2"
        )
        assert code == 0 and err.count("kvstore: warning: tier 'v2' is deprecated: use 'fp8'") == 1


@pytest.mark.parametrize(
    "args,reason",
    [
        (["--tier", "fp9"], "unknown tier 'fp9'"),
        (["--tier", "q8"], "tier 'q8' is a cache tier with no .coli_kv format of its own"),
        (["--tier", "int4", "--bits", "3"], "--bits does not apply to tier 'int4'"),
        (["--codec", "polar"], "--codec and --bits only qualify --tier"),
        ([], "give the target with --tier NAME (f32, bf16, fp8, int4, polar2..polar6)"),
    ],
)
def test_bad_tiers_exit_2_with_one_line(tmp_path, vectors, capsys, args, reason):
    dst = tmp_path / "out.coli_kv"
    code, out, err = run(capsys, "migrate", vectors / "small.v1.coli_kv", dst, *args)
    assert code == 2 and out == "" and not dst.exists()
    errors = [line for line in err.splitlines() if not line.startswith("kvstore: warning: ")]
    assert len(errors) == 1 and errors[0].startswith("kvstore: error: ") and reason in errors[0], err


def test_sessions_take_canonical_and_old_tiers(tmp_path, capsys):
    data = tmp_path / "data"
    base = [
        "sessions",
        "create",
        "--data",
        data,
        "--model-name",
        "m",
        "--model-revision",
        "r",
        "--geometry",
        "2,32,8,4,1,1000",
        "--json",
    ]
    code, out, err = run(capsys, *base, "--id", "a")
    assert code == 0 and json.loads(out)["tier"]["version"] == 2 and "warning" not in err  # default fp8
    code, out, err = run(capsys, *base, "--id", "b", "--tier", "polar5")
    assert (
        code == 0 and (json.loads(out)["tier"]["codec"], json.loads(out)["tier"]["bits"]) == ("polar", 5) and err == ""
    )
    code, out, err = run(capsys, *base, "--id", "c", "--tier", "v3", "--codec", "polar", "--bits", "5")
    assert code == 0 and (json.loads(out)["tier"]["codec"], json.loads(out)["tier"]["bits"]) == ("polar", 5)
    assert err.splitlines() == ["kvstore: warning: tier 'v3' (codec polar, bits 5) is deprecated: use 'polar5'"]
    code, out, err = run(
        capsys, "sessions", "migrate", "a", "--data", data, "--tier", "v3", "--codec", "int4", "--bits", "4", "--json"
    )
    assert code == 0 and json.loads(out)["tier"]["codec"] == "int4" and "use 'int4'" in err
    code, _, err = run(capsys, *base, "--id", "d", "--tier", "q8")
    assert code == 2 and "cache tier" in err
    code, out, _ = run(capsys, *base, "--id", "e", "--tier", "bf16", "--json")
    assert code == 0 and json.loads(out)["tier"]["name"] == "bf16" and json.loads(out)["tier"]["version"] == 4


# ---------------------------------------------------------------------------- --owner, --data, --json
def test_owner_defaults_any_owner_except_where_a_session_is_created():
    creating = {"sessions create"}
    either = {"chat", "hf-chat"}  # continue a session of any owner; one they create gets 'default'
    seen = set()
    for words, leaf in leaf_parsers(build_parser()):
        owner = option(leaf, "--owner")
        if owner is None:
            continue
        seen.add(words)
        assert owner.default == ("default" if words in creating else None), words
        if words in either:
            assert "default: any owner" in owner.help and "'default'" in owner.help
    assert creating | either | {"verify", "sessions list", "sessions lookup", "sessions verify"} <= seen


def test_sessions_owner_defaults(tmp_path, capsys):
    data = tmp_path / "data"
    base = [
        "sessions",
        "create",
        "--data",
        data,
        "--model-name",
        "m",
        "--model-revision",
        "r",
        "--geometry",
        "2,32,8,4,1,1000",
        "--json",
    ]
    assert json.loads(run(capsys, *base, "--id", "mine")[1])["owner"] == "default"
    assert json.loads(run(capsys, *base, "--id", "hers", "--owner", "alice")[1])["owner"] == "alice"
    code, out, _ = run(capsys, "sessions", "list", "--data", data, "--json")
    assert code == 0 and sorted(s["id"] for s in json.loads(out)) == ["hers", "mine"]  # any owner
    assert [
        s["id"] for s in json.loads(run(capsys, "sessions", "list", "--data", data, "--owner", "alice", "--json")[1])
    ] == ["hers"]
    assert run(capsys, "sessions", "show", "hers", "--data", data, "--json")[0] == 0
    code, _, err = run(capsys, "sessions", "show", "hers", "--data", data, "--owner", "bob")
    assert code == 2 and "no session 'hers'" in err  # another owner's session is invisible


def test_every_reporting_command_takes_json_and_every_store_command_takes_data():
    for words, leaf in leaf_parsers(build_parser()):
        if words != "serve":
            assert option(leaf, "--json") is not None, words
        if words.startswith("sessions") or words in ("serve", "chat", "verify", "hf-chat"):
            data = option(leaf, "--data")
            assert data is not None and data.default == "./data" and data.metavar == "DIR", words


def test_export_json_report(tmp_path, vectors, capsys):
    out = tmp_path / "rows.npz"
    code, text, _ = run(capsys, "export", vectors / "small.v2.coli_kv", out, "--json")
    assert code == 0 and json.loads(text) == {
        "source": str(vectors / "small.v2.coli_kv"),
        "out": str(out),
        "records": 7,
        "tier": "fp8",
    }


def test_new_model_offers_every_preset():
    parser = build_parser()
    for name in PRESETS:
        assert parser.parse_args(["new-model", "folder", "--preset", name]).preset == name
    assert option(dict(leaf_parsers(parser))["new-model"], "--preset").choices == tuple(PRESETS)


# ---------------------------------------------------------------------------- serve
def test_serve_refuses_engine_options_without_a_model(tmp_path, capsys):
    code, _, err = run(capsys, "serve", "--data", tmp_path / "data", "--tier", "fp8")
    assert code == 2 and err.splitlines() == [
        "kvstore: error: --tier only apply to the engine: give its model folder with --model DIR"
    ]
    code, _, err = run(capsys, "serve", "--data", tmp_path / "data", "--model", tmp_path / "nowhere")
    assert code == 2 and "is not a model folder (no such folder); expected a folder with config.json" in err


def test_serve_answers_health_and_stops_on_sigterm(tmp_path, hash_cache):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.set_inheritable(True)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_API_KEYS"}
    exe = shutil.which("kvstore", path=os.path.dirname(sys.executable))
    server = subprocess.Popen(
        [exe, "serve", "--data", str(tmp_path / "data"), "--fd", str(listener.fileno()), "--log-level", "warning"],
        pass_fds=[listener.fileno()],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    listener.close()
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvstore serve did not answer /health"
            time.sleep(0.05)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        output = server.stdout.read()
        server.stdout.close()
    assert code in (0, -signal.SIGTERM) and "Traceback" not in output, (
        output
    )  # uvicorn re-raises SIGTERM after a clean stop
    assert "API key for owner 'default'" in output and (tmp_path / "data" / "keys.json").is_file()
