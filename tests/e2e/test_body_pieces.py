"""PUT bodies sent in pieces of any size, chunked and with a Content-Length, against a
real server: every one is stored and reads back byte for byte.

The server hands the store one piece per socket read (Content-Length) or per chunk
(chunked), and the store writes a batch of pieces with one ``writev``: a body in small
pieces gave thousands of buffers to one call, past IOV_MAX (EINVAL, a 500).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testkit.entries import body, crc_hex
from testkit.server import ServerProcess
from tests.e2e.rawhttp import RawResponse, read_response

#: The server's body limit: small enough to send a whole body at it in tiny pieces.
LIMIT = 3 * 1024 * 1024
#: The safetensors header of ``body((n,), "U8", 1)`` (n of up to 7 digits).
HEADER_BYTES = 80


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("pieces")
    with ServerProcess(root / "data", root / "server.log", max_body_bytes=LIMIT) as srv:
        yield srv


def _pieces(data: bytes, sizes: random.Random, largest: int) -> Iterator[bytes]:
    offset = 0
    while offset < len(data):
        size = sizes.randint(1, largest)
        yield data[offset : offset + size]
        offset += size


def _put_in_pieces(
    port: int, target: str, data: bytes, pieces: Iterator[bytes], *, chunked: bool
) -> RawResponse:
    """PUT ``data``, each piece in its own send (TCP_NODELAY) or its own chunk."""
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(data)}"
    head = f"PUT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{framing}\r\n"
    head += f"X-EC-CRC32C: {crc_hex(data)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(head.encode())
        if chunked:
            # Many chunks per send: the pieces are the chunks, not the sends.
            frames = [b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces]
            sock.sendall(b"".join(frames) + b"0\r\n\r\n")
        else:
            for piece in pieces:
                sock.sendall(piece)
        return read_response(sock)


@given(
    length=st.integers(min_value=1, max_value=400_000),
    largest=st.sampled_from([1, 7, 100, 1000, 4096, 65536]),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    chunked=st.booleans(),
)
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_body_in_random_pieces_is_stored(
    limited: ServerProcess, length: int, largest: int, seed: int, chunked: bool
) -> None:
    data = body((length,), "U8", 1, seed=seed)
    target = f"/ec/pieces/uint8/p{seed}-{length}-{largest}-{int(chunked)}"
    pieces = _pieces(data, random.Random(seed), largest)
    answer = _put_in_pieces(limited.port, target, data, pieces, chunked=chunked)
    assert answer.status in (200, 201), (answer.status, answer.body)
    got = httpx.get(limited.url + target, timeout=30)
    assert got.status_code == 200 and got.content == data


@pytest.mark.parametrize("chunked", [True, False])
def test_body_at_the_limit_in_small_pieces(limited: ServerProcess, chunked: bool) -> None:
    """A body of exactly the limit, in 100-byte pieces (thousands per write batch), is
    stored; one byte more is refused as too large, never a 500."""
    data = body((LIMIT - HEADER_BYTES,), "U8", 1, seed=7)
    assert len(data) == LIMIT
    target = f"/ec/pieces/uint8/limit-{int(chunked)}"
    answer = _put_in_pieces(
        limited.port, target, data, _pieces(data, random.Random(1), 100), chunked=chunked
    )
    assert answer.status == 201, answer.body
    assert httpx.get(limited.url + target, timeout=30).content == data

    over = body((LIMIT - HEADER_BYTES + 1,), "U8", 1, seed=8)
    answer = _put_in_pieces(
        limited.port, target + "-over", over, _pieces(over, random.Random(2), 100), chunked=chunked
    )
    assert answer.status == 413, answer.body
    assert answer.json()["error"] == "body_too_large"
    assert list((limited.data_dir / "tmp").iterdir()) == []
