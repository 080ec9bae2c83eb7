"""Requests the clients hand to the SDK's own transport directly, without httpx
building each one (``AsyncClient._send`` says why): a :class:`Route` per replica, and
the log line httpx would have written for each response."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import httpx


class Route:
    """How the SDK's transport reaches one replica without httpx building each request:
    the ``(host, port)``, the target's prefix (the base URL's path) and the request
    headers httpx itself would send there (``Host``, ``Accept``, ``User-Agent``,
    ``Authorization``, extra headers...), computed once from ``Client.build_request``."""

    __slots__ = ("headers", "key", "prefix")

    def __init__(self, key: tuple[str, int], prefix: bytes, headers: list[tuple[bytes, bytes]]):
        self.key = key
        self.prefix = prefix
        self.headers = headers

    def target(self, path: str) -> bytes:
        """The request target of ``path`` (a ``_path``: ASCII that httpx sends as is)."""
        return self.prefix + path.encode("ascii")


def direct_routes(http: httpx.Client | httpx.AsyncClient, urls: Iterable[str]) -> dict[str, Route]:
    """The :class:`Route` of each ``http://`` replica whose requests need nothing from
    httpx beyond their headers (no credentials or query in the URL)."""
    routes: dict[str, Route] = {}
    for url in urls:
        request = http.build_request("GET", url + "/ec")
        u = request.url
        if u.scheme != "http" or u.userinfo or u.query or not u.raw_path.endswith(b"/ec"):
            continue
        routes[url] = Route((u.host, u.port or 80), u.raw_path[:-3], list(request.headers.raw))
    return routes


_httpx_log = logging.getLogger("httpx")


def log_response(method: str, url: str, response: httpx.Response) -> None:
    """The line httpx logs for every response (INFO, logger ``httpx``), for the
    requests that the clients send without ``httpx.Client.send``."""
    if _httpx_log.isEnabledFor(logging.INFO):
        _httpx_log.info(
            'HTTP Request: %s %s "%s %d %s"',
            method,
            url,
            response.http_version,
            response.status_code,
            response.reason_phrase,
        )
