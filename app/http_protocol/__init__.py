"""The HTTP protocol the server runs on uvicorn: the one door to uvicorn's internals.

uvicorn's httptools protocol has no public extension points, so what the server adds
to it subclasses and reaches into private parts of uvicorn (its request cycle, flow
control, keep-alive task, parser set-up) and httptools:

* ``httptools_protocol``: JSON 400s for requests the HTTP parser refuses, a response
  head sent with small first body bytes, PUT bodies read straight into buffers;
* ``guarded``: a bound on open connections and the idle, request-head and send
  deadlines, which uvicorn lacks for a new connection, and a lingering close.

Those modules are written against the versions in requirements.lock (``LOCKED``), and
only ever imported on them: :func:`uvicorn_options` checks the installed uvicorn and
httptools at start-up. On any other version the server serves with uvicorn's stock h11
protocol (public options only) and logs a warning naming the versions and what is off.
h11, not uvicorn's stock httptools protocol, because the latter loses the body of a
request that carries ``Upgrade:`` (llhttp skips it) and with it the requests pipelined
behind; h11 serves them as the locked path does, and bounds a request head while it
arrives (``h11_max_incomplete_event_size``, answered with uvicorn's plain-text 400).
uvicorn's own settings keep the connection bound (``limit_concurrency``: over it
uvicorn answers a plain-text 503) and the keep-alive deadline. The request-head and
send deadlines, JSON 400s and 431s, the lingering close, the ``ec_connections_*``
metrics and httptools' speed (h11 parses in Python: uploads cost more CPU) need the
adapter.
"""

from __future__ import annotations

import inspect
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry

from app.middleware import MAX_TARGET_BYTES
from app.settings import Settings

log = logging.getLogger(__name__)

#: The versions the adapter modules are written and tested against: requirements.lock's
#: (tests/unit/test_http_protocol_versions.py keeps the two equal).
LOCKED = {"uvicorn": "0.55.0", "httptools": "0.9.0"}
#: Room in a request head's bound for its request line past the target, and for the
#: whitespace around header values that the middleware's count leaves out.
HEAD_SLACK_BYTES = 1024


def max_head_bytes(max_header_bytes: int) -> int:
    """The most bytes of a request head taken in before its end: never less than a
    head the middleware accepts (``EC_MAX_HEADER_BYTES`` of headers, a target of
    ``MAX_TARGET_BYTES``)."""
    return max_header_bytes + MAX_TARGET_BYTES + HEAD_SLACK_BYTES


def unlocked_versions() -> dict[str, str]:
    """``{distribution: installed version}`` for each that is not the locked one."""
    off: dict[str, str] = {}
    for name, locked in LOCKED.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = "not installed"
        if installed != locked:
            off[name] = installed
    return off


def uvicorn_options(settings: Settings, registry: CollectorRegistry) -> dict[str, Any]:
    """The ``uvicorn.run`` options that choose the HTTP protocol and bound connections."""
    off = unlocked_versions()
    if not off:
        from app.http_protocol.guarded import ConnectionLimits, guarded_protocol

        limits = ConnectionLimits.from_settings(settings)
        return {"http": guarded_protocol(limits, registry)}
    found = ", ".join(f"{name} {installed}" for name, installed in sorted(off.items()))
    wanted = ", ".join(f"{name} {locked}" for name, locked in sorted(LOCKED.items()))
    log.warning(
        "ec-cache's HTTP protocol adapter is written for %s, but %s is installed: serving "
        "with uvicorn's stock h11 protocol (its stock httptools protocol would lose the "
        "body of a request carrying Upgrade:). Kept: EC_MAX_CONNECTIONS (uvicorn's "
        "limit_concurrency, a plain-text 503 beyond it), EC_KEEPALIVE_TIMEOUT, and a bound "
        "on a request head while it arrives (a plain-text 400). Off: EC_HEADER_TIMEOUT and "
        "EC_SEND_TIMEOUT, JSON bodies on 400s and 431s the HTTP parser sends, the "
        "lingering close after an early answer to a PUT, the ec_connections_* metrics, "
        "and httptools' speed and the adapter's upload and response speed-ups. Install "
        "requirements.lock to get them back.",
        wanted,
        found,
    )
    options: dict[str, Any] = {
        "http": "h11",
        # uvicorn counts the connection asking too: N + 1 refuses the one past N.
        "limit_concurrency": settings.max_connections + 1,
        "timeout_keep_alive": settings.keepalive_timeout,
    }
    if "h11_max_incomplete_event_size" in inspect.signature(uvicorn.Config).parameters:
        options["h11_max_incomplete_event_size"] = max_head_bytes(settings.max_header_bytes)
    return options
