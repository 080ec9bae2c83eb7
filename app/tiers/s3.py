"""S3 tier: a thin async wrapper around boto3 for any S3-compatible endpoint.

The object for an entry lives at ``{prefix}/{model}/{dtype}/{hash}.safetensors`` and holds
the safetensors body byte for byte. Every upload carries the entry's CRC32C twice:

* as the S3 object checksum (``ChecksumAlgorithm=CRC32C``), so the endpoint refuses a body
  that does not match (single PUT: whole-object CRC; multipart: one CRC per part, and the
  parts' combined CRC is checked locally against the expected one before completing);
* as user metadata ``x-amz-meta-ec-crc32c`` (8 lowercase hex digits), because endpoints
  differ in what they return on HEAD (composite ``...-N`` checksums for multipart, or
  none at all).

boto3 is synchronous; every call runs on a dedicated thread pool so the event loop never
blocks. Errors come out as two types: :class:`S3Unavailable` (connection refused or reset,
timeouts, 5xx, throttling: the server answers 503 with ``Retry-After``) and
:class:`S3Error` (everything else: credentials, permissions, missing bucket, checksum
refused, ...). A missing object is not an error: ``head`` and ``open`` return ``None``.

After an :class:`S3Unavailable`, calls fail fast for ``unavailable_cooldown`` seconds
(a tiny circuit breaker) so a dead endpoint costs each request no more than one timeout per
cooldown period; the first call after the cooldown probes the endpoint again, so the tier
recovers on its own without a restart.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import boto3
import botocore.exceptions as bce
from botocore.config import Config
from prometheus_client import CollectorRegistry, Counter, Histogram

from app import wire
from app.checksum import crc32c as crc32c_of

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1024 * 1024
METADATA_CRC_KEY = "ec-crc32c"  # sent as x-amz-meta-ec-crc32c
#: S3 refuses multipart parts smaller than this (except the last one).
MIN_PART_SIZE = 5 * MiB
#: S3 allows at most this many parts in one multipart upload.
MAX_PARTS = 10_000

# --------------------------------------------------------------------------- errors


class S3Error(Exception):
    """An S3 call failed for a reason retrying soon will not fix (credentials, permissions,
    missing bucket, checksum refused, bad request)."""

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.code = code
        self.status = status


class S3Unavailable(S3Error):
    """The endpoint is unreachable or overloaded (connection refused/reset, timeout, 5xx,
    throttling). Callers answer 503 with ``Retry-After: retry_after``."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status: int | None = None,
        retry_after: float = 1.0,
    ):
        super().__init__(message, code=code, status=status)
        self.retry_after = retry_after


_UNAVAILABLE_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "RequestTimeTooSkewed",  # clock skew is not ours to fix, but it is transient-ish
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
    }
)

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


def _client_error_info(exc: bce.ClientError) -> tuple[str, int, str]:
    err: Mapping[str, Any] = exc.response.get("Error", {}) or {}
    meta: Mapping[str, Any] = exc.response.get("ResponseMetadata", {}) or {}
    code = str(err.get("Code", "") or "")
    status = int(meta.get("HTTPStatusCode", 0) or 0)
    message = str(err.get("Message", "") or "")
    return code, status, message


def is_not_found(exc: BaseException) -> bool:
    if not isinstance(exc, bce.ClientError):
        return False
    code, status, _ = _client_error_info(exc)
    return code in _NOT_FOUND_CODES or (status == 404 and code != "NoSuchBucket")


