"""Response heads as the transport uses them, and a strict parser for the plain ones.

h11 parses every response head it is given, and spends ~50 us of Python on the dozen
header lines of an ec-cache answer: about a tenth of a 128 KiB GET. Nearly every answer
from an ec-cache server is *plain*: a whole HTTP/1.1 final head in the first receive,
framed by one ``Content-Length`` (or with no body at all: ``HEAD``, 204, 304). For
those, :func:`parse_plain_head` does in ~10 us what h11 does, accepting only heads that
h11 accepts and reading them the same way (``tests/client/test_head.py`` checks this
against h11). Anything else (1xx, chunked, no length, HTTP/1.0, an odd byte anywhere)
is declined and goes to h11 unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import h11

# RFC 9110/9112 as h11 spells them (h11/_abnf.py): a status line with a reason phrase,
# and a header field whose value is trimmed of optional whitespace.
_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([2-5][0-9][0-9]) ([\t !-~\x80-\xff]*)")
_FIELD = re.compile(
    rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*"
    rb"((?:[!-~\x80-\xff](?:[\t !-~\x80-\xff]*[!-~\x80-\xff])?)?)[ \t]*"
)
_MAX_LENGTH_DIGITS = 18  # bodies below 1 EB; h11 allows 20, longer ones go to it


@dataclass(frozen=True, slots=True)
class Head:
    """A final response head: ``fields`` with lower-case names (for lookups),
    ``raw`` as received (for ``httpx.Response``)."""

    status_code: int
    reason: bytes
    http_version: bytes
    fields: list[tuple[bytes, bytes]]
    raw: list[tuple[bytes, bytes]]

    @classmethod
    def of(cls, event: h11.Response) -> Head:
        headers = event.headers
        return cls(
            event.status_code, event.reason, event.http_version, list(headers), headers.raw_items()
        )


@dataclass(frozen=True, slots=True)
class PlainHead:
    """What :func:`parse_plain_head` found: the head, the body length (0 when there is
    no body) and where the body starts in the bytes parsed."""

    head: Head
    body_length: int
    body_start: int


def parse_plain_head(data: bytes | bytearray, size: int, method: bytes) -> PlainHead | None:
    """The plain final head at the start of ``data[:size]`` (the answer to a ``method``
    request), or ``None`` when it is not one (see the module docstring)."""
    end = data.find(b"\r\n\r\n", 0, size)
    if end < 0:
        return None
    lines = bytes(memoryview(data)[:end]).split(b"\r\n")
    status = _STATUS_LINE.fullmatch(lines[0])
    if status is None:
        return None
    fields: list[tuple[bytes, bytes]] = []
    raw: list[tuple[bytes, bytes]] = []
    length: bytes | None = None
    for line in lines[1:]:
        field = _FIELD.fullmatch(line)
        if field is None:
            return None
        name, value = field.group(1, 2)
        lower = name.lower()
        if lower == b"content-length":
            if length is not None or not value.isdigit() or len(value) > _MAX_LENGTH_DIGITS:
                return None
            length = value
        elif lower == b"transfer-encoding":
            return None
        fields.append((lower, value))
        raw.append((name, value))
    code = int(status.group(1))
    if method == b"HEAD" or code in (204, 304):
        body_length = 0
    elif length is None:
        return None  # delimited by the close: h11's case
    else:
        body_length = int(length)
    head = Head(code, status.group(2), b"1.1", fields, raw)
    return PlainHead(head, body_length, end + 4)
