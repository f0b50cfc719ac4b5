"""Chaos run of the shared store: ``kvstore serve`` replicas over one PostgreSQL + S3 store, with a
fault in every round, checked against a ledger of what was acknowledged (issue 18, docs/SCALE.md).

Starts a throwaway PostgreSQL cluster, moto's standalone S3 server behind a fault-injecting proxy
(tests/shared/servers.py) and three ``kvstore serve --index --blobs`` replica processes, each with
its own ``--data``, every replica reaching S3 through the proxy. Then ``--rounds`` rounds; each:

- issues a few random operations on a few sessions through random live replicas, concurrently:
  appends of records whose bytes say which append they are (``seq``), the re-send of an append that
  got no acknowledgement (through the same replica, which settles an attempt left in doubt), resumes
  (raw, ``.coli_kv``, with ``verify``) and metadata reads;
- injects one fault (each kind once per block of six rounds, in random order): SIGKILL of a replica
  (restarted in the background, a third of the time with its ``--data`` emptied), PostgreSQL stopped
  (``fast`` or ``immediate``) and started again, S3 answering 500/503, S3 connections dropped before
  or after the request took effect, S3 bodies cut in half, S3 requests left without an answer past
  the client's read timeout.

Every read is checked as it arrives: it must be whole appends as they were sent, byte for byte, each
acknowledged one at the place its acknowledgement named (else **torn**), each at most once (else it
shows an append committed twice: **duplicate**), and hold every append acknowledged before the read
was sent (else **stale**). At the end, with the faults off, every
session is read through every replica and straight from the store: **lost** counts acknowledged
rows missing; every read of the run must be a prefix of that final image (else torn); GC with no
grace must leave exactly the committed segments. Answers other than 200/201, 503 with
``Retry-After`` and 409 with ``Retry-After`` are **untyped** (5xx) or **unexpected** (4xx), and so is
a live replica closing a connection without an answer.

    PYTHONPATH=. .venv/bin/python bench/scale_chaos.py [--rounds 1000] [--seed 18] [--json]

Exit 0 when lost, torn, stale, duplicated, untyped and unexpected are all 0, else 1 (2: PostgreSQL
missing).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kvstore.formats import coli_kv  # noqa: E402
from shared.rows import GEOMETRY, TIER, fingerprint_fields, rec_bytes  # noqa: E402
from shared.servers import FaultProxy, MotoServer, PostgresCluster, postgres_bin  # noqa: E402

FAULTS = ("kill", "postgres", "s3-errors", "s3-drops", "s3-cut", "s3-timeouts")
ROWS_PER_SEQ = 64  # token = seq * 64 + j: a record says which append it came from and its place in it
MAX_ROWS = 8
REPLICAS = 3
LEASE_TTL_S = "2"  # a killed replica holds its session this long
LOCK_TIMEOUT_S = "3"  # an append waits this long for another replica's lease, then 409
ROUND_WAIT_S = 4.0  # a round waits this long for its operations; slower ones finish during the next
RAW = "application/octet-stream"
OWNER = "chaos"
FAILING = (
    "lost_rows",
    "torn_reads",
    "stale_reads",
    "duplicate_reads",
    "duplicated_appends",
    "untyped_errors",
    "cut_bodies",
    "unexpected_answers",
)
BUSY = ("LeaseHeld", "JournalLocked", "SessionBusy")  # the 409s that say "another writer; try again"


def append_records(session: int, seq: int, n: int) -> bytes:
    """The ``n`` records of append ``seq`` of session ``session`` (deterministic, distinct per append)."""
    rng = np.random.default_rng([session, seq, n])
    tokens = seq * ROWS_PER_SEQ + np.arange(n, dtype=np.int32)
    # values on a coarse grid: the fp8 codes compress, so parking rewrites real objects
    L = rng.integers(-8, 8, (GEOMETRY.n_layers, n, GEOMETRY.kv_lora)).astype(np.float32) / 4
    R = rng.integers(-8, 8, (GEOMETRY.n_layers, n, GEOMETRY.qk_rope)).astype(np.float32) / 4
    return coli_kv.encode_records(GEOMETRY, TIER, tokens, L, R).tobytes()


def tokens_of(body: bytes) -> np.ndarray:
    """The token ids of raw records, int64."""
    records: Any = np.frombuffer(body, dtype=coli_kv.record_dtype(GEOMETRY, TIER))
    return records["token"].astype(np.int64)


# ---------------------------------------------------------------------------------- the ledger
class Ledger:
    """What was sent to one session and what was acknowledged, by append ``seq``."""

    def __init__(self, index: int, name: str, seed: int):
        self.index = index
        self.name = name
        self.random = random.Random(seed * 1000 + index)
        self.lock = threading.Lock()
        self.sent: list[bytes] = []
        self.n_rows = np.zeros(64, np.int64)
        self.ack_start = np.full(64, -1, np.int64)
        self.acked_at = np.full(64, np.inf)
        self.retry: dict[int, tuple[int, int]] = {}  # seq -> (replica, its generation): to re-send
        self.tries: dict[int, int] = {}  # seq -> re-sends so far
        self.reads: list[tuple[int, bytes]] = []  # (records, blake2b of the bytes) of every read

    def new_append(self) -> tuple[int, bytes]:
        with self.lock:
            seq = len(self.sent)
            if seq == len(self.n_rows):  # grow by doubling
                self.n_rows = np.concatenate([self.n_rows, np.zeros(seq, np.int64)])
                self.ack_start = np.concatenate([self.ack_start, np.full(seq, -1, np.int64)])
                self.acked_at = np.concatenate([self.acked_at, np.full(seq, np.inf)])
            n = self.random.randint(1, MAX_ROWS)
            body = append_records(self.index, seq, n)
            self.sent.append(body)
            self.n_rows[seq] = n
            return seq, body

    def acked(self, seq: int, start: int, end: int, at: float) -> str | None:
        """Record an acknowledgement; a reason when it contradicts the ledger."""
        with self.lock:
            self.retry.pop(seq, None)
            if end - start != self.n_rows[seq]:
                return f"append {seq} of {self.n_rows[seq]} rows acknowledged as [{start}, {end})"
            if self.ack_start[seq] >= 0 and self.ack_start[seq] != start:
                return f"append {seq} acknowledged at {self.ack_start[seq]} and again at {start}"
            self.ack_start[seq] = start
            self.acked_at[seq] = min(self.acked_at[seq], at)
            return None

    def unanswered(self, seq: int, replica: int, generation: int) -> None:
        """No acknowledgement: the rows may or may not be in; re-sent later through the same replica
        (at most 5 times), which settles an attempt that replica keeps in doubt."""
        with self.lock:
            if self.ack_start[seq] < 0 and self.tries.get(seq, 0) < 5:
                self.retry[seq] = (replica, generation)

    def take_retry(self, alive: dict[int, int]) -> tuple[int, int] | None:
        """An unacknowledged append whose replica still runs the same process: (seq, replica).

        Taken out while it is re-sent: the same bytes sent twice at once would be two appends."""
        with self.lock:
            for seq, (replica, generation) in list(self.retry.items()):
                del self.retry[seq]
                if alive.get(replica) == generation:
                    self.tries[seq] = self.tries.get(seq, 0) + 1
                    return seq, replica
                # else its replica died since: the rows stay in doubt, never sent again
        return None

    def check(self, body: bytes, sent_at: float) -> tuple[str | None, str]:
        """A read against the ledger: (None | "torn" | "stale" | "duplicate", what was wrong)."""
        size = rec_bytes()
        if len(body) % size:
            return "torn", f"{len(body)} bytes is not whole records"
        with self.lock:
            count = len(self.sent)
            n_rows = self.n_rows[:count].copy()
            ack_start = self.ack_start[:count].copy()
            acked_at = self.acked_at[:count].copy()
            sent = self.sent
            self.reads.append((len(body) // size, hashlib.blake2b(body, digest_size=16).digest()))
        tokens = tokens_of(body)
        n = tokens.shape[0]
        required = np.flatnonzero(acked_at < sent_at)  # acknowledged before this read was sent
        need = int((ack_start[required] + n_rows[required]).max()) if required.size else 0
        if n < need:
            return "stale", f"{n} records, but {need} were acknowledged before the read"
        if n == 0:
            return None, ""
        seqs_of, rows_of = tokens // ROWS_PER_SEQ, tokens % ROWS_PER_SEQ
        starts = np.flatnonzero(rows_of == 0)
        if starts.size == 0 or starts[0] != 0:
            return "torn", "the image does not begin with the first row of an append"
        lengths = np.diff(np.append(starts, n))
        if not np.array_equal(rows_of, np.arange(n) - np.repeat(starts, lengths)):
            return "torn", "an append is cut or its rows out of order"
        seqs = seqs_of[starts]
        if seqs.max() >= count:
            return "torn", "an append that was never sent"
        if not np.array_equal(n_rows[seqs], lengths):
            return "torn", "an append holds another number of rows than was sent"
        if body != b"".join(sent[s] for s in seqs.tolist()):
            return "torn", "the bytes differ from the appends sent"
        # each acknowledged append in the read has a copy at the place its acknowledgement named
        placed = ack_start[seqs] >= 0
        at = seqs * (n + 1) + starts
        if not np.isin(seqs[placed] * (n + 1) + ack_start[seqs][placed], at).all():
            return "torn", "an acknowledged append is not at the place its acknowledgement named"
        if not np.isin(required, seqs).all():
            return "torn", "an append acknowledged before the read is missing from it"
        if np.unique(seqs).size != seqs.size:  # whole, in place, but one append's rows twice
            return "duplicate", f"{seqs.size - np.unique(seqs).size} append(s) present twice"
        return None, ""

    def lost_rows(self, image: bytes) -> int:
        """Rows of acknowledged appends not in ``image`` at their place, byte for byte."""
        size = rec_bytes()
        with self.lock:
            acked = np.flatnonzero(self.ack_start[: len(self.sent)] >= 0)
            lost = 0
            for seq in acked.tolist():
                start, n = int(self.ack_start[seq]), int(self.n_rows[seq])
                if image[start * size : (start + n) * size] != self.sent[seq]:
                    lost += n
            return lost

    def acked_rows(self) -> int:
        with self.lock:
            count = len(self.sent)
            return int(self.n_rows[:count][self.ack_start[:count] >= 0].sum())


# ---------------------------------------------------------------------------------- replicas
class Replica:
    """One ``kvstore serve`` process over the shared store; its output goes to a log file."""

    def __init__(self, number: int, folder: Path, env: dict[str, str], api_key: str):
        self.number = number
        self.data = folder / f"r{number}"
        self.log = folder / f"r{number}.log"
        self.env = env
        self.api_key = api_key
        self.process: subprocess.Popen | None = None
        self.client: httpx.Client | None = None

    def start(self, *, empty: bool = False, timeout: float = 120.0) -> None:
        if self.client is not None:
            self.client.close()  # the killed process's: what it still had in flight ends here
            self.client = None
        if empty:
            shutil.rmtree(self.data, ignore_errors=True)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(256)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        command = [
            sys.executable, "-m", "kvstore.cli", "serve", "--data", str(self.data), "--fd", str(listener.fileno()),
            "--log-level", "warning", "--lease-ttl", LEASE_TTL_S, "--lock-timeout", LOCK_TIMEOUT_S,
        ]  # fmt: skip
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                command, pass_fds=[listener.fileno()], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        listener.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"replica r{self.number} exited at start ({self.process.returncode}); see {self.log}"
                )
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"replica r{self.number} did not answer /health; see {self.log}")
            time.sleep(0.05)
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=120)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=60)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.client is not None:
            self.client.close()


# ---------------------------------------------------------------------------------- the report
@dataclass
class Report:
    rounds: int = 0
    operations: int = 0
    appends_sent: int = 0
    appends_acked: int = 0
    resends: int = 0
    reads: int = 0
    metadata_reads: int = 0
    parks: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    empty_data_restarts: int = 0
    s3_requests_failed: dict[str, int] = field(default_factory=dict)
    acked_rows: int = 0
    lost_rows: int = 0
    torn_reads: int = 0
    stale_reads: int = 0
    duplicate_reads: int = 0
    duplicated_appends: int = 0
    typed_503: int = 0
    typed_409: int = 0
    typed: dict[str, int] = field(default_factory=dict)
    untyped_errors: int = 0
    cut_bodies: int = 0
    unexpected_answers: int = 0
    cut_by_kill: int = 0
    unacked_appends_committed: int = 0
    orphans_after_gc: int = 0
    replica_tracebacks: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    def failures(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in FAILING if getattr(self, name)}

    def table(self) -> str:
        rows = [
            ("rounds", self.rounds),
            ("operations (HTTP requests)", self.operations),
            ("  appends sent / acknowledged / re-sent", f"{self.appends_sent} / {self.appends_acked} / {self.resends}"),
            ("  resumes / metadata reads / parks", f"{self.reads} / {self.metadata_reads} / {self.parks}"),
            *((f"faults: {name}", count) for name, count in self.faults.items()),
            ("  restarts with an emptied --data", self.empty_data_restarts),
            ("  S3 requests failed by the proxy", ", ".join(f"{k} {v}" for k, v in sorted(self.s3_requests_failed.items()))),
            ("acknowledged rows", self.acked_rows),
            ("lost acknowledged rows", self.lost_rows),
            ("torn reads", self.torn_reads),
            ("stale reads", self.stale_reads),
            ("appends committed twice (at the end) / reads showing one", f"{self.duplicated_appends} / {self.duplicate_reads}"),
            ("typed 503 (Retry-After) / 409 (busy)", f"{self.typed_503} / {self.typed_409}"),
            ("  by error", ", ".join(f"{k} {v}" for k, v in sorted(self.typed.items()))),
            ("untyped errors (other 5xx)", self.untyped_errors),
            ("answers cut after 200 by a live replica (untyped)", self.cut_bodies),
            ("unexpected answers (other 4xx, a live replica silent)", self.unexpected_answers),
            ("requests cut by a kill", self.cut_by_kill),
            ("unacknowledged appends found committed", self.unacked_appends_committed),
            ("objects left after GC (uncommitted)", self.orphans_after_gc),
            ("tracebacks in replica logs", ", ".join(f"{k} {v}" for k, v in sorted(self.replica_tracebacks.items()))),
            ("wall time", f"{self.wall_s:.1f} s"),
        ]  # fmt: skip
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# ---------------------------------------------------------------------------------- the run
class Chaos:
    """The servers, the replicas, the ledgers and the counters of one run."""

    def __init__(self, folder: Path, cluster: PostgresCluster, moto: MotoServer, *, sessions: int, seed: int):
        self.folder = folder
        self.cluster = cluster
        self.moto = moto
        self.random = random.Random(seed)
        self.report = Report()
        self.count_lock = threading.Lock()
        self.proxy = FaultProxy(moto.port, seed=seed)
        self.proxy.server.handle_error = lambda request, client_address: None  # a client gone is what faults do
        self.index_url = cluster.new_database()
        bucket = f"chaos-{uuid.uuid4().hex[:12]}"
        import boto3

        boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        self.blobs_url = f"s3://{bucket}/kv"
        from kvstore.keys import IndexKeys

        with IndexKeys(self.index_url) as keys:
            self.api_key = keys.create(OWNER)[1]
        env = {k: v for k, v in os.environ.items() if k != "KVSTORE_API_KEYS"}
        env.update(
            AWS_ENDPOINT_URL=self.proxy.endpoint,  # every replica reaches S3 through the fault proxy
            KVSTORE_INDEX_URL=self.index_url,
            KVSTORE_BLOBS_URL=self.blobs_url,
        )
        self.replicas = [Replica(i, folder, env, self.api_key) for i in range(REPLICAS)]
        self.state_lock = threading.Lock()
        self.generation = [0] * REPLICAS  # bumped at each kill: a request cut by it is expected
        self.up = [False] * REPLICAS
        self.restarts: list[threading.Thread] = []
        self.ledgers = [Ledger(i, f"s{i}", seed) for i in range(sessions)]
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="chaos-op")
        self.pending: set[concurrent.futures.Future] = set()
        self.on_problem = None  # called with each problem as it is found

    # ---- bookkeeping
    def count(self, name: str, by: int = 1) -> None:
        with self.count_lock:
            setattr(self.report, name, getattr(self.report, name) + by)

    def problem(self, kind: str, what: str) -> None:
        self.count(kind)
        line = f"{kind}: {what}"
        with self.count_lock:
            if len(self.report.problems) < 50:
                self.report.problems.append(line)
        if self.on_problem is not None:
            self.on_problem(line)

    def alive(self) -> dict[int, int]:
        with self.state_lock:
            return {i: self.generation[i] for i in range(REPLICAS) if self.up[i]}

    def answer_kind(self, answer: httpx.Response, what: str) -> str:
        """ "ok", "503", "409" (typed, with Retry-After) or "bad" (counted as untyped or unexpected)."""
        if answer.status_code in (200, 201):
            return "ok"
        has_retry = answer.headers.get("Retry-After", "").isdigit()
        try:
            error = str(answer.json().get("error"))
        except ValueError:
            error = "?"
        if (answer.status_code == 503 and has_retry) or (answer.status_code == 409 and error in BUSY):
            name = f"{answer.status_code} {error}" + ("" if has_retry else " (no Retry-After)")
            with self.count_lock:
                self.report.typed[name] = self.report.typed.get(name, 0) + 1
            self.count(f"typed_{answer.status_code}")
            return str(answer.status_code)
        kind = "untyped_errors" if answer.status_code >= 500 else "unexpected_answers"
        self.problem(kind, f"{what}: {answer.status_code} {answer.text[:300]}")
        return "bad"

    def request(self, replica: int, generation: int, method: str, path: str, **options) -> httpx.Response | None:
        """One HTTP request; None when the connection ended without an answer (counted)."""
        client = self.replicas[replica].client
        self.count("operations")
        try:
            if client is None:
                raise RuntimeError(f"r{replica} is restarting")  # killed since it was chosen
            return client.request(method, path, **options)
        except (httpx.TransportError, RuntimeError) as exc:  # RuntimeError: the client closed by a restart
            with self.state_lock:
                killed = self.generation[replica] != generation
            if killed:
                self.count("cut_by_kill")
            elif isinstance(exc, httpx.RemoteProtocolError) and "complete message body" in str(exc):
                # the answer's headers said 200 and a length, then the body stopped: no typed error
                self.problem("cut_bodies", f"{method} {path} through live r{replica}: {exc}")
            else:
                self.problem("unexpected_answers", f"{method} {path} through live r{replica}: {exc!r}")
            return None

    # ---- operations
    def op_append(self, ledger: Ledger) -> None:
        alive = self.alive()
        if not alive:
            return
        retry = ledger.take_retry(alive)
        if retry is not None:
            seq, replica = retry
            body = ledger.sent[seq]
            self.count("resends")
        else:
            seq, body = ledger.new_append()
            replica = self.random.choice(sorted(alive))
            self.count("appends_sent")
        generation = alive[replica]
        answer = self.request(
            replica, generation, "POST", f"/sessions/{ledger.name}/append", content=body, headers={"Content-Type": RAW}
        )
        if answer is not None and self.answer_kind(answer, f"append {seq} to {ledger.name}") == "ok":
            start, end = answer.json()["turn"]
            wrong = ledger.acked(seq, start, end, time.monotonic())
            if wrong is not None:
                self.problem("torn_reads", f"{ledger.name}: {wrong}")
            self.count("appends_acked")
            return
        ledger.unanswered(seq, replica, generation)

    def op_resume(self, ledger: Ledger) -> None:
        alive = self.alive()
        if not alive:
            return
        replica = self.random.choice(sorted(alive))
        form = self.random.choice(("raw", "raw", "raw", "coli_kv", "verify"))
        params = {"format": "coli_kv"} if form == "coli_kv" else {"verify": "true"} if form == "verify" else {}
        sent_at = time.monotonic()
        answer = self.request(replica, alive[replica], "GET", f"/sessions/{ledger.name}/resume", params=params)
        self.count("reads")
        if answer is None or self.answer_kind(answer, f"resume {ledger.name} ({form})") != "ok":
            return
        body = answer.content
        if form == "coli_kv":
            header = coli_kv.parse_header(body[: coli_kv.HEADER_BYTES])
            body = body[coli_kv.HEADER_BYTES :]
            if header.nrec * rec_bytes() != len(body):
                self.problem("torn_reads", f"{ledger.name}: a .coli_kv image whose header says {header.nrec} records")
                return
        elif int(answer.headers["X-KV-Reused-Tokens"]) * rec_bytes() != len(body):
            self.problem("torn_reads", f"{ledger.name}: X-KV-Reused-Tokens disagrees with the body")
            return
        verdict, what = ledger.check(body, sent_at)
        if verdict is not None:
            self.problem(f"{verdict}_reads", f"{ledger.name} through r{replica} ({form}): {what}")

    def op_metadata(self, ledger: Ledger) -> None:
        alive = self.alive()
        if not alive:
            return
        replica = self.random.choice(sorted(alive))
        sent_at = time.monotonic()
        with ledger.lock:
            count = len(ledger.sent)
            required = ledger.acked_at[:count] < sent_at
            need = int((ledger.ack_start[:count] + ledger.n_rows[:count])[required].max()) if required.any() else 0
        answer = self.request(replica, alive[replica], "GET", f"/sessions/{ledger.name}")
        self.count("metadata_reads")
        if answer is not None and self.answer_kind(answer, f"get {ledger.name}") == "ok":
            if answer.json()["n_records"] < need:
                self.problem(
                    "stale_reads", f"{ledger.name}: n_records {answer.json()['n_records']} < {need} acknowledged"
                )

    def op_park(self, ledger: Ledger) -> None:
        """Park the session (a job in the replica: objects rewritten and swapped in under the lease);
        the next resume or append unparks it. Its rows must read the same all along."""
        alive = self.alive()
        if not alive:
            return
        replica = self.random.choice(sorted(alive))
        answer = self.request(replica, alive[replica], "POST", f"/sessions/{ledger.name}/park")
        self.count("parks")
        if answer is not None and answer.status_code != 202:
            self.answer_kind(answer, f"park {ledger.name}")

    def run_op(self, op, ledger: Ledger) -> None:
        try:
            op(ledger)
        except Exception as exc:  # a defect of this driver or an answer it cannot parse: never hidden
            self.problem("unexpected_answers", f"{op.__name__} on {ledger.name}: {exc!r}")

    # ---- faults
    def restart(self, number: int, empty: bool) -> None:
        """Start replica ``number`` again (in the background); retried while a server is down."""
        for _ in range(10):
            try:
                self.replicas[number].start(empty=empty)
                break
            except RuntimeError:
                time.sleep(1.0)  # PostgreSQL may be stopped by this very round
        else:
            raise RuntimeError(f"replica r{number} did not come back")
        with self.state_lock:
            self.up[number] = True

    def fault(self, kind: str) -> None:
        time.sleep(self.random.uniform(0.0, 0.15))  # somewhere inside the round's operations
        if kind == "kill":
            alive = sorted(self.alive())
            victim = self.random.choice(alive)
            with self.state_lock:
                self.up[victim] = False
                self.generation[victim] += 1
            self.replicas[victim].kill()
            empty = self.random.random() < 1 / 3
            self.count("empty_data_restarts", int(empty))
            thread = threading.Thread(target=self.restart, args=(victim, empty), daemon=True)
            thread.start()
            self.restarts.append(thread)
        elif kind == "postgres":
            self.cluster.stop(self.random.choice(("fast", "immediate")))
            time.sleep(self.random.uniform(0.1, 0.6))
            self.cluster.start()
        elif kind == "s3-timeouts":
            self.proxy.fail_next(self.random.choice(("stall", "stall-after")), self.random.randint(1, 2))

    def s3_faults(self, kind: str) -> None:
        kinds = {"s3-errors": ("500", "503"), "s3-drops": ("drop", "drop-after"), "s3-cut": ("truncate",)}.get(kind)
        if kinds is None:
            self.proxy.rate = 0.0
        else:
            self.proxy.kinds = kinds
            self.proxy.rate = self.random.uniform(0.2, 0.6)

    def wait_for_replicas(self, at_least: int) -> None:
        while len(self.alive()) < at_least:
            if not any(thread.is_alive() for thread in self.restarts):
                raise RuntimeError("fewer live replicas than needed and none restarting")
            time.sleep(0.05)

    def round(self, kind: str) -> None:
        if kind == "kill":
            self.wait_for_replicas(2)  # one always stays up
        self.s3_faults(kind)
        ops = [self.op_append, self.op_append, self.op_append, self.op_resume, self.op_resume, self.op_metadata]
        ops += [self.op_park]
        futures = [
            self.pool.submit(self.run_op, self.random.choice(ops), self.random.choice(self.ledgers))
            for _ in range(self.random.randint(4, 8))
        ]
        self.fault(kind)
        done, slow = concurrent.futures.wait(futures, timeout=ROUND_WAIT_S)
        self.pending = {f for f in self.pending if not f.done()} | slow
        self.proxy.rate = 0.0
        self.report.faults[kind] += 1
        self.report.rounds += 1

    def start(self) -> None:
        for number in range(REPLICAS):
            self.restart(number, False)
        first = self.replicas[0].client
        assert first is not None
        for ledger in self.ledgers:
            created = first.post(
                "/sessions",
                json={
                    "id": ledger.name,
                    **fingerprint_fields("chaos"),
                },
            )
            if created.status_code != 201:
                raise RuntimeError(f"creating {ledger.name}: {created.status_code} {created.text}")

    def finish(self) -> None:
        """Faults off, every operation and restart done; then every session checked end to end."""
        self.proxy.rate = 0.0
        concurrent.futures.wait(self.pending)
        for thread in self.restarts:
            thread.join()
        with self.state_lock:
            down = [i for i in range(REPLICAS) if not self.up[i]]
        for number in down:
            self.restart(number, False)
        from kvstore.store.shared import BlobStore, SharedIndex, SharedStore

        size = rec_bytes()
        with SharedStore(
            SharedIndex(self.index_url), BlobStore(self.blobs_url, endpoint_url=self.moto.endpoint)
        ) as store:
            finals: dict[str, bytes] = {}
            for ledger in self.ledgers:
                direct = store.file_bytes(f"{ledger.name}~{OWNER}")[coli_kv.HEADER_BYTES :]
                finals[ledger.name] = direct
                for replica in self.replicas:
                    answer = self.final_read(replica, ledger.name)
                    if answer.status_code == 200 and answer.content != direct:
                        self.problem(
                            "torn_reads",
                            f"{ledger.name}: r{replica.number} serves {len(answer.content)} bytes at the end, "
                            f"the store holds {len(direct)}",
                        )
                verdict, what = ledger.check(direct, time.monotonic())
                if verdict is not None:
                    self.problem(f"{verdict}_reads", f"{ledger.name} at the end: {what}")
                self.report.lost_rows += ledger.lost_rows(direct)
                self.report.acked_rows += ledger.acked_rows()
                # every read of the run is a prefix of the final image
                for n, digest in ledger.reads:
                    if n * size > len(direct) or hashlib.blake2b(direct[: n * size], digest_size=16).digest() != digest:
                        self.problem("torn_reads", f"{ledger.name}: a read of {n} records is not a prefix of the end")
                # appends never acknowledged whose rows are in (their answer was lost): allowed, counted
                tokens = tokens_of(direct)
                seqs = tokens[tokens % ROWS_PER_SEQ == 0] // ROWS_PER_SEQ  # one per copy of an append
                self.report.duplicated_appends += seqs.size - np.unique(seqs).size
                seqs = np.unique(seqs[seqs < len(ledger.sent)])
                self.report.unacked_appends_committed += int((ledger.ack_start[seqs] < 0).sum())
            # the uploads of killed or fenced writers, once no writer runs: a park is a job in its
            # replica and may still be rewriting objects after its request was answered, and a GC
            # with no grace would take its intents and leave what it uploads next uncommitted
            for replica in self.replicas:
                replica.stop()
            store.gc(grace=0)
            committed = {s.object for ledger in self.ledgers for s in store.segments(f"{ledger.name}~{OWNER}")}
            listed = {info.name for info in store.blobs.list("seg")}
            self.report.orphans_after_gc = len(listed - committed)
            if committed - listed:
                self.problem("lost_rows", f"{len(committed - listed)} committed segments missing from S3")
            for ledger in self.ledgers:  # GC took nothing committed
                if store.file_bytes(f"{ledger.name}~{OWNER}")[coli_kv.HEADER_BYTES :] != finals[ledger.name]:
                    self.problem("lost_rows", f"{ledger.name} changed by GC")
        self.report.s3_requests_failed = {k: v for k, v in self.proxy.counts.items() if k != "ok"}

    def final_read(self, replica: Replica, name: str) -> httpx.Response:
        """The session through ``replica`` with the faults off; a 503 is retried (a replica's first
        request after PostgreSQL came back may meet its broken connection)."""
        assert replica.client is not None
        for attempt in range(5):
            answer = replica.client.get(f"/sessions/{name}/resume", params={"verify": "true"})
            if self.answer_kind(answer, f"the final resume of {name}") != "503" or attempt == 4:
                return answer
            time.sleep(int(answer.headers["Retry-After"]))
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for replica in self.replicas:
            replica.stop()
        for replica in self.replicas:  # what the replicas logged as tracebacks, by their last line
            lines = replica.log.read_text(errors="replace").splitlines() if replica.log.exists() else []
            for number, line in enumerate(lines):
                if line.startswith("Traceback"):
                    last = next(
                        (
                            x
                            for x in lines[number + 1 :]
                            if x and not x.startswith((" ", "Traceback", "During", "The above"))
                        ),
                        "?",
                    )
                    name = last.split(":")[0][:80]
                    self.report.replica_tracebacks[name] = self.report.replica_tracebacks.get(name, 0) + 1
        self.proxy.close()


def run(
    rounds: int = 1000,
    *,
    seed: int = 18,
    sessions: int = 4,
    folder: Path | None = None,
    cluster: PostgresCluster | None = None,
    moto: MotoServer | None = None,
    progress=None,
    on_problem=None,
) -> Report:
    """One chaos run of ``rounds`` rounds; servers are started here unless given (and then left running).

    ``progress(round, report)`` is called every 50 rounds, ``on_problem(line)`` with each problem as
    it is found, when given.
    """
    began = time.monotonic()
    owned: list = []
    scratch = None
    if folder is None:
        scratch = tempfile.mkdtemp(prefix="kvstore-chaos-")
        folder = Path(scratch)
    try:
        if cluster is None:
            bindir = postgres_bin()
            if bindir is None:
                raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
            cluster = PostgresCluster(bindir)
            owned.append(cluster)
        if moto is None:
            moto = MotoServer()
            owned.append(moto)
        chaos = Chaos(folder, cluster, moto, sessions=sessions, seed=seed)
        chaos.on_problem = on_problem
        try:
            chaos.start()
            schedule: list[str] = []
            for number in range(rounds):
                if not schedule:  # every kind once per block, in random order
                    schedule = list(FAULTS)
                    chaos.random.shuffle(schedule)
                chaos.round(schedule.pop())
                if progress is not None and (number + 1) % 50 == 0:
                    progress(number + 1, chaos.report)
            chaos.finish()
        finally:
            try:
                chaos.cluster.start()  # a failure inside a round may have left it stopped
            except RuntimeError:
                pass  # it runs
            chaos.close()
        chaos.report.wall_s = time.monotonic() - began
        return chaos.report
    finally:
        for server in reversed(owned):
            server.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the table to stderr)")
    parser.add_argument(
        "--folder", type=Path, help="keep the replicas' folders and logs here (a temporary folder if not given)"
    )
    args = parser.parse_args()
    if postgres_bin() is None:
        print("PostgreSQL is not installed (apt-get install postgresql)", file=sys.stderr)
        return 2
    for name, value in {
        "AWS_ACCESS_KEY_ID": "chaos",
        "AWS_SECRET_ACCESS_KEY": "chaos",
        "AWS_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)

    def progress(done: int, report: Report) -> None:
        print(
            f"round {done}: {report.operations} requests, {report.appends_acked} appends acknowledged, "
            f"problems {len(report.problems)}",
            file=sys.stderr,
            flush=True,
        )

    if args.folder is not None:
        args.folder.mkdir(parents=True, exist_ok=True)
    report = run(
        args.rounds,
        seed=args.seed,
        sessions=args.sessions,
        folder=args.folder,
        progress=progress,
        on_problem=lambda line: print(line, file=sys.stderr, flush=True),
    )
    table = "\n".join([report.table(), *report.problems])
    if args.json:  # the JSON on stdout, the table still shown
        print(table, file=sys.stderr)
        print(json.dumps(asdict(report), indent=2))
    else:
        print(table)
    return 1 if report.failures() else 0


if __name__ == "__main__":
    raise SystemExit(main())
