"""The package a user installs with ``pip install .`` (not editable): every part of the import
namespace, the CUDA kernel sources and the web console's files are in the wheel, and building it
prints no deprecation or "would be ignored" warning (issue 19)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_every_part_and_the_kernel_sources_and_builds_without_warnings(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", str(tmp_path), "-v"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    log = built.stdout + built.stderr
    for warning in ("BuildBackendWarning", "SetuptoolsDeprecationWarning", "would be ignored"):
        assert warning not in log, warning
    (wheel,) = tmp_path.glob("kvstore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # every source module of the repository's parts, at its place in the kvstore namespace
    parts = {
        "formats": "formats",
        "migrations": "migrations",
        "engine": "engine",
        "gpu": "gpu",
        "api": "api",
        "cli": "cli",
    }
    expected = {f"kvstore/{p.relative_to(ROOT / 'kvstore').as_posix()}" for p in (ROOT / "kvstore").rglob("*.py")}
    for folder, name in parts.items():
        expected |= {f"kvstore/{name}/{p.relative_to(ROOT / folder).as_posix()}" for p in (ROOT / folder).rglob("*.py")}
    expected = {n for n in expected if "/tests/" not in n and "__pycache__" not in n}
    assert expected - names == set()
    kernels = {f"kvstore/gpu/kernels/{p.name}" for p in (ROOT / "gpu" / "kernels").glob("*.cu*")}
    assert kernels and kernels <= names
    # the web console's static files (served at /), every one of them
    console = {f"kvstore/api/console/{p.name}" for p in (ROOT / "api" / "console").iterdir() if p.is_file()}
    assert "kvstore/api/console/index.html" in console and console <= names, console - names
    # and the installed wheel runs, away from the checkout: the command, the console's page as the
    # app serves it, and the kernel sources found through the package (not the repository)
    target = tmp_path / "installed"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    probe = (
        "import importlib.resources, kvstore, tempfile\n"
        "from fastapi.testclient import TestClient\n"
        "from kvstore.api.main import create_app\n"
        "from kvstore.api.settings import Settings\n"
        "print(kvstore.__file__)\n"
        "print(sorted(p.name for p in importlib.resources.files('kvstore.gpu.kernels').iterdir() if p.name.endswith('.cu')))\n"
        "with tempfile.TemporaryDirectory() as data, TestClient(create_app(Settings(data_dir=data, api_keys_env='k' * 16 + ':alice'), first_key=False)) as client:\n"
        "    page = client.get('/')\n"
        "    print(page.status_code, 'kvstore console' in page.text.lower())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    ran = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    where, kernels_found, console_page = ran.stdout.splitlines()[-3:]
    assert where.startswith(str(target)), where
    assert "mla_decode.cu" in kernels_found
    assert console_page == "200 True", console_page
    version = subprocess.run(
        [sys.executable, "-m", "kvstore", "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert version.returncode == 0 and version.stdout.strip(), version.stderr[-2000:]
