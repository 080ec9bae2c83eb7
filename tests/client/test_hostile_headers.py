"""The SDK's header parser refuses hostile headers with IntegrityError, nothing else."""

from __future__ import annotations

import pytest
from ec_cache import IntegrityError
from ec_cache._tensors import parse_header

HOSTILE = [
    "[" * 50_000 + "]" * 50_000,
    '{"t":{"dtype":"U8","shape":[' + "9" * 5000 + '],"data_offsets":[0,1]}}',
    '{"t":{"dtype":["U8"],"shape":[1],"data_offsets":[0,1]}}',
    '{"t":{"dtype":{"U8":1},"shape":[1],"data_offsets":[0,1]}}',
    '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}}',
    '{"t":{"dtype":"U8","shape":[1],"data_offsets":[false,true]}}',
    '{"t":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}}',
    '{"t":{"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}}',
]


@pytest.mark.parametrize("header", HOSTILE)
def test_hostile_headers_raise_integrity_error(header: str) -> None:
    with pytest.raises(IntegrityError):
        parse_header(header.encode())


def test_a_plain_header_parses() -> None:
    meta = parse_header(b'{"t":{"dtype":"U8","shape":[0,7],"data_offsets":[0,0]}}')
    assert meta.shape == (0, 7)
