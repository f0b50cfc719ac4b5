"""Connections the server holds: a deadline on every request's headers, and enough descriptors.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but a connection that
never finishes its headers — one that sends nothing, or a few bytes now and then (slowloris) — is
held forever: 1,100 of them took every descriptor of the default limit (1,024) and ``/health``
stopped answering. :class:`HeaderDeadline` is uvicorn's h11 protocol with one more timer: from the
moment a connection opens, or a new request's first bytes arrive after a response, its headers
must be complete within ``header_timeout`` seconds, or the connection is answered ``408`` and
closed. Nothing else changes: a request whose headers arrived may take as long as its route does
(bodies have their own limits, streams their own deadlines).

:func:`raise_descriptor_limit` lifts the soft ``RLIMIT_NOFILE`` to the hard one at start (the
kernel's default soft limit of 1,024 is a fraction of what a server can hold).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvstore.api")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DESCRIPTORS_WANTED = 1 << 20  # the soft limit asked for (capped by the hard limit)
_TOO_SLOW = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request headers do not arrive within
    ``config.header_timeout`` seconds (set on the uvicorn ``Config``; default
    :data:`DEFAULT_HEADER_TIMEOUT_S`)."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any], _loop: Any = None):
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout = float(getattr(config, "header_timeout", DEFAULT_HEADER_TIMEOUT_S))
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._in_request():
            self._arm()  # the first bytes of a request: its headers are due from now
        super().data_received(data)
        if self._in_request():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        """A request's headers have arrived and its response is not complete."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        self._deadline = None
        if self._in_request() or self.transport.is_closing():
            return
        started = self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])
        log.info("closing a connection from %s: no request headers within %.0f s", self.client, self.header_timeout)
        if started:  # it sent part of a request: say why it is closed
            self.transport.write(_TOO_SLOW)
        self.transport.close()


def raise_descriptor_limit(wanted: int = DESCRIPTORS_WANTED) -> tuple[int, int] | None:
    """Raise the soft limit of open descriptors toward ``wanted`` (never past the hard limit);
    returns ``(before, after)``, or None where the platform has no such limit."""
    try:
        import resource
    except ImportError:  # not a POSIX platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
            return soft, soft
        return soft, target
    return soft, soft
