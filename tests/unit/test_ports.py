"""testkit.ports picks ports no outgoing connection can take before a server binds them."""

from __future__ import annotations

import contextlib
import socket

import pytest

from testkit import ports
from testkit.ports import EPHEMERAL_RANGE, LOWEST, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = free_ports(10)
    assert len(set(ports)) == 10
    assert all(LOWEST <= port < ephemeral_low for port in ports), (ports, ephemeral_low)
    socks = []
    try:
        for port in ports:
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", port))
            sock.listen()
    finally:
        for sock in socks:
            sock.close()


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    window = range(LOWEST, LOWEST + 100)
    monkeypatch.setattr(ports, "_below_ephemeral", lambda: window)
    held: list[socket.socket] = []
    try:
        for port in window[5:]:
            sock = socket.socket()
            held.append(sock)
            with contextlib.suppress(OSError):  # somebody else's already: in use too
                sock.bind(("127.0.0.1", port))
        free = [port for port in window[:5] if bindable(port)]
        assert sorted(ports.free_ports(len(free))) == free
    finally:
        for sock in held:
            sock.close()


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
