"""Segment objects in an S3-compatible object store, through boto3 and standard S3 calls only.

PutObject (``If-None-Match: *``, ``Content-MD5``), multipart upload for large objects, ranged
GetObject, ListObjectsV2, DeleteObject, ListMultipartUploads / AbortMultipartUpload. Endpoint and
credentials come from the standard ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` and ``AWS_REGION`` (boto3's own lookup).

Every call is retried here, with exponential backoff and full jitter, on what a retry can fix:
5xx answers, throttling, timeouts, refused or dropped connections, short bodies. botocore's own
retries are off, so the count and the delays are this module's (``BlobStore.retries`` counts
them). What a retry cannot fix is :class:`~kvstore.errors.BlobStoreError`; retries run out as
:class:`~kvstore.errors.BlobStoreUnavailable`.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import urlsplit

import boto3.session
import botocore.config
import botocore.exceptions

from kvstore import config as settings
from kvstore.errors import BlobStoreError, BlobStoreUnavailable, ConfigError

T = TypeVar("T")

MIN_PART_BYTES = 5 << 20  # S3's smallest part (all parts but the last)
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_RETRY_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"})
# botocore errors a retry cannot fix: configuration, not the network
_FATAL_BOTOCORE = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
    botocore.exceptions.ParamValidationError,
    botocore.exceptions.NoRegionError,
)


class _ShortBody(Exception):
    """A body with fewer bytes than asked (a dropped connection mid-body): retried."""


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    modified: float  # seconds since the epoch (the object store's clock)


def parse_blobs_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> ``(bucket, prefix)`` (the prefix without slashes at its ends)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ConfigError(f"--blobs {url!r} is not of the form s3://BUCKET/PREFIX")
    return parts.netloc, parts.path.strip("/")


class BlobStore:
    """Objects under ``s3://BUCKET/PREFIX``.

    Parameters
    ----------
    url : ``s3://BUCKET/PREFIX``
    endpoint_url, region : default to ``AWS_ENDPOINT_URL`` and ``AWS_REGION`` (AWS when unset)
    attempts : tries per call (the first included)
    base_delay, max_delay : backoff bounds in seconds (delay ``k`` is uniform in ``[0, min(max, base * 2**k)]``)
    part_bytes : multipart part size; objects larger than it are uploaded in parts
    get_bytes : bytes per ranged GET of a whole-object read, the parts fetched in parallel (None:
        ``KVSTORE_BLOBS_GET_SIZE``, 8 MiB unless set; 0: one GET per object)
    timeout : connect and read timeout of one request, seconds
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        attempts: int = 8,
        base_delay: float = 0.05,
        max_delay: float = 2.0,
        part_bytes: int = 64 << 20,
        get_bytes: int | None = None,
        timeout: float = 10.0,
        max_connections: int = 32,
    ):
        self.bucket, self.prefix = parse_blobs_url(url)
        if part_bytes < MIN_PART_BYTES:
            raise ConfigError(f"part_bytes is {part_bytes}; S3 parts are at least {MIN_PART_BYTES} bytes")
        self.get_bytes = settings.BLOBS_GET_SIZE.get() if get_bytes is None else get_bytes
        if self.get_bytes < 0:
            raise ConfigError(f"get_bytes is {self.get_bytes}; give a size in bytes (0: one GET per object)")
        self.attempts = max(1, attempts)
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.part_bytes = part_bytes
        self.retries = 0  # retried requests since this store was made
        self._count_lock = threading.Lock()
        endpoint_url = endpoint_url or settings.AWS_ENDPOINT_URL.get()
        region = region or settings.AWS_REGION.get() or settings.AWS_DEFAULT_REGION.get() or "us-east-1"
        config = botocore.config.Config(
            retries={"total_max_attempts": 1},  # the retries are ours (counted, with our backoff)
            connect_timeout=timeout,
            read_timeout=timeout,
            max_pool_connections=max_connections,
            # S3-compatible servers at an endpoint of their own take path-style addresses
            s3={"addressing_style": "path" if endpoint_url else "auto"},
            # checksums only where S3 requires them: Content-MD5 and the digest in the index cover the bytes
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client: Any = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )

    # ------------------------------------------------------------------ naming
    def object_name(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    # ------------------------------------------------------------------ retries
    def _retry(self, what: str, call: Callable[[], T]) -> T:
        delay = self.base_delay
        for attempt in range(self.attempts):
            try:
                return call()
            except Exception as exc:
                if not _retryable(exc):
                    raise _fatal(what, exc) from None
                if attempt == self.attempts - 1:
                    raise BlobStoreUnavailable(
                        f"the object store failed {self.attempts} times while {what} ({_describe(exc)}); nothing "
                        "was committed: retry later",
                        retry_after=max(1.0, self.max_delay),
                    ) from None
                with self._count_lock:
                    self.retries += 1
                time.sleep(random.uniform(0, delay))  # full jitter: replicas do not retry in step
                delay = min(self.max_delay, delay * 2)
        raise AssertionError("unreachable")  # the loop returns or raises

    # ------------------------------------------------------------------ writes
    def put(self, name: str, payload: bytes | memoryview) -> None:
        """Create ``name`` holding ``payload``; it must not exist (names are unique to their writer).

        An object appears whole or not at all (a single PUT, or a multipart upload that is completed
        only after every part is in). A retried PUT that finds its own earlier attempt landed
        (``412`` under ``If-None-Match``, same size and MD5) is a success.
        """
        view = memoryview(payload).cast("B")
        if len(view) > self.part_bytes:
            self._put_multipart(name, view)
            return
        md5 = hashlib.md5(view, usedforsecurity=False).digest()
        content_md5 = base64.b64encode(md5).decode()

        def call() -> None:
            try:
                self.client.put_object(
                    Bucket=self.bucket, Key=name, Body=bytes(view), ContentMD5=content_md5, IfNoneMatch="*"
                )
            except botocore.exceptions.ClientError as exc:
                if _status(exc) == 412 and self._holds(name, len(view), md5):
                    return  # an earlier attempt of ours landed and its answer was lost
                raise

        self._retry(f"writing {name}", call)

    def _holds(self, name: str, size: int, md5: bytes) -> bool:
        head = self._retry(f"checking {name}", lambda: self.client.head_object(Bucket=self.bucket, Key=name))
        return int(head["ContentLength"]) == size and head.get("ETag", "").strip('"') == md5.hex()

    def _put_multipart(self, name: str, view: memoryview) -> None:
        started = self._retry(
            f"starting the upload of {name}",
            lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=name),
        )
        upload_id = started["UploadId"]
        try:
            parts = []
            for number, offset in enumerate(range(0, len(view), self.part_bytes), 1):
                chunk = bytes(view[offset : offset + self.part_bytes])
                content_md5 = base64.b64encode(hashlib.md5(chunk, usedforsecurity=False).digest()).decode()
                answer = self._retry(
                    f"writing part {number} of {name}",
                    lambda: self.client.upload_part(
                        Bucket=self.bucket,
                        Key=name,
                        UploadId=upload_id,
                        PartNumber=number,  # noqa: B023  # called at once, inside this iteration
                        Body=chunk,  # noqa: B023
                        ContentMD5=content_md5,  # noqa: B023
                    ),
                )
                parts.append({"PartNumber": number, "ETag": answer["ETag"]})

            def complete() -> None:
                try:
                    self.client.complete_multipart_upload(
                        Bucket=self.bucket, Key=name, UploadId=upload_id, MultipartUpload={"Parts": parts}
                    )
                except botocore.exceptions.ClientError as exc:
                    # a retried completion whose first attempt finished: the upload is gone, the object is there
                    if _code(exc) == "NoSuchUpload" and self.size_of(name) == len(view):
                        return
                    raise

            self._retry(f"completing the upload of {name}", complete)
        except BaseException:
            try:  # leave no parts behind (GC aborts what this misses)
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
            except Exception:
                pass
            raise

    def delete(self, name: str) -> None:
        """Remove ``name`` (no error when it is already gone)."""
        self._retry(f"deleting {name}", lambda: self.client.delete_object(Bucket=self.bucket, Key=name))

    # ------------------------------------------------------------------ reads
    def get(self, name: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of ``name`` (one ranged GET; the whole object when both are default).

        Fewer bytes than asked only when the object ends before ``stop`` (the answer says so: the
        caller decides what a short object means). A body cut short of what its answer announced
        (a dropped connection), or longer than the range asked, is retried."""
        if stop is not None and stop <= start:
            return b""

        def call() -> bytes:
            if start == 0 and stop is None:
                answer = self.client.get_object(Bucket=self.bucket, Key=name)
            else:
                last = "" if stop is None else str(stop - 1)
                answer = self.client.get_object(Bucket=self.bucket, Key=name, Range=f"bytes={start}-{last}")
            body = answer["Body"].read()
            expected = int(answer.get("ContentLength", len(body)))
            if len(body) != expected or (stop is not None and len(body) > stop - start):
                raise _ShortBody(f"{len(body)} of {expected} bytes")
            return body

        return self._retry(f"reading {name}", call)

    def size_of(self, name: str) -> int | None:
        """The object's size (None: no such object)."""

        def call() -> int | None:
            try:
                return int(self.client.head_object(Bucket=self.bucket, Key=name)["ContentLength"])
            except botocore.exceptions.ClientError as exc:
                if _status(exc) == 404:
                    return None
                raise

        return self._retry(f"checking {name}", call)

    def list(self, under: str = "") -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``PREFIX/under`` (ListObjectsV2, page by page)."""
        prefix = self.object_name(under)
        prefix = prefix + "/" if prefix and not prefix.endswith("/") else prefix
        token: str | None = None
        while True:
            page_args = {"Bucket": self.bucket, "Prefix": prefix}
            if token:
                page_args["ContinuationToken"] = token
            page = self._retry(f"listing {prefix}", lambda: self.client.list_objects_v2(**page_args))  # noqa: B023
            for entry in page.get("Contents", ()):
                yield ObjectInfo(entry["Key"], int(entry["Size"]), _epoch(entry["LastModified"]))
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def abort_stale_uploads(self, older_than: float) -> int:
        """Abort multipart uploads under the prefix started before ``older_than`` (epoch seconds)."""
        prefix = self.object_name("")
        page = self._retry(
            "listing multipart uploads",
            lambda: self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix + "/" if prefix else ""),
        )
        aborted = 0
        for upload in page.get("Uploads", ()):
            if _epoch(upload["Initiated"]) < older_than:
                self._retry(
                    f"aborting an upload of {upload['Key']}",
                    lambda: self.client.abort_multipart_upload(
                        Bucket=self.bucket,
                        Key=upload["Key"],  # noqa: B023  # called at once, inside this iteration
                        UploadId=upload["UploadId"],  # noqa: B023
                    ),
                )
                aborted += 1
        return aborted


def _epoch(value: Any) -> float:
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    return float(value)


def _status(exc: botocore.exceptions.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _retryable(exc: Exception) -> bool:
    if isinstance(exc, _ShortBody):
        return True
    if isinstance(exc, botocore.exceptions.ClientError):
        return _status(exc) in _RETRY_STATUS or _code(exc) in _RETRY_CODES
    if isinstance(exc, _FATAL_BOTOCORE):
        return False
    # connection refused or dropped, timeouts, short or broken bodies (botocore and urllib3 alike)
    return isinstance(exc, (botocore.exceptions.BotoCoreError, ConnectionError, TimeoutError, OSError)) or (
        type(exc).__module__.startswith("urllib3")
    )


def _describe(exc: Exception) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        return f"{_status(exc)} {_code(exc)}"
    return f"{type(exc).__name__}: {exc}"


def _fatal(what: str, exc: Exception) -> BlobStoreError:
    return BlobStoreError(f"the object store refused {what}: {_describe(exc)}")
