"""Real servers for the shared backend's tests: a throwaway PostgreSQL cluster, moto's standalone S3
server, and a fault-injecting HTTP proxy in front of it.

The cluster comes from the Debian package (``/usr/lib/postgresql/*/bin``): ``initdb`` into a fresh
folder, ``postgres`` on a free loopback port, run as the unprivileged ``postgres`` user when the
tests run as root (PostgreSQL refuses to run as root), removed at the end.
"""

from __future__ import annotations

import glob
import http.client
import http.server
import os
import pwd
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def postgres_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` that has ``initdb`` (None: not installed)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


class PostgresCluster:
    """One cluster in a temporary folder; :meth:`stop` / :meth:`start` restart it on the same port."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="kvstore-pg-"))
        self.datadir = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.user = "kvstore"
        self._as_user: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL will not run as root
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.datadir), "-U", self.user, "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as_user, str(self.bindir / tool), *args], capture_output=True, text=True, timeout=120, cwd=self.root
        )
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stdout}\n{done.stderr}\n{log[-2000:]}")

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off -c full_page_writes=off "
            "-c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        """``fast`` (clean) or ``immediate`` (a crash: no checkpoint, WAL replay on the next start)."""
        self._run("pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "-t", "60", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        name = f"t{time.time_ns()}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]  # our own name
        return self.url(name)

    def close(self) -> None:
        try:
            self.stop("immediate")
        except RuntimeError:
            pass  # already stopped
        shutil.rmtree(self.root, ignore_errors=True)


class MotoServer:
    """moto's standalone S3 server (wire-level S3) on a free loopback port, in a child process."""

    def __init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class FaultProxy:
    """An HTTP proxy in front of an S3 endpoint that fails a share of the requests.

    ``rate``: the share of requests that fail; each failure is one of ``kinds``:
    ``"500"``/``"503"`` (answered without forwarding), ``"drop"`` (the connection closed without an
    answer, before forwarding), ``"drop-after"`` (forwarded — it took effect — then closed without
    an answer), ``"truncate"`` (the answer's headers and half its body, then closed).
    ``counts`` tallies what happened, by kind (``"ok"`` for forwarded requests).
    :meth:`hold` makes every PUT wait at the proxy (its body read, nothing forwarded) until
    :meth:`release`; ``held`` counts those that arrived: a writer caught mid-upload.
    :meth:`fail_next` makes the next requests fail with a chosen kind whatever ``rate`` says; it
    also takes ``"stall"`` / ``"stall-after"``: no answer for ``stall_s`` seconds (longer than the
    client's read timeout, so the client times out), then the connection closed, before or after
    forwarding.
    """

    def __init__(self, upstream_port: int, *, seed: int = 0):
        self.upstream_port = upstream_port
        self.rate = 0.0
        self.kinds: tuple[str, ...] = ("500", "503", "drop", "drop-after", "truncate")
        self.counts: dict[str, int] = {}
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._holding = False
        self._released = threading.Event()
        self.held = 0
        self.stall_s = 10.5  # boto3's read timeout in BlobStore is 10 s
        self._forced: list[str] = []
        self._closed = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.command == "PUT" and proxy._caught():
                    proxy._released.wait(timeout=300)
                fault = proxy._choose()
                if fault in ("500", "503"):
                    reply = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(reply)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(reply)
                    self.close_connection = True
                    return
                if fault in ("drop", "stall"):
                    if fault == "stall":
                        proxy._closed.wait(proxy.stall_s)
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                try:
                    upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        upstream.putheader(name, value)
                    upstream.endheaders(body or None)
                    answer = upstream.getresponse()
                    payload = answer.read()
                finally:
                    upstream.close()
                if fault in ("drop-after", "stall-after"):
                    if fault == "stall-after":
                        proxy._closed.wait(proxy.stall_s)
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(name, value)
                # a HEAD answer has no body but the object's length
                length = answer.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(payload))
                self.send_header("Content-Length", length)
                self.send_header("Connection", "close")
                self.end_headers()
                if fault == "truncate" and len(payload) > 1:
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                else:
                    self.wfile.write(payload)
                self.close_connection = True

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def hold(self) -> None:
        with self._lock:
            self._released.clear()
            self._holding = True

    def release(self) -> None:
        with self._lock:
            self._holding = False
            self._released.set()

    def _caught(self) -> bool:
        with self._lock:
            if self._holding:
                self.held += 1
            return self._holding

    def fail_next(self, kind: str, n: int = 1) -> None:
        """The next ``n`` requests fail with ``kind`` (one of ``kinds``, ``"stall"``, ``"stall-after"``)."""
        with self._lock:
            self._forced.extend([kind] * n)

    def _choose(self) -> str:
        with self._lock:
            if self._forced:
                fault = self._forced.pop(0)
            else:
                fault = self._random.choice(self.kinds) if self.rate and self._random.random() < self.rate else "ok"
            self.counts[fault] = self.counts.get(fault, 0) + 1
            return fault

    def close(self) -> None:
        self._closed.set()
        self.release()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)
