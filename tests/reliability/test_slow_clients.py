"""Slow clients against a real ``kvstore serve`` on 127.0.0.1: connections that never finish their
headers (silent ones and slowloris ones, on a fresh connection or after a keep-alive response) are
answered 408 / closed after ``--header-timeout``; 1,100 of them at once — more than the default
descriptor limit of 1,024 — do not stop ``/health`` from answering; a client that sends its headers
slowly but within the deadline is served."""

from __future__ import annotations

import resource
import select
import socket
import time

import httpx
import pytest

from served import ServeProcess

SLOW = 1_100
PARTIAL = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


@pytest.fixture
def descriptors():
    """Room in this process for the slow connections, raised once the server runs (started from
    the default limit, the server must raise its own): ``raise_own()``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * SLOW + 200
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard descriptor limit here is {hard}; the test needs {wanted}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))  # the server starts from the default

    def raise_own() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))

    yield raise_own
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _address(server: ServeProcess) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_by_server(sock: socket.socket, within: float) -> bytes | None:
    """What the server sent before closing ``sock`` (None: still open after ``within`` seconds)."""
    received = b""
    deadline = time.monotonic() + within
    poller = select.poll()  # not select(): these descriptors are past 1,024
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    while time.monotonic() < deadline:
        if not poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            continue
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return None


def _one_response(sock: socket.socket) -> bytes:
    """One whole response (headers and a Content-Length body) read from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _soft_limit_of(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as limits:
        for line in limits:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no open-file limit in /proc")


def test_connections_without_headers_are_closed_and_never_starve_the_server(tmp_path, descriptors):
    server = ServeProcess(tmp_path / "data", "--header-timeout", "2").start()
    try:
        assert _soft_limit_of(server.process.pid) > 1024  # started with 1,024, raised at start
        descriptors()
        address = _address(server)
        slow = []
        for i in range(SLOW):
            sock = socket.create_connection(address)
            if i % 2:
                sock.sendall(PARTIAL)  # half a request, then nothing
            slow.append(sock)
        opened = time.monotonic()
        # more connections than the default descriptor limit, none finished: the server still answers
        answer = httpx.get(server.url + "/health", timeout=5)
        assert answer.status_code == 200
        # a client whose headers come slowly, but in time, is served
        with socket.create_connection(address) as polite:
            for piece in (b"GET /health HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n", b"Connection: close\r\n\r\n"):
                polite.sendall(piece)
                time.sleep(0.3)
            assert (_closed_by_server(polite, 10) or b"").startswith(b"HTTP/1.1 200")
        # a keep-alive connection whose next request stalls in its headers
        keep = socket.create_connection(address)
        keep.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _one_response(keep).startswith(b"HTTP/1.1 200")
        keep.sendall(PARTIAL)
        stalled_at = time.monotonic()
        # every slow connection is closed by the server after the deadline (408 for those that began)
        for i, sock in enumerate(slow):
            got = _closed_by_server(sock, max(0.5, opened + 15 - time.monotonic()))
            assert got is not None, f"slow connection {i} is still open {time.monotonic() - opened:.1f} s on"
            assert got == (b"" if i % 2 == 0 else got) and (i % 2 == 0 or got.startswith(b"HTTP/1.1 408"))
            sock.close()
        assert time.monotonic() - opened >= 1.5  # not before the deadline
        got = _closed_by_server(keep, 15)
        assert got is not None and got.startswith(b"HTTP/1.1 408") and time.monotonic() - stalled_at >= 1.5
        keep.close()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        server.stop_cleanly()
