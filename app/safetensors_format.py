"""Validation of single-tensor safetensors bodies, whole or while they stream in.

Format: 8-byte little-endian header length ``N``, ``N`` bytes of JSON, then the raw
data. ec-cache accepts exactly one tensor (plus optional string ``__metadata__``)
whose dtype is the key's and whose data fills the rest of the body exactly.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from app.checksum import crc32c, to_hex
from app.errors import BodyTooLarge, ChecksumMismatch, DtypeMismatch, InvalidBody
from app.keys import DTYPES

#: A one-tensor header is ~100 bytes; this leaves room for metadata, not for abuse.
MAX_HEADER_BYTES = 64 * 1024
PREFIX_BYTES = 8

_NAME_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


@dataclass(frozen=True)
class TensorHeader:
    dtype: str
    shape: tuple[int, ...]
    header_length: int

    @property
    def data_offset(self) -> int:
        return PREFIX_BYTES + self.header_length

    @property
    def data_length(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]

    @property
    def total_length(self) -> int:
        return self.data_offset + self.data_length

    @property
    def shape_text(self) -> str:
        return ",".join(str(dim) for dim in self.shape)


def read_header_length(prefix: bytes | bytearray | memoryview) -> int:
    (length,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if length < 2:
        raise InvalidBody(f"safetensors header length {length} is too small")
    if length > MAX_HEADER_BYTES:
        raise InvalidBody(
            f"safetensors header length {length} exceeds the {MAX_HEADER_BYTES}-byte limit"
        )
    return int(length)


def parse_header(raw: bytes | bytearray | memoryview, expected_dtype: str) -> TensorHeader:
    """Parse the JSON header (without the 8-byte prefix) of a single-tensor body."""
    try:
        header = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidBody(f"safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidBody("safetensors header must be a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise InvalidBody("safetensors __metadata__ must map strings to strings")
    if len(header) != 1:
        raise InvalidBody(f"body must hold exactly one tensor, found {len(header)}")
    ((name, info),) = header.items()
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise InvalidBody(f"tensor {name!r} needs exactly dtype, shape and data_offsets")

    code = info["dtype"]
    if code != DTYPES[expected_dtype][0]:
        found = _NAME_BY_CODE.get(code, code) if isinstance(code, str) else repr(code)
        raise DtypeMismatch(f"body holds {found} but the path says {expected_dtype}", part="dtype")
    shape = info["shape"]
    if not isinstance(shape, list) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape
    ):
        raise InvalidBody("tensor shape must be a list of non-negative integers")
    result = TensorHeader(expected_dtype, tuple(shape), len(raw))
    offsets = info["data_offsets"]
    if offsets != [0, result.data_length]:
        raise InvalidBody(
            f"data_offsets {offsets!r} do not match shape {shape} of {expected_dtype}: "
            f"expected [0, {result.data_length}]"
        )
    return result


class BodyValidator:
    """Checks a body chunk by chunk: header as soon as it is in, size and CRC32C at the end.

    ``feed`` raises as early as the body is known to be bad, so the caller can stop
    reading; ``finish`` raises unless the body was complete and its checksum right.
    """

    def __init__(
        self,
        dtype: str,
        *,
        max_bytes: int,
        expected_crc: int | None = None,
        declared_length: int | None = None,
    ) -> None:
        self._dtype = dtype
        self._max_bytes = max_bytes
        self._expected_crc = expected_crc
        self._declared_length = declared_length
        self._head = bytearray()
        self.header: TensorHeader | None = None
        self.received = 0
        self.crc = 0

    def feed(self, chunk: bytes | memoryview) -> None:
        self.received += len(chunk)
        if self.received > self._max_bytes:
            raise BodyTooLarge(f"body exceeds the {self._max_bytes}-byte limit")
        self.crc = crc32c(chunk, self.crc)
        if self.header is None:
            self._head += chunk[: MAX_HEADER_BYTES + PREFIX_BYTES - len(self._head)]
            self._try_parse_header()
        if self.header is not None and self.received > self.header.total_length:
            raise InvalidBody(
                f"body is longer than its header declares ({self.header.total_length} bytes)"
            )

    def _try_parse_header(self) -> None:
        if len(self._head) < PREFIX_BYTES:
            return
        length = read_header_length(self._head)
        if len(self._head) < PREFIX_BYTES + length:
            return
        header = parse_header(self._head[PREFIX_BYTES : PREFIX_BYTES + length], self._dtype)
        if header.total_length > self._max_bytes:
            raise BodyTooLarge(
                f"tensor of {header.total_length} bytes exceeds the {self._max_bytes}-byte limit"
            )
        if self._declared_length is not None and header.total_length != self._declared_length:
            raise InvalidBody(
                f"Content-Length {self._declared_length} does not match the "
                f"{header.total_length} bytes the safetensors header declares"
            )
        self.header = header
        self._head = bytearray()

    def finish(self) -> TensorHeader:
        if self.header is None:
            raise InvalidBody(f"body ended after {self.received} bytes, inside its header")
        if self.received != self.header.total_length:
            raise InvalidBody(
                f"body has {self.received} bytes but its header declares {self.header.total_length}"
            )
        if self._expected_crc is not None and self.crc != self._expected_crc:
            raise ChecksumMismatch(
                f"CRC32C of the body is {to_hex(self.crc)}, "
                f"X-EC-CRC32C says {to_hex(self._expected_crc)}"
            )
        return self.header


def validate_body(body: bytes | memoryview, dtype: str) -> TensorHeader:
    """Validate a complete body held in memory (e.g. a file on disk)."""
    if len(body) < PREFIX_BYTES:
        raise InvalidBody("body is shorter than the 8-byte safetensors prefix")
    length = read_header_length(body)
    if len(body) < PREFIX_BYTES + length:
        raise InvalidBody("body ends inside its safetensors header")
    header = parse_header(body[PREFIX_BYTES : PREFIX_BYTES + length], dtype)
    if header.total_length != len(body):
        raise InvalidBody(
            f"body has {len(body)} bytes but its header declares {header.total_length}"
        )
    return header
