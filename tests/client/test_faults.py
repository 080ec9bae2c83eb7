"""Failure handling: integrity errors from a corrupting server, 503/502, truncated
bodies, dropped keep-alive connections, retries across a real server restart, and
rendezvous routing with failover over two real servers."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import ec_cache
import httpx
import pytest
import torch
from ec_cache._tensors import build_header, tensor_memoryview

from testkit.polling import wait_for
from testkit.ports import free_port
from testkit.server import ServerProcess

from .fakeserver import FakeServer, Reply, Request, entry_reply, json_reply

Factory = Callable[..., Any]


def body_for(t: torch.Tensor, dtype: str) -> bytes:
    return build_header(dtype, tuple(t.shape)) + bytes(tensor_memoryview(t.contiguous()))


@pytest.fixture()
def fake() -> Iterator[Callable[[Callable[[Request], Reply]], FakeServer]]:
    servers: list[FakeServer] = []

    def make(handler: Callable[[Request], Reply]) -> FakeServer:
        servers.append(FakeServer(handler))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


T = torch.arange(64, dtype=torch.float32).reshape(8, 8)
BODY = body_for(T, "float32")


def test_corrupted_body_raises_integrity_error(fake: Any, client_factory: Factory) -> None:
    corrupted = bytearray(BODY)
    corrupted[-1] ^= 0xFF  # one flipped bit in the data, checksum of the original
    good_crc = __import__("google_crc32c").value(BODY)
    srv = fake(
        lambda r: entry_reply(bytes(corrupted), dtype="float32", shape="8,8", crc=f"{good_crc:08x}")
    )
    c = client_factory(srv.url, model="m", dtype="float32")
    with pytest.raises(ec_cache.IntegrityError, match="CRC32C"):
        c.get("h")
    assert len(srv.requests) == 1  # not retried


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "float16", "shape": "8,8"}, "X-EC-Dtype"),
        ({"dtype": "float32", "shape": "4,16"}, "X-EC-Shape"),
        ({"dtype": "float32", "shape": "8,8", "extra": "X-EC-Data-Offset: 8\r\n"}, "Offset"),
    ],
)
def test_header_disagreements(
    fake: Any, client_factory: Factory, kwargs: dict[str, Any], match: str
) -> None:
    srv = fake(lambda r: entry_reply(BODY, **kwargs))
    c = client_factory(srv.url, model="m", dtype="float32")
    with pytest.raises(ec_cache.IntegrityError, match=match):
        c.get("h")


def test_body_of_other_dtype(fake: Any, client_factory: Factory) -> None:
    body = body_for(T.to(torch.float16), "float16")
    srv = fake(lambda r: entry_reply(body, dtype="float32", shape="8,8"))
    c = client_factory(srv.url, model="m", dtype="float32")
    with pytest.raises(ec_cache.IntegrityError):
        c.get("h")


def test_good_fake_answer_round_trips(fake: Any, client_factory: Factory) -> None:
    srv = fake(lambda r: entry_reply(BODY, dtype="float32", shape="8,8"))
    c = client_factory(srv.url, model="m/x", dtype="float32", token="tok-123")
    assert torch.equal(c.get("h"), T)
    req = srv.requests[0]
    assert req.path == "/ec/m/x/float32/h" and req.headers["authorization"] == "Bearer tok-123"
    for _ in range(3):
        assert torch.equal(c.get("h"), T)
    assert srv.connections == 1  # keep-alive


def test_truncated_body_is_a_transport_error(fake: Any, client_factory: Factory) -> None:
    srv = fake(lambda r: entry_reply(BODY, dtype="float32", shape="8,8", truncate=10))
    c = client_factory(srv.url, model="m", dtype="float32", retries=ec_cache.Retries(2, 0.0))
    with pytest.raises(ec_cache.TransportError):
        c.get("h")
    assert len(srv.requests) == 2  # retried once, then given up


def test_503_is_a_miss_unless_asked(fake: Any, client_factory: Factory) -> None:
    srv = fake(
        lambda r: json_reply(
            503, '{"error":"unavailable","message":"s3 down","part":null}', "Retry-After: 2\r\n"
        )
    )
    c = client_factory(srv.url, model="m", dtype="float32")
    assert c.get("h") is None and c.head("h") is None and c.exists("h") is False
    assert c.exists_many(["a", "b"]) == [False, False]
    strict = client_factory(srv.url, model="m", dtype="float32", raise_on_unavailable=True)
    with pytest.raises(ec_cache.UnavailableError) as info:
        strict.get("h")
    assert info.value.retry_after == 2.0 and info.value.code == "unavailable"
    with pytest.raises(ec_cache.UnavailableError):  # writes always raise
        c.put("h", T)


def test_502_is_retried(fake: Any, client_factory: Factory) -> None:
    calls = [0]

    def handler(r: Request) -> Reply:
        calls[0] += 1
        if calls[0] < 3:
            return json_reply(502, "bad gateway")
        return entry_reply(BODY, dtype="float32", shape="8,8")

    srv = fake(handler)
    c = client_factory(
        srv.url, model="m", dtype="float32", retries=ec_cache.Retries(attempts=3, backoff=0.01)
    )
    assert torch.equal(c.get("h"), T)
    calls[0] = 0
    c1 = client_factory(srv.url, model="m", dtype="float32", retries=1)
    with pytest.raises(ec_cache.ServerError) as info:
        c1.get("h")
    assert info.value.status_code == 502 and info.value.code is None


def test_4xx_is_not_retried(fake: Any, client_factory: Factory) -> None:
    srv = fake(lambda r: json_reply(400, '{"error":"invalid_hash","message":"no","part":"hash"}'))
    c = client_factory(srv.url, model="m", dtype="float32")
    with pytest.raises(ec_cache.ServerError) as info:
        c.get("h")
    assert (info.value.code, info.value.part) == ("invalid_hash", "hash")
    assert len(srv.requests) == 1


def test_silently_dropped_keepalive_connection_is_retried(
    fake: Any, client_factory: Factory
) -> None:
    """The server closes after each answer without ``Connection: close``: the next request
    on the pooled connection fails before any byte and is sent again on a new one."""
    srv = fake(lambda r: Reply(entry_reply(BODY, dtype="float32", shape="8,8").raw, close=True))
    c = client_factory(srv.url, model="m", dtype="float32", retries=1)
    for n in range(1, 5):
        assert torch.equal(c.get("h"), T)
        wait_for(lambda: srv.closed == n, "the server to close it")  # noqa: B023 (used at once)
    assert len(srv.requests) == 4


def test_connection_refused_is_connect_error(client_factory: Factory) -> None:

    c = client_factory(
        f"http://127.0.0.1:{free_port()}",
        model="m",
        dtype="float32",
        retries=ec_cache.Retries(attempts=2, backoff=0.01),
    )
    with pytest.raises(ec_cache.ConnectError):
        c.get("h")
    with pytest.raises(ec_cache.TransportError):
        c.put("h", T)


def test_read_timeout(fake: Any, client_factory: Factory) -> None:
    def slow(r: Request) -> Reply:
        time.sleep(1.0)  # the behaviour under test: a server slower than the read timeout
        return entry_reply(BODY, dtype="float32", shape="8,8")

    srv = fake(slow)
    c = client_factory(
        srv.url,
        model="m",
        dtype="float32",
        retries=1,
        timeouts=ec_cache.Timeouts(connect=1, read=0.2, write=1, pool=1),
    )
    with pytest.raises(ec_cache.TransportTimeout):
        c.get("h")


# -- real servers ----------------------------------------------------------------------
def test_retries_across_a_server_restart(
    make_server: Callable[..., ServerProcess], client_factory: Factory
) -> None:
    srv = make_server()
    c = client_factory(
        srv.url,
        model="m",
        dtype="bfloat16",
        retries=ec_cache.Retries(attempts=30, backoff=0.1, max_backoff=0.3),
    )
    t = torch.randn(16, 32).to(torch.bfloat16)
    c.put("persist", t)
    srv.stop()
    restarter = threading.Timer(0.7, srv.start, kwargs={"wait": False})
    restarter.start()
    try:
        got = c.get("persist")  # refused, retried with backoff until the server is back
    finally:
        restarter.join()
    assert got is not None and torch.equal(got, t)


def test_two_replicas_routing_and_failover(
    make_server: Callable[..., ServerProcess], client_factory: Factory
) -> None:
    a, b = make_server(), make_server()
    c = client_factory(
        [a.url, b.url], model="m", dtype="float32", retries=ec_cache.Retries(attempts=1)
    )
    hashes = [uuid.uuid4().hex for _ in range(40)]
    for i, h in enumerate(hashes):
        assert c.put(h, torch.full((4,), float(i)))
    on_a = [h for h in hashes if httpx.head(f"{a.url}/ec/m/float32/{h}").status_code == 200]
    on_b = [h for h in hashes if httpx.head(f"{b.url}/ec/m/float32/{h}").status_code == 200]
    assert sorted(on_a + on_b) == sorted(hashes) and on_a and on_b  # spread, no duplicates
    for h in on_a:
        assert c.router.order("m", "float32", h)[0] == a.url
    assert c.exists_many(hashes) == [True] * len(hashes)
    assert c.get_many(hashes)[5].tolist() == [5.0] * 4

    a.stop()  # keys of a now go to b: misses there, then stored there
    h = on_a[0]
    assert c.get(h) is None
    assert c.put(h, torch.ones(4))
    assert httpx.head(f"{b.url}/ec/m/float32/{h}").status_code == 200
    assert torch.equal(c.get(on_b[0]), torch.full((4,), float(hashes.index(on_b[0]))))
    assert c.exists_many([h, on_b[0], on_a[1]]) == [True, True, False]
    c.delete(on_b[0])  # a is down: deleted where reachable
    assert c.get(on_b[0]) is None
    b.stop()
    with pytest.raises(ec_cache.ConnectError):
        c.get(h)


def test_cookies_are_neither_kept_nor_sent(fake: Any, client_factory: Factory) -> None:
    """ec-cache sets no cookies, so a ``Set-Cookie`` from a server (or a proxy in front)
    is never sent back: neither by the SDK's own transport (GET) nor through httpx
    (DELETE, ``stats``)."""
    srv = fake(
        lambda r: entry_reply(BODY, dtype="float32", shape="8,8", extra="Set-Cookie: s=1\r\n")
    )
    c = client_factory(srv.url, model="m", dtype="float32")
    assert c.get("h") is not None
    c.delete("h")
    assert c.get("h") is not None
    c.delete("h")
    assert [r.method for r in srv.requests] == ["GET", "DELETE", "GET", "DELETE"]
    assert all("cookie" not in {k.lower() for k in r.headers} for r in srv.requests)
