"""Validated cache keys: ``{model}/{dtype}/{hash}``.

Validation is the only defence of the file system and the bucket against hostile
paths, so it is strict and allow-list based: every accepted key maps to a file name
and an object key that stay inside the cache's own directory and prefix.
"""

from __future__ import annotations

import functools
import hashlib
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.errors import InvalidKey

MAX_MODEL_BYTES = 256
MAX_HASH_CHARS = 256

_SEGMENT_RE = re.compile(r"[A-Za-z0-9._@+\-]+")
#: A hash's characters: the pattern below, and what a batch's check deletes.
_HASH_CHARS = (string.ascii_letters + string.digits + "._:-").encode()
_HASH_RE = re.compile(f"[{re.escape(_HASH_CHARS.decode())}]{{1,{MAX_HASH_CHARS}}}")
#: "." and ".." are dot segments: every URL parser (httpx, curl) removes them.
_DOT_SEGMENTS = frozenset((".", ".."))

#: torch dtype name -> (safetensors dtype code, item size in bytes)
DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float64": ("F64", 8),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "int16": ("I16", 2),
    "int32": ("I32", 4),
    "int64": ("I64", 8),
    "bool": ("BOOL", 1),
}


def validate_model(model: str) -> str:
    if not model:
        raise InvalidKey("model", "model is empty")
    if len(model.encode("utf-8")) > MAX_MODEL_BYTES:
        raise InvalidKey("model", f"model is longer than {MAX_MODEL_BYTES} bytes")
    for segment in model.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidKey("model", f"model {model!r} has an empty, '.' or '..' segment")
        if not _SEGMENT_RE.fullmatch(segment):
            raise InvalidKey(
                "model",
                f"model segment {segment!r} may only use letters, digits and . _ - @ +",
            )
    return model


def validate_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise InvalidKey("dtype", f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return dtype


HASH_RULE = (
    f"hash must be 1-{MAX_HASH_CHARS} characters of letters, digits and . _ : - (not '.' or '..')"
)


def _is_hash(value: str) -> bool:
    return _HASH_RE.fullmatch(value) is not None and value not in _DOT_SEGMENTS


def validate_hash(value: str) -> str:
    if not _is_hash(value):
        raise InvalidKey("hash", HASH_RULE)
    return value


def first_invalid_hash(values: Sequence[str]) -> int | None:
    """The index of the first of ``values`` that :func:`validate_hash` refuses, or
    ``None``. A batch of valid hashes (``POST .../_exists``) is checked in a few passes
    over all of them together, each in C: a third of the time of a regular expression
    match per hash."""
    try:
        odd_chars = "".join(values).encode("ascii").translate(None, _HASH_CHARS)
    except UnicodeEncodeError:
        odd_chars = b"?"
    if (
        not odd_chars
        and min(map(len, values), default=1) > 0
        and max(map(len, values), default=0) <= MAX_HASH_CHARS
        and not _DOT_SEGMENTS.intersection(values)
    ):
        return None
    return next(index for index, value in enumerate(values) if not _is_hash(value))


def key_digest(model: str, dtype: str, hash: str) -> str:
    """The disk tier's name for a key (hashes may exceed NAME_MAX)."""
    return hashlib.sha256(f"{model}/{dtype}/{hash}".encode()).hexdigest()


def key_digests(model: str, dtype: str, hashes: Sequence[str]) -> list[str]:
    """:func:`key_digest` of each of ``hashes`` (of one model and dtype), with the
    common prefix encoded once."""
    sha256, prefix = hashlib.sha256, f"{model}/{dtype}/"
    return [sha256((prefix + hash).encode()).hexdigest() for hash in hashes]


@dataclass(frozen=True)
class EntryKey:
    """One cache entry's identity; construct with :meth:`parse` to validate."""

    model: str
    dtype: str
    hash: str
    #: ``key_digest`` of the key, computed once.
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", key_digest(self.model, self.dtype, self.hash))

    @classmethod
    def parse(cls, model: str, dtype: str, hash: str) -> EntryKey:
        return cls(validate_model(model), validate_dtype(dtype), validate_hash(hash))

    def __str__(self) -> str:
        return f"{self.model}/{self.dtype}/{self.hash}"

    def object_key(self, prefix: str) -> str:
        """The S3 key: ``{prefix}/{model}/{dtype}/{hash}.safetensors``."""
        name = f"{self}.safetensors"
        return f"{prefix}/{name}" if prefix else name


@functools.lru_cache(maxsize=8192)
def parse_key(model: str, dtype: str, hash: str) -> EntryKey:
    """:meth:`EntryKey.parse` for request paths, remembered: a hot key's reads skip
    validation and its digest (invalid keys raise and are not remembered)."""
    return EntryKey.parse(model, dtype, hash)
