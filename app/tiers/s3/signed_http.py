"""The S3 data plane's requests on botocore's transport: SigV4-signed GETs, PUTs and
part uploads (``UploadPart``) on one botocore connection pool, GET bodies read on the S3
thread pool. ``data_plane`` sends every PUT and part upload here, and GETs too where
the endpoint is reached through a proxy (elsewhere ``loop_get`` reads on the event
loop).

boto3 spends about 1 ms of CPU per call on its request pipeline (parameter validation,
endpoint rules, event hooks, response parsing), as much as the whole request costs S3
for a small object; measured per 4.7 MB upload of a cached file, 3.6 ms of process CPU
through ``put_object`` against 2.8 ms through this. These requests keep what matters
from botocore and drop the rest:

* the request is the one boto3 sends (same headers, checksum and metadata), signed by
  ``signing.Signer`` (botocore's ``S3SigV4Auth``; payload signing off:
  ``UNSIGNED-PAYLOAD``; the CRC32C header, which S3 verifies, is signed). One
  difference: boto3 asks for ``100 Continue`` before every body, these only before one
  above ``EXPECT_CONTINUE_ABOVE``, where not sending a refused body is worth a round
  trip;
* transport: ``http_session``'s ``URLLib3Session``, made as the boto3 client's is (TLS
  verification and CA bundle, proxies, timeouts, pool size, keep-alive), so its
  exceptions are botocore's;
* errors: a non-2xx answer becomes the ``ClientError`` boto3 raises
  (``errors.client_error``), so ``errors.map_error`` maps it like any boto3 failure;
* retries: ``app.retries.retried`` with ``errors.standard_retries`` (botocore's
  "standard" mode) up to ``max_attempts``, an upload's body rewound for each; a body
  that cannot be rewound (a streaming upload's pipe) gets one attempt.

Path-style addressing only (``client.ADDRESSING_STYLE``). A GET's body is a urllib3
response read exactly as botocore's ``StreamingBody`` reads it, by one pool job per GET.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any
from urllib.parse import quote

from app.retries import retried
from app.tiers.s3.botocore_adapter import AWSRequest, URLLib3Session
from app.tiers.s3.download import FIRST_READ_BYTES, OK, READ_AHEAD
from app.tiers.s3.errors import ERROR_BODY_BYTES, client_error, standard_retries
from app.tiers.s3.objects import ByteSpan
from app.tiers.s3.signing import Signer

log = logging.getLogger(__name__)

#: A body above this size waits for ``100 Continue`` (S3's go-ahead after checking the
#: signature and the request) before it is sent, so a refused upload is not sent whole.
EXPECT_CONTINUE_ABOVE = 1024 * 1024


class SignedHttp:
    """Requests signed by ``signer``, sent on ``http`` (a botocore ``URLLib3Session``),
    retried up to ``max_attempts``; GET bodies read on ``executor`` in chunks of up to
    ``chunk_size`` bytes. ``put`` and ``upload_part`` block: call them on the S3 thread
    pool."""

    def __init__(
        self,
        http: URLLib3Session,
        signer: Signer,
        max_attempts: int,
        executor: Executor,
        chunk_size: int,
    ) -> None:
        self._http = http
        self._signer = signer
        self._retries = standard_retries(max_attempts)
        self._no_retries = standard_retries(1)
        self._executor = executor
        self._chunk_size = chunk_size

    # -- GET ------------------------------------------------------------------------

    async def open(
        self, key: str, span: ByteSpan | None = None, if_match: str | None = None
    ) -> tuple[Mapping[str, str], ThreadedBody]:
        """The response headers and the body of ``key`` (of its bytes ``span`` when
        given, while its ETag is ``if_match`` when given), its first chunk read. Raises
        botocore's exceptions: ``ClientError`` for an error answer (a missing object
        included), connection errors after the last attempt."""
        loop = asyncio.get_running_loop()
        headers, raw, first = await loop.run_in_executor(
            self._executor, self._open, key, span, if_match
        )
        size = int(headers.get("content-length", len(first)))
        return headers, ThreadedBody(self._executor, raw, first, size, self._chunk_size)

    def _open(
        self, key: str, span: ByteSpan | None, if_match: str | None
    ) -> tuple[Mapping[str, str], Any, bytes]:
        headers, raw = retried(lambda: self._get_once(key, span, if_match), self._retries)
        # The first chunk is read by this same job, so it reaches the loop without
        # another hand-over to the pool and back.
        try:
            return headers, raw, raw.read(min(FIRST_READ_BYTES, self._chunk_size))
        except BaseException:
            raw.close()
            raise

    def _get_once(
        self, key: str, span: ByteSpan | None, if_match: str | None
    ) -> tuple[Mapping[str, str], Any]:
        signed = self._signer.get(key, span, if_match)
        prepared = AWSRequest(method="GET", url=signed.url, headers=signed.headers).prepare()
        prepared.stream_output = True
        response = self._http.send(prepared)
        raw = response.raw
        if response.status_code in OK:
            return response.headers, raw
        try:
            document = raw.read(ERROR_BODY_BYTES)
        finally:
            raw.close()
        raise client_error(response.status_code, response.headers, document, "GetObject")

    # -- uploads --------------------------------------------------------------------

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
        """``PutObject``: ``size`` bytes of ``body`` as ``key``; a file-like object
        (``read``, ``seekable``; when seekable, ``tell`` and ``seek`` rewind it for a
        retry). ``if_absent``: only if the key has no object (``If-None-Match: *``; S3
        answers 412 otherwise). Raises botocore's exceptions, as ``put_object`` would."""
        headers = {
            "Content-Type": content_type,
            **{f"x-amz-meta-{name}": value for name, value in metadata.items()},
        }
        if if_absent:
            headers["If-None-Match"] = "*"
        self._upload("PutObject", key, "", headers, body, size, checksum_crc32c)

    def upload_part(
        self, key: str, upload_id: str, number: int, body: bytes, checksum_crc32c: str
    ) -> str:
        """``UploadPart``: ``body`` as part ``number`` of the multipart upload
        ``upload_id`` of ``key``; its ETag. Raises botocore's exceptions, as
        ``upload_part`` would."""
        query = f"partNumber={number}&uploadId={quote(upload_id, safe='')}"
        answer = self._upload("UploadPart", key, query, {}, body, len(body), checksum_crc32c)
        return answer["etag"]

    def _upload(
        self,
        operation: str,
        key: str,
        query: str,
        headers: Mapping[str, str],
        body: Any,
        size: int,
        checksum_crc32c: str,
    ) -> Mapping[str, str]:
        """One upload request, retried; the answer's headers."""
        headers = {
            "Content-Length": str(size),
            "x-amz-sdk-checksum-algorithm": "CRC32C",
            "x-amz-checksum-crc32c": checksum_crc32c,
            **headers,
        }
        if size > EXPECT_CONTINUE_ABOVE:
            headers["Expect"] = "100-continue"
        if isinstance(body, bytes):  # sent whole by each attempt
            return retried(
                lambda: self._upload_once(operation, key, query, headers, body), self._retries
            )
        rewindable = body.seekable()
        start = body.tell() if rewindable else 0
        return retried(
            lambda: self._upload_once(operation, key, query, headers, body),
            self._retries if rewindable else self._no_retries,
            lambda: body.seek(start),
        )

    def _upload_once(
        self, operation: str, key: str, query: str, headers: Mapping[str, str], body: Any
    ) -> Mapping[str, str]:
        signed = self._signer.put(key, headers, body, query)
        request = AWSRequest(method="PUT", url=signed.url, headers=signed.headers, data=body)
        # Read whole (an answer to a PUT is empty, or a short error document), so the
        # connection goes back to the pool.
        response = self._http.send(request.prepare())
        if response.status_code >= 300:
            document = response.content[:ERROR_BODY_BYTES]
            raise client_error(response.status_code, response.headers, document, operation)
        return {k.lower(): v for k, v in response.headers.items()}


