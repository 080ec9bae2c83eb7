"""The wire grammar of ``/ec/{model}/{dtype}/{hash}`` (docs/http-api.md), in one place
for the SDK and the vLLM connector; no torch import.

The server checks the same rules in ``app/keys.py`` (a separate distribution, so a
separate copy); ``tests/data/keys.json`` is run against both so that they cannot
drift. Every pattern is applied with ``fullmatch``: ``re.match`` with ``$`` would
accept a trailing newline.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

__all__ = [
    "DTYPE_NAMES",
    "MAX_HASH_CHARS",
    "MAX_MODEL_BYTES",
    "hash_error",
    "hashes_error",
    "model_error",
    "segment_ok",
]

MAX_MODEL_BYTES = 256
MAX_HASH_CHARS = 256

#: the dtypes ec-cache stores, by their torch names without ``torch.``
DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
)

_SEGMENT_RE = re.compile(r"[A-Za-z0-9._@+\-]+")
#: A hash's characters: the pattern below, and what a batch's check deletes.
_HASH_CHARS = (string.ascii_letters + string.digits + "._:-").encode()
_HASH_RE = re.compile(f"[{re.escape(_HASH_CHARS.decode())}]{{1,{MAX_HASH_CHARS}}}")
#: "." and ".." are dot segments: every URL parser (httpx, curl) removes them.
_DOT_SEGMENTS = frozenset((".", ".."))


def segment_ok(segment: str) -> bool:
    """Whether ``segment`` uses only the characters of a model segment (letters, digits,
    ``. _ - @ +``; at least one). :func:`model_error` also refuses ``.`` and ``..``."""
    return _SEGMENT_RE.fullmatch(segment) is not None


def model_error(model: object) -> str | None:
    """Why ``model`` is not a valid ``{model}`` path part, or ``None`` when it is."""
    if not isinstance(model, str) or not model:
        return "model must be a non-empty string"
    if len(model.encode("utf-8")) > MAX_MODEL_BYTES:
        return f"model is longer than {MAX_MODEL_BYTES} bytes"
    for segment in model.split("/"):
        if segment in (".", "..") or not segment_ok(segment):
            return (
                f"model {model!r}: segment {segment!r} is not letters, digits, . _ @ + - "
                "(and not empty, '.' or '..')"
            )
    return None


def hash_error(value: object) -> str | None:
    """Why ``value`` is not a valid ``{hash}`` path part, or ``None`` when it is."""
    if not isinstance(value, str) or _HASH_RE.fullmatch(value) is None or value in _DOT_SEGMENTS:
        return (
            f"hash {value!r} is not 1-{MAX_HASH_CHARS} characters of letters, digits, . _ : - "
            "(and not '.' or '..')"
        )
    return None


def hashes_error(values: Sequence[str]) -> str | None:
    """Why the first invalid one of ``values`` is not a valid hash (with its index), or
    ``None`` when all are valid. A batch of valid hashes (``exists_many``) is checked in
    a few passes over all of them together, each in C: a third of the time of
    :func:`hash_error` on each. A value that is not a string is reported too."""
    try:
        odd_chars = "".join(values).encode("ascii").translate(None, _HASH_CHARS)
    except (TypeError, UnicodeEncodeError):  # not strings, or not ASCII: found below
        odd_chars = b"?"
    if (
        not odd_chars
        and min(map(len, values), default=1) > 0
        and max(map(len, values), default=0) <= MAX_HASH_CHARS
        and not _DOT_SEGMENTS.intersection(values)
    ):
        return None
    for index, value in enumerate(values):
        error = hash_error(value)
        if error is not None:
            return f"hashes[{index}]: {error}"
    return None
