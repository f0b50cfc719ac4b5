"""The wheel alone, as a user installs it: ``python tests/wheel_alone.py`` (``.ci/run`` runs it).

Builds the sdist, then the wheel from that sdist (so the sdist is shown complete), installs the wheel
into a new virtualenv outside the checkout with no extra (no engine: no torch, no transformers), and
uses it there as a user would, from a folder of its own:

- ``kvstore --version``; torch is not importable; ``kvstore new-model`` exits 2 in one line that
  says ``pip install 'kvstore[engine]'`` and writes nothing;
- ``kvstore serve`` on a free loopback port: ``HEAD /health``, the first key it prints, the web
  console's page, then one session created, two turns appended and resumed byte for byte;
- after the server stopped, ``kvstore sessions list`` shows the session.

Prints one line per step and ``wheel alone: N passed, 0 failed`` at the end; exits 1 at the first
step that fails (with what it printed). ``--keep DIR`` builds and installs under DIR and leaves it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What the user's Python runs against the installed server: one session, two turns, a resume.
ROUND_TRIP = r"""
import sys
import httpx
import numpy as np
from kvstore import tiers
from kvstore.formats.coli_kv import Geometry, encode_records

url, key = sys.argv[1], sys.argv[2]
geometry, rng = Geometry(2, 64, 16, 0, 0, 1000), np.random.default_rng(0)
client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
created = client.post("/sessions", json={
    "id": "chat-1", "model": {"name": "tiny-mla", "revision": "r1"},
    "geometry": {"n_layers": 2, "kv_lora": 64, "qk_rope": 16, "index_hd": 0, "nic": 0, "vocab": 1000},
    "tier": "fp8",
})
assert created.status_code == 201, created.text
sent = b""
for n in (12, 7):
    rows = encode_records(geometry, tiers.FP8, rng.integers(0, 1000, n), rng.standard_normal((2, n, 64)),
                          rng.standard_normal((2, n, 16))).tobytes()
    answer = client.post("/sessions/chat-1/append", content=rows, params={"complete_turn": True},
                         headers={"Content-Type": "application/octet-stream"})
    assert answer.status_code == 200, answer.text
    sent += rows
resumed = client.get("/sessions/chat-1/resume")
assert resumed.status_code == 200, resumed.text
assert resumed.content == sent, "the resumed rows differ from the appended ones"
print("resumed", resumed.headers["X-KV-Reused-Tokens"], "tokens byte for byte")
"""


class StepFailed(Exception):
    pass


def run(command: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600):
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise StepFailed(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done


def user_env(venv: Path, home: Path) -> dict[str, str]:
    """A user's shell with the new virtualenv first on PATH and nothing of the checkout's."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "KVSTORE_API_KEYS", "PYTHONUNBUFFERED")
    env = {name: value for name, value in os.environ.items() if name not in drop}
    checkout = str(ROOT / ".venv" / "bin")
    path = [entry for entry in env.get("PATH", "").split(os.pathsep) if entry and entry != checkout]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["HOME"] = str(home)
    return env


def build(work: Path) -> Path:
    """The sdist, then the wheel built from it; the wheel's path."""
    tools = work / "build-tools"
    run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(tools), "build>=1"], cwd=work)
    dist = work / "dist"
    env = {**os.environ, "PYTHONPATH": str(tools)}
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], cwd=work, env=env)
    (sdist,) = dist.glob("kvstore-*.tar.gz")
    (wheel,) = dist.glob("kvstore-*.whl")
    print(f"built {sdist.name} and, from it, {wheel.name}")
    return wheel


def install(work: Path, wheel: Path) -> Path:
    venv = work / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=work)
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)], cwd=work)
    print(f"installed {wheel.name} (no extra) into {venv}")
    return venv


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_health(url: str, server: subprocess.Popen, deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        if server.poll() is not None:
            raise StepFailed(f"kvstore serve exited {server.returncode} before /health answered")
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/health", method="HEAD"), timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise StepFailed("/health did not answer")
        time.sleep(0.2)


def read_key(server: subprocess.Popen, deadline_s: float = 60) -> tuple[str, str]:
    """The first key the server prints once it listens (and what it printed until then)."""
    assert server.stdout is not None
    seen = ""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            break
        seen += line
        found = re.fullmatch(r"\s+(kvs_\S+)\n", line)
        if found:
            return found.group(1), seen
    raise StepFailed(f"kvstore serve printed no key:\n{seen}")


def check(work: Path, venv: Path) -> int:
    home = work / "home"
    folder = home / "demo"
    folder.mkdir(parents=True)
    env = user_env(venv, home)
    steps = 0

    version = run(["kvstore", "--version"], cwd=folder, env=env)
    if not re.fullmatch(r"kvstore \S+\n", version.stdout):
        raise StepFailed(f"kvstore --version printed {version.stdout!r}")
    print(f"kvstore --version: {version.stdout.strip()}")
    steps += 1

    torch = subprocess.run(["python", "-c", "import torch"], cwd=folder, env=env, capture_output=True, text=True)
    if torch.returncode == 0:
        raise StepFailed("torch is importable from the core install")
    refused = subprocess.run(
        ["kvstore", "new-model", "models/tiny"], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )
    lines = refused.stderr.splitlines()
    if refused.returncode != 2 or len(lines) != 1 or "pip install 'kvstore[engine]'" not in lines[0]:
        raise StepFailed(f"kvstore new-model without the engine: exit {refused.returncode}\n{refused.stderr}")
    if (folder / "models").exists():
        raise StepFailed("kvstore new-model without the engine wrote a folder")
    print(f"no engine: torch absent; kvstore new-model exits 2: {lines[0]}")
    steps += 1

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        ["kvstore", "serve", "--host", "127.0.0.1", "--port", str(port), "--data", "./data", "--log-level", "warning"],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        key, printed = read_key(server)
        wait_for_health(url, server)
        if f"kvstore: serving {url}" not in printed:
            raise StepFailed(f"kvstore serve did not say where it listens:\n{printed}")
        with urllib.request.urlopen(url + "/", timeout=30) as page:
            if page.status != 200 or b"kvstore console" not in page.read():
                raise StepFailed("the web console's page is not served")
        with urllib.request.urlopen(url + "/docs/assets/swagger-ui-bundle.js", timeout=30) as script:
            if script.status != 200:
                raise StepFailed("/docs' Swagger UI files are not served")
        print(f"kvstore serve on {url}: HEAD /health 200, first key printed, console and /docs files served")
        steps += 1
        trip = run(["python", "-c", ROUND_TRIP, url, key], cwd=folder, env=env, timeout=300)
        print(f"append + resume over HTTP: {trip.stdout.strip()}")
        steps += 1
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()

    listed = run(["kvstore", "sessions", "list", "--data", "./data", "--json"], cwd=folder, env=env)
    sessions = json.loads(listed.stdout)
    if [(s["id"], s["n_records"]) for s in sessions] != [("chat-1", 19)]:
        raise StepFailed(f"kvstore sessions list: {sessions}")
    print("kvstore sessions list: chat-1, 19 records")
    steps += 1
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="build and install under this folder and leave it")
    args = parser.parse_args()
    work = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="kvstore-wheel-"))
    work.mkdir(parents=True, exist_ok=True)
    if work.is_relative_to(ROOT):
        print("wheel alone: the work folder must be outside the checkout", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        steps = check(work, install(work, build(work)))
    except (StepFailed, subprocess.TimeoutExpired) as exc:
        print(f"wheel alone: {exc}", file=sys.stderr)
        print("wheel alone: 0 passed, 1 failed")
        return 1
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wheel alone: {steps} passed, 0 failed ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
