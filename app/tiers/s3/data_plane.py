"""The S3 data plane: the one way GETs, ranged GETs, single-part PUTs and multipart part
uploads (``UploadPart``) reach S3. boto3 keeps the control plane (HEAD, list, delete,
create/complete/abort of multipart uploads, the conditional-write probes).

:class:`S3DataPlane` is what the tier calls; its HTTP layer is chosen once, here, when
the client is made, never by a caller:

* ``loop`` (the locked botocore, no proxy): GETs are read on the event loop
  (``loop_get``: the fastest GET, no thread hand-over per chunk), uploads are signed
  requests on botocore's connection pool (``signed_http``: boto3's request without its
  ~1 ms per-call pipeline);
* ``botocore`` (the locked botocore, the endpoint behind a proxy): GETs too go on
  ``signed_http``'s pool, which speaks to the proxy as boto3 would;
* ``boto3`` (another botocore, ``botocore_adapter.usable``): plain boto3 calls on the
  S3 thread pool (:class:`Boto3Http`): ``get_object`` (with ``Range`` and ``IfMatch``),
  ``put_object``, ``upload_part``.

The ``loop`` layer keeps two sets of kept-alive connections to the endpoint: the event
loop's, for GETs, and botocore's pool, for uploads, which are sent from the S3 thread
pool (a file's body from its mapping, a streaming upload's from a pipe the loop feeds).
The other layers have one pool.

Whatever the layer: one retry policy (botocore's "standard" mode up to
``EC_S3_MAX_ATTEMPTS``: ``errors.standard_retries``, or boto3's own, which is that
mode), one error mapping (botocore's exceptions, mapped by ``errors.map_error`` in
``client``), SigV4 by ``signing`` (or boto3 itself), and a large object's GET read as
concurrent ranged parts (``ranged_get``) unless ``EC_S3_GET_CONCURRENCY`` is 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any, Literal, Protocol

from botocore.config import Config
from botocore.credentials import Credentials

from app.settings import Settings
from app.tiers.s3 import botocore_adapter
from app.tiers.s3.download import FIRST_READ_BYTES, ObjectBody
from app.tiers.s3.errors import standard_retries
from app.tiers.s3.http_session import s3_transport
from app.tiers.s3.loop_get import LoopGet
from app.tiers.s3.objects import ByteSpan
from app.tiers.s3.ranged_get import RangedGet, SpanGet
from app.tiers.s3.signed_http import SignedHttp, ThreadedBody
from app.tiers.s3.signing import Signer

#: See the module docstring.
Layer = Literal["loop", "botocore", "boto3"]


class Uploads(Protocol):
    """A layer's uploads (``signed_http.SignedHttp``, :class:`Boto3Http`); blocking."""

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
    ) -> None: ...

    def upload_part(
        self, key: str, upload_id: str, number: int, body: bytes, checksum_crc32c: str
    ) -> str: ...


class S3DataPlane:
    """GETs through ``gets`` (read in ranged parts as ``settings`` say), uploads through
    ``uploads``; ``layer`` names them (see the module docstring), ``closers`` release
    their connections."""

    def __init__(
        self,
        layer: Layer,
        gets: SpanGet,
        uploads: Uploads,
        settings: Settings,
        closers: tuple[Callable[[], None], ...] = (),
    ) -> None:
        self.layer = layer
        self._gets = gets
        self._reads: SpanGet | RangedGet = gets
        if settings.s3_get_concurrency > 1:
            self._reads = RangedGet(
                gets,
                settings.s3_get_part_size,
                settings.s3_get_concurrency,
                standard_retries(settings.s3_max_attempts),
                settings.s3_get_buffer_bytes,
            )
        self._uploads = uploads
        self._closers = closers

    async def get(self, key: str) -> tuple[Mapping[str, str], ObjectBody]:
        """The headers of the whole object ``key`` (its ``Content-Length``) and its
        unread body. Raises botocore's exceptions (``ClientError`` for an error answer,
        a missing object included)."""
        return await self._reads.open(key)

    async def get_span(self, key: str, span: ByteSpan) -> tuple[Mapping[str, str], ObjectBody]:
        """The headers and the unread body of the bytes ``span`` of ``key`` (fewer at
        the object's end), in one GET. Raises as :meth:`get` does."""
        return await self._gets.open(key, span)

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
        """``PutObject``: ``size`` bytes of ``body`` (file-like: ``read``, ``seekable``;
        ``tell`` and ``seek`` when seekable, to rewind it for a retry; one attempt
        otherwise) as ``key``. ``if_absent``: only if the key has no object
        (``If-None-Match: *``; S3 answers 412 otherwise). Blocking: call it on the S3
        thread pool."""
        self._uploads.put(
            key,
            body,
            size,
            content_type=content_type,
            checksum_crc32c=checksum_crc32c,
            metadata=metadata,
            if_absent=if_absent,
        )

    def upload_part(
        self, key: str, upload_id: str, number: int, body: bytes, checksum_crc32c: str
    ) -> str:
        """``UploadPart``: ``body`` as part ``number`` of the multipart upload
        ``upload_id`` of ``key``, S3 checking its CRC32C; the part's ETag. Blocking:
        call it on the S3 thread pool."""
        return self._uploads.upload_part(key, upload_id, number, body, checksum_crc32c)

    def close(self) -> None:
        """Release the layer's connections."""
        for close in self._closers:
            close()


def data_plane(
    client: Any,
    endpoint: str,
    bucket: str,
    settings: Settings,
    config: Config,
    credentials: Credentials | None,
    executor: Executor,
) -> S3DataPlane:
    """The data plane of the boto3 ``client`` (made with ``config`` for ``endpoint`` and
    ``bucket``); ``executor`` is the S3 thread pool."""
    if not botocore_adapter.usable():
        boto3_http = Boto3Http(client, bucket, executor, settings.s3_get_chunk_size)
        return S3DataPlane("boto3", boto3_http, boto3_http, settings)

    transport = s3_transport(endpoint, settings.s3_verify_tls, config)
    signer = Signer(transport, bucket, settings.s3_region, config, credentials)
    signed = SignedHttp(
        transport.session, signer, settings.s3_max_attempts, executor, settings.s3_get_chunk_size
    )
    if transport.proxy_url:  # LoopGet does not speak to proxies
        return S3DataPlane("botocore", signed, signed, settings, (transport.session.close,))
    loop_get = LoopGet(
        transport, config, signer, settings.s3_max_attempts, settings.s3_get_chunk_size
    )
    closers = (loop_get.close, transport.session.close)
    return S3DataPlane("loop", loop_get, signed, settings, closers)


class Boto3Http:
    """The ``boto3`` layer: the data plane's requests as boto3 calls (their retries
    boto3's own), GETs on ``executor`` read in chunks of up to ``chunk_size`` bytes."""

    def __init__(self, client: Any, bucket: str, executor: Executor, chunk_size: int) -> None:
        self._client = client
        self._bucket = bucket
        self._executor = executor
        self._chunk_size = chunk_size

    async def open(
        self, key: str, span: ByteSpan | None = None, if_match: str | None = None
    ) -> tuple[Mapping[str, str], ObjectBody]:
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

    def upload_part(
        self, key: str, upload_id: str, number: int, body: bytes, checksum_crc32c: str
    ) -> str:
        answer = self._client.upload_part(
            Bucket=self._bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            ContentLength=len(body),
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=checksum_crc32c,
        )
        return str(answer["ETag"])
