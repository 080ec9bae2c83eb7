from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save

from app.checksum import crc32c
from app.errors import BodyTooLarge, ChecksumMismatch, DtypeMismatch, InvalidBody
from app.keys import DTYPES
from app.safetensors_format import MAX_HEADER_BYTES, BodyValidator, validate_body
from testkit.entries import body


def _feed_all(
    data: bytes,
    dtype: str = "float32",
    chunk: int = 7,
    *,
    expected_crc: int | None = None,
    declared_length: int | None = None,
) -> None:
    """Validate ``data`` fed in small chunks, as a PUT body arrives."""
    validator = BodyValidator(
        dtype, max_bytes=1 << 30, expected_crc=expected_crc, declared_length=declared_length
    )
    for start in range(0, len(data), chunk):
        validator.feed(data[start : start + chunk])
    validator.finish()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_safetensors_files_of_every_dtype_validate(dtype: str) -> None:
    tensor = torch.zeros(3, 5, dtype=getattr(torch, dtype))
    data = save({"embedding": tensor})
    header = validate_body(data, dtype)
    assert header.shape == (3, 5)
    assert header.total_length == len(data)
    _feed_all(data, dtype, chunk=3, expected_crc=crc32c(data), declared_length=len(data))


def test_zero_token_and_scalar_tensors() -> None:
    assert validate_body(save({"x": torch.zeros(0, 4096, dtype=torch.bfloat16)}), "bfloat16")
    assert validate_body(save({"x": torch.tensor(1.0)}), "float32").shape_text == ""


def test_metadata_is_allowed() -> None:
    data = save({"x": torch.ones(2)}, metadata={"model": "llava"})
    assert validate_body(data, "float32").shape == (2,)


def test_dtype_mismatch_names_both() -> None:
    with pytest.raises(DtypeMismatch, match="bfloat16 but the path says float16"):
        _feed_all(body(code="BF16", itemsize=2), "float16")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (struct.pack("<Q", MAX_HEADER_BYTES + 1), "not a safetensors file.*65537, over"),
        (struct.pack("<Q", 1) + b"{", "too small"),
        (struct.pack("<Q", 8) + b"not json", "start with"),
        (struct.pack("<Q", 8) + b"{notjson", "not valid JSON"),
        (struct.pack("<Q", 8) + b"[1,2,3] ", "start with"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "start with"),
        (struct.pack("<Q", 4) + b"{\xff\xfe}", "not valid UTF-8"),
    ],
)
def test_malformed_headers(data: bytes, message: str) -> None:
    with pytest.raises(InvalidBody, match=message):
        _feed_all(data + b"\0" * 16)


def test_two_tensors_rejected() -> None:
    data = save({"a": torch.ones(2), "b": torch.ones(2)})
    with pytest.raises(InvalidBody, match="exactly one tensor"):
        _feed_all(data)


def test_no_tensor_rejected() -> None:
    with pytest.raises(InvalidBody, match="exactly one tensor, found 0"):
        _feed_all(body(header={"__metadata__": {"a": "b"}}))


@pytest.mark.parametrize(
    "info",
    [
        {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 100]},
        {"dtype": "F32", "shape": [4, 8], "data_offsets": [4, 132]},
        {"dtype": "F32", "shape": [4, -8], "data_offsets": [0, 128]},
        {"dtype": "F32", "shape": "4,8", "data_offsets": [0, 128]},
        {"dtype": "F32", "shape": [4, True], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [4, 8]},
        {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128], "extra": 1},
    ],
)
def test_shape_and_offsets_must_agree(info: dict[str, object]) -> None:
    with pytest.raises(InvalidBody):
        _feed_all(body(header={"t": info}))


def test_length_must_match_header() -> None:
    data = body()
    with pytest.raises(InvalidBody, match="header declares"):
        _feed_all(data[:-1])
    with pytest.raises(InvalidBody, match="longer than its header"):
        _feed_all(data + b"\0")
    with pytest.raises(InvalidBody, match="inside its header"):
        _feed_all(data[:12])


def test_content_length_must_match_header() -> None:
    data = body()
    with pytest.raises(InvalidBody, match="Content-Length"):
        _feed_all(data, declared_length=len(data) + 10)


def test_checksum_mismatch() -> None:
    data = body()
    with pytest.raises(ChecksumMismatch, match="X-EC-CRC32C"):
        _feed_all(data, expected_crc=crc32c(data) ^ 1)


