"""A real ``kvstore serve`` in a child process and httpx clients for it (imported as ``service.support``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

KEY = "svc-key-0123456789abcdef"
OTHER_KEY = "svc-other-0123456789abcdef"
ENV_KEYS = f"{KEY}:alice,{OTHER_KEY}:bob"


class Server:
    """``kvstore serve`` on a socket bound here (a free port, no race), stopped cleanly.

    ``extra`` are more ``serve`` arguments (``--model DIR --tier fp8``...); ``env`` more variables;
    ``cwd`` the folder relative paths are taken from.
    """

    def __init__(self, data: Path, *extra: str, env: dict[str, str] | None = None, log_level: str = "info", cwd: Path | None = None):
        self.data = data
        self.cwd = cwd
        self.extra = extra
        self.env = env or {}
        self.log_level = log_level
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
        env = {**os.environ, "KVSTORE_API_KEYS": ENV_KEYS, **self.env}
        command = [sys.executable, "-m", "kvstore.cli_sessions", "serve", "--data", str(self.data),
                   "--fd", str(listener.fileno()), "--log-level", self.log_level, *self.extra]
        self.process = subprocess.Popen(
            command, pass_fds=[listener.fileno()], env=env, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        listener.close()
        deadline = time.monotonic() + 120
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

    def stop(self) -> str:
        """SIGTERM, a clean exit, and the server's output (its log)."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.output = self.process.stdout.read()
        self.process.stdout.close()
        if code not in (0, -signal.SIGTERM) or "Traceback" in self.output:
            raise AssertionError(f"the server did not stop cleanly ({code}): {self.output}")
        return self.output

    def client(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)


def metrics(client: httpx.Client) -> dict[str, float]:
    """``GET /metrics`` parsed: ``{'name{labels}': value}``."""
    page = client.get("/metrics")
    assert page.status_code == 200, page.text
    out = {}
    for line in page.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a server-sent-events body."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields["event"], json.loads(fields["data"])))
    return events
