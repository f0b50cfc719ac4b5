"""The service as one replica of a shared store (``kvstore serve --index postgresql://... --blobs s3://...``).

With ``Settings.index_url`` the app's store is a
:class:`~kvstore.store.shared.sessions.SharedSessionStore` (sessions in PostgreSQL + S3, the same
for every replica) instead of the embedded ``SessionStore``, both opened by
``kvstore.api.main.open_store`` through the one factory (``kvstore.store.open``); the routes call
the same interface (``kvstore.store.Store``) on either. This module holds what differs for a replica:

- :class:`IndexKeyTable`: the API keys of the index (``kv_keys``), re-read at most every second, so
  every replica accepts the same keys and a revocation reaches all of them (an unknown key re-reads
  them sooner, so a new key works at once); while PostgreSQL is
  down the keys read last keep working (the request itself then answers 503), and a replica that
  started while it was down answers 503 ``IndexUnavailable`` (not 401) until the keys are read;
- :class:`IndexJobs`: the replica's jobs published to the index, found through any replica;
- :class:`IdempotencyKeys`: an append's ``Idempotency-Key`` header, handed to the store, which
  applies the append once across every replica and answers a retry with the first result.
"""

from __future__ import annotations

import logging
import threading
import time

from fastapi.responses import JSONResponse
from starlette.routing import compile_path

from kvstore import keys as store_keys
from kvstore.api.keys import KeyTable
from kvstore.errors import ConfigError, IndexUnavailable, InvalidRequest, Unavailable
from kvstore.keys import Keyring
from kvstore.store import Store

log = logging.getLogger("kvstore.api")

KEYS_REFRESH_S = 1.0  # a revoked key is refused by every replica within this
MISS_REFRESH_S = 0.2  # an unknown key re-reads keys older than this (a new key works at once)


class IndexJobs:
    """A replica's jobs published to the shared index (``kv_jobs``), so ``GET /jobs/{id}`` answers
    through every replica (:class:`~kvstore.api.jobs.JobRunner`'s ``mirror``). A job cut short by
    its replica's death stays as it was last published, as a restart leaves an embedded job."""

    def __init__(self, index):
        self.index = index

    @classmethod
    def of(cls, store: Store) -> "IndexJobs":
        """The jobs of the shared store ``store`` is (a replica's store); ``ConfigError`` for another."""
        from kvstore.store.shared.sessions import SharedSessionStore

        if not isinstance(store, SharedSessionStore):
            raise ConfigError("jobs are published to a shared store's index, and this store is not a shared one")
        return cls(store.index)

    def publish(self, job) -> None:
        try:
            self.index.put_job({**job.to_dict(), "owner": job.owner, "bytes_per_unit": job.bytes_per_unit})
        except Unavailable as exc:  # the job runs on; its state is published again as it goes
            log.warning("job %s not published: %s", job.id, exc.reason)

    def find(self, owner: str, job_id: str):
        from kvstore.api.jobs import Job

        found = self.index.jobs_of(owner, job_id)
        return Job.from_dict(owner, found[0]) if found else None

    def all(self, owner: str) -> list:
        from kvstore.api.jobs import Job

        return [Job.from_dict(owner, data) for data in self.index.jobs_of(owner)]


IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
_APPEND_PATH = compile_path("/sessions/{session_id}/append")[0]


class IdempotencyKeys:
    """ASGI middleware of a replica: an append's ``Idempotency-Key`` header goes to the store
    (:data:`~kvstore.store.shared.sessions.CURRENT_REQUEST`), which records it with the result in
    the commit transaction, so a retry through any replica answers the first result instead of
    appending again; such an answer carries ``Idempotent-Replayed: true``. A malformed key is
    refused (400) before the body is read; one reused with other rows answers 422
    ``IdempotencyKeyReused``. Other routes ignore the header."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not _APPEND_PATH.match(scope["path"]):
            return await self.app(scope, receive, send)
        from kvstore.store.shared.sessions import CURRENT_REQUEST, AppendRequest
        from kvstore.store.shared.store import RequestKey

        values = [v for k, v in scope.get("headers", ()) if k == IDEMPOTENCY_HEADER.lower().encode()]
        if not values:
            return await self.app(scope, receive, send)
        try:
            if len(values) > 1:
                raise InvalidRequest(f"{IDEMPOTENCY_HEADER} is given {len(values)} times; send it once")
            request = AppendRequest(RequestKey(values[0].decode("latin-1")))
        except InvalidRequest as exc:
            answer = JSONResponse({"error": "InvalidRequest", "reason": exc.reason}, status_code=400)
            return await answer(scope, receive, send)

        async def marked(message):
            if message["type"] == "http.response.start" and request.replayed:
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (REPLAYED_HEADER.lower().encode(), b"true")],
                }
            await send(message)

        token = CURRENT_REQUEST.set(request)
        try:
            await self.app(scope, receive, marked)
        finally:
            CURRENT_REQUEST.reset(token)


class IndexKeyTable(KeyTable):
    """:class:`KeyTable` over the keys of the shared index (and ``KVSTORE_API_KEYS``).

    No keys are read until :meth:`attach` (the app's startup) names the index.
    """

    def __init__(self, env_value: str | None, *, refresh_s: float = KEYS_REFRESH_S):
        # not KeyTable.__init__: there is no keys.json to read
        self.path = "the shared index"
        self._env = store_keys.env_records(env_value)
        self._lock = threading.Lock()
        self._ring = Keyring(self._env)
        self._keys = None  # a kvstore.keys.IndexKeys (its own connection: key checks never wait on the store's)
        self._refresh_s = refresh_s
        self._read_at = float("-inf")
        self._read_ok = False  # the index's keys were read at least once

    def attach(self, index_url: str) -> None:
        from kvstore.keys import IndexKeys

        self._keys = IndexKeys(index_url)
        self.path = self._keys.path
        self._read_at = float("-inf")
        self._reload()
        if not self._read_ok:
            log.warning(
                "the API keys of %s cannot be read now: requests answer 503 IndexUnavailable until it answers",
                self.path,
            )
        elif len(self._ring) == 0:
            log.warning(
                "%s holds no API key and KVSTORE_API_KEYS is not set: every request will be refused until one is "
                "made (kvstore keys create --owner NAME --index URL)",
                self.path,
            )

    def close(self) -> None:
        if self._keys is not None:
            self._keys.close()

    def owner_for(self, key: str) -> str | None:
        owner = super().owner_for(key)
        if owner is None and self._keys is not None:  # perhaps a key made since the last read
            with self._lock:
                self._reload(MISS_REFRESH_S)
            owner = super().owner_for(key)
        if owner is None and self._keys is not None and not self._read_ok:
            # the key may well be in the index: say it is down (503, retry) rather than 401
            raise IndexUnavailable(f"the API keys of {self.path} cannot be read now; retry")
        return owner

    def _reload(self, max_age: float | None = None) -> None:
        age = time.monotonic() - self._read_at
        if self._keys is None or age < (self._refresh_s if max_age is None else max_age):
            return
        self._read_at = time.monotonic()
        try:
            records = self._keys.records()
        except Unavailable as exc:
            log.warning("keeping the API keys read last: %s", exc.reason)
            return
        self._ring = Keyring([*self._env, *records])
        self._read_ok = True
