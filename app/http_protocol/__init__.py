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
httptools at start-up. On any other version the server serves with uvicorn's stock
httptools protocol and logs a warning naming the versions and what is off; uvicorn's
own settings keep the connection bound (``limit_concurrency``: over it uvicorn answers a
plain-text 503) and the keep-alive deadline. The request-head and send deadlines, the
bound on a head while it arrives, JSON 400s, the lingering close and the ``ec_connections_*`` metrics need the adapter.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from prometheus_client import CollectorRegistry

from app.settings import Settings

log = logging.getLogger(__name__)

#: The versions the adapter modules are written and tested against: requirements.lock's
#: (tests/unit/test_http_protocol_versions.py keeps the two equal).
LOCKED = {"uvicorn": "0.55.0", "httptools": "0.9.0"}


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
        "with uvicorn's stock httptools protocol. Kept: EC_MAX_CONNECTIONS (uvicorn's "
        "limit_concurrency, a plain-text 503 beyond it) and EC_KEEPALIVE_TIMEOUT. Off: "
        "EC_HEADER_TIMEOUT and EC_SEND_TIMEOUT, EC_MAX_HEADER_BYTES while a head arrives "
        "(it applies once the head is whole), JSON bodies on 400s the HTTP parser "
        "sends, the lingering close after an early answer to a PUT, the ec_connections_* "
        "metrics, and the adapter's upload and response speed-ups. Install "
        "requirements.lock to get them back.",
        wanted,
        found,
    )
    return {
        "http": "httptools",
        # uvicorn counts the connection asking too: N + 1 refuses the one past N.
        "limit_concurrency": settings.max_connections + 1,
        "timeout_keep_alive": settings.keepalive_timeout,
    }
