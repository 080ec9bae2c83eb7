"""Requests that ask to switch protocols (``Upgrade: h2c``, what ``curl --http2`` sends
on a plain-HTTP URL) against a real server: nothing is upgraded (``ws="none"``), so
each is served as the plain HTTP/1.1 request it also is, body included, and the
requests pipelined after it on the connection are served too. So on the locked uvicorn
(the adapter, app/http_protocol) and on another one (the fallback: uvicorn's h11).

httptools tells llhttp to skip an Upgrade request's body: the server ended such a PUT
at its head and answered ``400 invalid_body`` (0 bytes received), or a 500; uvicorn's
stock httptools protocol, the fallback until it was h11, did so too, or reset the
connection, and never answered what was pipelined behind."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from testkit.entries import body, crc_hex
from testkit.server import ServerProcess
from tests.e2e.test_unlocked_uvicorn import OTHER_UVICORN

H2C = (
    "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)


@pytest.fixture(scope="module", params=["locked", "unlocked"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server on the locked uvicorn, and one on another (``make`` installs it)."""
    root = tmp_path_factory.mktemp(request.param)
    srv = ServerProcess(root / "data", root / "server.log")
    if request.param == "unlocked":
        if not (OTHER_UVICORN / "uvicorn").is_dir():
            pytest.fail(f"{OTHER_UVICORN} is missing: `make .venv/.test` installs it")
        srv.env["PYTHONPATH"] = str(OTHER_UVICORN)
    with srv:
        yield srv


def _exchange(port: int, requests: bytes) -> list[tuple[int, bytes]]:
    """Send ``requests`` (pipelined, the last one with ``Connection: close``) and read
    every answer until the server closes: (status, body) of each, 100 Continue too."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(requests)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    answers = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        answers.append((status, data[:length]))
        data = data[length:]
    return answers


def _framed(data: bytes, chunked: bool) -> tuple[str, bytes]:
    if not chunked:
        return f"Content-Length: {len(data)}\r\n", data
    pieces = [data[i : i + 70_000] for i in range(0, len(data), 70_000)]
    return "Transfer-Encoding: chunked\r\n", b"".join(
        b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces
    ) + b"0\r\n\r\n"


@pytest.mark.parametrize("size", [100, 400_000])
@pytest.mark.parametrize("expect", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_an_upgrade_put_is_stored(
    server: ServerProcess, size: int, expect: bool, chunked: bool
) -> None:
    data = body((size,), "U8", 1, seed=size)
    target = f"/ec/upgrade/uint8/h2c-{size}-{int(expect)}-{int(chunked)}"
    framing, payload = _framed(data, chunked)
    head = f"PUT {target} HTTP/1.1\r\nHost: x\r\n{H2C}{framing}X-EC-CRC32C: {crc_hex(data)}\r\n"
    head += "Expect: 100-continue\r\n" if expect else ""
    after = f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    answers = _exchange(server.port, head.encode() + b"\r\n" + payload + after.encode())
    answers = [answer for answer in answers if answer[0] != 100]
    assert [status for status, _ in answers] == [201, 200], answers
    assert json.loads(answers[0][1])["size"] == len(data)
    assert answers[1][1] == data
    assert httpx.get(server.url + target).content == data


def test_upgrade_requests_with_and_without_bodies_keep_the_connection_in_step(
    server: ServerProcess,
) -> None:
    """An Upgrade GET (no body), an Upgrade POST with a JSON body and a plain request,
    pipelined: each is answered in order, as if no Upgrade header were there."""
    data = body((64,), "U8", 1, seed=3)
    assert httpx.put(server.url + "/ec/upgrade/uint8/present", content=data).status_code == 201
    query = json.dumps({"hashes": ["present", "absent"]}).encode()
    requests = (
        f"GET /healthz HTTP/1.1\r\nHost: x\r\n{H2C}\r\n".encode()
        + f"POST /ec/upgrade/uint8/_exists HTTP/1.1\r\nHost: x\r\n{H2C}".encode()
        + f"Content-Type: application/json\r\nContent-Length: {len(query)}\r\n\r\n".encode()
        + query
        + f"GET /ec/upgrade/uint8/present HTTP/1.1\r\nHost: x\r\n{H2C}\r\n".encode()
        + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    answers = _exchange(server.port, requests)
    assert [status for status, _ in answers] == [200, 200, 200, 200], answers
    assert json.loads(answers[1][1]) == {"present": [True, False]}
    assert answers[2][1] == data
