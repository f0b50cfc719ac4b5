"""``curl -I`` works: ``HEAD /health``, ``HEAD /`` and ``HEAD /docs`` answer 200 with the headers ``GET`` gives and no
body, from a real uvicorn server, with no key (issue 39: both answered 405)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def test_head_answers_like_get_without_the_body(server):
    with server.client(None) as anonymous:
        pages = (
            ("/health", "application/json"),
            ("/", "text/html; charset=utf-8"),
            ("/docs", "text/html; charset=utf-8"),
        )
        for path, media in pages:
            got, head = anonymous.get(path), anonymous.head(path)
            assert got.status_code == head.status_code == 200, (path, head.status_code)
            assert head.headers["content-type"] == got.headers["content-type"] == media
            assert head.headers["content-length"] == str(len(got.content)) and head.content == b""
    # what curl -I sends, byte for byte: the whole answer is the status line and the headers
    where = urlsplit(server.url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as conn:
        conn.sendall(f"HEAD /health HTTP/1.1\r\nHost: {where.netloc}\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 200 OK" and rest.endswith(b"\r\n\r\n"), answer


def test_head_is_not_a_second_operation_in_the_schema(server):
    with server.client(None) as anonymous:
        paths = anonymous.get("/openapi.json").json()["paths"]
    assert list(paths["/health"]) == ["get"] and "/" not in paths
