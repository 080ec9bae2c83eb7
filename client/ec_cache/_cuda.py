"""Host<->device copies, and the calling thread's CUDA state for worker threads.
Everything CUDA-specific lives here.

Only these functions touch a GPU; they can only be exercised on a machine with one
(the CPU test-suite covers the staging logic with ``device="cpu"`` buffers, and
``bench/gpu.py`` checks the streams on a GPU).

* :func:`stage_to_host` - PUT of a device tensor: one asynchronous copy into a pinned
  pooled buffer, then wait for it, so that the socket sends from host memory.
* :func:`copy_to_device` - GET to a device: the body was received into a pinned pooled
  buffer; enqueue one ``non_blocking`` copy on the current stream of the target device
  and record an event on the buffer, so that the pool waits for the copy before the
  buffer is reused. Work queued later on the same stream sees the data; other streams
  must wait on that stream (``torch.cuda.current_stream(device)``) as usual.
* :class:`SectionCopy` - the same for a contiguous CUDA destination, but in sections
  queued while the body is still arriving, so that the copy overlaps the receive
  instead of following it.
* :func:`caller_context` - the calling thread's current device and streams, to enter
  in the worker threads of ``Client.get_many``/``put_many``: a thread starts on device
  0's default stream, so without it their copies would not be ordered with the
  caller's work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ._buffers import BufferPool, PooledBuffer

__all__ = ["SectionCopy", "caller_context", "copy_to_device", "stage_to_host"]


def stage_to_host(tensor: torch.Tensor, pool: BufferPool) -> PooledBuffer:
    """Copy a (possibly non-contiguous) device tensor's bytes into a pooled buffer.

    Returns the leased buffer holding ``tensor.nbytes`` bytes; the caller releases it.
    """
    nbytes = tensor.numel() * tensor.element_size()
    buf = pool.acquire(nbytes)
    try:
        if nbytes:
            src = tensor.contiguous().reshape(-1).view(torch.uint8)
            dst = buf.tensor[:nbytes]
            if tensor.device.type == "cuda":
                with torch.cuda.device(tensor.device):
                    dst.copy_(src, non_blocking=buf.tensor.is_pinned())
                    torch.cuda.current_stream(tensor.device).synchronize()
            else:  # other accelerators: a plain blocking copy
                dst.copy_(src)
    except BaseException:
        buf.release()
        raise
    return buf


def copy_to_device(
    staged: torch.Tensor,
    buf: PooledBuffer,
    device: torch.device,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy ``staged`` (a typed view into ``buf``) to ``device`` (or into ``out``).

    The returned tensor owns its memory; ``buf`` may be released right after this
    returns (the pool waits for the recorded event before reusing it).
    """
    if out is None:
        out = torch.empty(staged.shape, dtype=staged.dtype, device=device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            out.copy_(staged, non_blocking=buf.tensor.is_pinned())
            _fence(buf, device)
    else:
        out.copy_(staged)
    return out


class SectionCopy:
    """Copies a body received into a pinned pooled buffer to ``dst`` (a contiguous CUDA
    tensor) section by section as the bytes land, on the current stream of ``dst``'s
    device (the calling thread's, as :func:`copy_to_device`)."""

    #: Bytes per queued copy (~0.1 ms of host-to-device time): each launch costs the
    #: receiving thread ~10 us, so a few per entry, and the last one is short.
    SECTION = 2 << 20

    def __init__(self, buf: PooledBuffer, dst: torch.Tensor, nbytes: int) -> None:
        self.buf = buf
        self.dst = dst
        self._src = buf.tensor
        self._dst = dst.reshape(-1).view(torch.uint8)
        self.nbytes = nbytes
        self.copied = 0

    def landed(self, filled: int) -> None:
        """The first ``filled`` bytes are in the buffer: queue the complete sections."""
        if filled - self.copied >= self.SECTION:
            self._copy(filled)

    def finish(self) -> torch.Tensor:
        """Queue the rest; the buffer may be released once this returns."""
        self._copy(self.nbytes)
        self.fence()
        return self.dst

    def fence(self) -> None:
        """Make the pool wait for the copies queued so far before reusing the buffer."""
        if self.copied and self.buf.event is None:
            _fence(self.buf, self.dst.device)

    def _copy(self, end: int) -> None:
        # copy_ queues a host-to-device copy on the current stream of dst's device.
        start, self.copied = self.copied, end
        if end > start:
            self._dst[start:end].copy_(self._src[start:end], non_blocking=True)


def _fence(buf: PooledBuffer, device: torch.device) -> None:
    """Record on ``buf`` an event after the copies queued so far on ``device``'s current
    stream: the pool waits for it before reusing the buffer."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    buf.event = event


def caller_context() -> Callable[[], contextlib.AbstractContextManager[None]] | None:
    """A context that makes the calling thread's current CUDA device and non-default
    current streams current in another thread; None when this process has not
    initialised CUDA (then every thread is on the defaults already)."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    device = torch.cuda.current_device()
    streams = []
    for index in range(torch.cuda.device_count()):
        stream = torch.cuda.current_stream(index)
        if stream != torch.cuda.default_stream(index):
            streams.append(stream)

    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for stream in streams:
                stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(torch.cuda.device(device))
            yield

    return entered
