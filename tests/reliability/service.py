"""The real service for the reliability suites: ``kvstore serve`` under uvicorn on 127.0.0.1.

The socket is bound here (a free port, no race) and handed to the server, which runs in a
child process; :meth:`Service.stop` ends it with SIGTERM and returns what it printed.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from served import ServeProcess

ALICE_KEY = "alice-key-reliability-0123456789"
BOB_KEY = "bob-key-reliability-0123456789ab"
KEYS = {"alice": ALICE_KEY, "bob": BOB_KEY}


class Service(ServeProcess):
    def __init__(self, data: Path, *extra: str):
        super().__init__(
            data, *extra, env={"KVSTORE_API_KEYS": ",".join(f"{key}:{owner}" for owner, key in KEYS.items())}
        )

    def client(self, owner: str | None = "alice", **headers: str) -> httpx.Client:
        if owner is not None:
            headers = {"Authorization": f"Bearer {KEYS[owner]}", **headers}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def stop(self) -> str:
        """SIGTERM, wait, and return the server's output (a traceback in it is a failure)."""
        self.finish()
        return self.output
