"""The read path's GET of a large object as concurrent ranged GETs, as the AWS CRT and
boto3's TransferManager read one, streamed in order.

S3 serves each connection at about 90 MB/s, so one GET of a 67 MB entry takes ~0.75 s
however fast the node's link is. :class:`RangedGet` asks for the object's first
``part_size`` bytes (``Range: bytes=0-...``); S3's answer says how large the object is
(``Content-Range``). An object of one part is then read as before, from that one
answer. A larger one is read as parts of ``part_size`` bytes, up to ``concurrency`` of
them at once, each on a connection of its own, every later one pinned to the first
answer's ETag (``If-Match``: an object replaced meanwhile fails the read rather than
mixing two bodies). :class:`PartedBody` hands the parts on in order, each chunk as it
arrives: the consumer gets the first bytes as soon as with one GET.

Memory: the parts in flight are the consumer's part and the ``concurrency - 1`` after
it; a part's bytes are held until the consumer took them, so a body holds at most
``concurrency * part_size`` bytes received out of order. A part starts once the
consumer moved past the one ``concurrency`` places before it; the first ones once the
consumer took the first bytes (their traffic must not delay the client's first byte).
Across all bodies, parts ahead of their consumer's reserve their size from one budget
(``EC_S3_GET_BUFFER_BYTES``) until consumed; when it is spent, a body reads its parts
one at a time (the consumer's own part always starts) until another returns some.

Failures: each part's GET is retried by its transport as any GET is
(``errors.standard_retries``); a part whose connection breaks mid-way is asked again
for its missing bytes, under the same policy; a part that still fails fails the body
(its read raises), and closing the body cancels every part's GET and drops its
connection.

Objects with no ``ec-crc32c`` metadata (written by other tools) are read with one plain
GET instead: only a whole-object answer carries S3's own checksum, which the read-through
needs to check the body against.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Mapping
from typing import Protocol

import botocore.exceptions as bce

from app.retries import RetryPolicy
from app.tiers.base import Chunk
from app.tiers.s3.download import ObjectBody
from app.tiers.s3.errors import client_error_info
from app.tiers.s3.objects import METADATA_CRC_KEY, METADATA_HEADER, ByteSpan


class SpanGet(Protocol):
    """A data plane layer's GET (``loop_get``, ``signed_http``, ``data_plane.Boto3Http``):
    open retried, body unread."""

    async def open(
        self, key: str, span: ByteSpan | None = None, if_match: str | None = None
    ) -> tuple[Mapping[str, str], ObjectBody]: ...


def content_range(headers: Mapping[str, str]) -> tuple[ByteSpan, int] | None:
    """The span a 206 answer holds and the object's size (None: a whole-object answer).
    Raises ``ConnectionError`` for a ``Content-Range`` that is not ``bytes a-b/n``."""
    value = headers.get("content-range")
    if value is None:
        return None
    try:
        unit, _, rest = value.partition(" ")
        span, _, total = rest.partition("/")
        first, _, last = span.partition("-")
        result = ByteSpan(int(first), int(last) + 1), int(total)
    except ValueError:
        result = None
    if unit != "bytes" or result is None or not 0 <= result[0].start < result[0].end:
        raise ConnectionError(f"S3 answered a malformed Content-Range: {value!r}")
    return result


class RangedGet:
    """GETs of ``transport`` read as parts of ``part_size`` bytes, ``concurrency`` at a
    time, parts ahead of their consumer within ``budget`` bytes in all; part failures
    mid-way retried as ``retries`` says. See the module docstring."""

    def __init__(
        self,
        transport: SpanGet,
        part_size: int,
        concurrency: int,
        retries: RetryPolicy,
        budget: int,
    ) -> None:
        self.transport = transport
        self._part_size = part_size
        self._concurrency = concurrency
        self._retries = retries
        #: Bytes that parts ahead of their consumer may still reserve, all bodies
        #: together (one event loop: no lock).
        self.budget = budget

    async def open(self, key: str) -> tuple[Mapping[str, str], ObjectBody]:
        """The headers of the whole object (its ``Content-Length``) and its body; raises
        what the transport's ``open`` raises."""
        try:
            headers, body = await self.transport.open(key, ByteSpan(0, self._part_size))
        except bce.ClientError as exc:
            if client_error_info(exc)[1] != 416:  # an empty object has no first byte
                raise
            return await self.transport.open(key)
        try:
            answered = content_range(headers)
        except BaseException:
            await body.aclose()
            raise
        if answered is None:  # the endpoint ignored the range: the whole object came
            return headers, body
        span, size = answered
        if METADATA_HEADER + METADATA_CRC_KEY not in headers:
            await body.aclose()
            return await self.transport.open(key)
        whole = {k.lower(): v for k, v in headers.items() if k.lower() != "content-range"}
        whole["content-length"] = str(size)
        if span.start != 0:
            await body.aclose()
            raise ConnectionError(f"S3 answered bytes {span.header} to a GET of bytes 0-")
        if span.end >= size:
            return whole, body
        return whole, PartedBody(self, key, headers.get("etag"), size, span, body)


