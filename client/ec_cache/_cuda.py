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
* :class:`SideStreamStager` - the vLLM connector's uploads: a device-to-host copy on a
  side stream into pinned memory, waited for by the upload thread, not the forward
  pass.
* :func:`wait_for_default_stream` - the vLLM connector's loads: the forward pass's
  stream waits for the copies queued on the default stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ._buffers import BufferPool, PooledBuffer

__all__ = [
    "SectionCopy",
    "SideStreamStager",
    "caller_context",
    "copy_to_device",
    "stage_to_host",
    "wait_for_default_stream",
]


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


def wait_for_default_stream(device: torch.device) -> None:
    """Make ``device``'s current stream wait for its default stream: the connector's
    loads enqueue their host-to-device copies on the current stream of the loading
    thread (the default stream), and vLLM's forward pass, on its own stream, must not
    read the tensors before them."""
    current = torch.cuda.current_stream(device)
    default = torch.cuda.default_stream(device)
    if current != default:
        current.wait_stream(default)


class SideStreamStager:
    """Device-to-host copies for uploads that do not block the forward pass (the
    connector's ``save_caches``).

    The copy is queued on a side stream after the work already queued on the
    forward stream (so it reads the finished encoder output) into a pinned buffer
    from torch's caching host allocator; the tensor is marked as used by the side
    stream so that its memory is not reused before the copy ran. The upload thread
    waits for the returned event, not the forward thread.
    """

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def stage(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """A pinned host tensor that will hold ``tensor``'s data, and the call that
        waits until it does."""
        device = tensor.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        side = self._streams.get(index)
        if side is None:
            side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            self._streams[index] = side
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(side)
        tensor.record_stream(side)
        return host, event.synchronize
