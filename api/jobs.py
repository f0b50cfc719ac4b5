"""Long work (park, unpark, migrate) as jobs with progress: ``202`` + ``GET /jobs/{id}``.

Jobs run on a small thread pool and live in memory: a restart forgets them (the work itself is
crash-safe in the store; a job cut short by a restart simply never reports ``done``). On a replica
of a shared store each job is also published to the index as it goes (a ``mirror``:
``kvstore.api.replica.IndexJobs``), so ``GET /jobs/{id}`` answers through every replica.

The queue is bounded: at most ``max_pending`` jobs wait or run at once service-wide, and at most
``max_pending_per_owner`` of one owner (so one owner cannot fill the queue for everyone). A job
beyond either is refused with :class:`~kvstore.api.errors.JobQueueFull` (429) and a ``Retry-After``
estimated from how long recent jobs took; finished jobs are kept (for ``GET /jobs``) up to
``MAX_KEPT_JOBS``, the oldest forgotten first.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from kvstore.api.errors import JobNotFound, JobQueueFull
from kvstore.errors import KVStoreError

MAX_KEPT_JOBS = 1000
DEFAULT_MAX_PENDING = 64  # jobs queued or running, service-wide (Settings.max_jobs)
DEFAULT_MAX_PENDING_PER_OWNER = 16  # of one owner (Settings.max_jobs_per_owner)
_RECENT = 16  # finished jobs whose durations estimate Retry-After
PUBLISH_EVERY_S = 0.25  # a running job's progress reaches the mirror at most this often


class JobMirror(Protocol):
    """Where a replica's jobs are published, and every replica's are found."""

    def publish(self, job: "Job") -> None: ...

    def find(self, owner: str, job_id: str) -> "Job | None": ...

    def all(self, owner: str) -> "list[Job]": ...


@dataclass
class Job:
    id: str
    owner: str
    kind: str
    session_id: str
    state: str = "queued"
    done: int = 0
    total: int = 0
    bytes_per_unit: int = 1  # bytes per unit of done/total (a record's bytes for migrate)
    result: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    created: float = field(default_factory=time.time)
    finished: float | None = None

    @property
    def fraction(self) -> float:
        """Share of the work done, 0 to 1 (1 once done, also for work that had nothing to do)."""
        if self.state == "done":
            return 1.0
        return min(1.0, self.done / self.total) if self.total > 0 else 0.0

    @classmethod
    def from_dict(cls, owner: str, data: dict[str, Any]) -> "Job":
        """A job as :meth:`to_dict` gave it (``owner``'s; what another replica published)."""
        return cls(
            str(data["id"]), owner, str(data["kind"]), str(data["session_id"]), str(data["state"]),
            int(data["done"]), int(data["total"]), max(1, int(data.get("bytes_per_unit", 1))), data.get("result"),
            data.get("error"), float(data["created"]), data.get("finished"),
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "session_id": self.session_id,
            "state": self.state,
            "done": self.done,
            "total": self.total,
            "fraction": self.fraction,
            "bytes_done": self.done * self.bytes_per_unit,
            "bytes_total": self.total * self.bytes_per_unit,
            "result": self.result,
            "error": self.error,
            "created": self.created,
            "finished": self.finished,
        }


class JobRunner:
    """Runs ``work(progress) -> dict`` in background threads and keeps each job's state.

    Parameters
    ----------
    workers : threads running jobs
    max_pending : jobs queued or running at once, service-wide; more are refused (JobQueueFull)
    max_pending_per_owner : the same bound for one owner's jobs
    mirror : where jobs are also published and looked up (a replica's shared index), or None
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_pending_per_owner: int = DEFAULT_MAX_PENDING_PER_OWNER,
        mirror: "JobMirror | None" = None,
    ):
        self.mirror = mirror
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-job")
        self._workers = workers
        self.max_pending = max_pending
        self.max_pending_per_owner = max_pending_per_owner
        self._jobs: dict[str, Job] = {}
        self._pending: dict[str, int] = {}  # owner -> jobs queued or running
        self._durations: list[float] = []  # seconds, of the last _RECENT finished jobs
        self._lock = threading.Lock()

    def _retry_after(self, ahead: int) -> int:
        """Seconds until ``ahead`` queued jobs have likely run (lock held): recent durations, or 1."""
        if not self._durations:
            return 1
        mean = sum(self._durations) / len(self._durations)
        return min(60, max(1, math.ceil(mean * ahead / self._workers)))

    def _admit(self, owner: str) -> None:
        """Count a new job of ``owner`` as pending, or refuse it (lock held)."""
        total = sum(self._pending.values())
        mine = self._pending.get(owner, 0)
        if total >= self.max_pending:
            raise JobQueueFull(
                f"{total} jobs are queued or running, the most this service queues (--max-jobs "
                f"{self.max_pending}); nothing was queued, retry later",
                self._retry_after(total),
            )
        if mine >= self.max_pending_per_owner:
            raise JobQueueFull(
                f"{mine} of your jobs are queued or running, the most this service queues for one owner "
                f"(--max-jobs-per-owner {self.max_pending_per_owner}); nothing was queued, retry when one finishes",
                self._retry_after(mine),
            )
        self._pending[owner] = mine + 1

    def _finished(self, job: Job) -> None:
        with self._lock:
            left = self._pending.get(job.owner, 0) - 1
            if left > 0:
                self._pending[job.owner] = left
            else:
                self._pending.pop(job.owner, None)
            if job.finished is not None:
                self._durations = [*self._durations[-(_RECENT - 1) :], job.finished - job.created]

    def submit(
        self,
        owner: str,
        kind: str,
        session_id: str,
        work: Callable[[Callable[[int, int], None]], dict],
        *,
        bytes_per_unit: int = 1,
    ) -> Job:
        """Queue ``work`` as a job of ``owner``; ``work(progress)`` calls ``progress(done, total)``
        in units of ``bytes_per_unit`` bytes (1: it counts bytes).

        Raises
        ------
        JobQueueFull : the queue is at ``max_pending`` (or the owner at ``max_pending_per_owner``)
        """
        job = Job(uuid.uuid4().hex, owner, kind, session_id, bytes_per_unit=bytes_per_unit)
        with self._lock:
            self._admit(owner)
            self._jobs[job.id] = job
            finished = [(j.finished, j) for j in self._jobs.values() if j.finished is not None]
            for _, old in sorted(finished, key=lambda pair: pair[0])[: max(0, len(self._jobs) - MAX_KEPT_JOBS)]:
                del self._jobs[old.id]

        published = [time.monotonic()]
        self._publish(job)

        def progress(done: int, total: int) -> None:
            job.done, job.total = done, total
            if self.mirror is not None and time.monotonic() - published[0] >= PUBLISH_EVERY_S:
                published[0] = time.monotonic()
                self._publish(job)

        def run() -> None:
            job.state = "running"
            self._publish(job)
            try:
                job.result = work(progress)
                job.done = max(job.done, job.total)
                job.state = "done"
            except KVStoreError as exc:
                job.error = {"error": type(exc).__name__, "reason": exc.reason}
                job.state = "failed"
            except Exception as exc:  # a job must always end in a state the client can read
                job.error = {"error": "InternalError", "reason": f"{type(exc).__name__}: {exc}"}
                job.state = "failed"
            finally:
                job.finished = time.time()
                self._finished(job)
                self._publish(job)

        try:
            self._pool.submit(run)
        except BaseException:  # the pool is shut down: the job will never run
            with self._lock:
                self._jobs.pop(job.id, None)
            self._finished(job)
            raise
        return job

    def _publish(self, job: Job) -> None:
        if self.mirror is not None:
            self.mirror.publish(job)

    def get(self, job_id: str, owner: str) -> Job:
        """``owner``'s job: this service's own, else one the mirror holds (another replica's)."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is not None and job.owner == owner:
            return job
        found = self.mirror.find(owner, job_id) if self.mirror is not None else None
        if found is None:
            raise JobNotFound(f"no job {job_id!r}")
        return found

    def list(self, owner: str) -> list[Job]:
        """``owner``'s jobs: this service's own and, with a mirror, every replica's."""
        with self._lock:
            mine = [job for job in self._jobs.values() if job.owner == owner]
        if self.mirror is None:
            return mine
        ids = {job.id for job in mine}
        return [*[job for job in self.mirror.all(owner) if job.id not in ids], *mine]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
