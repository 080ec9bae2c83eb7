"""HTTP/1.1 heads as the transport uses them: strict writers and parsers for the
plain ones, h11 for the rest.

h11 parses every response head it is given, and spends ~50 us of Python on the dozen
header lines of an ec-cache answer: about a tenth of a 128 KiB GET. Nearly every answer
from an ec-cache server is *plain*: a whole HTTP/1.1 final head in the first receive,
framed by one ``Content-Length`` (or with no body at all: ``HEAD``, 204, 304). For
those, :func:`parse_plain_head` does in ~10 us what h11 does, accepting only heads that
h11 accepts and reading them the same way (``tests/client/test_head.py`` checks this
against h11). Anything else (1xx, chunked, no length, HTTP/1.0, an odd byte anywhere)
is declined and goes to h11 unchanged.

Writing a request costs h11 ~25 us (validating each field, then its state machine) of
a HEAD's ~250 us of client CPU. The SDK's GET and HEAD are *plain* requests: no body,
``Host`` first, fields that need nothing of h11's framing or connection rules.
:func:`plain_request_head` writes those as h11 would, byte for byte, and declines the
rest (also checked against h11 by ``tests/client/test_head.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import h11

# RFC 9110/9112 as h11 spells them (h11/_abnf.py): a status line with a reason phrase,
# and a header field whose value is trimmed of optional whitespace. Stricter than h11
# where they differ (no control characters in a value): what passes, h11 accepts.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_VALUE = rb"(?:[!-~\x80-\xff](?:[\t !-~\x80-\xff]*[!-~\x80-\xff])?)?"
_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([2-5][0-9][0-9]) ([\t !-~\x80-\xff]*)")
_FIELD = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _VALUE + rb")[ \t]*")
_MAX_LENGTH_DIGITS = 18  # bodies below 1 EB; h11 allows 20, longer ones go to it
# A request head as h11 writes it: a method token, a target of visible characters.
_PLAIN_REQUEST = re.compile(
    _TOKEN + rb" [!-~]+ HTTP/1\.1\r\n(?:" + _TOKEN + rb": " + _VALUE + rb"\r\n)+\r\n"
)
# Fields (after the first, Host) that only h11 handles: body framing, a protocol switch,
# 100 Continue, and a second Host, which h11 refuses.
_NOT_PLAIN = frozenset({b"host", b"content-length", b"transfer-encoding", b"expect", b"upgrade"})


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


def plain_request_head(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]
) -> bytes | None:
    """The head of a request without a body, as h11 writes it, when the request is
    plain (see the module docstring); else ``None``, and h11 writes it."""
    if not headers or headers[0][0].lower() != b"host" or method == b"CONNECT":
        return None
    for name, value in headers[1:]:
        lower = name.lower()
        if lower in _NOT_PLAIN or (lower == b"connection" and value.lower() != b"keep-alive"):
            return None
    fields = b"".join([b"%s: %s\r\n" % field for field in headers])
    head = b"%s %s HTTP/1.1\r\n%s\r\n" % (method, target, fields)
    if head.count(b"\r\n") != len(headers) + 2:
        return None  # a CR LF within a name or value: no field may add lines
    return head if _PLAIN_REQUEST.fullmatch(head) else None
