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
from app.errors import BodyTooLarge, ChecksumMismatch, DtypeMismatch, ECError, InvalidBody
from app.keys import DTYPES

#: A one-tensor header is ~100 bytes; this leaves room for metadata, not for abuse.
MAX_HEADER_BYTES = 64 * 1024
PREFIX_BYTES = 8

_NAME_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}
# What a body that is no safetensors file at all most likely needs (curl -d strips newlines).
_NOT_SAFETENSORS = "not a safetensors file; send the file as it is, e.g. curl --data-binary @FILE"


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
    if len(prefix) < PREFIX_BYTES:
        raise InvalidBody("body is shorter than the 8-byte safetensors prefix")
    (length,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if length < 2:
        raise InvalidBody(f"safetensors header length {length} is too small")
    if length > MAX_HEADER_BYTES:
        raise InvalidBody(
            f"{_NOT_SAFETENSORS} (its first 8 bytes give a header length of {length}, "
            f"over the {MAX_HEADER_BYTES}-byte limit)"
        )
    return int(length)


# -- the header's JSON, read the way the reference parser (serde_json) reads it --------
#
# ``safetensors`` parses headers with serde_json into typed fields; Python's ``json`` is
# laxer. The hooks below close every gap a one-tensor header can reach: NaN/Infinity,
# duplicate keys, lone surrogate escapes, numbers that are not unsigned 64-bit integers
# ("-0", "2.0", "1e3", 2**64) and integers too long for ``int()``. An accepted header
# nests three levels deep, so deeper nesting is refused (serde_json stops at 128).

_U64_MAX = (1 << 64) - 1
#: numpy and torch size arrays in signed 64-bit: ``prod(max(dim, 1)) * itemsize`` must
#: fit, even for a tensor with no elements (numpy refuses ``[0, 2**63]``, torch overflows
#: its strides on ``[0, 2**32, 2**32]``, safetensors on ``[2**32, 2**32, 0]``).
MAX_TENSOR_BYTES = (1 << 63) - 1
#: numpy's limit on dimensions.
MAX_DIMS = 64


class _Refused(Exception):
    """Raised inside the JSON hooks; becomes ``InvalidBody``."""


@dataclass(frozen=True)
class _Number:
    """A JSON number that is not an unsigned 64-bit integer (kept as its text)."""

    text: str

    def __repr__(self) -> str:
        return self.text if len(self.text) <= 40 else self.text[:40] + "..."


def _parse_int(text: str) -> int | _Number:
    # At most 20 digits: never reaches int()'s digit limit, never above 2**64 - 1.
    if text.startswith("-") or len(text) > 20:
        return _Number(text)  # serde_json reads "-0" as a float, negatives as i64
    value = int(text)
    return value if value <= _U64_MAX else _Number(text)


def _parse_constant(text: str) -> object:
    raise _Refused(f"{text} is not JSON")


def _check_text(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _Refused("a string holds a lone surrogate escape") from None
    return text


def _object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise _Refused(f"duplicate key {key[:64]!r}")
        if isinstance(value, str):
            _check_text(value)
        result[_check_text(key)] = value
    return result


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _is_u64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _load_json(raw: bytes | bytearray | memoryview) -> object:
    try:
        return json.loads(
            bytes(raw).decode("utf-8"),
            object_pairs_hook=_object,
            parse_int=_parse_int,
            parse_float=_Number,
            parse_constant=_parse_constant,
        )
    except UnicodeDecodeError as exc:
        raise InvalidBody(f"safetensors header is not valid UTF-8: {exc.reason}") from None
    except (json.JSONDecodeError, _Refused) as exc:
        raise InvalidBody(f"safetensors header is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidBody("safetensors header nests too deeply") from None


def parse_header(raw: bytes | bytearray | memoryview, expected_dtype: str) -> TensorHeader:
    """Parse the JSON header (without the 8-byte prefix) of a single-tensor body.

    Raises ``InvalidBody`` (or its ``DtypeMismatch``) for anything it does not accept,
    whatever the input: hostile headers are 400s, never 500s.
    """
    try:
        return _parse_header(raw, expected_dtype)
    except ECError:
        raise
    except Exception as exc:  # a bug here must still answer 400, not a traceback
        raise InvalidBody(f"safetensors header is not valid ({type(exc).__name__})") from None


def _parse_header(raw: bytes | bytearray | memoryview, expected_dtype: str) -> TensorHeader:
    # safetensors 0.8 still skips leading whitespace but has long meant to refuse it
    # (its InvalidHeaderStart); every writer starts with "{", so require it already.
    if bytes(raw[:1]) != b"{":
        raise InvalidBody(f"{_NOT_SAFETENSORS} (its header must start with '{{')")
    header = _load_json(raw)
    if not isinstance(header, dict):
        raise InvalidBody("safetensors header must be a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise InvalidBody("safetensors __metadata__ must map strings to strings")
    if len(header) != 1:
        raise InvalidBody(f"body must hold exactly one tensor, found {len(header)}")
    ((name, info),) = header.items()
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise InvalidBody(f"tensor {name[:64]!r} needs exactly dtype, shape and data_offsets")

    code = info["dtype"]
    if code != DTYPES[expected_dtype][0]:
        found = _NAME_BY_CODE.get(code, code[:64]) if isinstance(code, str) else _short(code)
        raise DtypeMismatch(f"body holds {found} but the path says {expected_dtype}", part="dtype")
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_u64(dim) for dim in shape):
        raise InvalidBody("tensor shape must be a list of integers from 0 to 2**64 - 1")
    if len(shape) > MAX_DIMS:
        raise InvalidBody(f"tensor has {len(shape)} dimensions, more than {MAX_DIMS}")
    itemsize = DTYPES[expected_dtype][1]
    if math.prod(max(dim, 1) for dim in shape) * itemsize > MAX_TENSOR_BYTES:
        raise InvalidBody(
            f"tensor shape {_short(shape)} is too large: the product of its dimensions (0 counted "
            f"as 1) times the {itemsize}-byte item size exceeds 2**63 - 1"
        )
    result = TensorHeader(expected_dtype, tuple(shape), len(raw))
    offsets = info["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(o) for o in offsets)):
        raise InvalidBody(f"data_offsets {_short(offsets)} must be a list of two unsigned integers")
    if offsets != [0, result.data_length]:
        raise InvalidBody(
            f"data_offsets {_short(offsets)} do not match shape {_short(shape)} of {expected_dtype}: "
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

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
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
