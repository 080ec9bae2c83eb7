"""A tiny raw-socket HTTP/1.1 server for fault injection (corrupted bodies, wrong
headers, 502/503, truncated bodies, silent connection drops)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import google_crc32c


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Reply:
    raw: bytes
    close: bool = False  # close the connection after sending (without saying so)


Handler = Callable[[Request], Reply]


def entry_reply(
    body: bytes,
    *,
    dtype: str,
    shape: str,
    crc: str | None = None,
    extra: str = "",
    truncate: int = 0,
) -> Reply:
    crc = crc if crc is not None else f"{google_crc32c.value(body):08x}"
    head = (
        f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n"
        f"Content-Type: application/octet-stream\r\nX-EC-CRC32C: {crc}\r\n"
        f"X-EC-Dtype: {dtype}\r\nX-EC-Shape: {shape}\r\n{extra}\r\n"
    ).encode()
    if truncate:
        return Reply(head + body[:-truncate], close=True)
    return Reply(head + body)


def json_reply(status: int, payload: str, extra: str = "") -> Reply:
    data = payload.encode()
    return Reply(
        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n{extra}\r\n".encode()
        + data
    )


@dataclass
class FakeServer:
    handler: Handler
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.closed = 0  # connections this server has closed (each after its last answer)
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn: socket.socket) -> None:
        try:
            self._answer(conn)
        finally:
            conn.close()
            self.closed += 1

    def _answer(self, conn: socket.socket) -> None:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
            length = int(headers.get("content-length", "0"))
            while len(buf) < length:
                data = conn.recv(1 << 20)
                if not data:
                    return
                buf += data
            body, buf = buf[:length], buf[length:]
            request = Request(method, path, headers, body)
            self.requests.append(request)
            reply = self.handler(request)
            try:
                conn.sendall(reply.raw)
            except OSError:
                return
            if reply.close:
                return

    def close(self) -> None:
        self._stop = True
        self.sock.close()