def test_declared_size_over_limit_is_rejected_before_the_data() -> None:
    data = body((1024, 1024), "U8", 1)
    validator = BodyValidator("uint8", max_bytes=1000)
    with pytest.raises(BodyTooLarge):
        validator.feed(data[:200])  # header only: rejected before any data arrives


def test_metadata_must_be_strings() -> None:
    info = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    with pytest.raises(InvalidBody, match="__metadata__"):
        _feed_all(body((1,), header={"t": info, "__metadata__": {"a": 1}}))


def test_header_json_is_checked_for_exactly_one_key_even_when_padded() -> None:
    raw = json.dumps({"t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}).encode()
    raw += b" " * 9
    data = struct.pack("<Q", len(raw)) + raw + b"ab"
    assert validate_body(data, "uint8").data_offset == 8 + len(raw)


def _header_body(header: str, data: bytes = b"") -> bytes:
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    "header",
    [
        "[" * 60_000 + "]" * 60_000,  # RecursionError in json
        '{"t":' * 20_000 + "1" + "}" * 20_000,
        '{"t":{"dtype":"U8","shape":[' + "9" * 5000 + '],"data_offsets":[0,1]}}',  # int() limit
        '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,' + "1" * 5000 + "]}}",
        '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + "7" * 5000 + "}}",
        '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1e999999]}}',
        '{"t":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}',
        '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,Infinity]}}',
        '{"t":{"dtype":[[[[]]]],"shape":[1],"data_offsets":[0,1]}}',
        '{"t":{"dtype":{"a":1},"shape":[1],"data_offsets":[0,1]}}',
    ],
)
def test_hostile_headers_are_invalid_bodies_whatever_python_raises(header: str) -> None:
    data = _header_body(header, b"\0")
    with pytest.raises(InvalidBody):
        validate_body(data, "uint8")
    with pytest.raises(InvalidBody):
        _feed_all(data, "uint8", chunk=4096)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ('{"t":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "duplicate key"),
        ('{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"t":{}}', "duplicate key"),
        (
            '{"__metadata__":{"a":"b","a":"c"},"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
            "duplicate key",
        ),
        ('{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}}', "two unsigned integers"),
        ('{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1e0]}}', "two unsigned integers"),
        ('{"t":{"dtype":"U8","shape":[1],"data_offsets":[false,true]}}', "two unsigned integers"),
        ('{"t":{"dtype":"U8","shape":[1],"data_offsets":[-0,1]}}', "two unsigned integers"),
        ('{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1,1]}}', "two unsigned integers"),
        ('{"t":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}', "shape"),
        ('{"t":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}', "shape"),
        ('{"t":{"dtype":"U8","shape":[0,18446744073709551616],"data_offsets":[0,0]}}', "shape"),
        ('{"t":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}}', "too large"),
        (
            '{"t":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}',
            "too large",
        ),
        ('{"t":{"dtype":"I64","shape":[0,1152921504606846976],"data_offsets":[0,0]}}', "too large"),
        (
            '{"t":{"dtype":"U8","shape":[' + ",".join(["1"] * 65) + '],"data_offsets":[0,1]}}',
            "65 dimensions",
        ),
        ('{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "surrogate"),
        (
            '{"__metadata__":{"a":"\\udfff"},"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
            "surrogate",
        ),
        (' {"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "start with"),
    ],
)
def test_headers_the_reference_parser_refuses(header: str, message: str) -> None:
    dtype = "int64" if '"I64"' in header else "uint8"
    data = _header_body(header, b"\0" if '"data_offsets":[0,0]' not in header else b"")
    with pytest.raises(InvalidBody, match=message):
        validate_body(data, dtype)


@pytest.mark.parametrize(
    "header",
    [
        '{"\\ud83d\\ude00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',  # a surrogate pair
        '{"t":{"dtype":"U8","shape":[0,9223372036854775807],"data_offsets":[0,0]}}',
        '{"t":{"dtype":"U8","shape":[' + ",".join(["1"] * 64) + '],"data_offsets":[0,1]}}',
        '{"__metadata__":null,"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}\t\r\n ',
    ],
)
def test_edge_headers_the_reference_parser_accepts(header: str) -> None:
    data = _header_body(header, b"\0" if '"data_offsets":[0,0]' not in header else b"")
    assert validate_body(data, "uint8").total_length == len(data)
