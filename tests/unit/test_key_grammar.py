"""One key grammar: ``tests/data/keys.json`` run against every validator of
``/ec/{model}/{dtype}/{hash}`` (server, SDK, vLLM connector), so they cannot drift."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ec_cache import InvalidKeyError
from ec_cache._exists import exists_body
from ec_cache._tensors import CODES as SDK_CODES
from ec_cache._tensors import DTYPES as SDK_DTYPES
from ec_cache._tensors import check_hash, check_hashes, check_model, parse_dtype
from ec_cache._vllm.config import check_model_namespace
from ec_cache._vllm.keys import cache_key

from app.errors import InvalidKey
from app.keys import DTYPES as SERVER_DTYPES
from app.keys import (
    first_invalid_hash,
    key_digest,
    key_digests,
    validate_dtype,
    validate_hash,
    validate_model,
)

TABLE: dict[str, Any] = json.loads(
    (Path(__file__).parent.parent / "data" / "keys.json").read_text()
)


def _cases(part: str, kind: str) -> list[Any]:
    return [pytest.param(v, id=repr(v)[:40]) for v in TABLE[part][kind]]


def test_the_table_is_not_trivial() -> None:
    for part in ("model", "dtype", "hash"):
        assert len(TABLE[part]["valid"]) >= 10 and len(TABLE[part]["invalid"]) >= 10
        assert not set(TABLE[part]["valid"]) & set(TABLE[part]["invalid"])


# -- model ---------------------------------------------------------------------------
@pytest.mark.parametrize("model", _cases("model", "valid"))
def test_valid_model(model: str) -> None:
    assert validate_model(model) == model
    assert check_model(model) == model
    assert check_model_namespace(model) == model


@pytest.mark.parametrize("model", _cases("model", "invalid"))
def test_invalid_model(model: str) -> None:
    with pytest.raises(InvalidKey) as info:
        validate_model(model)
    assert info.value.part == "model"
    with pytest.raises(InvalidKeyError):
        check_model(model)
    with pytest.raises(ValueError):
        check_model_namespace(model)


# -- dtype ---------------------------------------------------------------------------
def test_dtype_lists_are_the_table() -> None:
    assert list(SERVER_DTYPES) == TABLE["dtype"]["valid"]
    assert list(SDK_DTYPES) == TABLE["dtype"]["valid"]
    # The SDK's torch-free copy: the same safetensors code and item size per name as
    # the server's, and torch's own item size.
    assert SDK_CODES == SERVER_DTYPES
    assert all(SDK_DTYPES[name][0].itemsize == size for name, (_, size) in SDK_CODES.items())


@pytest.mark.parametrize("dtype", _cases("dtype", "valid"))
def test_valid_dtype(dtype: str) -> None:
    """The connector passes its dtype to the SDK's ``parse_dtype``."""
    assert validate_dtype(dtype) == dtype
    assert parse_dtype(dtype) == dtype
    assert parse_dtype(SDK_DTYPES[dtype][0]) == dtype  # the torch.dtype spelling


@pytest.mark.parametrize("dtype", _cases("dtype", "invalid"))
def test_invalid_dtype(dtype: str) -> None:
    with pytest.raises(InvalidKey):
        validate_dtype(dtype)
    with pytest.raises(InvalidKeyError):
        parse_dtype(dtype)


# -- hash ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", _cases("hash", "valid"))
def test_valid_hash(value: str) -> None:
    assert validate_hash(value) == value
    assert check_hash(value) == value
    assert cache_key(value) == value  # the connector stores a valid id as it is


@pytest.mark.parametrize("value", _cases("hash", "invalid"))
def test_invalid_hash(value: str) -> None:
    with pytest.raises(InvalidKey) as info:
        validate_hash(value)
    assert info.value.part == "hash"
    with pytest.raises(InvalidKeyError):
        check_hash(value)
    key = cache_key(value)  # the connector maps it onto a valid one
    assert key != value and key.startswith("sha256:")
    assert validate_hash(key) == key and check_hash(key) == key


def test_a_batch_of_valid_hashes() -> None:
    """The batch checks (``POST .../_exists``, ``exists_many``) take what the single
    ones take; the batch digests are the single ones."""
    valid = TABLE["hash"]["valid"]
    assert first_invalid_hash(valid) is None and first_invalid_hash([]) is None
    assert check_hashes(iter(valid)) == valid and check_hashes([]) == []
    assert key_digests("m/x", "uint8", valid) == [key_digest("m/x", "uint8", h) for h in valid]
    # exists_many's body joins checked hashes as JSON strings without escaping them
    batches: list[list[str]] = [valid, valid[:1], []]
    for batch in batches:
        stream, headers = exists_body(batch)
        content = b"".join(stream)
        assert json.loads(content) == {"hashes": batch}
        assert headers["Content-Length"] == str(len(content))


@pytest.mark.parametrize("value", _cases("hash", "invalid"))
def test_an_invalid_hash_in_a_batch(value: str) -> None:
    """Anywhere among valid ones, the batch checks find it (and the first of several)."""
    valid = TABLE["hash"]["valid"]
    for at in (0, 5, len(valid)):
        batch = [*valid[:at], value, *valid[at:], value]
        assert first_invalid_hash(batch) == at
        with pytest.raises(InvalidKeyError, match=rf"^hashes\[{at}\]: hash "):
            check_hashes(batch)


def test_a_value_that_is_not_a_string_in_a_batch() -> None:
    with pytest.raises(InvalidKeyError, match=r"^hashes\[1\]: hash 7 "):
        check_hashes(["a", 7, "b"])  # type: ignore[list-item]
