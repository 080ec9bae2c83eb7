"""README.md's rendered blocks: the text between a begin and an end marker, which a
bench's renderer rewrites from its results JSON (tests/docs/test_bench_results.py
compares each with its rendering)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    begin: str
    end: str

    def cited(self, text: str) -> str:
        """The block as ``text`` (README.md) has it, markers included."""
        begin, end = text.index(self.begin), text.index(self.end)
        return text[begin : end + len(self.end) + 1]

    def replaced(self, text: str, block: str) -> str:
        """``text`` with its block replaced by ``block`` (markers included)."""
        begin, end = text.index(self.begin), text.index(self.end)
        return text[:begin] + block + text[end + len(self.end) + 1 :]


def wrapped(paragraph: str) -> str:
    """A prose paragraph wrapped as README.md's source is (tables stay one line each)."""
    return textwrap.fill(paragraph, 88, break_long_words=False, break_on_hyphens=False)
