"""The data directory at start-up (app/tiers/disk/data_dir.py), with real ``python -m
app`` processes: one server per directory, and stray files either set aside or named in
one line that says what to do."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from testkit.entries import body, crc_hex
from testkit.server import ServerProcess

ENTRY = "/ec/m/uint8/h1"


def _put(url: str, data: bytes) -> int:
    return httpx.put(
        f"{url}{ENTRY}", content=data, headers={"X-EC-CRC32C": crc_hex(data)}
    ).status_code


def _refused(srv: ServerProcess) -> str:
    """Start ``srv`` expecting it to stop at once; its output."""
    srv.start(wait=False)
    assert srv.proc is not None
    code = srv.proc.wait(30)
    srv.proc = None
    assert code != 0
    return srv.log_path.read_text()


def _one_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert "Traceback" not in output
    return lines[0]


def test_a_second_server_on_the_directory_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data = body((4, 8), "U8", 1, seed=1)
    with ServerProcess(data_dir, tmp_path / "first.log") as first:
        assert _put(first.url, data) == 201
        # A write in progress of the first server: a second one would remove it.
        in_flight = data_dir / "tmp" / "upload-in-progress"
        in_flight.write_bytes(b"partial")
        line = _one_line(_refused(ServerProcess(data_dir, tmp_path / "second.log")))
        assert line.startswith("ec-cache: EC_DATA_DIR ")
        assert f"in use by another ec-cache server (pid {first.proc.pid}" in line  # type: ignore[union-attr]
        assert "give this server its own EC_DATA_DIR" in line
        assert in_flight.read_bytes() == b"partial"
        assert httpx.get(f"{first.url}{ENTRY}").content == data
    # The lock goes with the process: the next server starts (and cleans up).
    with ServerProcess(data_dir, tmp_path / "third.log") as third:
        assert httpx.get(f"{third.url}{ENTRY}").content == data
    assert not in_flight.exists()


def test_the_lock_is_released_by_a_killed_server(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = ServerProcess(data_dir, tmp_path / "first.log").start()
    first.kill()
    with ServerProcess(data_dir, tmp_path / "second.log") as second:
        assert httpx.get(f"{second.url}/healthz").status_code == 200


def test_a_keys_log_tmp_directory_is_set_aside(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data = body((4, 8), "U8", 1, seed=2)
    with ServerProcess(data_dir, tmp_path / "a.log") as srv:
        assert _put(srv.url, data) == 201
    (data_dir / "keys.log.tmp").mkdir()
    (data_dir / "keys.log.tmp" / "junk").write_text("x")
    with ServerProcess(data_dir, tmp_path / "b.log") as srv:
        assert httpx.get(f"{srv.url}{ENTRY}").content == data
        listed = httpx.get(f"{srv.url}/namespaces").json()
        assert any(ns["model"] == "m" for ns in listed["namespaces"]), listed
    aside = list(data_dir.glob("keys.log.tmp.invalid-*"))
    assert len(aside) == 1 and (aside[0] / "junk").read_text() == "x"
    assert (data_dir / "keys.log").is_file()
    assert "keys.log.tmp is a directory" in (tmp_path / "b.log").read_text()


def test_a_tmp_file_is_set_aside(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "tmp").write_text("not a folder")
    data = body((4, 8), "U8", 1, seed=3)
    with ServerProcess(data_dir, tmp_path / "log") as srv:
        assert _put(srv.url, data) == 201
        assert httpx.get(f"{srv.url}{ENTRY}").content == data
    assert (data_dir / "tmp").is_dir()
    (aside,) = data_dir.glob("tmp.invalid-*")
    assert aside.read_text() == "not a folder"


@pytest.mark.parametrize("name", ["objects", "upload-queue", "purges"])
def test_a_kept_folder_as_a_plain_file_stops_start_up_in_one_line(
    tmp_path: Path, name: str
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / name).write_text("what is this")
    line = _one_line(_refused(ServerProcess(data_dir, tmp_path / "log")))
    assert line == (
        f"ec-cache: {data_dir / name} is a plain file, where the server keeps a directory: "
        "move it out of EC_DATA_DIR (look at it first) and start again"
    )
    assert (data_dir / name).read_text() == "what is this"


def test_a_data_dir_that_is_a_file_stops_start_up_in_one_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.write_text("")
    line = _one_line(_refused(ServerProcess(data_dir, tmp_path / "log")))
    assert (
        line
        == f"ec-cache: EC_DATA_DIR {data_dir} is not a directory: point EC_DATA_DIR at a directory"
    )


def test_a_data_dir_that_cannot_be_created_stops_start_up_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    data_dir = tmp_path / "file" / "data"
    line = _one_line(_refused(ServerProcess(data_dir, tmp_path / "log")))
    assert line == (
        f"ec-cache: cannot use EC_DATA_DIR {data_dir} (Not a directory): give the server "
        "a directory it can create and write"
    )
