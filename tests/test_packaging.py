"""The package a user installs with ``pip install .`` (not editable): every part of the import
namespace, the CUDA kernel sources and the web console's files are in the wheel, and building it
prints no deprecation or "would be ignored" warning (issue 19).

The core install is light (issue 39): the wheel requires no torch, transformers, safetensors or
tokenizers (they are the ``engine`` extra, which ``test`` brings), the service imports and answers
with none of them importable, and ``make run`` installs the core alone, with nothing from setuptools
on its screen. (``tests/wheel_alone.py``, run by ``.ci/run``, installs the wheel into a virtualenv
of its own and serves from it.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The engine extra's packages: never a requirement of the core install.
ENGINE = {"torch", "transformers", "safetensors", "tokenizers"}
#: What the core install requires (the store, the service, the command line, the formats).
CORE = {
    "numpy",
    "zstandard",
    "lmdb",
    "pyarrow",
    "fastapi",
    "uvicorn",
    "pydantic",
    "httpx",
    "tqdm",
    "prometheus-client",
    "swagger-ui-bundle-v2",
    "xxhash",  # the connectors' check of the rows they load (XXH3-128)
    "cryptography",  # encryption at rest (AES-256-GCM, HKDF: kvstore.crypto)
}
#: Run first in a probe: torch and the rest of the engine cannot be imported, as on the core install.
WITHOUT_ENGINE = (
    "import sys\n"
    "class NoEngine:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.partition('.')[0] in ('torch', 'transformers', 'safetensors', 'tokenizers', 'triton'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, NoEngine())\n"
)


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def wheel_metadata(wheel: Path) -> tuple[set[str], dict[str, set[str]]]:
    """The wheel's core requirements (names) and, per extra, the requirements it adds (as written)."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(name).decode())
    core, extras = set(), {extra: set() for extra in metadata.get_all("Provides-Extra") or []}
    for requirement in metadata.get_all("Requires-Dist") or []:
        extra = re.search(r"extra == \"([^\"]+)\"", requirement)
        if extra is None:
            core.add(requirement_name(requirement))
        else:
            extras[extra.group(1)].add(requirement.split(";")[0].strip())
    return core, extras


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """The wheel ``pip wheel .`` builds, and what the build printed."""
    folder = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", str(folder), "-v"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = folder.glob("kvstore-*.whl")
    return wheel, done.stdout + done.stderr


def test_the_wheel_holds_every_part_and_the_kernel_sources_and_builds_without_warnings(tmp_path, built):
    wheel, log = built
    for warning in ("BuildBackendWarning", "SetuptoolsDeprecationWarning", "would be ignored"):
        assert warning not in log, warning
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


# ---------------------------------------------------------------------------- the core install
def test_the_core_requires_no_engine_and_the_extras_bring_it(built):
    core, extras = wheel_metadata(built[0])
    assert core == CORE, core ^ CORE
    engine = {requirement_name(r) for r in extras["engine"]}
    assert engine == ENGINE and "torch==2.13.0" in extras["engine"], extras["engine"]
    assert "kvstore[engine]" in extras["test"]  # the suite tests the engine
    for extra in ("cuda", "cuda13"):
        assert "kvstore[engine]" in extras[extra] and any(r.startswith("cupy-") for r in extras[extra])
    assert {"shared", "lint"} <= set(extras)


def test_the_installed_wheel_serves_with_no_engine_importable(tmp_path, built):
    target = tmp_path / "installed"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(built[0])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    probe = WITHOUT_ENGINE + (
        "import tempfile\n"
        "from fastapi.testclient import TestClient\n"
        "from kvstore.api.main import create_app\n"
        "from kvstore.api.settings import Settings\n"
        "key = 'k' * 16\n"
        "with tempfile.TemporaryDirectory() as data, TestClient(create_app(Settings(data_dir=data, api_keys_env=key + ':alice'), first_key=False)) as client:\n"
        "    auth = {'Authorization': 'Bearer ' + key}\n"
        "    print(client.head('/health').status_code, client.get('/').status_code, client.get('/docs').status_code)\n"
        "    print(client.get('/engine', headers=auth).json()['error'])\n"
        "    print(client.get('/sessions', headers=auth).status_code)\n"
        "print(sorted({m.partition('.')[0] for m in sys.modules} & {'torch', 'transformers', 'safetensors', 'tokenizers'}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    ran = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.splitlines()[-4:] == ["200 200 200", "EngineNotLoaded", "200", "[]"], ran.stdout


def makefile_pip_filter() -> str:
    """The one warning filter the Makefile's pip runs under (see its comment)."""
    found = re.search(r'^PIP\s+:=\s+PYTHONWARNINGS="([^"]+)"', (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, "the Makefile's PIP line changed"
    return found.group(1)


def test_make_run_installs_the_core_alone(tmp_path):
    planned = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "run", "test", f"VENV={tmp_path / 'venv'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert planned.returncode == 0, planned.stderr
    pip = [line for line in planned.stdout.splitlines() if " -m pip " in line and not line.startswith("echo")]
    installs = [line for line in pip if "--upgrade pip" not in line]
    assert [line.split(" install ", 1)[1] for line in installs] == ["-e .", "-e '.[test,lint]'"], installs
    assert all(f'PYTHONWARNINGS="{makefile_pip_filter()}"' in line for line in installs)


def test_the_editable_install_make_run_does_prints_nothing_from_setuptools(tmp_path):
    # into a virtualenv of its own (pip --python): the checkout's .venv keeps its install
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    command = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    command += ["install", "--quiet", "--no-deps", "-e", str(ROOT)]

    def install(**extra: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | extra
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout + done.stderr

    # setuptools' note on an editable install of this layout (the control: this test would see it) ...
    assert "Editable installation" in install()
    # ... is the one thing the Makefile leaves out
    shown = install(PYTHONWARNINGS=makefile_pip_filter())
    assert "Warning" not in shown and "!!" not in shown and "*****" not in shown, shown
    assert (venv / "lib").exists() and list(venv.glob("lib/python*/site-packages/__editable__*kvstore*.pth"))
