from __future__ import annotations

import pytest

from app.errors import InvalidKey
from app.keys import DTYPES, EntryKey


@pytest.mark.parametrize(
    "model",
    ["llava", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct@a1b2c3", "a+b/c_d.e-f"],
)
def test_valid_models(model: str) -> None:
    assert EntryKey.parse(model, "bfloat16", "abc").model == model


@pytest.mark.parametrize(
    "model",
    ["", "/abs", "a//b", "a/./b", "../etc", "a/..", "a b", "a\x00b", "a\\b", "é", "a/", "x" * 257],
)
def test_invalid_models(model: str) -> None:
    with pytest.raises(InvalidKey) as info:
        EntryKey.parse(model, "bfloat16", "abc")
    assert info.value.part == "model"
    assert info.value.code == "invalid_model"


def test_model_limit_is_in_bytes() -> None:
    EntryKey.parse("m" * 256, "int8", "h")
    with pytest.raises(InvalidKey):
        EntryKey.parse("m" * 257, "int8", "h")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_design_dtype_is_accepted(dtype: str) -> None:
    assert EntryKey.parse("m", dtype, "h").dtype == dtype


@pytest.mark.parametrize("dtype", ["torch.float32", "float", "F32", "", "complex64", "uint16"])
def test_invalid_dtypes(dtype: str) -> None:
    with pytest.raises(InvalidKey) as info:
        EntryKey.parse("m", dtype, "h")
    assert info.value.part == "dtype"


@pytest.mark.parametrize(
    "value",
    [
        "a" * 64,
        "f" * 128,
        "lora-1:" + "0" * 64,
        "123e4567-e89b-12d3-a456-426614174000",
        "req-42-image-0",
        "x" * 256,
    ],
)
def test_valid_hashes(value: str) -> None:
    assert EntryKey.parse("m", "int8", value).hash == value


@pytest.mark.parametrize(
    "value", ["", "a/b", ".", "..", "a b", "a\x00", "x" * 257, "h%2F", "ü", "h\n"]
)
def test_invalid_hashes(value: str) -> None:
    """``.`` and ``..`` are refused: URL parsers (httpx, curl) remove dot segments, so no
    client could address such an entry. See also tests/unit/test_key_grammar.py."""
    with pytest.raises(InvalidKey) as info:
        EntryKey.parse("m", "int8", value)
    assert info.value.part == "hash"


def test_digest_is_fixed_length_and_distinct() -> None:
    a = EntryKey.parse("m", "int8", "x" * 256)
    b = EntryKey.parse("m", "uint8", "x" * 256)
    assert len(a.digest) == 64
    assert a.digest != b.digest


def test_object_key_is_human_readable() -> None:
    key = EntryKey.parse("Qwen/Qwen2.5-VL", "bfloat16", "lora:abc")
    assert key.object_key("ec") == "ec/Qwen/Qwen2.5-VL/bfloat16/lora:abc.safetensors"
    assert key.object_key("") == "Qwen/Qwen2.5-VL/bfloat16/lora:abc.safetensors"
