"""Free TCP ports on the loopback interface, for the servers the tests and benchmarks start."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (their sockets held together while picked,
    so no two are the same)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    """One free loopback port."""
    (port,) = free_ports(1)
    return port
