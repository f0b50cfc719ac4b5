"""Shared by the API benchmarks: a real ``kvstore serve`` child process and GLM-geometry records.

Records are generated as valid v2 bytes directly (random fp8 codes with the NaN codes removed,
positive scales): producing 32k x 78 layers of rows through the quantizer would dominate the run
and measures nothing the API does.
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
import numpy as np

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from served import parse_metrics  # noqa: E402 - the /metrics parser the service's tests use

# GLM-4.5 style MLA geometry without a sparse-attention indexer (nic = 0).
GLM = Geometry(n_layers=78, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=151552)
TIER = tiers.FP8
KEY = "bench-key-0123456789abcdef"
MODEL = {"name": "glm-4.5", "revision": "bench"}
GEOMETRY_JSON = {"n_layers": 78, "kv_lora": 512, "qk_rope": 64, "index_hd": 0, "nic": 0, "vocab": 151552}


def v2_records(n: int, seed: int) -> np.ndarray:
    """``n`` valid v2 records of the GLM geometry (structured array)."""
    rng = np.random.default_rng(seed)
    dtype = coli_kv.record_dtype(GLM, TIER)
    raw = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    records = raw.view(dtype)
    records["token"] = rng.integers(0, GLM.vocab, n)
    layers = records["layers"]
    for codes in ("Lc", "Rc"):
        view = layers[codes]
        view[(view & 0x7F) == 0x7F] = 0  # fp8 NaN codes are never written by an encoder
    layers["Ls"] = rng.uniform(0.01, 1.0, (n, GLM.n_layers)).astype(np.float32)
    layers["Rs"] = rng.uniform(0.01, 1.0, (n, GLM.n_layers)).astype(np.float32)
    return records


class Server:
    """``python -m kvstore.cli serve`` on a socket bound here (``keys``: its ``KVSTORE_API_KEYS``)."""

    def __init__(
        self,
        data: Path,
        *extra: str,
        keys: str = f"{KEY}:bench",
        start_timeout: float = 60,
        switch_interval: float | None = None,
    ):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        listener.set_inheritable(True)
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        env = {**os.environ, "KVSTORE_API_KEYS": keys}
        # the interpreter's GIL switch interval (sys.setswitchinterval) for an experiment on how much
        # the server's threads wait on one another; None: Python's default (5 ms)
        launcher = ["-m", "kvstore.cli"]
        if switch_interval is not None:
            launcher = [
                "-c",
                f"import runpy, sys; sys.setswitchinterval({switch_interval!r}); "
                "runpy.run_module('kvstore.cli', run_name='__main__', alter_sys=True)",
            ]
        self.process = subprocess.Popen(
            [
                sys.executable,
                *launcher,
                "serve",
                "--data",
                str(data),
                "--fd",
                str(listener.fileno()),
                "--log-level",
                "warning",
                *extra,
            ],
            pass_fds=[listener.fileno()],
            env=env,
        )
        listener.close()
        began = time.monotonic()
        deadline = began + start_timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.started_s = time.monotonic() - began

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


def server_metrics(url: str) -> dict[str, float]:
    """A server's ``GET /metrics`` (no credentials) parsed: ``{'name{labels}': value}``, the labels
    as the page spells them (``kvstore_scheduler_seconds_total{phase="decode"}``)."""
    page = httpx.get(url + "/metrics", timeout=30)
    page.raise_for_status()
    return parse_metrics(page.text)


def process_stat(pid: int) -> list[str]:
    """A process's ``/proc/PID/stat`` fields after its command name (Linux): ``[0]`` its state,
    ``[1]`` its parent, ``[7]`` its minor page faults, ``[11]``/``[12]`` its user/system ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = process_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    return time.process_time()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))
