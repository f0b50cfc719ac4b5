"""The real service for the reliability suites: ``kvstore serve`` under uvicorn on 127.0.0.1.

The socket is bound here (a free port, no race) and handed to the server, which runs in a
child process; :meth:`Service.stop` ends it with SIGTERM and returns what it printed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ALICE_KEY = "alice-key-reliability-0123456789"
BOB_KEY = "bob-key-reliability-0123456789ab"
KEYS = {"alice": ALICE_KEY, "bob": BOB_KEY}


class Service:
    def __init__(self, data: Path, *extra: str):
        self.data = data
        self.extra = extra
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.output = ""

    def start(self) -> "Service":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(256)
        listener.set_inheritable(True)
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        env = {**os.environ, "KVSTORE_API_KEYS": ",".join(f"{key}:{owner}" for owner, key in KEYS.items())}
        command = [sys.executable, "-m", "kvstore.cli_sessions", "serve", "--data", str(self.data),
                   "--fd", str(listener.fileno()), "--log-level", "warning", *self.extra]
        self.process = subprocess.Popen(command, pass_fds=[listener.fileno()], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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

    def client(self, owner: str | None = "alice", **headers: str) -> httpx.Client:
        if owner is not None:
            headers = {"Authorization": f"Bearer {KEYS[owner]}", **headers}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def stop(self) -> str:
        """SIGTERM, wait, and return the server's output (a traceback in it is a failure)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        self.output = self.process.stdout.read()
        self.process.stdout.close()
        return self.output
