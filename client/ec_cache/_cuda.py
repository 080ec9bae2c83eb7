"""Host<->device copies. Everything CUDA-specific lives here.

Only these two functions touch a GPU; they can only be exercised on a machine with
one (the CPU test-suite covers the staging logic with ``device="cpu"`` buffers).

* :func:`stage_to_host` - PUT of a device tensor: one asynchronous copy into a pinned
  pooled buffer, then wait for it, so that the socket sends from host memory.
* :func:`copy_to_device` - GET to a device: the body was received into a pinned pooled
  buffer; enqueue one ``non_blocking`` copy on the current stream of the target device
  and record an event on the buffer, so that the pool waits for the copy before the
  buffer is reused. Work queued later on the same stream sees the data; other streams
  must wait on that stream (``torch.cuda.current_stream(device)``) as usual.
"""

from __future__ import annotations

import torch

from ._buffers import BufferPool, PooledBuffer

__all__ = ["copy_to_device", "stage_to_host"]


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
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            buf.event = event
    else:
        out.copy_(staged)
    return out
