"""Strict parsers for the numbers clients and S3 objects send as text.

``int()`` is lax in ways a wire format must not be: it takes a sign (``+5``), surrounding
whitespace (`` 5 ``), underscores (``5_0``), any Unicode digit (Arabic-Indic, fullwidth) and, in
base 16, a ``0x`` prefix. These accept ASCII digits only, exactly as documented.
"""

from __future__ import annotations

import re

_DECIMAL_RE = re.compile(r"[0-9]{1,20}")
_HEX32_RE = re.compile(r"[0-9a-f]{8}")
_LOOSE_HEX32_RE = re.compile(r"[0-9A-Fa-f]{1,8}")


def decimal(text: str) -> int:
    """1 to 20 ASCII digits (HTTP's ``1*DIGIT``, so leading zeros are fine); no sign,
    space or underscore. Raises ``ValueError`` for anything else."""
    if not _DECIMAL_RE.fullmatch(text):
        raise ValueError(f"{text[:40]!r} is not a non-negative decimal integer")
    return int(text)


def hex32(text: str) -> int:
    """Exactly 8 lowercase hex digits (``X-EC-CRC32C``); raises ``ValueError`` otherwise."""
    if not _HEX32_RE.fullmatch(text):
        raise ValueError(f"{text[:40]!r} is not 8 lowercase hex digits")
    return int(text, 16)


def loose_hex32(text: str) -> int:
    """1 to 8 ASCII hex digits of either case (what other tools may write in object
    metadata); still no sign, space, underscore or ``0x``. Raises ``ValueError``."""
    if not _LOOSE_HEX32_RE.fullmatch(text):
        raise ValueError(f"{text[:40]!r} is not a 32-bit hex number")
    return int(text, 16)
