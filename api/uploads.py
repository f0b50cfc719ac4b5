"""The service-wide budget of upload bodies held at once (``kvstore serve --max-inflight-bytes``).

An append holds its body while it is read, decoded and written (raw records: the body itself;
Arrow: the body and its encoded records, a record batch at a time — about 1.1x the body). Without
an overall bound, a few large uploads at once took the server's memory. :class:`UploadBudget`
counts the bytes of the bodies being held — the declared ``Content-Length``, or ``--max-body``
for a body sent without one — and refuses an upload that would pass the budget with 503
``UploadsBusy`` and ``Retry-After`` before reading a byte of it. A single body is always at most
``--max-body`` (413 past it), so the budget must be at least that.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from fastapi import Request

from kvstore.api.errors import UploadsBusy

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30  # four of the default --max-body (256 MiB) at once


class UploadBudget:
    """Bytes of upload bodies held at once, at most ``budget_bytes`` (changed on the event loop
    only: no lock). ``held`` is what ``GET /metrics`` reports."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.held = 0
        self.refused = 0  # uploads refused since start (GET /metrics)

    @contextlib.contextmanager
    def holding(self, nbytes: int) -> Iterator[None]:
        """Count ``nbytes`` as held for the block, or raise :class:`UploadsBusy` at once."""
        if self.held + nbytes > self.budget_bytes:
            self.refused += 1
            raise UploadsBusy(
                f"the service is holding {self.held} bytes of uploads; this one of {nbytes} bytes would pass "
                f"its budget of {self.budget_bytes} (--max-inflight-bytes); nothing was read, retry",
                retry_after=1,
            )
        self.held += nbytes
        try:
            yield
        finally:
            self.held -= nbytes


def declared_bytes(request: Request, limit: int) -> int:
    """What an upload will hold: its ``Content-Length`` (when it is a number within ``limit``), else
    ``limit`` (a body without one may be that long; ``read_body`` refuses anything longer)."""
    declared = request.headers.get("content-length", "")
    return min(int(declared), limit) if declared.isdigit() else limit
