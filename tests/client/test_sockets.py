"""The SDK's asyncio socket under a timeout: a receive whose deadline passes in the loop
iteration that made the socket readable raises ``TimeoutError`` and leaves every byte
on the socket (a caller that goes on after the timeout, as the wait for
``100 Continue`` does, must still find the server's answer)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest
import uvloop
from ec_cache._backends import AsyncSocket

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_bytes_that_land_as_the_deadline_passes_are_never_lost(loop: str) -> None:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)

    async def receive() -> bytes:
        sock = AsyncSocket(ours)
        buf = memoryview(bytearray(64))

        def busy() -> None:  # the answer lands, then the deadline passes, loop blocked
            theirs.send(b"answer")
            time.sleep(0.3)

        asyncio.get_running_loop().call_later(0.05, busy)
        try:
            n = await sock.recv_into(buf, 0.1)
        except TimeoutError:
            n = await sock.recv_into(buf, 1.0)
        return bytes(buf[:n])

    try:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            assert runner.run(receive()) == b"answer"
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_receive_times_out_and_then_receives(loop: str) -> None:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)

    async def receive() -> tuple[float, bytes]:
        sock = AsyncSocket(ours)
        buf = memoryview(bytearray(64))
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await sock.recv_into(buf, 0.05)
        waited = time.monotonic() - started
        asyncio.get_running_loop().call_later(0.01, theirs.send, b"late")
        n = await sock.recv_into(buf, 5.0)
        return waited, bytes(buf[:n])

    try:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            waited, got = runner.run(receive())
        assert waited >= 0.045 and got == b"late"  # not before its deadline
    finally:
        ours.close()
        theirs.close()
