"""Hostile loads for the resource-exhaustion suite (``test_exhaustion.py``) and its bench
(``bench/exhaustion_bench.py``): compressed Arrow bombs, oversized JSON, a server's memory peak, a
latency prober, and a session lock held from outside the server.
"""

from __future__ import annotations

import dataclasses
import http.client
import multiprocessing as mp
import os
import socket
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa

from kvstore.api import arrow
from kvstore.formats.coli_kv import Geometry
from kvstore.locks import FileLock
from reliability.store_workload import MODEL as MODEL_JSON
from reliability.workload import GEOMETRY

MiB = 1 << 20
GEOMETRY_JSON = dataclasses.asdict(GEOMETRY)


def arrow_bomb(geometry: Geometry, decoded_bytes: int) -> bytes:
    """An honest zstd Arrow upload of all-zero rows that decodes to about ``decoded_bytes``.

    The rows are ``np.zeros`` (untouched pages, no memory taken), so a 1 GB bomb costs the client
    nothing; zstd squeezes each buffer to almost nothing (1 GB decodes from ~30 KB).
    """
    g = geometry
    widths = [g.n_layers * g.kv_lora, g.n_layers * g.qk_rope] + ([g.nic * g.index_hd] if g.nic else [])
    rows = max(1, decoded_bytes // (4 * (1 + sum(widths))))
    columns = [pa.array(np.zeros(rows, np.int32))]
    columns += [pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(rows * w, np.float32)), w) for w in widths]
    schema = arrow.schema_for(g)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_batch(pa.record_batch(columns, schema=schema))
    return sink.getvalue().to_pybytes()


def arrow_rows(geometry: Geometry, n: int, seed: int = 0, compression: str | None = "zstd") -> bytes:
    """A real upload of ``n`` random rows (tokens 0..n-1), compressed like a careful client would."""
    g = geometry
    rng = np.random.default_rng(seed)
    widths = [g.n_layers * g.kv_lora, g.n_layers * g.qk_rope] + ([g.nic * g.index_hd] if g.nic else [])
    columns = [pa.array(np.arange(n, dtype=np.int32) % g.vocab)]
    columns += [
        pa.FixedSizeListArray.from_arrays(pa.array(rng.standard_normal(n * w).astype(np.float32)), w) for w in widths
    ]
    schema = arrow.schema_for(g)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as writer:
        writer.write_batch(pa.record_batch(columns, schema=schema))
    return sink.getvalue().to_pybytes()


def many_batches(geometry: Geometry, count: int) -> bytes:
    """An upload of ``count`` empty record batches (~360 bytes each): rows are not what it costs."""
    schema = arrow.schema_for(geometry)
    columns = [pa.array(np.zeros(0, np.int32))]
    columns += [
        pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(0, np.float32)), f.type.list_size) for f in list(schema)[1:]
    ]
    batch = pa.record_batch(columns, schema=schema).serialize().to_pybytes()
    return schema.serialize().to_pybytes() + batch * count + arrow.END_OF_STREAM


def lying_arrow_upload(geometry: Geometry, declared: int) -> bytes:
    """A 3-row zstd upload whose L-values buffer claims to decode to ``declared`` bytes: the rows
    and node lengths are honest, only the buffer's 8-byte length prefix lies."""
    g = geometry
    body = bytearray(arrow_rows(geometry, 3))
    # the stream: the schema message (continuation, length, metadata), the batch's the same way,
    # then the batch's body: the prefix is looked for in the body only
    schema_end = 8 + struct.unpack_from("<i", body, 4)[0]
    body_start = schema_end + 8 + struct.unpack_from("<i", body, schema_end + 4)[0]
    honest = struct.pack("<q", 3 * g.n_layers * g.kv_lora * 4)
    at = body.index(honest, body_start)
    body[at : at + 8] = struct.pack("<q", declared)
    return bytes(body)


# ---------------------------------------------------------------------------------- memory
def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_rss_growth(pid: int, action) -> int:
    """Bytes the peak RSS of process ``pid`` rose above its RSS while ``action()`` ran.

    The peak (VmHWM) is reset to the current RSS first (``clear_refs`` 5, Linux 4.0+).
    """
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _status(pid, "VmRSS")
    action()
    return max(0, _status(pid, "VmHWM") - before)


def rss(pid: int) -> int:
    return _status(pid, "VmRSS")


# ---------------------------------------------------------------------------------- latency
class Prober(threading.Thread):
    """GETs ``url`` every ``every`` seconds until stopped; keeps each answer's latency."""

    def __init__(self, url: str, every: float = 0.02, headers: dict[str, str] | None = None):
        super().__init__(daemon=True)
        self.url, self.every, self.headers = url, every, headers or {}
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        # http.client on one kept-alive connection: a few hundred microseconds of its own per
        # request (httpx adds milliseconds), so the latencies are the server's
        address = urlsplit(self.url)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        try:
            while not self._stop_event.is_set():
                started = time.perf_counter()
                connection.request("GET", address.path, headers=self.headers)
                response = connection.getresponse()
                response.read()
                self.latencies.append(time.perf_counter() - started)
                self.statuses.append(response.status)
                self._stop_event.wait(self.every)
        finally:
            connection.close()

    def stop(self) -> "Prober":
        self._stop_event.set()
        self.join()
        return self

    def p99(self) -> float:
        return float(np.percentile(self.latencies, 99)) if self.latencies else float("nan")

    def worst(self) -> float:
        return max(self.latencies, default=float("nan"))


