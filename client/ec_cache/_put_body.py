"""A PUT's body: the safetensors header, then the tensor's own memory (no copy for a
contiguous CPU tensor)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import httpx

from ._buffers import BufferPool, PooledBuffer
from ._crc import Crc32c
from ._tensors import build_header, check_tensor, tensor_memoryview

if TYPE_CHECKING:
    import torch

    from ._client_base import Progress


def split_chunks(data: memoryview | bytes, size: int = 8 << 20) -> list[memoryview | bytes]:
    """``data`` in slices of at most ``size`` bytes (no copies)."""
    if len(data) <= size:
        return [data]
    mv = memoryview(data)
    return [mv[i : i + size] for i in range(0, len(mv), size)]


class PutBody(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A PUT body: the safetensors header, then the tensor's own bytes (8 MiB slices of
    one ``memoryview``, so each socket write is bounded and progress can be shown).
    Re-iterable, so a retried PUT sends the same memory again."""

    def __init__(
        self,
        header: bytes,
        data: memoryview,
        *,
        keepalive: object,
        lease: PooledBuffer | None,
    ) -> None:
        self.header = header
        self.data = data
        self.length = len(header) + len(data)
        crc = Crc32c()
        crc.update(header)
        crc.update(data)
        self.crc32c = crc.hexdigest()
        self.progress: Progress | None = None
        self._keepalive = keepalive
        self._lease = lease

    def _chunks(self) -> list[bytes | memoryview]:
        return [self.header, *split_chunks(self.data)]

    def __iter__(self) -> Iterator[bytes]:
        done = 0
        for chunk in self._chunks():
            yield chunk  # type: ignore[misc]  # memoryviews: bytes-like, sent as they are
            done += len(chunk)
            if self.progress is not None:
                self.progress(done, self.length)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.__iter__():
            yield chunk

    def headers(self) -> dict[str, str]:
        return {
            "Content-Length": str(self.length),
            "Content-Type": "application/octet-stream",
            "X-EC-CRC32C": self.crc32c,
        }

    def release(self) -> None:
        lease, self._lease = self._lease, None
        self._keepalive = None
        if lease is not None:
            lease.release()


def encode_put(tensor: torch.Tensor, dtype: str, pool: BufferPool) -> PutBody:
    """The PUT body for ``tensor``: no copy for a contiguous CPU tensor, one
    ``.contiguous()`` for a strided one, one staging copy for a device tensor."""
    tensor = check_tensor(tensor, dtype)
    header = build_header(dtype, tuple(tensor.shape))
    if tensor.device.type == "cpu":
        contiguous = tensor if tensor.is_contiguous() else tensor.contiguous()
        return PutBody(header, tensor_memoryview(contiguous), keepalive=contiguous, lease=None)
    from ._cuda import stage_to_host

    lease = stage_to_host(tensor, pool)
    nbytes = tensor.numel() * tensor.element_size()
    return PutBody(header, lease.view(nbytes), keepalive=None, lease=lease)
