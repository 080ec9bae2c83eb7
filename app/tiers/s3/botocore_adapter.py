"""The one door to botocore's internals, and the check of its version.

The S3 tier's data plane (``data_plane``: GETs, ranged GETs, PUTs, part uploads) skips
boto3's per-call pipeline (~1 ms of CPU per call, as much as S3's own time for a small
object): ``signing`` signs with botocore's ``S3SigV4Auth``, ``http_session`` makes
botocore's ``URLLib3Session`` as botocore makes the boto3 client's (proxies, TLS,
timeouts), ``signed_http`` and ``loop_get`` send on it or beside it. None of that is
botocore's public API, so those modules import what they use of botocore's internals
from here, and ``data_plane`` builds them only where :func:`usable` says the installed
botocore is the one they are written and tested against (``LOCKED``: requirements.lock's;
the unit tests keep the two equal), as ``app.http_protocol`` does for uvicorn. On any
other version the data plane sends the same requests as plain boto3 calls on the S3
thread pool: slower per call, the same answers and errors.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.httpsession import ProxyConfiguration, URLLib3Session, get_cert_path
from botocore.utils import get_environ_proxies

log = logging.getLogger(__name__)

#: The botocore the data plane's modules are written against (requirements.lock's).
LOCKED = "1.44.18"

__all__ = [
    "LOCKED",
    "AWSRequest",
    "ProxyConfiguration",
    "S3SigV4Auth",
    "URLLib3Session",
    "get_cert_path",
    "get_environ_proxies",
    "installed",
    "usable",
]


def installed() -> str:
    """The installed botocore's version."""
    try:
        return version("botocore")
    except PackageNotFoundError:  # pragma: no cover - boto3 needs it
        return "not installed"


def usable() -> bool:
    """Whether the installed botocore is ``LOCKED`` (else a warning says what it costs)."""
    found = installed()
    if found == LOCKED:
        return True
    log.warning(
        "botocore %s is not the locked %s: the S3 tier's GETs and PUTs go through "
        "plain boto3 calls (about 1 ms more CPU per request)",
        found,
        LOCKED,
    )
    return False
