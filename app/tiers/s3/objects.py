"""What S3 says about an object, parsed: size, CRC32C, ETag and user metadata, from a
boto3 answer or from the raw headers of a GET, and the wire forms of the CRC32C.

An object's CRC32C is read from its ``x-amz-meta-ec-crc32c`` metadata (written with
every upload, see ``transfers``), else from S3's own whole-object checksum; a composite
multipart checksum (``...-N``) is no CRC32C of the body.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app import wire

METADATA_HEADER = "x-amz-meta-"
METADATA_CRC_KEY = "ec-crc32c"  # sent as x-amz-meta-ec-crc32c


def crc32c_to_b64(crc: int) -> str:
    """The wire form of an S3 CRC32C checksum: base64 of the 4 big-endian bytes."""
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def crc32c_from_b64(text: str) -> int | None:
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


@dataclass(frozen=True)
class ObjectInfo:
    """What HEAD (or the start of a GET) tells about an object."""

    key: str
    size: int
    crc32c: int | None
    etag: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ByteSpan:
    """Bytes ``start`` to ``end`` (exclusive) of an object: a ranged GET's ``Range``."""

    start: int
    end: int

    @property
    def header(self) -> str:
        return f"bytes={self.start}-{self.end - 1}"

    def __len__(self) -> int:
        return self.end - self.start


def _parse_crc(metadata: Mapping[str, str], checksum: str | None) -> int | None:
    text = metadata.get(METADATA_CRC_KEY)
    if text:
        with contextlib.suppress(ValueError):
            return wire.loose_hex32(text)
    if checksum and "-" not in checksum:  # "...-N" is a composite multipart checksum
        return crc32c_from_b64(checksum)
    return None


def info_from_headers(key: str, headers: Mapping[str, str]) -> ObjectInfo:
    """:func:`info_from_response` for the raw headers of a GET (``loop_get``,
    ``signed_http``)."""
    lowered = ((name.lower(), value) for name, value in headers.items())
    metadata = {
        name[len(METADATA_HEADER) :]: value
        for name, value in lowered
        if name.startswith(METADATA_HEADER)
    }
    return ObjectInfo(
        key=key,
        size=int(headers.get("content-length", 0)),
        crc32c=_parse_crc(metadata, headers.get("x-amz-checksum-crc32c")),
        etag=headers.get("etag"),
        metadata=metadata,
    )


def info_from_response(key: str, resp: Mapping[str, Any]) -> ObjectInfo:
    """The object described by a boto3 ``head_object`` answer."""
    metadata = {str(k).lower(): str(v) for k, v in (resp.get("Metadata") or {}).items()}
    checksum = resp.get("ChecksumCRC32C")
    return ObjectInfo(
        key=key,
        size=int(resp.get("ContentLength", 0)),
        crc32c=_parse_crc(metadata, str(checksum) if checksum else None),
        etag=str(resp["ETag"]) if resp.get("ETag") else None,
        metadata=metadata,
    )
