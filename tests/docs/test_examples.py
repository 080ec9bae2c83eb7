"""What README.md and client/README.md tell a user to type works as written.

Every fenced block right after a ``<!-- tested -->`` line runs, in the document's order,
against a real server started for the document (``python -m app``, disk only):
``sh`` blocks with bash (``set -e``), ``pycon`` blocks as doctests (their printed
results are checked). A plain block right after a tested ``sh`` block and a
``<!-- output of the block above -->`` line is a sample of its output: each of its
``name: value`` header lines must appear in what the block printed, except values
that differ every time (``etag``, ``x-ec-crc32c``, ``x-request-id``).

The documents say ``http://127.0.0.1:8080`` and ``/tmp/``; the test's server has a free
port and the test a temp folder of its own, so both are rewritten. Blocks run with the
test venv's ``bin`` first on ``PATH`` (``python``, ``ec-cache``), as after
``make sdk`` and ``. .venv/bin/activate``; README blocks from the repository root,
client/README blocks from the temp folder.
"""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.server import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
TESTED = "<!-- tested -->"
OUTPUT = "<!-- output of the block above -->"
VARYING = {"etag", "x-ec-crc32c", "x-request-id", "date"}


@dataclass
class Block:
    language: str
    code: str
    line: int  # 1-based line of the opening fence
    sample: str | None = None  # the documented output, for an ``sh`` block


def marked_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        marker = lines[i].strip()
        if marker in (TESTED, OUTPUT) and i + 1 < len(lines) and lines[i + 1].startswith("```"):
            language = lines[i + 1][3:].strip()
            end = lines.index("```", i + 2)
            code = "\n".join(lines[i + 2 : end]) + "\n"
            if marker == TESTED:
                blocks.append(Block(language, code, i + 2))
            else:
                assert blocks and blocks[-1].language == "sh", f"{path}:{i + 1}: output of what?"
                blocks[-1].sample = code
            i = end
        i += 1
    return blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("docs-server")
    with ServerProcess(root / "data", root / "server.log") as srv:
        yield srv


def run_document(path: Path, server: ServerProcess, tmp: Path, cwd: Path) -> None:
    blocks = marked_blocks(path)
    assert blocks, f"{path} has no {TESTED} block"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "EC_CACHE_URL": server.url,
    }
    for block in blocks:
        code = block.code.replace("http://127.0.0.1:8080", server.url).replace("/tmp/", f"{tmp}/")
        where = f"{path.relative_to(ROOT)}:{block.line}"
        if block.language == "sh":
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", code],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            assert done.returncode == 0, f"{where} failed:\n{done.stdout}\n{done.stderr}"
            if block.sample is not None:
                check_sample(block.sample, done.stdout, where)
        elif block.language == "pycon":
            run_doctest(code, where, cwd)
        else:
            raise AssertionError(f"{where}: a tested block must be sh or pycon")


def check_sample(sample: str, printed: str, where: str) -> None:
    got = {line.lower().strip() for line in printed.splitlines()}
    for line in sample.splitlines():
        name, sep, value = line.partition(":")
        if not sep or name.lower() in VARYING or "..." in value:
            continue
        assert f"{name.lower()}:{value}".strip() in got, f"{where}: {line!r} not in:\n{printed}"


def run_doctest(code: str, where: str, cwd: Path) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(code, {"__name__": "__main__"}, where, where, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        runner.run(test, out=out.append)
    finally:
        os.chdir(previous)
    assert runner.failures == 0, "".join(out)


def test_readme(server: ServerProcess, tmp_path: Path) -> None:
    run_document(ROOT / "README.md", server, tmp_path, ROOT)


def test_client_readme(server: ServerProcess, tmp_path: Path) -> None:
    run_document(ROOT / "client" / "README.md", server, tmp_path, tmp_path)


def test_a_wrong_sample_fails(tmp_path: Path) -> None:
    """The sample check can fail: a documented header the server does not send."""
    with pytest.raises(AssertionError, match="x-ec-shape: 1,2"):
        check_sample("x-ec-shape: 1,2\netag: anything", "x-ec-shape: 576,4096\n", "here")


def test_markers_are_found(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        f"{TESTED}\n```sh\necho hi\n```\n{OUTPUT}\n```\nhi\n```\n\n```sh\nnot tested\n```\n"
    )
    (block,) = marked_blocks(doc)
    assert (block.language, block.code, block.sample) == ("sh", "echo hi\n", "hi\n")
