"""How a failed request becomes one of the SDK's exceptions: an error answer
(:func:`error_for`, wrapped in :class:`RetryableStatus` when ``Retries.statuses`` lists
its status), and httpx's own failures (:func:`to_ec_error`)."""

from __future__ import annotations

import httpx

from ._exceptions import ConnectError, ECCacheError, ServerError, TransportError, TransportTimeout


def error_for(resp: httpx.Response, body: bytes, url: str) -> ServerError:
    """The :class:`ServerError` of an error answer and its JSON ``body``."""
    return ServerError.from_response(
        resp.status_code,
        body,
        url=url,
        retry_after=resp.headers.get("retry-after"),
        error_header=resp.headers.get("x-ec-error"),
    )


class RetryableStatus(Exception):
    """Internal: an answer whose status is in ``Retries.statuses``."""

    def __init__(self, error: ServerError) -> None:
        super().__init__(str(error))
        self.error = error


def to_ec_error(exc: BaseException | None, url: str) -> ECCacheError:
    """Map the last failure of a call to the SDK's exceptions."""
    if isinstance(exc, RetryableStatus):
        return exc.error
    if isinstance(exc, ECCacheError):
        return exc
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return ConnectError(f"cannot connect to {url}: {exc}", url=url)
    if isinstance(exc, httpx.TimeoutException):
        return TransportTimeout(f"{url}: {type(exc).__name__}: {exc}", url=url)
    return TransportError(f"{url}: {type(exc).__name__}: {exc}", url=url)
