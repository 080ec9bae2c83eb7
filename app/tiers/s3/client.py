"""The S3 client of one bucket: calls off the event loop, counted, timed, their errors
mapped, behind the circuit breaker.

boto3 is synchronous; every call runs on a dedicated thread pool (sized like the HTTP
connection pool) so the event loop never blocks. :meth:`S3Client.call` is the one way a
call is made: it counts and times it, maps its failure onto :class:`S3Error` /
:class:`S3Unavailable` (``errors``), opens or closes the breaker (``breaker``) and
answers ``None`` for a missing object where the caller allows it. The control plane
(HEAD, list, delete, multipart create/complete/abort) is boto3 calls; the data plane
(the read path's GET, :meth:`open`, its body an ``S3Download``; the ranged GET of
:meth:`get_range`; single PUTs and part uploads, ``transfers``) goes through
:attr:`S3Client.data_plane` (``data_plane``).

Everything here speaks object keys (described by ``objects``); ``backend`` maps entries
onto them, ``transfers`` uploads, ``readiness`` diagnoses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from prometheus_client import CollectorRegistry

from app.metrics import S3Metrics
from app.settings import Settings
from app.tiers.s3.breaker import CircuitBreaker
from app.tiers.s3.data_plane import S3DataPlane, data_plane
from app.tiers.s3.download import ObjectBody, S3Download
from app.tiers.s3.errors import (
    S3Error,
    S3Unavailable,
    is_not_found,
    is_precondition_failed,
    map_error,
    outage_reason,
)
from app.tiers.s3.objects import ByteSpan, ObjectInfo, info_from_headers, info_from_response

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Path-style addressing: any endpoint works without wildcard DNS.
ADDRESSING_STYLE = "path"


class S3Client:
    """Async S3 client for the bucket and key prefix of ``settings`` (``EC_S3_*``).

    Credentials left ``None`` come from the standard AWS chain (``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``, profiles, web identity, IMDS). ``metrics`` (or a fresh
    :class:`S3Metrics` on ``registry``; on a private registry when both are None).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        metrics: S3Metrics | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
    ) -> None:
        if not settings.s3_endpoint_url or not settings.s3_bucket:
            raise ValueError("S3 endpoint URL or bucket name is empty")
        self.settings = settings
        self.endpoint: str = settings.s3_endpoint_url
        self.bucket: str = settings.s3_bucket
        self.prefix = settings.s3_prefix.strip("/")
        self.breaker = CircuitBreaker(settings.s3_unavailable_cooldown)
        self.metrics = metrics if metrics is not None else S3Metrics(registry)
        pool = settings.s3_max_pool_connections
        # One pool for every blocking S3 call (boto3 clients are thread-safe); its size
        # matches the HTTP connection pool so no thread waits for a connection.
        self.executor = ThreadPoolExecutor(max_workers=pool, thread_name_prefix="ec-s3")
        session = boto3.session.Session(
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            aws_session_token=session_token,
            region_name=settings.s3_region,
        )
        common: dict[str, Any] = {
            "region_name": settings.s3_region,
            "signature_version": "s3v4",
            # Every upload carries its CRC32C, which S3 verifies and the signature
            # covers; hashing the body with SHA-256 as well (what botocore does by
            # default over http://) would cost a second pass over every byte, and a
            # streamed body cannot be hashed before it is sent.
            "s3": {"addressing_style": ADDRESSING_STYLE, "payload_signing_enabled": False},
            "max_pool_connections": pool,
            "tcp_keepalive": True,
            # We pass our own CRC32C where it matters; don't let botocore add its default
            # CRC32 trailers (aws-chunked), which some S3-compatible endpoints reject.
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            "user_agent_extra": "ec-cache",
        }
        config = Config(
            connect_timeout=settings.s3_connect_timeout,
            read_timeout=settings.s3_read_timeout,
            retries={"max_attempts": settings.s3_max_attempts, "mode": "standard"},
            **common,
        )
        #: The boto3 client (thread-safe); call it only through :meth:`call`.
        self.client: Any = session.client(
            "s3",
            endpoint_url=self.endpoint,
            verify=settings.s3_verify_tls,
            config=config,
        )
        #: Readiness probes: one attempt, short timeouts, so /readyz answers within ~3 s
        #: even when the endpoint is a black hole.
        self.probe_client: Any = session.client(
            "s3",
            endpoint_url=self.endpoint,
            verify=settings.s3_verify_tls,
            config=Config(
                connect_timeout=min(settings.s3_connect_timeout, 1.0),
                read_timeout=min(settings.s3_read_timeout, 2.0),
                retries={"max_attempts": 1, "mode": "standard"},
                **common,
            ),
        )
        #: GETs, single PUTs and part uploads (``transfers``); a streaming upload's body
        #: gets one attempt.
        self.data_plane: S3DataPlane = data_plane(
            self.client,
            self.client.meta.endpoint_url,
            self.bucket,
            settings,
            config,
            session.get_credentials(),
            self.executor,
        )

    def _check_breaker(self, operation: str) -> None:
        refused = self.breaker.refusal(operation)
        if refused is not None:
            self.metrics.fast_failures.inc()
            raise refused

    # ---------------------------------------------------------------- plumbing

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the S3 thread pool (no metrics, no mapping)."""
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
            self._failed(operation, started, exc, not_found_ok)
            return None
        self._succeeded(operation, started)
        return result

    async def _call_on_loop(
        self, operation: str, fn: Callable[[], Awaitable[T]], *, not_found_ok: bool = False
    ) -> T | None:
        """:meth:`call` for a call made on the event loop."""
        self._check_breaker(operation)
        started = time.perf_counter()
        try:
            result = await fn()
        except Exception as exc:
            self._failed(operation, started, exc, not_found_ok)
            return None
        self._succeeded(operation, started)
        return result

    def _succeeded(self, operation: str, started: float) -> None:
        self.metrics.latency.labels(operation).observe(time.perf_counter() - started)
        self.metrics.requests.labels(operation, "ok").inc()
        self.breaker.mark_available()

    def _failed(self, operation: str, started: float, exc: Exception, not_found_ok: bool) -> None:
        """Count ``exc``; return for a missing object when ``not_found_ok``, else raise
        it mapped (opening the breaker if S3 is unavailable)."""
        self.metrics.latency.labels(operation).observe(time.perf_counter() - started)
        if not_found_ok and is_not_found(exc):
            self.metrics.requests.labels(operation, "not_found").inc()
            self.breaker.mark_available()
            return
        mapped = map_error(exc, operation, self.breaker.cooldown)
        if is_precondition_failed(exc):  # a conditional write found the key taken
            self.metrics.requests.labels(operation, "exists").inc()
            self.breaker.mark_available()
            raise mapped from exc
        if isinstance(mapped, S3Unavailable):
            self.metrics.requests.labels(operation, "unavailable").inc()
            self.breaker.mark_unavailable(outage_reason(exc))
        else:
            self.metrics.requests.labels(operation, "error").inc()
            self.breaker.mark_available()  # it answered, so it is reachable
        raise mapped from exc

    async def call(
        self,
        operation: str,
        fn: Callable[[], T],
        *,
        not_found_ok: bool = False,
        breaker: bool = True,
    ) -> T | None:
        """Run one boto3 call off the event loop: counted and timed as ``operation``,
        failures raised as :class:`S3Error`/:class:`S3Unavailable`, a missing object
        answered ``None`` when ``not_found_ok``, refused at once while the breaker is
        open (unless ``breaker`` is False)."""
        return await self.run(
            lambda: self._call_sync(operation, fn, not_found_ok=not_found_ok, breaker=breaker)
        )

    # ---------------------------------------------------------------- operations

    async def head(self, key: str) -> ObjectInfo | None:
        """Size and CRC32C of an object, or ``None`` when it does not exist."""
        resp = await self.call(
            "head",
            lambda: self.client.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED"),
            not_found_ok=True,
        )
        return None if resp is None else info_from_response(key, resp)

    async def open(self, key: str) -> S3Download | None:
        """Start a GET: ``None`` when the object does not exist, else an open download
        whose headers (size, CRC32C) are known and whose body is still on the wire."""
        answer: tuple[Mapping[str, str], ObjectBody] | None = await self._call_on_loop(
            "get", lambda: self.data_plane.get(key), not_found_ok=True
        )
        if answer is None:
            return None
        headers, body = answer
        return S3Download(info_from_headers(key, headers), body, self.breaker, self.metrics)

    async def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """``length`` bytes from ``start`` (fewer at the end of the object), or ``None``
        when the object does not exist. For reading a body's header without the body."""

        async def _get() -> bytes:
            _, body = await self.data_plane.get_span(key, ByteSpan(start, start + length))
            data = bytearray()
            try:
                while chunk := await body.read():
                    data += chunk
            finally:
                await body.aclose()
            self.metrics.bytes_down.inc(len(data))
            return bytes(data)

        return await self._call_on_loop("get_range", _get, not_found_ok=True)

    async def delete(self, key: str) -> None:
        """Remove an object; absent objects are fine."""
        await self.call(
            "delete",
            lambda: self.client.delete_object(Bucket=self.bucket, Key=key),
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
            return self.client.list_objects_v2(**kwargs)

        resp = await self.call("list", _list)
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
            return self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True},
            )

        resp = await self.call("delete_many", _delete)
        errors = (resp or {}).get("Errors") or []
        if errors:
            first = errors[0]
            raise S3Error(
                f"S3 could not delete {len(errors)} of {len(keys)} objects, first "
                f"{first.get('Key')!r}: {first.get('Code')} {first.get('Message')}",
                code=first.get("Code"),
            )

    async def close(self) -> None:
        """Release the thread pool and HTTP connections."""
        self.shutdown()

    def shutdown(self) -> None:
        """Synchronous :meth:`close` (for code outside an event loop)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.data_plane.close()
        for client in (self.client, self.probe_client):
            try:
                client.close()
            except Exception:
                log.debug("closing boto3 client failed", exc_info=True)
