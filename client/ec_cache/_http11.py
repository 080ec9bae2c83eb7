"""Sans-I/O pieces of the HTTP/1.1 client used by both transports.

Only what ec-cache needs: requests with a known ``Content-Length`` body, responses
framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or connection close,
interim ``1xx`` answers skipped, keep-alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

MAX_HEAD_BYTES = 64 * 1024
CONN_BUFFER_BYTES = 64 * 1024
RECV_CHUNK = 256 * 1024
"""Largest single receive: small enough that the CRC of the chunk just received runs
from the CPU cache, large enough that syscalls are few."""
SEND_COALESCE = 64 * 1024
"""Body chunks below this are sent in one write with the request head."""


def request_head(request: httpx.Request) -> bytes:
    """Request line and headers, ready to send."""
    target = request.url.raw_path or b"/"
    lines = [request.method.encode("ascii") + b" " + target + b" HTTP/1.1"]
    lines.extend(name + b": " + value for name, value in request.headers.raw)
    return b"\r\n".join(lines) + b"\r\n\r\n"


@dataclass(slots=True)
class ResponseHead:
    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool
    content_length: int | None
    chunked: bool


def parse_response_head(data: bytes, request: httpx.Request) -> ResponseHead:
    """Parse ``data`` (status line to the blank line, inclusive)."""
    lines = data[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}", request=request)
    version, status = parts[0], int(parts[1])
    reason = parts[2] if len(parts) > 2 else b""
    headers: list[tuple[bytes, bytes]] = []
    content_length: int | None = None
    chunked = False
    connection = b""
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise httpx.RemoteProtocolError(f"bad header line {line[:80]!r}", request=request)
        value = value.strip()
        headers.append((name, value))
        lname = name.lower()
        if lname == b"content-length":
            if not value.isdigit():
                raise httpx.RemoteProtocolError("bad Content-Length", request=request)
            if content_length is not None and content_length != int(value):
                raise httpx.RemoteProtocolError("conflicting Content-Length", request=request)
            content_length = int(value)
        elif lname == b"transfer-encoding":
            chunked = value.lower().endswith(b"chunked")
        elif lname == b"connection":
            connection = value.lower()
    keep_alive = version == b"HTTP/1.1" and b"close" not in connection
    if chunked:
        content_length = None
    if request.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        content_length, chunked = 0, False
    elif content_length is None and not chunked:
        keep_alive = False  # body runs until the server closes the connection
    return ResponseHead(status, reason, headers, keep_alive, content_length, chunked)


def parse_chunk_size(line: bytes, request: httpx.Request) -> int:
    size = line.split(b";", 1)[0].strip()
    try:
        return int(size, 16)
    except ValueError:
        raise httpx.RemoteProtocolError(f"bad chunk size {line[:40]!r}", request=request) from None


class ConnBuffer:
    """Read-ahead buffer of one connection (I/O done by the subclasses)."""

    def __init__(self) -> None:
        self.buf = bytearray(CONN_BUFFER_BYTES)
        self.start = 0
        self.end = 0
        self.received_any = False

    def _prepare_fill(self) -> memoryview:
        """Room at the end of the buffer for the next receive (compacts if needed)."""
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            if self.start == 0:
                raise ValueError("line or head larger than the connection buffer")
            size = self.end - self.start
            self.buf[:size] = self.buf[self.start : self.end]
            self.start, self.end = 0, size
        return memoryview(self.buf)[self.end :]

    def _take(self, mv: memoryview) -> int:
        """Copy buffered bytes into ``mv``; 0 when the buffer is empty."""
        size = min(len(mv), self.end - self.start)
        if size:
            mv[:size] = self.buf[self.start : self.start + size]
            self.start += size
        return size

    def _find(self, needle: bytes, since: int) -> int:
        """Index of ``needle`` in the buffered bytes; only a match ending after
        ``since`` (absolute index) is looked for."""
        return self.buf.find(needle, max(self.start, since - len(needle) + 1), self.end)

    @property
    def pending(self) -> int:
        return self.end - self.start


def split_chunks(data: memoryview | bytes, size: int = 8 << 20) -> list[memoryview | bytes]:
    if len(data) <= size:
        return [data]
    mv = memoryview(data)
    return [mv[i : i + size] for i in range(0, len(mv), size)]
