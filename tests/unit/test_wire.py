"""The strict number parsers every header, query and metadata value goes through."""

from __future__ import annotations

import pytest

from app import checksum, wire
from app.settings import parse_size

LAX_FOR_INT = ["+5", "-5", " 5", "5 ", "5_0", "\u0665", "\uff15", "5.0", "0x5", "", "1e2", "5\n"]


@pytest.mark.parametrize("text", LAX_FOR_INT)
def test_decimal_refuses_what_int_would_take(text: str) -> None:
    with pytest.raises(ValueError):
        wire.decimal(text)


def test_decimal_accepts_plain_digits() -> None:
    assert wire.decimal("0") == 0
    assert wire.decimal("076") == 76  # HTTP's 1*DIGIT
    assert wire.decimal("9" * 20) == int("9" * 20)
    with pytest.raises(ValueError):
        wire.decimal("9" * 21)


@pytest.mark.parametrize(
    "text",
    [
        "+fc94ace",
        "-fc94ace",
        "0xfc94ac",
        "fc94_ace",
        " fc94ace",
        "fc94ace ",
        "FC94ACE0",
        "fc94ace",
        "fc94ace01",
        "\u0665c94ace0",
        "fc94ace\n",
        "",
    ],
)
def test_crc_header_is_exactly_8_lowercase_hex_digits(text: str) -> None:
    with pytest.raises(ValueError):
        checksum.from_hex(text)


def test_crc_header_round_trips() -> None:
    assert checksum.from_hex("fc94ace0") == 0xFC94ACE0
    assert checksum.from_hex(checksum.to_hex(7)) == 7


@pytest.mark.parametrize("text", ["+fc94ace", "0x94ace", "fc_94", " fc94", "\u0665", "123456789"])
def test_metadata_crc_is_hex_without_extras(text: str) -> None:
    with pytest.raises(ValueError):
        wire.loose_hex32(text)
    assert wire.loose_hex32("FC94ace") == 0xFC94ACE


@pytest.mark.parametrize("text", ["\u0665MiB", "+5MiB", "5_0", "-1"])
def test_sizes_take_ascii_digits_only(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)
