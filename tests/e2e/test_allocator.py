"""The server reuses the memory of upload bodies instead of faulting in fresh pages.

glibc's default thresholds made every 64-256 KiB piece of every PUT body fresh memory:
a page fault per 4 KiB of body, about 1,000 per 4.7 MB PUT (``app.allocator``). The
server's minor-fault counter (``/proc/PID/stat``) is exact and timing-free: after a
warm-up, a run of PUTs must fault in far fewer pages than the bodies hold.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.entries import body, crc_hex
from testkit.server import ServerProcess

SHAPE = (256, 4096)  # float32: 4 MiB, 1,024 pages a body
PUTS = 12


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    with ServerProcess(tmp_path / "data", tmp_path / "server.log") as srv:
        yield srv


def _minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def test_put_bodies_do_not_fault_in_fresh_pages(server: ServerProcess) -> None:
    assert server.proc is not None
    with httpx.Client(base_url=server.url, timeout=30) as http:

        def put(index: int) -> None:
            data = body(SHAPE, "F32", 4, seed=index)
            response = http.put(
                f"/ec/alloc/float32/k{index}", content=data, headers={"X-EC-CRC32C": crc_hex(data)}
            )
            assert response.status_code == 201, response.text

        for index in range(4):  # warm-up: the heap grows to what a PUT needs
            put(index)
        before = _minor_faults(server.proc.pid)
        for index in range(4, 4 + PUTS):
            put(index)
        per_put = (_minor_faults(server.proc.pid) - before) / PUTS
    pages = 4 * SHAPE[0] * SHAPE[1] // 4096
    assert per_put < pages / 8, f"{per_put:.0f} page faults per PUT of {pages} pages"


def _thresholds_raised(env: dict[str, str]) -> str:
    code = "from app.allocator import keep_freed_memory; print(keep_freed_memory())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_an_operators_malloc_settings_are_kept() -> None:
    base = {"PATH": "/usr/bin:/bin"}
    assert _thresholds_raised(base) == "True"  # glibc (Debian, the image)
    assert _thresholds_raised({**base, "MALLOC_TRIM_THRESHOLD_": "131072"}) == "False"
