"""Pools of reusable host memory: staging buffers, and the memory of returned tensors.

Freshly allocated memory is slow to touch for the first time (every 4 KiB page faults,
and with several threads the faults and the allocator's returns to the kernel contend
for the process's address space: 16 threads each receiving 4.7 MB into fresh tensors
spent 5-9 ms of system time per GET, 1.0-2.2 with reused memory). So memory is kept
and reused:

* staging buffers, page-locked (pinned) when CUDA is available so that host<->device
  copies can run asynchronously (``non_blocking=True``) at full PCIe speed;
* the memory of the CPU tensors a GET returns (:meth:`BufferPool.tensor`): it goes back
  to the pool when the caller has dropped the tensor and every view of it.

A buffer leased for an asynchronous device copy carries a CUDA event; the pool waits
on that event before the buffer is handed out again, so a returned GPU tensor never
races with the next request that reuses the memory.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ._tensors import tensor_memoryview

if TYPE_CHECKING:
    import torch

__all__ = ["BufferPool", "PooledBuffer", "typed_view"]

_MIN_CAPACITY = 1 << 20


def _capacity_for(nbytes: int, steps: int, minimum: int = _MIN_CAPACITY) -> int:
    """Size class: ``nbytes`` rounded up to one of ``steps`` (a power of two) sizes
    between consecutive powers of two, at least ``minimum``. One step wastes up to half
    of a buffer and reuses it for any size up to it; 16 steps waste at most 1/16.

    >>> _capacity_for(4_718_592, 1), _capacity_for(4_718_592, 16), _capacity_for(10, 16)
    (8388608, 4718592, 1048576)
    """
    if nbytes <= minimum:
        return minimum
    top = 1 << (nbytes - 1).bit_length()
    step = max(1, top // (2 * steps))
    return -(-nbytes // step) * step


class PooledBuffer:
    """One leased buffer: ``tensor`` (``uint8``, ``capacity`` bytes, pinned when the pool
    is) and ``view(n)``, a writable ``memoryview`` of its first ``n`` bytes.

    Use as a context manager, or call :meth:`release` exactly once.
    """

    __slots__ = ("_pool", "_view", "capacity", "event", "tensor")

    def __init__(self, pool: BufferPool, tensor: torch.Tensor) -> None:
        self._pool: BufferPool | None = pool
        self.tensor = tensor
        self.capacity = tensor.numel()
        self._view = tensor_memoryview(tensor)
        self.event: Any = None  # a torch.cuda.Event recorded after an async copy

    def view(self, nbytes: int) -> memoryview:
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a {self.capacity}-byte buffer")
        return self._view[:nbytes]

    def wait(self) -> None:
        """Block until the device copy recorded in ``event`` (if any) is done."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self)

    def __enter__(self) -> PooledBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class BufferPool:
    """Thread-safe pool of host buffers, bounded by ``max_bytes`` kept idle; ``steps``
    size classes per power of two, none below ``min_capacity`` (see
    :func:`_capacity_for`). A request reuses an idle buffer of its class, else the
    smallest idle one up to twice as large.

    >>> pool = BufferPool(max_bytes=8 << 20, pinned=False)
    >>> with pool.acquire(3_000_000) as buf:
    ...     buf.capacity, len(buf.view(10))
    (4194304, 10)
    >>> pool.acquire(4_000_000).capacity, pool.stats()["reused"]
    (4194304, 1)
    """

    def __init__(
        self,
        max_bytes: int = 512 << 20,
        *,
        pinned: bool | None = None,
        steps: int = 1,
        min_capacity: int = _MIN_CAPACITY,
    ) -> None:
        self.max_bytes = max_bytes
        self._pinned = pinned
        self._steps = steps
        self._min_capacity = min_capacity
        # Reentrant: a tensor's memory can come back from a garbage collection that
        # runs while this thread holds the lock.
        self._lock = threading.RLock()
        self._idle: dict[int, list[PooledBuffer]] = {}
        self._idle_bytes = 0
        self._leased_bytes = 0
        self._peak_bytes = 0  # most leased + idle at once
        self._allocated = 0
        self._reused = 0

    @property
    def pinned(self) -> bool:
        """Whether new buffers are page-locked (default: when CUDA is available)."""
        if self._pinned is None:
            import torch

            self._pinned = bool(torch.cuda.is_available())
        return self._pinned

    def capacity_for(self, nbytes: int) -> int:
        """The capacity of a new buffer for ``nbytes`` (a reused one may be larger)."""
        return _capacity_for(nbytes, self._steps, self._min_capacity)

    def acquire(self, nbytes: int) -> PooledBuffer:
        """Lease a buffer of at least ``nbytes`` (reused when one is idle)."""
        buf = self.reuse(nbytes)
        if buf is not None:
            return buf
        capacity = self.capacity_for(nbytes)
        with self._lock:
            self._leased_bytes += capacity
            self._peak_bytes = max(self._peak_bytes, self._leased_bytes + self._idle_bytes)
        try:
            import torch

            tensor = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pinned)
        except BaseException:
            with self._lock:
                self._leased_bytes -= capacity
            raise
        with self._lock:
            self._allocated += 1
        return PooledBuffer(self, tensor)

    def reuse(self, nbytes: int, *, up_to: float = 2.0) -> PooledBuffer | None:
        """Lease an idle buffer of at least ``nbytes`` (of its size class, else the
        smallest up to ``up_to`` times as large), or ``None``: none is idle."""
        capacity = self.capacity_for(nbytes)
        with self._lock:
            fits = [c for c in self._idle if capacity <= c <= up_to * capacity and self._idle[c]]
            if not fits:
                return None
            buf = self._idle[min(fits)].pop()
            self._idle_bytes -= buf.capacity
            self._leased_bytes += buf.capacity
            self._reused += 1
        buf._pool = self
        buf.wait()
        return buf

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` and ``dtype`` (contents undefined); from
        1 MiB on, on a pooled buffer, which comes back to the pool once nothing refers
        to the tensor, to a view of it or to its storage.

        ``torch.frombuffer`` keeps the buffer's exporter (a ctypes array made for this
        tensor alone) alive as long as the storage lives; a finalizer on that exporter
        returns the buffer.
        """
        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self._min_capacity:  # the allocator's heap reuses small blocks well
            return torch.empty(shape, dtype=dtype)
        buf = self.acquire(nbytes)
        exporter = (ctypes.c_ubyte * nbytes).from_address(buf.tensor.data_ptr())
        weakref.finalize(exporter, buf.release).atexit = False
        return torch.frombuffer(exporter, dtype=dtype).view(shape)

    def _give_back(self, buf: PooledBuffer) -> None:
        with self._lock:
            self._leased_bytes -= buf.capacity
            if self._idle_bytes + buf.capacity <= self.max_bytes:
                self._idle.setdefault(buf.capacity, []).append(buf)
                self._idle_bytes += buf.capacity
                return
        buf.wait()  # dropped: its memory is freed once the device copy is done

    def trim(self, max_idle_bytes: int = 0) -> None:
        """Drop idle buffers, the smallest first (a larger one serves more sizes), until
        at most ``max_idle_bytes`` stay."""
        dropped: list[PooledBuffer] = []
        with self._lock:
            for capacity in sorted(self._idle):
                bufs = self._idle[capacity]
                while bufs and self._idle_bytes > max_idle_bytes:
                    dropped.append(bufs.pop())
                    self._idle_bytes -= capacity
                if not bufs:
                    del self._idle[capacity]
        for buf in dropped:
            buf.wait()

    def clear(self) -> None:
        """Drop every idle buffer."""
        self.trim(0)

    def stats(self) -> dict[str, int]:
        """Bytes idle, leased and at most both at once (capacities), buffers idle,
        allocated and reused (leases served by an idle buffer)."""
        with self._lock:
            return {
                "idle_bytes": self._idle_bytes,
                "idle_buffers": sum(len(v) for v in self._idle.values()),
                "leased_bytes": self._leased_bytes,
                "peak_bytes": self._peak_bytes,
                "allocated": self._allocated,
                "reused": self._reused,
            }


def typed_view(
    raw: torch.Tensor, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """``raw[:nbytes]`` (uint8) seen as ``dtype`` of ``shape``, without copying."""
    if math.prod(shape) == 0:
        import torch

        return torch.empty(shape, dtype=dtype)
    return raw[:nbytes].view(dtype).view(shape)