def map_error(exc: BaseException, operation: str, retry_after: float = 1.0) -> S3Error:
    """Translate a botocore/urllib3 exception into :class:`S3Unavailable` or
    :class:`S3Error`. Already-mapped errors pass through unchanged."""
    if isinstance(exc, S3Error):
        return exc
    if isinstance(exc, bce.ClientError):
        code, status, message = _client_error_info(exc)
        text = f"S3 {operation} failed: {code or status} {message}".rstrip()
        if status >= 500 or status == 429 or code in _UNAVAILABLE_CODES:
            return S3Unavailable(text, code=code, status=status, retry_after=retry_after)
        return S3Error(text, code=code, status=status)
    if isinstance(
        exc,
        bce.ConnectionError  # EndpointConnectionError, ConnectTimeout, ReadTimeout, ...
        | bce.HTTPClientError
        | bce.ResponseStreamingError
        | bce.IncompleteReadError
        | ConnectionError
        | TimeoutError,
    ):
        return S3Unavailable(
            f"S3 {operation} failed: endpoint unreachable ({type(exc).__name__}: {exc})",
            retry_after=retry_after,
        )
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
        return S3Error(
            f"S3 {operation} failed: no usable AWS credentials ({exc})", code="NoCredentials"
        )
    if isinstance(exc, bce.BotoCoreError):
        return S3Error(f"S3 {operation} failed: {type(exc).__name__}: {exc}")
    return S3Error(f"S3 {operation} failed: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- crc helpers


def crc32c_to_b64(crc: int) -> str:
    """The wire form of an S3 CRC32C checksum: base64 of the 4 big-endian bytes."""
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def crc32c_from_b64(text: str) -> int | None:
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


_CRC32C_POLY_REVERSED = 0x82F63B78


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's algorithm)."""
    if len2 <= 0:
        return crc1
    odd = [_CRC32C_POLY_REVERSED] + [1 << n for n in range(31)]  # operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return (crc1 ^ crc2) & 0xFFFFFFFF


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class S3Config:
    """Everything the S3 tier needs. Credentials left ``None`` come from the standard AWS
    chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, profiles, web identity, IMDS)."""

    bucket: str
    endpoint_url: str | None = None
    prefix: str = "ec"
    region: str = "us-east-1"
    create_bucket: bool = False
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    addressing_style: Literal["path", "virtual", "auto"] = "path"
    connect_timeout: float = 3.0
    read_timeout: float = 30.0
    max_attempts: int = 3
    max_pool_connections: int = 32
    multipart_threshold: int = 64 * MiB
    multipart_part_size: int = 16 * MiB
    multipart_concurrency: int = 4
    get_chunk_size: int = 4 * MiB
    unavailable_cooldown: float = 1.0
    verify_tls: bool | str = True

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Config:
        """The S3 tier's configuration from the server's ``EC_S3_*`` settings."""
        if not settings.s3_bucket:
            raise ValueError(
                "EC_S3_BUCKET must be set when EC_S3_ENDPOINT_URL is set "
                f"({settings.s3_endpoint_url})"
            )
        return cls(
            bucket=settings.s3_bucket,
            endpoint_url=settings.s3_endpoint_url,
            prefix=settings.s3_prefix,
            region=settings.s3_region,
            create_bucket=settings.s3_create_bucket,
            connect_timeout=settings.s3_connect_timeout,
            read_timeout=settings.s3_read_timeout,
            max_attempts=settings.s3_max_attempts,
            max_pool_connections=settings.s3_max_pool_connections,
            multipart_threshold=settings.s3_multipart_threshold,
            multipart_part_size=settings.s3_multipart_part_size,
            multipart_concurrency=settings.s3_multipart_concurrency,
            get_chunk_size=settings.s3_get_chunk_size,
            unavailable_cooldown=settings.s3_unavailable_cooldown,
            verify_tls=settings.s3_verify_tls,
        )

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("S3 bucket name is empty")
        if self.multipart_part_size < MIN_PART_SIZE:
            raise ValueError(f"multipart part size must be at least {MIN_PART_SIZE} bytes")
        if self.multipart_threshold < 1:
            raise ValueError("multipart threshold must be positive")
        if self.get_chunk_size < 64 * 1024:
            raise ValueError("S3 GET chunk size must be at least 64 KiB")
        if self.max_pool_connections < 1 or self.multipart_concurrency < 1:
            raise ValueError("S3 pool size and multipart concurrency must be positive")


# --------------------------------------------------------------------------- metrics


class S3Metrics:
    """Prometheus metrics of the S3 tier. Pass the server's registry; with none, the
    metrics go to a private registry (useful in tests that build many stores)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = reg
        self.requests = Counter(
            "ec_s3_requests_total",
            "S3 requests by operation and outcome (ok, not_found, error, unavailable)",
            ["operation", "outcome"],
            registry=reg,
        )
        self.bytes = Counter(
            "ec_s3_bytes_total",
            "Body bytes moved to (up) and from (down) S3",
            ["direction"],
            registry=reg,
        )
        self.latency = Histogram(
            "ec_s3_request_duration_seconds",
            "S3 request latency by operation (get: until the response headers arrived)",
            ["operation"],
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=reg,
        )
        self.fast_failures = Counter(
            "ec_s3_fast_failures_total",
            "S3 calls refused locally while the endpoint was marked unavailable",
            registry=reg,
        )
        self.bytes_up = self.bytes.labels("up")
        self.bytes_down = self.bytes.labels("down")


# --------------------------------------------------------------------------- values


@dataclass(frozen=True)
class ObjectInfo:
    """What HEAD (or the start of a GET) tells about an object."""

    key: str
    size: int
    crc32c: int | None
    etag: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Readiness:
    ok: bool
    reason: str
    #: "ok", "unreachable", "credentials", "access_denied", "no_bucket", "error"
    state: str


def _parse_crc(metadata: Mapping[str, str], checksum: str | None) -> int | None:
    text = metadata.get(METADATA_CRC_KEY)
    if text:
        with contextlib.suppress(ValueError):
            return wire.loose_hex32(text)
    if checksum and "-" not in checksum:  # "...-N" is a composite multipart checksum
        return crc32c_from_b64(checksum)
    return None


def _info_from_response(key: str, resp: Mapping[str, Any]) -> ObjectInfo:
    metadata = {str(k).lower(): str(v) for k, v in (resp.get("Metadata") or {}).items()}
    checksum = resp.get("ChecksumCRC32C")
    return ObjectInfo(
        key=key,
        size=int(resp.get("ContentLength", 0)),
        crc32c=_parse_crc(metadata, str(checksum) if checksum else None),
        etag=str(resp["ETag"]) if resp.get("ETag") else None,
        metadata=metadata,
    )


# --------------------------------------------------------------------------- download


class S3Download:
    """An open S3 GET: ``info`` is known, the body is read in chunks on the S3 thread pool
    with one chunk of read-ahead, never buffered whole. Always ``aclose()`` it (or use
    ``async with``); closing early drops the connection instead of draining the body."""

    def __init__(self, store: ObjectStore, info: ObjectInfo, body: Any) -> None:
        self.info = info
        self._store = store
        self._body = body
        self._pending: asyncio.Future[bytes] | None = None
        self._closed = False
        self._received = 0

    async def __aenter__(self) -> S3Download:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _read(self) -> bytes:
        try:
            data: bytes = self._body.read(self._store.config.get_chunk_size)
        except Exception as exc:
            raise map_error(exc, "get", self._store.config.unavailable_cooldown) from exc
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield the body in chunks of up to ``get_chunk_size`` bytes. Raises
        :class:`S3Unavailable` when the connection breaks mid-body (the body is then
        incomplete and must not be used)."""
        if self._closed:
            raise RuntimeError("download already closed")
        loop = asyncio.get_running_loop()
        metrics = self._store.metrics
        try:
            self._pending = loop.run_in_executor(self._store.executor, self._read)
            while True:
                chunk = await self._pending
                self._pending = None
                if not chunk:
                    break
                self._received += len(chunk)
                metrics.bytes_down.inc(len(chunk))
                self._pending = loop.run_in_executor(self._store.executor, self._read)
                yield chunk
        except S3Unavailable:
            self._store._mark_unavailable()
            metrics.requests.labels("get_body", "unavailable").inc()
            raise
        if self._received != self.info.size:
            metrics.requests.labels("get_body", "error").inc()
            raise S3Unavailable(
                f"S3 get of {self.info.key}: body ended after {self._received} of "
                f"{self.info.size} bytes"
            )
        metrics.requests.labels("get_body", "ok").inc()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.chunks()

    async def read_all(self) -> bytes:
        """The whole body (tests and small objects only)."""
        parts = [chunk async for chunk in self.chunks()]
        return b"".join(parts)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, None
        body = self._body

        def _close() -> None:
            try:
                body.close()
            except Exception:  # closing a broken connection must not mask the real error
                log.debug("closing S3 body failed", exc_info=True)

        loop = asyncio.get_running_loop()
        if pending is not None:
            # A read-ahead is in flight on the pool: let it finish before closing the
            # stream under it (urllib3 responses are not thread-safe).
            with contextlib.suppress(BaseException):
                await asyncio.shield(pending)
        await loop.run_in_executor(self._store.executor, _close)


# --------------------------------------------------------------------------- store


class ObjectStore:
    """Async S3 client for one bucket and key prefix."""

    def __init__(
        self,
        config: S3Config,
        *,
        registry: CollectorRegistry | None = None,
        metrics: S3Metrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else S3Metrics(registry)
        self.prefix = config.prefix.strip("/")
        # One pool for every blocking S3 call (boto3 clients are thread-safe); its size
        # matches the HTTP connection pool so no thread waits for a connection.
        self.executor = ThreadPoolExecutor(
            max_workers=config.max_pool_connections, thread_name_prefix="ec-s3"
        )
        session = boto3.session.Session(
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            aws_session_token=config.session_token,
            region_name=config.region,
        )
        common: dict[str, Any] = {
            "region_name": config.region,
            "signature_version": "s3v4",
            "s3": {"addressing_style": config.addressing_style},
            "max_pool_connections": config.max_pool_connections,
            "tcp_keepalive": True,
            # We pass our own CRC32C where it matters; don't let botocore add its default
            # CRC32 trailers (aws-chunked), which some S3-compatible endpoints reject.
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            "user_agent_extra": "ec-cache",
        }
        self._client: Any = session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            verify=config.verify_tls,
            config=Config(
                connect_timeout=config.connect_timeout,
                read_timeout=config.read_timeout,
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
                **common,
            ),
        )
        # Readiness probes: one attempt, short timeouts, so /readyz answers within ~3 s
        # even when the endpoint is a black hole.
        self._probe_client: Any = session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            verify=config.verify_tls,
            config=Config(
                connect_timeout=min(config.connect_timeout, 1.0),
                read_timeout=min(config.read_timeout, 2.0),
                retries={"max_attempts": 1, "mode": "standard"},
                **common,
            ),
        )
        self._lock = threading.Lock()
        self._unavailable_until = 0.0
        self._last_unavailable: str | None = None

    # ---------------------------------------------------------------- keys

    def key_for(self, model: str, dtype: str, hash_: str) -> str:
        name = f"{model}/{dtype}/{hash_}.safetensors"
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def bucket(self) -> str:
        return self.config.bucket

    # ---------------------------------------------------------------- health

    @property
    def available(self) -> bool:
        """False while the circuit breaker is open (an unavailable error happened less than
        ``unavailable_cooldown`` seconds ago)."""
        return time.monotonic() >= self._unavailable_until

    def retry_after(self) -> float:
        """Seconds a client should wait before retrying (for ``Retry-After``)."""
        return max(
            1.0, self._unavailable_until - time.monotonic(), self.config.unavailable_cooldown
        )

    def _mark_unavailable(self, reason: str | None = None) -> None:
        with self._lock:
            self._unavailable_until = time.monotonic() + self.config.unavailable_cooldown
            if reason:
                self._last_unavailable = reason

    def _mark_available(self) -> None:
        if self._unavailable_until:
            with self._lock:
                self._unavailable_until = 0.0

    def _check_breaker(self, operation: str) -> None:
        if time.monotonic() < self._unavailable_until:
            self.metrics.fast_failures.inc()
            raise S3Unavailable(
                f"S3 {operation} skipped: endpoint marked unavailable "
                f"({self._last_unavailable or 'recent failure'})",
                retry_after=self.retry_after(),
            )

    # ---------------------------------------------------------------- plumbing

    async def _run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, fn)

    def _call_sync(
        self,
        operation: str,
        fn: Callable[[], T],
        *,
        not_found_ok: bool = False,
        breaker: bool = True,
    ) -> T | None:
        """Run one boto3 call (on a pool thread) with metrics and error mapping."""
        if breaker:
            self._check_breaker(operation)
        started = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:
            self.metrics.latency.labels(operation).observe(time.perf_counter() - started)
            if not_found_ok and is_not_found(exc):
                self.metrics.requests.labels(operation, "not_found").inc()
                self._mark_available()
                return None
            mapped = map_error(exc, operation, self.config.unavailable_cooldown)
            if isinstance(mapped, S3Unavailable):
                self.metrics.requests.labels(operation, "unavailable").inc()
                self._mark_unavailable(str(mapped))
            else:
                self.metrics.requests.labels(operation, "error").inc()
                self._mark_available()  # it answered, so it is reachable
            raise mapped from exc
        self.metrics.latency.labels(operation).observe(time.perf_counter() - started)
        self.metrics.requests.labels(operation, "ok").inc()
        self._mark_available()
        return result

    async def _call(
        self,
        operation: str,
        fn: Callable[[], T],
        *,
        not_found_ok: bool = False,
        breaker: bool = True,
    ) -> T | None:
        return await self._run(
            lambda: self._call_sync(operation, fn, not_found_ok=not_found_ok, breaker=breaker)
        )

    # ---------------------------------------------------------------- operations

    async def head(self, key: str) -> ObjectInfo | None:
        """Size and CRC32C of an object, or ``None`` when it does not exist."""
        resp = await self._call(
            "head",
            lambda: self._client.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED"),
            not_found_ok=True,
        )
        return None if resp is None else _info_from_response(key, resp)

    async def open(self, key: str) -> S3Download | None:
        """Start a GET: ``None`` when the object does not exist, else an open download
        whose headers (size, CRC32C) are known and whose body is still on the wire."""
        resp = await self._call(
            "get",
            lambda: self._client.get_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED"),
            not_found_ok=True,
        )
        if resp is None:
            return None
        return S3Download(self, _info_from_response(key, resp), resp["Body"])

    async def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """``length`` bytes from ``start`` (fewer at the end of the object), or ``None``
        when the object does not exist. For reading a body's header without the body."""

        def _get() -> bytes:
            resp = self._client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
            )
            body = resp["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
            self.metrics.bytes_down.inc(len(data))
            return data

        return await self._call("get_range", _get, not_found_ok=True)

    async def get_bytes(self, key: str) -> bytes | None:
        """The whole object in memory, or ``None`` (tests, small objects)."""
        download = await self.open(key)
        if download is None:
            return None
        async with download:
            return await download.read_all()

    async def delete(self, key: str) -> None:
        """Remove an object; absent objects are fine."""
        await self._call(
            "delete",
            lambda: self._client.delete_object(Bucket=self.bucket, Key=key),
            not_found_ok=True,
        )

    async def list_page(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> tuple[list[tuple[str, int]], str | None]:
        """(key, size) of up to ``limit`` objects directly under ``prefix`` (``/`` is the
        delimiter: deeper keys are not listed) after ``start_after``, in key order, and
        the ``start_after`` of the next page (None at the end)."""

        def _list() -> Any:
            kwargs: dict[str, Any] = {
                "Bucket": self.bucket,
                "Prefix": prefix,
                "Delimiter": "/",
                "MaxKeys": limit,
            }
            if start_after:
                kwargs["StartAfter"] = start_after
            return self._client.list_objects_v2(**kwargs)

        resp = await self._call("list", _list)
        assert resp is not None
        objects = [(item["Key"], int(item["Size"])) for item in resp.get("Contents", ())]
        if not resp.get("IsTruncated"):
            return objects, None
        markers = [key for key, _ in objects[-1:]]
        markers += [item["Prefix"] for item in resp.get("CommonPrefixes", ())[-1:]]
        return objects, max(markers) if markers else None

    async def delete_many(self, keys: Sequence[str]) -> None:
        """Remove up to 1000 objects in one request (absent ones are fine); raises
        ``S3Error`` naming the first key S3 could not delete."""
        if not keys:
            return

        def _delete() -> Any:
            return self._client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True},
            )

        resp = await self._call("delete_many", _delete)
        errors = (resp or {}).get("Errors") or []
        if errors:
            first = errors[0]
            raise S3Error(
                f"S3 could not delete {len(errors)} of {len(keys)} objects, first "
                f"{first.get('Key')!r}: {first.get('Code')} {first.get('Message')}",
                code=first.get("Code"),
            )

    async def put_bytes(
        self, key: str, data: bytes, *, crc32c: int, metadata: Mapping[str, str] | None = None
    ) -> None:
        """Single PUT of an in-memory body (tests, small objects)."""
        await self._call("put", lambda: self._put_object(key, data, len(data), crc32c, metadata))

    async def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        crc32c: int,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Upload a local file as ``key``. ``crc32c`` is the CRC32C of the whole file; S3
        verifies it (single PUT) or each part's CRC (multipart, where the combined CRC is
        also checked locally before the upload is completed). On any failure nothing is
        left visible under ``key`` (a failed multipart upload is aborted, best effort)."""
        size = os.stat(path).st_size
        if size < self.config.multipart_threshold:

            def _single() -> None:
                with open(path, "rb") as f:
                    self._put_object(key, f, size, crc32c, metadata)

            await self._call("put", _single)
        else:
            await self._put_multipart(key, os.fspath(path), size, crc32c, metadata)

    def _meta(self, crc32c: int, metadata: Mapping[str, str] | None) -> dict[str, str]:
        meta = {str(k).lower(): str(v) for k, v in (metadata or {}).items()}
        meta[METADATA_CRC_KEY] = f"{crc32c & 0xFFFFFFFF:08x}"
        return meta

    def _put_object(
        self,
        key: str,
        body: Any,
        size: int,
        crc32c: int,
        metadata: Mapping[str, str] | None,
    ) -> None:
        self._client.put_object(
            Bucket=self.bucket,
            Key=key,
            Body=body,
            ContentLength=size,
            ContentType="application/octet-stream",
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=crc32c_to_b64(crc32c),
            Metadata=self._meta(crc32c, metadata),
        )
        self.metrics.bytes_up.inc(size)

    def _part_size_for(self, size: int) -> int:
        part = self.config.multipart_part_size
        while -(-size // part) > MAX_PARTS:
            part *= 2
        return part

    async def _put_multipart(
        self,
        key: str,
        path: str,
        size: int,
        crc32c: int,
        metadata: Mapping[str, str] | None,
    ) -> None:
        part_size = self._part_size_for(size)
        resp = await self._call(
            "create_multipart",
            lambda: self._client.create_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                ContentType="application/octet-stream",
                ChecksumAlgorithm="CRC32C",
                Metadata=self._meta(crc32c, metadata),
            ),
        )
        assert resp is not None
        upload_id = str(resp["UploadId"])
        offsets = list(range(0, size, part_size)) or [0]
        results: list[tuple[str, int, int] | None] = [None] * len(offsets)
        semaphore = asyncio.Semaphore(self.config.multipart_concurrency)
        completed = False
        try:

            def _upload(index: int, offset: int) -> tuple[str, int, int]:
                length = min(part_size, size - offset)
                # Each part opens the file itself: a part still running on the pool after
                # a cancellation must never read through a reused file descriptor.
                with open(path, "rb") as f:
                    data = os.pread(f.fileno(), length, offset)
                if len(data) != length:
                    raise S3Error(f"local file {path} shrank while uploading {key}")
                part_crc = crc32c_of(data)
                r = self._client.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=index + 1,
                    Body=data,
                    ContentLength=length,
                    ChecksumAlgorithm="CRC32C",
                    ChecksumCRC32C=crc32c_to_b64(part_crc),
                )
                self.metrics.bytes_up.inc(length)
                return str(r["ETag"]), part_crc, length

            async def _one(index: int, offset: int) -> None:
                async with semaphore:
                    results[index] = await self._call("upload_part", lambda: _upload(index, offset))

            tasks = [asyncio.create_task(_one(i, off)) for i, off in enumerate(offsets)]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

            combined = 0
            parts: list[dict[str, Any]] = []
            for index, item in enumerate(results):
                assert item is not None
                etag, part_crc, length = item
                combined = part_crc if index == 0 else crc32c_combine(combined, part_crc, length)
                parts.append(
                    {
                        "PartNumber": index + 1,
                        "ETag": etag,
                        "ChecksumCRC32C": crc32c_to_b64(part_crc),
                    }
                )
            if combined != crc32c & 0xFFFFFFFF:
                raise S3Error(
                    f"checksum mismatch uploading {key}: file has crc32c {combined:08x}, "
                    f"expected {crc32c & 0xFFFFFFFF:08x}",
                    code="BadDigest",
                )
            await self._call(
                "complete_multipart",
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
            )
            completed = True
        finally:
            if not completed:
                await asyncio.shield(self._abort_multipart(key, upload_id))

    async def _abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            await self._call(
                "abort_multipart",
                lambda: self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id
                ),
                not_found_ok=True,
                breaker=False,
            )
        except S3Error as exc:
            # The parts stay invisible (no object exists under the key); a bucket lifecycle
            # rule AbortIncompleteMultipartUpload reclaims their space.
            log.warning("could not abort multipart upload %s of %s: %s", upload_id, key, exc)

    # ---------------------------------------------------------------- bucket / readiness

    async def ensure_bucket(self) -> bool:
        """Create the bucket when it is missing and ``create_bucket`` is set. Returns True
        when the bucket exists afterwards. Raises :class:`S3Error` for other problems."""
        exists = await self._call(
            "head_bucket",
            lambda: self._client.head_bucket(Bucket=self.bucket),
            not_found_ok=True,
            breaker=False,
        )
        if exists is not None:
            return True
        if not self.config.create_bucket:
            return False

        def _create() -> None:
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            if self.config.region and self.config.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.config.region}
            try:
                self._client.create_bucket(**kwargs)
            except bce.ClientError as exc:
                code, _, _ = _client_error_info(exc)
                if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

        await self._call("create_bucket", _create, breaker=False)
        log.info("created S3 bucket %s at %s", self.bucket, self.config.endpoint_url or "AWS")
        return True

    async def check_ready(self) -> Readiness:
        """Probe the endpoint and bucket (one attempt, short timeouts) and say what is
        wrong in words an operator can act on."""
        where = f"{self.config.endpoint_url or 'AWS S3'} bucket {self.bucket!r}"
        return await self._run(lambda: self._check_ready_sync(where))

    def _check_ready_sync(self, where: str) -> Readiness:
        client = self._probe_client
        try:
            client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            first = exc
        else:
            self._mark_available()
            return Readiness(True, f"{where} reachable", "ok")
        if isinstance(first, bce.NoCredentialsError | bce.PartialCredentialsError):
            return Readiness(
                False,
                f"no AWS credentials found for {where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or another standard AWS credential source)",
                "credentials",
            )
        mapped = map_error(first, "head_bucket")
        if isinstance(mapped, S3Unavailable):
            self._mark_unavailable(str(mapped))
            return Readiness(False, f"{where} unreachable: {mapped}", "unreachable")
        self._mark_available()
        code, status, _ = (
            _client_error_info(first) if isinstance(first, bce.ClientError) else ("", 0, "")
        )
        if status == 404 or code == "NoSuchBucket":
            return Readiness(
                False,
                f"bucket {self.bucket!r} does not exist at "
                f"{self.config.endpoint_url or 'AWS S3'} "
                "(create it, or set EC_S3_CREATE_BUCKET=true)",
                "no_bucket",
            )
        if status in (400, 401, 403):
            # HEAD answers carry no error code; ask again with a request that has a body.
            try:
                client.list_objects_v2(Bucket=self.bucket, MaxKeys=1, Prefix=self.prefix)
                detail_code = code
            except bce.ClientError as exc2:
                detail_code, _, _ = _client_error_info(exc2)
            except Exception:
                detail_code = code
            if detail_code in (
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
                "InvalidToken",
                "ExpiredToken",
                "TokenRefreshRequired",
                "AuthorizationHeaderMalformed",
            ):
                what = {
                    "InvalidAccessKeyId": "the access key id is not known to the endpoint",
                    "SignatureDoesNotMatch": "the secret access key is wrong",
                    "AuthorizationHeaderMalformed": "the region or credentials are malformed",
                }.get(detail_code, "the session token is invalid or expired")
                return Readiness(
                    False,
                    f"wrong S3 credentials for {where}: {what} ({detail_code})",
                    "credentials",
                )
            if detail_code == "NoSuchBucket":
                return Readiness(
                    False,
                    f"bucket {self.bucket!r} does not exist (set EC_S3_CREATE_BUCKET=true to "
                    "create it)",
                    "no_bucket",
                )
            return Readiness(
                False,
                f"access denied to {where} ({detail_code or status}): check the credentials' "
                "permissions on the bucket",
                "access_denied",
            )
        return Readiness(False, f"{where}: {mapped}", "error")

    async def close(self) -> None:
        """Release the thread pool and HTTP connections."""
        self.shutdown()

    def shutdown(self) -> None:
        """Synchronous :meth:`close` (for code outside an event loop)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        for client in (self._client, self._probe_client):
            try:
                client.close()
            except Exception:
                log.debug("closing boto3 client failed", exc_info=True)
