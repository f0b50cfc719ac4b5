"""A real uvicorn server on 127.0.0.1 in a child process, and httpx clients for it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from served import ServeProcess, servers_on_demand

ALICE_KEY = "alice-key-0123456789abcdef"
BOB_KEY = "bob-key-0123456789abcdef"
ENV_KEYS = f"{ALICE_KEY}:alice,{BOB_KEY}:bob"


class Server(ServeProcess):
    """``kvstore serve`` with the suite's two owners (``env_keys=None``: no keys in the environment)."""

    def __init__(self, data: Path, *extra: str, env_keys: str | None = ENV_KEYS):
        super().__init__(data, *extra, env={} if env_keys is None else {"KVSTORE_API_KEYS": env_keys})

    def stop(self) -> int:
        return self.stop_cleanly()

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

    def build(*extra: str, data: Path | None = None, env_keys: str | None = ENV_KEYS) -> Server:
        return Server(data or tmp_path / "data", *extra, env_keys=env_keys)

    yield from servers_on_demand(build)


@pytest.fixture
def keys():
    return {"alice": ALICE_KEY, "bob": BOB_KEY}
