"""One configuration registry (``kvstore.config``): no other module of the parts reads the
environment, every variable the repository names is declared there and documented in
docs/CONFIG.md, and a variable is read when asked for, never at import."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import config
from kvstore.errors import ConfigError
from layering import PARTS

ROOT = Path(__file__).resolve().parent.parent
#: Names the tests choose for a connector's ``api_key_env`` (a variable the user names): not kvstore's.
USER_NAMED = re.compile(r"^KVSTORE_TEST_[A-Z_]*$")


def environment_readers(root: Path) -> list[str]:
    """``file:line`` of every read of the environment in the parts' files outside ``config/``:
    ``os.environ`` in any form, ``os.getenv``, ``os.environb``, or those names imported from ``os``."""
    found = []
    for part in PARTS:
        if part == "config":
            continue
        for path in sorted((root / part).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            where = path.relative_to(root)
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv", "getenvb"):
                    found.append(f"{where}:{node.lineno}")
                elif isinstance(node, ast.ImportFrom) and node.module == "os":
                    if {a.name for a in node.names} & {"environ", "environb", "getenv", "getenvb"}:
                        found.append(f"{where}:{node.lineno}")
    return found


def named_variables(root: Path) -> dict[str, str]:
    """Every ``KVSTORE_*`` name written in the repository's code, scripts and docs -> one place it is."""
    names: dict[str, str] = {}
    files = [p for p in root.rglob("*") if p.suffix in (".py", ".md", ".sh", ".toml") or p.name in ("Makefile", "run")]
    for path in sorted(files):
        rel = path.relative_to(root)
        if rel.parts[0] in (".venv", ".git", "build", "test-artifacts") or "egg-info" in rel.parts[0]:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name in re.findall(r"\bKVSTORE_[A-Z][A-Z0-9_]*\b", line):
                names.setdefault(name, f"{rel}:{number}")
    return names


def test_no_module_of_the_parts_reads_the_environment_but_config():
    found = environment_readers(ROOT)
    assert not found, "read the environment through kvstore.config instead:\n" + "\n".join(found)


def test_the_reader_check_catches_a_planted_read(tmp_path):
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "bad.py").write_text("import os\nA = os.environ.get('X')\nfrom os import getenv\n")
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "__init__.py").write_text("import os\nB = os.environ\n")
    assert sorted(environment_readers(tmp_path)) == ["gpu/bad.py:2", "gpu/bad.py:3"]


def test_every_variable_the_repository_names_is_declared_and_documented():
    declared = {v.name for v in config.VARIABLES}
    named = named_variables(ROOT)
    undeclared = {n: where for n, where in named.items() if n not in declared and not USER_NAMED.match(n)}
    assert not undeclared, f"declare these in kvstore.config (config/__init__.py): {undeclared}"
    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    for entry in config.VARIABLES:
        assert f"| `{entry.name}` | {entry.group} |" in doc, f"{entry.name} is not in docs/CONFIG.md's table"
        assert entry.doc in doc, f"docs/CONFIG.md's row of {entry.name} differs from its declared doc"
    for default in config.DEFAULTS:
        assert f"| `{default.name}` | `{default.value}` |" in doc, f"default {default.name} is not in docs/CONFIG.md"
    assert len(declared) == len(config.VARIABLES), "a variable is declared twice"


def test_variables_are_read_when_asked_with_their_types(monkeypatch):
    monkeypatch.delenv("KVSTORE_GPU_WGMMA", raising=False)
    assert config.GPU_WGMMA.get() is None
    for text, value in (("1", True), ("on", True), ("0", False), ("No", False)):
        monkeypatch.setenv("KVSTORE_GPU_WGMMA", text)
        assert config.GPU_WGMMA.get() is value
    monkeypatch.setenv("KVSTORE_GPU_WGMMA", "")  # empty is unset
    assert config.GPU_WGMMA.get() is None
    monkeypatch.setenv("KVSTORE_GPU_WGMMA", "maybe")
    with pytest.raises(config.SettingError, match="KVSTORE_GPU_WGMMA='maybe': takes 1 or 0"):
        config.GPU_WGMMA.get()
    monkeypatch.setenv("KVSTORE_CACHE_DIR", "~/hashes")
    assert config.CACHE_DIR.get() == Path.home() / "hashes"
    monkeypatch.setenv("KVSTORE_API_KEYS", "a" * 20 + ":team")
    with pytest.raises(KeyError):
        config.variable("KVSTORE_TEST_NO_SUCH")
    row = next(r for r in config.report() if r["name"] == "KVSTORE_API_KEYS")
    assert row["value"] == "(set)", "a secret is never printed"
    assert issubclass(ConfigError, config.SettingError), "one except clause catches both"


def test_importing_kvstore_reads_no_variable():
    # A variable set to a value that does not parse fails only where it is read, not at import.
    code = (
        "import kvstore.formats, kvstore.gpu, kvstore.engine, kvstore.api.main, kvstore.cli, kvstore.connectors.prefix_cache\n"
        "print('imported')\n"
    )
    env = {"KVSTORE_GPU_WGMMA": "maybe", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr


def test_kvstore_config_prints_every_variable_and_refuses_a_bad_value():
    done = subprocess.run([sys.executable, "-m", "kvstore", "config", "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    import json

    rows = json.loads(done.stdout)
    assert [r["name"] for r in rows] == [v.name for v in config.VARIABLES] + [d.name for d in config.DEFAULTS]
    bad = subprocess.run(
        [sys.executable, "-m", "kvstore", "config"],
        capture_output=True,
        text=True,
        env={"KVSTORE_GPU_WGMMA": "maybe", "PATH": "/usr/bin:/bin"},
    )
    assert bad.returncode == 2 and bad.stderr.strip().endswith(
        "KVSTORE_GPU_WGMMA='maybe': takes 1 or 0 (true/false, yes/no, on/off)"
    )
