"""Free TCP ports on the loopback interface, for the servers the tests and benchmarks start.

A port is picked, its socket closed, and the server binds it later: SeaweedFS binds its
ten a second or more after it starts. Ports the kernel hands out (``bind(0)``) come from
its ephemeral range, the one every outgoing connection on the machine takes its source
port from, so on a busy machine a client connection could take one in between (it did:
"bind: address already in use"). Ports are therefore picked below that range, at random
so concurrent runs rarely pick alike, each checked free by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: The lowest port picked; the range below the ephemeral one starts no lower.
LOWEST = 10_000


def _below_ephemeral() -> range | None:
    """The ports between LOWEST and the kernel's ephemeral range (None: unknown, or too
    few to pick from)."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    ports = range(LOWEST, ephemeral_low)
    return ports if len(ports) >= 1_000 else None


def _bound(port: int) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (their sockets held together while picked,
    so no two are the same), below the ephemeral range where the kernel says what it is."""
    socks: list[socket.socket] = []
    try:
        candidates = _below_ephemeral()
        if candidates is not None:
            for port in random.sample(candidates, min(len(candidates), 50 * count)):
                if (sock := _bound(port)) is not None:
                    socks.append(sock)
                    if len(socks) == count:
                        break
        while len(socks) < count:  # no such range: the kernel's pick
            if (sock := _bound(0)) is not None:
                socks.append(sock)
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    """One free loopback port."""
    (port,) = free_ports(1)
    return port
