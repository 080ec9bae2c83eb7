"""Raw HTTP/1.1 over a socket, for requests no polite client would send."""

from __future__ import annotations

import json
import select
import socket
from dataclasses import dataclass
from typing import Any


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def read_response(sock: socket.socket, *, no_body: bool = False) -> RawResponse:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed after {data!r}")
        data += chunk
    status_and_headers, _, rest = data.partition(b"\r\n\r\n")
    lines = status_and_headers.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = 0 if no_body else int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return RawResponse(status, headers, rest[:length])


def request(
    port: int,
    method: str,
    target: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    *,
    send_body: bool = True,
    timeout: float = 10.0,
) -> RawResponse:
    """Send one request exactly as given (target is not normalised or re-encoded)."""
    all_headers = {"Host": "127.0.0.1", "Content-Length": str(len(body)), **(headers or {})}
    head = f"{method} {target} HTTP/1.1\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in all_headers.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode("latin-1") + (body if send_body else b""))
        return read_response(sock, no_body=method == "HEAD")


def send_partial(port: int, target: str, declared: int, body: bytes) -> None:
    """Announce ``declared`` bytes, send ``body`` (fewer), then hang up."""
    head = (
        f"PUT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {declared}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)


def flood_headers(port: int, flood_bytes: int) -> tuple[int, RawResponse | None]:
    """Send a head of small headers until the server answers (or ``flood_bytes`` are
    sent): the bytes sent by then, and the answer (None if it hung up without one)."""
    line = b"X-Flood: " + b"a" * 48 + b"\r\n"
    chunk = line * (64 * 1024 // len(line))
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        while sent < flood_bytes:
            if select.select([sock], [], [], 0)[0]:
                break  # the answer (or the end) is in
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        try:
            return sent, read_response(sock)
        except ConnectionError:
            return sent, None
