"""A raw-socket HTTP/1.1 server that answers with whatever bytes a test scripts, sent
in whatever pieces and at whatever pace it scripts: framing oddities, early closes,
slow drips, bytes after the body."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from ec_cache._tensors import build_header, tensor_memoryview

Step = bytes | float
"""A piece to send, or seconds to sleep before the next one."""
Script = Callable[[bytes], Iterable[Step]]
"""``script(request_head)`` -> the steps of the answer on that connection."""

T = torch.arange(64, dtype=torch.float32).reshape(8, 8)


def body_of(t: torch.Tensor, dtype: str = "float32") -> bytes:
    return build_header(dtype, tuple(t.shape)) + bytes(tensor_memoryview(t.contiguous()))


BODY = body_of(T)


def crc_of(body: bytes) -> str:
    # Imported here: tests/vllm's environment has the SDK's CRC32C, not this one.
    import google_crc32c

    return f"{google_crc32c.value(body):08x}"


def entry_head(
    body: bytes = BODY,
    *,
    framing: str | None = None,
    shape: str = "8,8",
    dtype: str = "float32",
    status: str = "200 OK",
    version: str = "HTTP/1.1",
    extra: str = "",
) -> bytes:
    """Status line and headers of an entry answer; ``framing`` replaces the
    ``Content-Length`` line (e.g. ``"Transfer-Encoding: chunked"`` or ``""``)."""
    if framing is None:
        framing = f"Content-Length: {len(body)}"
    lines = [
        f"{version} {status}",
        *([framing] if framing else []),
        "Content-Type: application/octet-stream",
        f"X-EC-CRC32C: {crc_of(body)}",
        f"X-EC-Dtype: {dtype}",
        f"X-EC-Shape: {shape}",
        *([extra] if extra else []),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(body: bytes, sizes: Iterable[int], *, trailers: bytes = b"") -> bytes:
    """``body`` in chunks of ``sizes`` (the rest in one more chunk), then the last
    chunk and ``trailers``."""
    out, pos = [], 0
    for size in sizes:
        if pos >= len(body):
            break
        piece = body[pos : pos + size]
        out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        pos += len(piece)
    if pos < len(body):
        out.append(b"%x\r\n%s\r\n" % (len(body) - pos, body[pos:]))
    return b"".join(out) + b"0\r\n" + trailers + b"\r\n"


def zero_elements_body(dims: list[int], dtype_code: str = "F32") -> bytes:
    """A body whose header describes ``dims`` (with a zero among them: no data)."""
    import json

    text = json.dumps(
        {"tensor": {"dtype": dtype_code, "shape": dims, "data_offsets": [0, 0]}},
        separators=(",", ":"),
    ).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


@dataclass
class HostileServer:
    """Answers every request on every connection with ``script(request_head)``; the
    connection is closed after a script whose last step is ``b""``."""

    script: Script
    requests: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.closed_connections = 0
        self._closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._conn_counted, args=(conn,), daemon=True).start()

    def _conn_counted(self, conn: socket.socket) -> None:
        try:
            self._conn(conn)
        finally:
            self.closed_connections += 1  # the client hung up, or the script ended

    def _conn(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            conn.settimeout(30)
            while not self._closed.is_set():
                try:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buf += data
                except OSError:
                    return
                head, buf = buf.split(b"\r\n\r\n", 1)
                self.requests.append(head)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                expect = b"100-continue" in head.lower()
                steps = list(self.script(head))
                try:
                    if not expect:  # read the request body first
                        while len(buf) < length:
                            data = conn.recv(1 << 20)
                            if not data:
                                return
                            buf += data
                        buf = buf[length:]
                    for step in steps:
                        if isinstance(step, float):
                            time.sleep(step)
                        elif step == b"":
                            return
                        else:
                            conn.sendall(step)
                except OSError:
                    return

    def close(self) -> None:
        self._closed.set()
        self.sock.close()
