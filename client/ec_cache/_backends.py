"""The I/O primitives under the clients: sockets, a semaphore, sleeping, running many
calls at once. Each has an asyncio form (``Async*``) and a blocking form.

Everything above this module is written once, as asyncio code in
:mod:`ec_cache._async`, and :mod:`ec_cache._sync` is generated from it by
``scripts/unasync.py`` (which renames ``AsyncSocket`` to ``Socket``, drops ``await``,
...). These primitives are the only place where the two forms are written by hand,
because they are where asyncio and blocking I/O really differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import select
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = [
    "AsyncMapper",
    "AsyncSemaphore",
    "AsyncSocket",
    "Mapper",
    "Semaphore",
    "Socket",
    "async_sleep",
    "sleep",
]

X = TypeVar("X")
T = TypeVar("T")


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read (data, EOF or an error) right now."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- sockets -----------------------------------------------------------------------------
class Socket:
    """A connected TCP socket in non-blocking mode; every operation takes its own
    timeout (``None``: wait forever) and raises ``TimeoutError`` / ``OSError``.

    Not ``settimeout``: a socket with a timeout polls before every receive, even when
    the data is already there (a 4.7 MB body is ~20 receives). Here the receive is
    tried first and ``poll`` runs only when it would block.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock

    @classmethod
    def connect(cls, host: str, port: int, timeout: float | None) -> Socket:
        sock = socket.create_connection((host, port), timeout=timeout)
        _tune(sock)
        return cls(sock)

    def _wait(self, events: int, deadline: float | None) -> None:
        if deadline is None:
            wait_ms = None
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            wait_ms = math.ceil(left * 1000)
        poller = select.poll()
        poller.register(self.sock.fileno(), events | select.POLLERR | select.POLLHUP)
        if not poller.poll(wait_ms):
            raise TimeoutError("timed out")

    def sendall(self, data: bytes | memoryview, timeout: float | None) -> None:
        """Send all of ``data``; ``timeout`` bounds the whole call (as ``sendall``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        view = memoryview(data).cast("B")
        sent = 0
        while sent < len(view):
            try:
                sent += self.sock.send(view[sent:])
            except BlockingIOError:
                self._wait(select.POLLOUT, deadline)

    def recv_into(self, mv: memoryview, timeout: float | None) -> int:
        try:  # fast path: the data is already there, no poll
            return self.sock.recv_into(mv)
        except BlockingIOError:
            pass
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._wait(select.POLLIN, deadline)
            try:
                return self.sock.recv_into(mv)
            except BlockingIOError:
                continue

    def readable(self) -> bool:
        return _readable(self.sock)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class AsyncSocket:
    """A connected non-blocking TCP socket driven by the running asyncio loop: it
    waits for readability through the loop, then receives straight into caller memory."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    async def connect(cls, host: str, port: int, timeout: float | None) -> AsyncSocket:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            last: OSError | None = None
            for family, type_, proto, _, addr in infos:
                sock = socket.socket(family, type_, proto)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, addr)
                except OSError as exc:
                    sock.close()
                    last = exc
                    continue
                except BaseException:
                    sock.close()
                    raise
                _tune(sock)
                return cls(sock)
        raise last or OSError(f"no address for {host}:{port}")

    async def sendall(self, data: bytes | memoryview, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            await loop.sock_sendall(self.sock, data)

    async def recv_into(self, mv: memoryview, timeout: float | None) -> int:
        """Receive into ``mv``; ``TimeoutError`` after ``timeout`` seconds with nothing.

        Only the wait for readability is ever cancelled, never a receive: under a
        timeout, ``loop.sock_recv_into`` can take bytes off the socket and then raise
        (the timeout fires in the loop iteration that received them), and a caller
        that goes on after a timeout (the wait for ``100 Continue``) lost the answer."""
        try:  # fast path: the data is already there, no timer needed
            return self.sock.recv_into(mv)
        except BlockingIOError:
            pass
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        fd = self.sock.fileno()
        while True:
            ready = loop.create_future()
            loop.add_reader(fd, _set_ready, ready)
            try:
                async with asyncio.timeout_at(deadline):
                    await ready
            finally:
                loop.remove_reader(fd)
            try:
                return self.sock.recv_into(mv)
            except BlockingIOError:
                continue

    def readable(self) -> bool:
        return _readable(self.sock)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _set_ready(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


# -- a semaphore with a timeout ------------------------------------------------------
class Semaphore:
    def __init__(self, value: int) -> None:
        self._sem = threading.BoundedSemaphore(value)

    def acquire(self, timeout: float | None) -> bool:
        """``False`` when ``timeout`` seconds passed without a free slot."""
        return self._sem.acquire(timeout=timeout)

    def release(self) -> None:
        self._sem.release()


class AsyncSemaphore:
    def __init__(self, value: int) -> None:
        self._sem = asyncio.BoundedSemaphore(value)

    async def acquire(self, timeout: float | None) -> bool:
        if not self._sem.locked():
            await self._sem.acquire()  # does not wait
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._sem.acquire()
        except TimeoutError:
            return False
        return True

    def release(self) -> None:
        self._sem.release()


# -- sleeping ----------------------------------------------------------------------------
def sleep(seconds: float) -> None:
    time.sleep(seconds)


async def async_sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


# -- many calls at once --------------------------------------------------------------
def _caller_context() -> Callable[[], contextlib.AbstractContextManager[None]] | None:
    """:func:`ec_cache._cuda.caller_context`; ``None`` without importing torch when this
    process has not imported it (then it has no CUDA state to carry over)."""
    if "torch" not in sys.modules:
        return None
    from ._cuda import caller_context

    return caller_context()


class Mapper:
    """Runs ``fn`` over items, ``concurrency`` at a time, in worker threads created on
    first use, each under the calling thread's CUDA device and streams; one item runs
    in the calling thread."""

    def __init__(self, concurrency: int) -> None:
        self._concurrency = concurrency
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def map(self, fn: Callable[[X], T], items: Sequence[X]) -> list[T]:
        if len(items) <= 1:
            return [fn(item) for item in items]
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self._concurrency, thread_name_prefix="ec-cache"
                )
            executor = self._executor
        context = _caller_context()
        if context is None:
            return list(executor.map(fn, items))

        def in_context(item: X) -> T:
            with context():
                return fn(item)

        return list(executor.map(in_context, items))

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


class AsyncMapper:
    """Awaits ``fn`` over items, ``concurrency`` at a time, as tasks of the running
    loop; one item is awaited directly."""

    def __init__(self, concurrency: int) -> None:
        self._concurrency = concurrency

    async def map(self, fn: Callable[[X], Awaitable[T]], items: Sequence[X]) -> list[T]:
        if len(items) <= 1:
            return [await fn(item) for item in items]
        limit = asyncio.Semaphore(self._concurrency)

        async def one(item: X) -> T:
            async with limit:
                return await fn(item)

        return list(await asyncio.gather(*(one(item) for item in items)))

    async def aclose(self) -> None:
        return None
