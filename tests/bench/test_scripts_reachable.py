"""Every file of bench/ is run by a make target, or used by a file that is: no script
that nothing runs (they go stale unnoticed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
PATTERNS = (
    re.compile(r"\bbench\.(\w+)"),  # bench.serve: a module run or imported
    re.compile(r"\bbench/(\w+)\.(?:py|sh)\b"),  # bench/gpu_wheels.sh: a file run
    re.compile(r"-m bench\b(?![./])()"),  # python -m bench: bench/__main__.py
)
IMPORTED = re.compile(r"^from bench import ([\w, ]+)$", re.MULTILINE)


def named_files(text: str) -> set[str]:
    """The bench files ``text`` names (as modules, paths or imports)."""
    names = {m.group(1) or "__main__" for pattern in PATTERNS for m in pattern.finditer(text)}
    for match in IMPORTED.finditer(text):
        names |= {name.strip() for name in match.group(1).split(",")}
    return names


def reachable_from_make() -> set[str]:
    files = {p.stem: p for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}
    reached: set[str] = set()
    todo = named_files((ROOT / "Makefile").read_text()) & set(files)
    while todo:
        name = todo.pop()
        reached.add(name)
        todo |= (named_files(files[name].read_text()) & set(files)) - reached
    return reached


def test_every_bench_file_is_reached_from_a_make_target() -> None:
    files = {p.stem for p in BENCH.iterdir() if p.suffix in (".py", ".sh")} - {"__init__"}
    assert files - reachable_from_make() == set()
