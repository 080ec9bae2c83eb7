#!/usr/bin/env python3
"""Generate the SDK's blocking code from its asyncio code (as encode/httpcore does).

The I/O of the SDK is written once, in ``client/ec_cache/_async/``; every module there
has a blocking twin in ``client/ec_cache/_sync/`` made by the substitutions below, then
formatted by ruff. The generated files say so in their first line and are never edited
by hand.

    python scripts/unasync.py          # regenerate client/ec_cache/_sync/
    python scripts/unasync.py --check  # fail when a generated file is stale (make lint)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "client" / "ec_cache" / "_async"
TARGET = ROOT / "client" / "ec_cache" / "_sync"

# (pattern, replacement), applied in order to every line; patterns match whole words.
SUBS: list[tuple[str, str]] = [
    (r"httpx\.AsyncByteStream", "httpx.SyncByteStream"),
    (r"httpx\.AsyncBaseTransport", "httpx.BaseTransport"),
    (r"Async([A-Z][A-Za-z0-9_]*)", r"\1"),
    (r"async_sleep", "sleep"),
    (r"async def", "def"),
    (r"async with", "with"),
    (r"async for", "for"),
    (r"await ", ""),
    (r"handle_async_request", "handle_request"),
    (r"aclose", "close"),
    (r"aread", "read"),
    (r"aiter_raw", "iter_raw"),
    (r"anext", "next"),
    (r"__aenter__", "__enter__"),
    (r"__aexit__", "__exit__"),
    (r"__aiter__", "__iter__"),
    # Awaitable[X] -> X, for X with at most one level of brackets (list[T]).
    (r"Awaitable\[((?:[^\[\]]|\[[^\[\]]*\])*)\]", r"\1"),
]
COMPILED = [
    (re.compile(r"(?<![A-Za-z0-9_])" + p + ("" if p.endswith(" ") else r"(?![A-Za-z0-9_])")), r)
    for p, r in SUBS
]


def header(name: str) -> str:
    return f"# Generated from ec_cache/_async/{name} by scripts/unasync.py; do not edit.\n"


def unasync_text(text: str) -> str:
    out = []
    for line in text.splitlines(keepends=True):
        for pattern, repl in COMPILED:
            line = pattern.sub(repl, line)
        out.append(line)
    return "".join(out)


def _ruff() -> str:
    here = Path(sys.executable).parent / "ruff"
    found = str(here) if here.exists() else shutil.which("ruff")
    if found is None:
        raise SystemExit("scripts/unasync.py needs ruff (pip install ruff)")
    return found


def _ruff_pipe(args: list[str], text: str, filename: Path) -> str:
    done = subprocess.run(
        [_ruff(), *args, "--stdin-filename", str(filename), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if done.returncode not in (0, 1) or not done.stdout:
        raise SystemExit(f"ruff {' '.join(args)} failed on {filename}:\n{done.stderr}")
    return done.stdout


def generate(source: Path) -> str:
    target = TARGET / source.name
    text = header(source.name) + unasync_text(source.read_text())
    # imports left unused (Awaitable) or unsorted by the renames, then the layout
    text = _ruff_pipe(
        ["check", "--fix", "--quiet", "--select", "I,F401", "--exit-zero"], text, target
    )
    return _ruff_pipe(["format", "--quiet"], text, target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    args = parser.parse_args()
    sources = sorted(SOURCE.glob("*.py"))
    expected = {TARGET / s.name: generate(s) for s in sources}
    stale = [
        path for path, text in expected.items() if not path.exists() or path.read_text() != text
    ]
    extra = [p for p in TARGET.glob("*.py") if p not in expected]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run `python scripts/unasync.py`")
        for path in extra:
            print(f"{path.relative_to(ROOT)} has no source in {SOURCE.relative_to(ROOT)}")
        return 1 if stale or extra else 0
    TARGET.mkdir(exist_ok=True)
    for path in stale:
        path.write_text(expected[path])
        print(f"wrote {path.relative_to(ROOT)}")
    for path in extra:
        path.unlink()
        print(f"removed {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
