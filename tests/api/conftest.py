"""A real uvicorn server on 127.0.0.1 in a child process, and httpx clients for it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ALICE_KEY = "alice-key-0123456789abcdef"
BOB_KEY = "bob-key-0123456789abcdef"
ENV_KEYS = f"{ALICE_KEY}:alice,{BOB_KEY}:bob"


class Server:
    """``kvstore serve`` on a socket bound here (a free port, no race), stopped cleanly."""

    def __init__(self, data: Path, *extra: str, env_keys: str | None = ENV_KEYS):
        self.data = data
        self.extra = extra
        self.env_keys = env_keys
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.output = ""

    def start(self) -> "Server":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        listener.set_inheritable(True)
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        env = {k: v for k, v in os.environ.items() if k != "KVSTORE_API_KEYS"}
        if self.env_keys is not None:
            env["KVSTORE_API_KEYS"] = self.env_keys
        command = [sys.executable, "-m", "kvstore.cli_sessions", "serve", "--data", str(self.data),
                   "--fd", str(listener.fileno()), "--log-level", "warning", *self.extra]
        self.process = subprocess.Popen(
            command, pass_fds=[listener.fileno()], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        listener.close()
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not answer /health")
            time.sleep(0.05)

    def _finish(self, sig: int) -> int:
        self.process.send_signal(sig)
        code = self.process.wait(timeout=60)
        self.output = self.process.stdout.read()
        self.process.stdout.close()
        return code

    def stop(self) -> int:
        """SIGTERM: uvicorn shuts down gracefully (lifespan shutdown closes the store), then re-raises
        the signal, so a clean stop exits with -SIGTERM (or 0)."""
        code = self._finish(signal.SIGTERM)
        if code not in (0, -signal.SIGTERM) or "Traceback" in self.output:
            raise AssertionError(f"the server did not stop cleanly ({code}): {self.output}")
        return code

    def kill(self) -> int:
        return self._finish(signal.SIGKILL)

    def client(self, key: str | None = ALICE_KEY, *, bearer: bool = True) -> httpx.Client:
        headers = {}
        if key is not None:
            headers = {"Authorization": f"Bearer {key}"} if bearer else {"X-API-Key": key}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@pytest.fixture
def server(tmp_path):
    running = Server(tmp_path / "data").start()
    yield running
    if running.process.poll() is None:
        running.stop()


@pytest.fixture
def alice(server):
    with server.client(ALICE_KEY) as client:
        yield client


@pytest.fixture
def bob(server):
    with server.client(BOB_KEY, bearer=False) as client:
        yield client


@pytest.fixture
def make_server(tmp_path):
    """Start servers on demand (restarts, other settings); all are stopped at the end."""
    started: list[Server] = []

    def make(*extra: str, data: Path | None = None, env_keys: str | None = ENV_KEYS) -> Server:
        running = Server(data or tmp_path / "data", *extra, env_keys=env_keys).start()
        started.append(running)
        return running

    yield make
    for running in started:
        if running.process.poll() is None:
            running.stop()


@pytest.fixture
def keys():
    return {"alice": ALICE_KEY, "bob": BOB_KEY}
