"""The read path's GET on botocore's transport: one SigV4-signed request on a botocore
connection pool, its body read on the S3 thread pool. It reads where the endpoint is
reached through a proxy (``get_transport``); everywhere else ``loop_get`` reads on the
event loop.

A read-through GET waits for S3's first byte before it can answer, so everything spent
before that byte is paid by the client. boto3's ``get_object`` spends about 1 ms of CPU
per call on its request pipeline (parameter validation, endpoint rules, event hooks,
response parsing), as much as the whole request costs S3 for a small object. This GET
keeps what matters from botocore and drops the rest:

* signing: ``signing.Signer`` (botocore's ``S3SigV4Auth``), shared with ``loop_get``;
* transport: ``http_session``'s ``URLLib3Session``, made as the boto3 client's is (TLS
  verification and CA bundle, proxies, timeouts, pool size, keep-alive as configured),
  so its exceptions are botocore's;
* errors: a non-200 answer becomes a botocore ``ClientError`` (code and message from
  S3's XML error document), so ``errors.map_error`` maps it like any boto3 failure;
* retries: ``app.retries.retried`` with ``errors.standard_retries`` (botocore's
  "standard" mode) up to ``EC_S3_MAX_ATTEMPTS``.

Path-style addressing only (``client.ADDRESSING_STYLE``). The body is a urllib3 response
read exactly as botocore's ``StreamingBody`` reads it, by one pool job per GET.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

from app.retries import retried
from app.tiers.s3.botocore_adapter import AWSRequest, URLLib3Session
from app.tiers.s3.errors import ERROR_BODY_BYTES, client_error, standard_retries
from app.tiers.s3.objects import ByteSpan
from app.tiers.s3.signing import Signer

log = logging.getLogger(__name__)

#: The first chunk of a GET body: small, so the safetensors header (and with it a
#: read-through's answer) is known after one round trip. Chunks then grow x8 up to
#: ``EC_S3_GET_CHUNK_SIZE``.
FIRST_READ_BYTES = 64 * 1024
#: Chunks a download reads ahead of its consumer at most.
READ_AHEAD = 2
#: The answers whose body is the object's: whole (200) or the span asked for (206).
OK = (200, 206)


class SignedGet:
    """GETs signed by ``signer``, sent on ``http`` (a botocore ``URLLib3Session``), their
    bodies read on ``executor`` in chunks of up to ``chunk_size`` bytes."""

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
        self._executor = executor
        self._chunk_size = chunk_size

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


class ThreadedBody:
    """The body of a :class:`SignedGet`: one pool job reads it (``READ_AHEAD`` chunks
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
