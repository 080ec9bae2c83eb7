"""The one door to botocore's internals, and the data plane chosen by its version.

The S3 tier's data plane (the read path's GET and ranged GETs, single-part PUTs) skips
boto3's per-call pipeline (~1 ms of CPU per call, as much as S3's own time for a small
object): ``signing`` signs with botocore's ``S3SigV4Auth``, ``http_session`` makes
botocore's ``URLLib3Session`` as botocore makes the boto3 client's (proxies, TLS,
timeouts), ``signed_get`` / ``signed_put`` / ``loop_get`` send on it or beside it. None
of that is botocore's public API, so those modules import what they use of botocore's
internals from here, and :func:`data_plane` builds them only on the botocore version
they are written and tested against (``LOCKED``: requirements.lock's; the unit tests
keep the two equal), as ``app.http_protocol`` does for uvicorn. On any other version it
logs a warning and falls back to plain boto3 calls on the S3 thread pool:
``get_object`` (with ``Range`` and ``IfMatch``, read by ``signed_get.ThreadedBody``) and
``put_object``; slower per call, the same answers and errors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Protocol

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.httpsession import ProxyConfiguration, URLLib3Session, get_cert_path
from botocore.utils import get_environ_proxies

from app.settings import Settings
from app.tiers.s3.objects import ByteSpan
from app.tiers.s3.ranged_get import RangedGet, SpanGet

log = logging.getLogger(__name__)

#: The botocore the data plane's modules are written against (requirements.lock's).
LOCKED = "1.44.18"

__all__ = [
    "LOCKED",
    "AWSRequest",
    "DataPlane",
    "ProxyConfiguration",
    "S3SigV4Auth",
    "URLLib3Session",
    "data_plane",
    "get_cert_path",
    "get_environ_proxies",
    "installed",
]


def installed() -> str:
    """The installed botocore's version."""
    try:
        return version("botocore")
    except PackageNotFoundError:  # pragma: no cover - boto3 needs it
        return "not installed"


class ObjectPut(Protocol):
    """A single-part upload (``signed_put.SignedPut`` or :class:`Boto3Put`)."""

    def put(
        self,
        key: str,
        body: Any,
        size: int,
        *,
        content_type: str,
        checksum_crc32c: str,
        metadata: Mapping[str, str],
        if_absent: bool = False,
    ) -> None:
        """``if_absent``: only if the key has no object (``If-None-Match: *``)."""
        ...


@dataclass
class DataPlane:
    """How the tier's GETs and single PUTs reach S3, and how to close it."""

    get: SpanGet | RangedGet
    put: ObjectPut
    closers: tuple[Callable[[], None], ...] = ()

    def close(self) -> None:
        for close in self.closers:
            close()


def data_plane(
    client: Any,
    endpoint: str,
    bucket: str,
    settings: Settings,
    config: Config,
    credentials: Credentials | None,
    executor: Executor,
) -> DataPlane:
    """The data plane of the boto3 ``client`` (made with ``config`` for ``endpoint`` and
    ``bucket``): the tier's own transports on the locked botocore, else boto3 calls."""
    # Imported here: the transports import this module (for botocore's internals).
    from app.tiers.s3.get_transport import object_get, ranged

    found = installed()
    if found != LOCKED:
        log.warning(
            "botocore %s is not the locked %s: the S3 tier's GETs and PUTs go through "
            "plain boto3 calls (about 1 ms more CPU per request)",
            found,
            LOCKED,
        )
        get = Boto3Get(client, bucket, executor, settings.s3_get_chunk_size)
        return DataPlane(ranged(get, settings), Boto3Put(client, bucket))

    from app.tiers.s3.http_session import s3_transport
    from app.tiers.s3.loop_get import LoopGet
    from app.tiers.s3.signed_put import SignedPut
    from app.tiers.s3.signing import Signer

    transport = s3_transport(endpoint, settings.s3_verify_tls, config)
    signer = Signer(transport, bucket, settings.s3_region, config, credentials)
    own = object_get(transport, config, signer, settings, executor)
    closers: tuple[Callable[[], None], ...] = (transport.session.close,)
    if isinstance(own, LoopGet):
        closers = (own.close, *closers)
    return DataPlane(
        ranged(own, settings),
        SignedPut(transport.session, signer, settings.s3_max_attempts),
        closers,
    )


class Boto3Get:
    """``get_transport.SpanGet`` over boto3's ``get_object`` on ``executor``."""

    def __init__(self, client: Any, bucket: str, executor: Executor, chunk_size: int) -> None:
        self._client = client
        self._bucket = bucket
        self._executor = executor
        self._chunk_size = chunk_size

    async def open(
        self, key: str, span: ByteSpan | None = None, if_match: str | None = None
    ) -> tuple[Mapping[str, str], Any]:
        # Imported here: signed_get imports this module.
        from app.tiers.s3.signed_get import FIRST_READ_BYTES, ThreadedBody

        def _open() -> tuple[Mapping[str, str], Any, bytes]:
            kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": key, "ChecksumMode": "ENABLED"}
            if span is not None:
                kwargs["Range"] = span.header
            if if_match is not None:
                kwargs["IfMatch"] = if_match
            resp = self._client.get_object(**kwargs)
            raw = resp["Body"]
            try:
                first = raw.read(min(FIRST_READ_BYTES, self._chunk_size))
            except BaseException:
                raw.close()
                raise
            return resp["ResponseMetadata"]["HTTPHeaders"], raw, first

        loop = asyncio.get_running_loop()
        headers, raw, first = await loop.run_in_executor(self._executor, _open)
        size = int(headers.get("content-length", len(first)))
        return headers, ThreadedBody(self._executor, raw, first, size, self._chunk_size)


class Boto3Put:
    """``ObjectPut`` over boto3's ``put_object`` (its own retries)."""

    def __init__(self, client: Any, bucket: str) -> None:
        self._client = client
        self._bucket = bucket

    def put(
        self,
        key: str,
        body: Any,
        size: int,
        *,
        content_type: str,
        checksum_crc32c: str,
        metadata: Mapping[str, str],
        if_absent: bool = False,
    ) -> None:
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": key,
            "Body": body,
            "ContentLength": size,
            "ContentType": content_type,
            "ChecksumCRC32C": checksum_crc32c,
            "Metadata": dict(metadata),
        }
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        self._client.put_object(**kwargs)
