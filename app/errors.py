"""The server's error hierarchy; ``app.error_responses`` maps it to HTTP in one place."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ECError(Exception):
    """Base class: an HTTP status, a stable machine code and the part that was wrong."""

    status_code = 500
    code = "internal_error"

    def __init__(self, message: str, *, part: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.part = part

    @property
    def headers(self) -> dict[str, str]:
        return {}


class InvalidKey(ECError):
    status_code = 400

    def __init__(self, part: str, message: str) -> None:
        super().__init__(message, part=part)
        self.code = f"invalid_{part}"


class InvalidBody(ECError):
    status_code = 400
    code = "invalid_body"

    def __init__(self, message: str, *, part: str | None = "body") -> None:
        super().__init__(message, part=part)


class DtypeMismatch(InvalidBody):
    code = "dtype_mismatch"


class ChecksumMismatch(InvalidBody):
    code = "checksum_mismatch"

    def __init__(self, message: str) -> None:
        super().__init__(message, part="checksum")


class InvalidRequest(ECError):
    status_code = 400
    code = "invalid_request"

    @classmethod
    def from_validation(cls, errors: Sequence[Mapping[str, Any]]) -> InvalidRequest:
        """The first of pydantic's (or FastAPI's) validation ``errors``: its location
        (without FastAPI's ``body``) names the part."""
        first = errors[0] if errors else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(location) or 'request'}: {first.get('msg', 'invalid request')}"
        return cls(message, part=location[0] if location else None)


class NotFound(ECError):
    status_code = 404
    code = "not_found"


class AlreadyExists(ECError):
    status_code = 412
    code = "already_exists"


class MethodNotAllowed(ECError):
    status_code = 405
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow

    @property
    def headers(self) -> dict[str, str]:
        return {"Allow": self.allow}


class BodyTooLarge(ECError):
    status_code = 413
    code = "body_too_large"


class ClientGone(ECError):
    """The client disconnected or sent less than it announced; nothing is stored."""

    status_code = 400
    code = "incomplete_body"


class SlowClient(ECError):
    """An upload stalled (``EC_BODY_READ_TIMEOUT``), went slower than
    ``EC_UPLOAD_MIN_RATE`` or past ``EC_UPLOAD_TIMEOUT``; nothing is stored."""

    status_code = 408
    code = "request_timeout"


class Unavailable(ECError):
    """A tier needed to answer is unreachable: the answer is unknown, not absent."""

    status_code = 503
    code = "unavailable"

    def __init__(self, message: str, *, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class InsufficientStorage(ECError):
    status_code = 507
    code = "insufficient_storage"


class BackendError(ECError):
    """The backend (S3) answered, but not with what we need (credentials, permissions,
    bucket...). The code keeps its ``s3_`` name: S3 is the one backend, and clients
    match on it."""

    status_code = 502
    code = "s3_error"


class InvalidBackendObject(BackendError):
    """What the backend holds for a key is not a valid entry (or failed its CRC32C)."""

    code = "s3_invalid_object"
