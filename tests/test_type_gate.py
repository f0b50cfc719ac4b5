"""The type gate can fail: one type error planted in each part of a copy of the checkout is reported,
at its line, by one run of ``.ci/typecheck`` — and the gate reads every module of every part.

(The gate once linked the parts' folders into its tree, and pyright does not look inside a linked
folder: an error in ``formats/tiers.py`` passed. This test is what keeps that from coming back.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import config
from layering import PARTS

ROOT = Path(__file__).resolve().parent.parent
PYRIGHT = ROOT / ".venv" / "bin" / "pyright"

#: One file per part, in a sub-package where the part has one (a folder the old gate never entered).
PLANTED = {
    "config": "config/__init__.py",
    "formats": "formats/tiers.py",
    "migrations": "migrations/formats.py",
    "kvstore": "kvstore/store/shared/index.py",
    "connectors": "connectors/prefix_cache.py",
    "gpu": "gpu/registry.py",
    "engine": "engine/hf/saving.py",
    "api": "api/routers/sessions.py",
    "cli": "cli/options.py",
}
MISTAKE = '\n\ndef _planted_mistake() -> int:\n    return "not a number"\n'


@pytest.fixture(scope="module")
def pyright() -> Path:
    if not PYRIGHT.exists():
        if config.CI.get():
            pytest.fail("pyright is not installed (the lint extra): CI must run the type gate's self-test")
        pytest.skip("pyright is not installed here (pip install -e '.[lint]')")
    return PYRIGHT


def test_every_part_is_planted():
    assert set(PLANTED) == set(PARTS), "a part without a planted error is a part the self-test does not cover"


def test_a_planted_error_in_each_part_is_reported(tmp_path, pyright):
    copy = tmp_path / "checkout"
    for part in PARTS:
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    expected = {}
    for rel in PLANTED.values():
        path = copy / rel
        text = path.read_text()
        path.write_text(text + MISTAKE)
        expected[rel] = len((text + MISTAKE).splitlines())  # the `return` line, the last one
    done = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "typecheck"), "--root", str(copy), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYRIGHT": str(pyright), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 1, done.stderr  # the gate fails the build
    report = json.loads(done.stdout)
    found = {(e["file"], e["line"]) for e in report["errors"] if e["rule"] == "reportReturnType"}
    missed = [f"{rel}:{line}" for rel, line in expected.items() if (rel, line) not in found]
    assert not missed, f"the gate did not report the error planted at {missed}; it reported {report['errors']}"
    modules = sum(1 for part in PARTS for p in (copy / part).rglob("*.py") if "__pycache__" not in p.parts)
    assert report["files"] == modules, f"pyright read {report['files']} of the parts' {modules} modules"
