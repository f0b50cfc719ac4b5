"""``kvstore serve`` in a child process for the end-to-end suites (api, service, reliability).

The socket is bound here (a free port, no race) and handed to the server with ``--fd``; the server
is a real uvicorn on 127.0.0.1.
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


class ServeProcess:
    """One server. ``extra``: more ``serve`` arguments; ``env``: variables set for it (the caller's
    ``KVSTORE_API_KEYS`` is never inherited); ``cwd``: where relative paths are taken from."""

    def __init__(
        self,
        data: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        log_level: str = "warning",
        cwd: Path | None = None,
        start_timeout: float = 60.0,
        ready_status: int = 200,
    ):
        self.data = data
        self.extra = extra
        self.env = env or {}
        self.log_level = log_level
        self.cwd = cwd
        self.start_timeout = start_timeout
        self.ready_status = ready_status  # what /health answers once it listens (503 while its index is down)
        self.process: subprocess.Popen | None = None
        self.launcher: tuple[str, ...] = ()  # a command the server runs under (it execs the rest)
        self.url = ""
        self.output = ""

    def start(self):
        if self.running():  # a second process would outlive whoever stops this one
            raise RuntimeError(f"the server of {self.data} is running already")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(256)
        listener.set_inheritable(True)
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        env = {k: v for k, v in os.environ.items() if k != "KVSTORE_API_KEYS"}
        env.update(self.env)
        command = [
            *self.launcher,
            sys.executable,
            "-m",
            "kvstore.cli",
            "serve",
            "--data",
            str(self.data),
            "--fd",
            str(listener.fileno()),
            "--log-level",
            self.log_level,
            *self.extra,
        ]
        self.process = subprocess.Popen(
            command,
            pass_fds=[listener.fileno()],
            env=env,
            cwd=self.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        listener.close()
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == self.ready_status:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not answer /health")
            time.sleep(0.05)

    def finish(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` (if it still runs), wait, keep what it printed in ``output``; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        code = self.process.wait(timeout=60)
        self.output = self.process.stdout.read()
        self.process.stdout.close()
        return code

    def stop_cleanly(self) -> int:
        """SIGTERM: uvicorn shuts down gracefully (lifespan shutdown closes the store), then re-raises
        the signal, so a clean stop exits with -SIGTERM (or 0) and prints no traceback."""
        code = self.finish(signal.SIGTERM)
        if code not in (0, -signal.SIGTERM) or "Traceback" in self.output:
            raise AssertionError(f"the server did not stop cleanly ({code}): {self.output}")
        return code

    def kill(self) -> int:
        return self.finish(signal.SIGKILL)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def parse_metrics(page: str) -> dict[str, float]:
    """A ``GET /metrics`` page (Prometheus text) as ``{'name{labels}': value}``, the labels as the
    page spells them (``kvstore_scheduler_seconds_total{phase="decode"}``): the service's tests and
    the benches read the server's counters through it."""
    out = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def servers_on_demand(build):
    """The body of a ``make_server`` fixture: yields ``make(*args, **kwargs)``, which starts
    ``build(*args, **kwargs)`` and returns it; every server still running at the end is stopped."""
    started: list[ServeProcess] = []

    def make(*args, **kwargs):
        running = build(*args, **kwargs).start()
        started.append(running)
        return running

    yield make
    for running in started:
        if running.running():
            running.stop()


def wait_job(client: httpx.Client, job: dict, *, expect: str | None = None, timeout: float = 60.0) -> dict:
    """Poll ``GET /jobs/{id}`` until the job ends (within ``timeout`` seconds); with ``expect``, it
    must end in that state (e.g. ``"done"``). Returns the job's last answer."""
    deadline = time.monotonic() + timeout
    while job["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
        response = client.get(f"/jobs/{job['id']}")
        assert response.status_code == 200, response.text
        job = response.json()
    if expect is not None:
        assert job["state"] == expect, job
    return job
