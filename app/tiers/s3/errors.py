"""The S3 backend's two error types and the one mapping of botocore (and urllib3) failures
onto them.

:class:`S3Unavailable`: connection refused or reset, timeouts, 5xx, throttling (the server
answers 503 with ``Retry-After``). :class:`S3Error`: everything else (credentials,
permissions, missing bucket, checksum refused, ...). A missing object is not an error:
callers ask :func:`is_not_found` and answer ``None``. :func:`client_error` makes the
``ClientError`` boto3 would raise for an error answer read without boto3, and
:func:`standard_retries` says which failures are retried, when (botocore's "standard"
retry mode).
"""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any

import botocore.exceptions as bce
import urllib3.exceptions

from app.retries import RetryPolicy, backoff

#: Bytes of an error answer read for its XML document.
ERROR_BODY_BYTES = 64 * 1024


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


_THROTTLING_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests"}
)

_UNAVAILABLE_CODES = _THROTTLING_CODES | {
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",  # clock skew is not ours to fix, but it is transient-ish
    "ConditionalRequestConflict",  # AWS: a conditional write raced another; retry it
}

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


def client_error_info(exc: bce.ClientError) -> tuple[str, int, str]:
    """(error code, HTTP status, message) of a botocore ``ClientError``."""
    err: Mapping[str, Any] = exc.response.get("Error", {}) or {}
    meta: Mapping[str, Any] = exc.response.get("ResponseMetadata", {}) or {}
    code = str(err.get("Code", "") or "")
    status = int(meta.get("HTTPStatusCode", 0) or 0)
    message = str(err.get("Message", "") or "")
    return code, status, message


def is_not_found(exc: BaseException) -> bool:
    if not isinstance(exc, bce.ClientError):
        return False
    code, status, _ = client_error_info(exc)
    return code in _NOT_FOUND_CODES or (status == 404 and code != "NoSuchBucket")


def is_precondition_failed(exc: BaseException) -> bool:
    """A conditional write (``If-None-Match: *``) refused: the key has an object."""
    if isinstance(exc, S3Error):
        return exc.status == 412
    if isinstance(exc, bce.ClientError):
        code, status, _ = client_error_info(exc)
        return status == 412 or code == "PreconditionFailed"
    return False


def is_throttling(exc: BaseException) -> bool:
    """S3 asked to slow down (429, or a throttling error code)."""
    if not isinstance(exc, bce.ClientError):
        return False
    code, status, _ = client_error_info(exc)
    return status == 429 or code in _THROTTLING_CODES


def map_error(exc: BaseException, operation: str, retry_after: float = 1.0) -> S3Error:
    """Translate a botocore/urllib3 exception into :class:`S3Unavailable` or
    :class:`S3Error`. Already-mapped errors pass through unchanged."""
    if isinstance(exc, S3Error):
        return exc
    if isinstance(exc, bce.ClientError):
        code, status, message = client_error_info(exc)
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
        | urllib3.exceptions.HTTPError  # a body read straight from urllib3 (signed_http)
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


def outage_reason(exc: BaseException) -> str:
    """Why S3 is unavailable, in words true of every call the circuit breaker refuses
    while open: the kind of failure, never the URL or key of the call that met it."""
    if isinstance(exc, bce.ClientError):
        code, status, _ = client_error_info(exc)
        return f"it answered {code or status}"
    if isinstance(exc, S3Error):  # mapped already: its code, if it answered
        return f"it answered {exc.code or exc.status}" if exc.code or exc.status else "unreachable"
    return f"unreachable ({type(exc).__name__})"


#: botocore's "standard" retry mode: full jitter over the backoff from these bases.
BASE_BACKOFF = 0.05
THROTTLING_BACKOFF = 1.0
MAX_BACKOFF = 20.0


def standard_retries(max_attempts: int) -> RetryPolicy:
    """botocore's "standard" retry mode up to ``max_attempts``, as an
    ``app.retries`` policy (for the data plane's layers that skip boto3's pipeline and
    its retries: ``loop_get``, ``signed_http``): a failure ``map_error``
    calls unavailable (connection errors, 5xx, throttling) is retried after a random
    part of the backoff, a longer one for throttling; any other is not."""

    def delay(exc: Exception, attempt: int) -> float | None:
        if attempt >= max_attempts or not isinstance(map_error(exc, "get"), S3Unavailable):
            return None
        scale = THROTTLING_BACKOFF if is_throttling(exc) else BASE_BACKOFF
        return random.random() * backoff(attempt, scale, MAX_BACKOFF)

    return delay


def client_error(
    status: int, headers: Mapping[str, str], document: bytes, operation: str
) -> bce.ClientError:
    """The ``ClientError`` boto3 raises for this error answer to ``operation`` (the
    data plane's layers that skip boto3's pipeline: ``loop_get``, ``signed_http``)."""
    code, message = str(status), ""
    try:
        root = ET.fromstring(document)
    except ET.ParseError:
        pass
    else:
        code = root.findtext("Code") or code
        message = root.findtext("Message") or ""
    return bce.ClientError(
        {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": dict(headers)},
        },
        operation,
    )