def chunked(total: int, chunk: bytes):
    """A generator body (httpx sends it chunked, no Content-Length) of ``total`` bytes."""
    for _ in range(total // len(chunk)):
        yield chunk


def oversized_lookup(total: int):
    """A /lookup body of ``total`` bytes that keeps going (a token list that never ends), chunked."""
    yield b'{"model": {"name": "m", "revision": "r"}, "geometry": {"n_layers": 1, "kv_lora": 1, "qk_rope": 1, '
    yield b'"vocab": 1000}, "tokens": ['
    yield from chunked(total, b"123456," * 9362)


def lookup_body(n_tokens: int, geometry: dict, model: dict) -> bytes:
    """A valid /lookup body of ``n_tokens`` six-digit token ids (a vocabulary of a million)."""
    import json

    head = json.dumps({"model": model, "geometry": {**geometry, "vocab": 1_000_000}})[:-1]
    return (head + ', "tokens": [' + ",".join(["999999"] * n_tokens) + "]}").encode()


#: hostile /lookup bodies just under the route's 8 MiB: millions of small values other than token ids
SHAPES = {"lists": b"[],", "strings": b'"",', "floats": b"0.5,", "objects": b"{},", "nulls": b"null,"}


def _sender(url: str, key: str, kind: str, until: float, results, nice: int) -> None:
    """Send one kind of body to /lookup over raw sockets until ``until`` (pre-built bytes: the
    client costs little CPU); put the count of each answer's status in ``results``."""
    os.nice(nice)  # first: building the body is load too
    host, port = url.removeprefix("http://").split(":")
    head = f"POST /lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
    if kind == "chunked":  # 24 MiB of token ids that never end, no Content-Length
        piece = b"123456," * 9362
        start = b'{"tokens": ['
        request = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + f"{len(start):x}\r\n".encode() + start
        request += b"\r\n" + (f"{len(piece):x}\r\n".encode() + piece + b"\r\n") * (24 * MiB // len(piece))
        request += b"0\r\n\r\n"
    elif kind == "declared":  # a Content-Length of 95 MB
        request = (head + "Content-Length: 95000000\r\n\r\n").encode()
    elif kind in SHAPES:  # just under 8 MiB of one kind of small value, in the token list
        item = SHAPES[kind]
        payload = b'{"tokens": [' + item * ((8 * MiB - 20) // len(item)) + b"0]}"
        request = (head + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    elif kind == "valid":  # a valid lookup just under the route's 8 MiB
        payload = lookup_body((8 * MiB - 400) // 7, GEOMETRY_JSON, MODEL_JSON)
        request = (head + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    else:
        raise ValueError(kind)
    statuses: dict[int, int] = {}
    sent = False
    # At least one request each, however late this (niced) sender got going on a loaded runner:
    # the caller checks every answer's status, and no answer at all would prove nothing.
    while not sent or time.time() < until:
        sent = True
        with socket.create_connection((host, int(port))) as sock:
            try:
                sock.sendall(request)
            except OSError:  # the server answered and closed before the whole body was sent
                pass
            reply = b""
            try:
                while b"\r\n" not in reply:
                    more = sock.recv(65536)
                    if not more:
                        break
                    reply += more
            except OSError:
                pass
        status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
        statuses[status] = statuses.get(status, 0) + 1
    results.put(statuses)


def json_load(url: str, key: str, kind: str, seconds: float, *, clients: int = 8, nice: int = 19) -> dict[int, int]:
    """``clients`` processes sending ``kind`` bodies (``chunked``, ``declared``, ``valid``, a key of
    :data:`SHAPES`) to /lookup for ``seconds``, at niceness ``nice``; returns how many answers had
    each status."""
    results: mp.Queue = mp.Queue()
    until = time.time() + seconds
    senders = [mp.Process(target=_sender, args=(url, key, kind, until, results, nice)) for _ in range(clients)]
    for sender in senders:
        sender.start()
    counts: dict[int, int] = {}
    for _ in senders:
        for status, n in results.get(timeout=seconds + 120).items():
            counts[status] = counts.get(status, 0) + n
    for sender in senders:
        sender.join()
    return counts


# ---------------------------------------------------------------------------------- locks
@contextmanager
def session_lock_held(data: Path, session_id: str):
    """Hold a session's write lock from outside the server (as another process would)."""
    found = sorted((data / "locks").glob(f"{session_id}*.write"))
    found = [p for p in found if p.name.split(".")[0].split("~")[0] == session_id]
    if len(found) != 1:
        raise AssertionError(f"expected one write lock file for {session_id!r}, found {found}")
    lock = FileLock(found[0], timeout=0).acquire()
    try:
        yield found[0]
    finally:
        lock.release()


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))
