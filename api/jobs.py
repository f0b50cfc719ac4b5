"""Long work (park, unpark, migrate) as jobs with progress: ``202`` + ``GET /jobs/{id}``.

Jobs run on a small thread pool and live in memory: a restart forgets them (the work itself is
crash-safe in the store; a job cut short by a restart simply never reports ``done``).
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from kvstore.api.errors import JobNotFound
from kvstore.errors import KVStoreError

MAX_KEPT_JOBS = 1000


@dataclass
class Job:
    id: str
    owner: str
    kind: str
    session_id: str
    state: str = "queued"
    done: int = 0
    total: int = 0
    result: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    created: float = field(default_factory=time.time)
    finished: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "session_id": self.session_id,
            "state": self.state,
            "done": self.done,
            "total": self.total,
            "result": self.result,
            "error": self.error,
            "created": self.created,
            "finished": self.finished,
        }


class JobRunner:
    """Runs ``work(progress) -> dict`` in background threads and keeps each job's state."""

    def __init__(self, workers: int = 2):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-job")
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def submit(self, owner: str, kind: str, session_id: str, work: Callable[[Callable[[int, int], None]], dict]) -> Job:
        job = Job(uuid.uuid4().hex, owner, kind, session_id)
        with self._lock:
            self._jobs[job.id] = job
            finished = [j for j in self._jobs.values() if j.finished is not None]
            for old in sorted(finished, key=lambda j: j.finished)[: max(0, len(self._jobs) - MAX_KEPT_JOBS)]:
                del self._jobs[old.id]

        def progress(done: int, total: int) -> None:
            job.done, job.total = done, total

        def run() -> None:
            job.state = "running"
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

        self._pool.submit(run)
        return job

    def get(self, job_id: str, owner: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None or job.owner != owner:
            raise JobNotFound(f"no job {job_id!r}")
        return job

    def list(self, owner: str) -> list[Job]:
        with self._lock:
            return [job for job in self._jobs.values() if job.owner == owner]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