class _Part:
    """The bytes ``span`` of the object: what arrived and was not taken yet."""

    def __init__(self, span: ByteSpan, reserved: int) -> None:
        self.span = span
        #: Bytes of the budget it holds until consumed.
        self.reserved = reserved
        self.arrived: deque[Chunk] = deque()
        #: Where the bytes still to come start.
        self.offset = span.start
        self.error: BaseException | None = None
        self.task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.offset >= self.span.end

    def add(self, chunk: Chunk) -> None:
        self.arrived.append(chunk)
        self.offset += len(chunk)
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._changed.set()

    async def changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()


class PartedBody:
    """The body of a :class:`RangedGet` read in parts, handed on in order (an
    ``ObjectBody``). ``first`` is the open answer to the GET of the first part."""

    def __init__(
        self,
        get: RangedGet,
        key: str,
        etag: str | None,
        size: int,
        first_span: ByteSpan,
        first: ObjectBody,
    ) -> None:
        self._get = get
        self._key = key
        self._etag = etag
        self._size = size
        self._next = first_span.end
        self._parts: deque[_Part] = deque()
        self._start(first_span, first, 0)
        #: The other parts start once the first bytes were handed on: their traffic
        #: must not delay the client's first byte.
        self._first_handed = False

    def _start(self, span: ByteSpan, body: ObjectBody | None, reserved: int) -> None:
        part = _Part(span, reserved)
        part.task = asyncio.create_task(self._fetch(part, body), name=f"S3 GET {span.header}")
        self._parts.append(part)

    def _top_up(self) -> None:
        """Start parts until ``concurrency`` are in flight or none is left; one ahead of
        the consumer's only while the budget has room for it."""
        get = self._get
        while len(self._parts) < get._concurrency and self._next < self._size:
            end = min(self._next + get._part_size, self._size)
            reserved = end - self._next if self._parts else 0
            if reserved > get.budget:
                return
            get.budget -= reserved
            self._start(ByteSpan(self._next, end), None, reserved)
            self._next = end

    def _release(self, part: _Part) -> None:
        self._get.budget += part.reserved
        part.reserved = 0

    async def read(self) -> Chunk:
        """The next chunk, in the object's order; ``b""`` at its end."""
        if self._first_handed:
            self._top_up()
        while self._parts:
            part = self._parts[0]
            if part.arrived:
                self._first_handed = True
                return part.arrived.popleft()
            if part.error is not None:
                raise part.error
            if part.done:
                self._release(self._parts.popleft())
                self._top_up()
                continue
            await part.changed()
        return b""

    async def _fetch(self, part: _Part, body: ObjectBody | None) -> None:
        """Read ``part`` into memory, asking again for what a broken connection lost."""
        breaks = 0
        try:
            while not part.done:
                if body is None:
                    try:
                        body = await self._open_rest(part)
                    except Exception as exc:  # the transport retried it already: final
                        part.fail(exc)
                        return
                try:
                    chunk = await body.read()
                    if not chunk:
                        raise ConnectionError(f"S3 ended {part.span.header} at byte {part.offset}")
                except Exception as exc:
                    breaks += 1
                    wait = self._get._retries(exc, breaks)
                    if wait is None:
                        part.fail(exc)
                        return
                    await _close(body)
                    body = None
                    await asyncio.sleep(wait)
                    continue
                part.add(chunk[: part.span.end - part.offset])
        finally:
            await _close(body)

    async def _open_rest(self, part: _Part) -> ObjectBody:
        rest = ByteSpan(part.offset, part.span.end)
        headers, body = await self._get.transport.open(self._key, rest, self._etag)
        try:
            answered = content_range(headers)
        except BaseException:
            await body.aclose()
            raise
        if answered is None or answered[0] != rest:
            await body.aclose()
            got = "the whole object" if answered is None else f"bytes {answered[0].header}"
            raise ConnectionError(f"S3 answered {got} to a GET of {rest.header}")
        return body

    async def aclose(self) -> None:
        """Stop every part's GET (their connections are dropped, not drained)."""
        parts, self._parts = list(self._parts), deque()
        self._next = self._size
        for part in parts:
            self._release(part)
        tasks = [part.task for part in parts if part.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


async def _close(body: ObjectBody | None) -> None:
    if body is not None:
        await body.aclose()
