"""A real ``kvstore serve`` in a child process and httpx clients for it (imported as ``service.support``)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from served import ServeProcess, parse_metrics

KEY = "svc-key-0123456789abcdef"
OTHER_KEY = "svc-other-0123456789abcdef"
ENV_KEYS = f"{KEY}:alice,{OTHER_KEY}:bob"


class Server(ServeProcess):
    """``kvstore serve`` with the suite's two owners; ``extra`` are more ``serve`` arguments
    (``--model DIR --tier fp8``...), ``env`` more variables, ``cwd`` the folder relative paths are
    taken from."""

    def __init__(
        self,
        data: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        log_level: str = "info",
        cwd: Path | None = None,
    ):
        super().__init__(
            data,
            *extra,
            env={"KVSTORE_API_KEYS": ENV_KEYS, **(env or {})},
            log_level=log_level,
            cwd=cwd,
            start_timeout=120.0,
        )

    def stop(self) -> str:
        """SIGTERM, a clean exit, and the server's output (its log)."""
        self.stop_cleanly()
        return self.output

    def client(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)


def metrics(client: httpx.Client) -> dict[str, float]:
    """``GET /metrics`` parsed: ``{'name{labels}': value}``."""
    page = client.get("/metrics")
    assert page.status_code == 200, page.text
    return parse_metrics(page.text)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a server-sent-events body."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields["event"], json.loads(fields["data"])))
    return events
