"""Receiving a GET's body (sans-I/O): the header checked against the client and the
``X-EC-*`` headers, the data straight into its destination, the checksum verified."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx

from ._buffers import BufferPool, PooledBuffer, typed_view
from ._crc import Crc32c
from ._exceptions import IntegrityError, InvalidTensorError
from ._tensors import (
    TensorMeta,
    parse_header,
    parse_header_length,
    parse_shape,
    tensor_memoryview,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch

    from ._cuda import SectionCopy


class Receiver:
    """Receives one GET body (sans-I/O): the callers read the 8-byte prefix, then the
    header, then fill :meth:`plan`'s target, then call :meth:`finish`.

    The data goes straight into the destination when that is a contiguous CPU tensor
    (``out``, or a new one on memory from the ``results`` pool, which gets it back once
    the caller drops the tensor); otherwise into a pooled staging buffer (pinned when
    CUDA is available) followed by one copy to the device / into ``out``; to a
    contiguous CUDA destination that copy goes in sections queued as the body arrives
    (:meth:`landed`). The returned tensor never aliases a staging buffer.
    """

    def __init__(
        self,
        *,
        dtype: str,
        resp: httpx.Response,
        url: str,
        device: torch.device | str | None,
        out: torch.Tensor | None,
        pool: BufferPool,
        results: BufferPool,
        verify: bool,
        max_bytes: int,
    ) -> None:
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.url = url
        self.headers = resp.headers
        length = resp.headers.get("content-length")
        self.total = int(length) if length is not None and length.isdigit() else None
        self.out = out
        import torch  # a tensor is coming

        if device is None:
            self.device = out.device if out is not None else torch.device("cpu")
        else:
            self.device = torch.device(device)
        self.pool = pool
        self.results = results
        self.verify = verify
        self.crc = Crc32c()
        self.meta: TensorMeta | None = None
        self._result: torch.Tensor | None = None
        self._lease: PooledBuffer | None = None
        self._sections: SectionCopy | None = None
        self.received = 0

    def header_length(self, prefix: bytes) -> int:
        return parse_header_length(prefix, self.total)

    def plan(self, header: bytes) -> memoryview:
        """Check the header against the client and the ``X-EC-*`` headers, and return
        the memory the tensor data must be received into."""
        meta = parse_header(header, total=self.total)
        if meta.total > self.max_bytes:
            raise IntegrityError(
                f"{self.url}: entry of {meta.total} bytes is larger than "
                f"Limits.max_body_bytes ({self.max_bytes})"
            )
        self.meta = meta
        h = self.headers
        if meta.dtype != self.dtype:
            raise IntegrityError(f"{self.url}: body holds {meta.dtype}, client wants {self.dtype}")
        wire_dtype = h.get("x-ec-dtype")
        if wire_dtype is not None and wire_dtype != meta.dtype:
            raise IntegrityError(f"X-EC-Dtype {wire_dtype} but body holds {meta.dtype}")
        wire_shape = h.get("x-ec-shape")
        if wire_shape is not None:
            try:
                shape = parse_shape(wire_shape)
            except ValueError:
                raise IntegrityError(f"bad X-EC-Shape {wire_shape!r}") from None
            if shape != meta.shape:
                raise IntegrityError(f"X-EC-Shape {wire_shape} but body holds {list(meta.shape)}")
        offset = h.get("x-ec-data-offset")
        if offset is not None and offset != str(meta.data_offset):
            raise IntegrityError(f"X-EC-Data-Offset {offset} but data starts at {meta.data_offset}")

        dtype = torch_dtype(meta.dtype)
        out = self.out
        if out is not None:
            if out.dtype != dtype or tuple(out.shape) != meta.shape:
                raise InvalidTensorError(
                    f"out= is {out.dtype}{list(out.shape)}, entry is {dtype}{list(meta.shape)}"
                )
            if out.device.type == "cpu" and out.is_contiguous():
                self._result = out
                return tensor_memoryview(out)
        elif self.device.type == "cpu":
            self._result = self.results.tensor(meta.shape, dtype)
            return tensor_memoryview(self._result)
        self._lease = self.pool.acquire(meta.nbytes)
        if self._lease.tensor.is_pinned():
            dst = out
            if dst is None and self.device.type == "cuda":
                import torch

                dst = torch.empty(meta.shape, dtype=dtype, device=self.device)
            if dst is not None and dst.device.type == "cuda" and dst.is_contiguous():
                from ._cuda import SectionCopy

                self._sections = SectionCopy(self._lease, dst, meta.nbytes)
        return self._lease.view(meta.nbytes)

    def landed(self, filled: int) -> None:
        """The first ``filled`` bytes of :meth:`plan`'s target have arrived."""
        if self._sections is not None:
            self._sections.landed(filled)

    def finish(self) -> torch.Tensor:
        meta = self.meta
        assert meta is not None
        if self.verify:
            expected = self.headers.get("x-ec-crc32c")
            if expected is None:
                raise IntegrityError(f"{self.url}: response carries no X-EC-CRC32C")
            if expected.lower() != self.crc.hexdigest():
                raise IntegrityError(
                    f"{self.url}: CRC32C of the body is {self.crc.hexdigest()}, "
                    f"X-EC-CRC32C says {expected}"
                )
        if self._result is not None:
            return self._result
        if self._sections is not None:
            try:
                return self._sections.finish()
            finally:
                self.release()
        lease = self._lease
        assert lease is not None
        staged = typed_view(lease.tensor, meta.nbytes, torch_dtype(meta.dtype), meta.shape)
        try:
            if self.out is not None and self.out.device.type == "cpu":
                self.out.copy_(staged)
                return self.out
            from ._cuda import copy_to_device

            return copy_to_device(
                staged, lease, self.out.device if self.out is not None else self.device, self.out
            )
        finally:
            self.release()

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            if self._sections is not None:
                self._sections.fence()
            lease.release()


def check_body_end(extra: int) -> None:
    if extra:
        raise IntegrityError("body is longer than its safetensors header describes")
