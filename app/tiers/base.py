"""What every tier hands back to the store: an entry's description and its body."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

from app import checksum
from app.safetensors_format import TensorHeader


@dataclass(frozen=True)
class EntryInfo:
    """What ``HEAD`` shows: enough to describe an entry without its bytes."""

    size: int
    crc32c: int
    header: TensorHeader
    tier: str

    @property
    def etag(self) -> str:
        return checksum.etag(self.crc32c)

    def http_headers(self) -> dict[str, str]:
        return {
            "Content-Length": str(self.size),
            "Content-Type": "application/octet-stream",
            "ETag": self.etag,
            "X-EC-CRC32C": checksum.to_hex(self.crc32c),
            "X-EC-Dtype": self.header.dtype,
            "X-EC-Shape": self.header.shape_text,
            "X-EC-Data-Offset": str(self.header.data_offset),
            "X-EC-Tier": self.tier,
        }


@dataclass(frozen=True)
class EntryBody:
    """An entry ready to send: the whole body in one buffer, or a stream of chunks."""

    info: EntryInfo
    buffer: memoryview | None = None
    chunks: AsyncGenerator[bytes, None] | None = None

    async def aclose(self) -> None:
        """Release a stream that will not be (fully) sent."""
        if self.chunks is not None:
            await self.chunks.aclose()