class ThreadedBody:
    """The body of a :class:`SignedHttp` GET: one pool job reads it (``READ_AHEAD`` chunks
    ahead of the consumer at most) and hands each chunk to the event loop as it arrives,
    one wake-up of the loop per chunk instead of a job submitted per chunk."""

    def __init__(
        self, executor: Executor, raw: Any, first: bytes, size: int, chunk_size: int
    ) -> None:
        self._executor = executor
        self._raw = raw
        self._chunk_size = chunk_size
        self._arrived: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._job: asyncio.Future[None] | None = None
        self._stop = False
        self._closed = False
        self._room = threading.Semaphore(READ_AHEAD)
        if first:
            self._room.acquire()  # ``first`` holds one of the read-ahead places
            self._arrived.put_nowait(first)
        if len(first) >= size:  # the whole body came with the first read
            self._arrived.put_nowait(None)
        self._remaining = size - len(first)

    async def read(self) -> bytes:
        """The next chunk; ``b""`` at the end of the body."""
        if self._job is None and self._remaining > 0:
            loop = asyncio.get_running_loop()

            def post(item: bytes | BaseException | None) -> None:
                loop.call_soon_threadsafe(self._arrived.put_nowait, item)

            self._job = loop.run_in_executor(self._executor, self._pump, post)
        item = await self._arrived.get()
        if item is None:
            self._arrived.put_nowait(None)  # every later read is at the end too
            return b""
        if isinstance(item, BaseException):
            raise item
        self._room.release()
        return item

    def _pump(self, post: Callable[[bytes | BaseException | None], None]) -> None:
        """On a pool thread: read the body to its end (or until closed), passing each
        chunk to ``post``; ``post(None)`` at the end, or the exception that stopped it."""
        size = min(FIRST_READ_BYTES * 8, self._chunk_size)
        remaining = self._remaining
        try:
            while True:
                self._room.acquire()
                if self._stop:
                    return
                data: bytes = self._raw.read(size)
                if not data:
                    post(None)
                    return
                post(data)
                remaining -= len(data)
                if remaining <= 0:
                    # The whole body: the end is known without one more read (and one
                    # more wait for room), and the connection is back in the pool.
                    post(None)
                    return
                size = min(size * 8, self._chunk_size)
        except BaseException as exc:
            post(exc)

    async def aclose(self) -> None:
        """Stop reading; an unread rest drops the connection instead of draining it."""
        if self._closed:
            return
        self._closed = True
        job, self._job = self._job, None
        raw = self._raw

        def _close() -> None:
            try:
                raw.close()
            except Exception:  # closing a broken connection must not mask the real error
                log.debug("closing S3 body failed", exc_info=True)

        if job is not None:
            # The reading job may be inside a read: let it finish before closing the
            # stream under it (urllib3 responses are not thread-safe).
            self._stop = True
            self._room.release()
            with contextlib.suppress(BaseException):
                await asyncio.shield(job)
        await asyncio.get_running_loop().run_in_executor(self._executor, _close)
