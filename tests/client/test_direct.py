"""GET and HEAD skip ``httpx.Client.send`` when the SDK's transport serves the replica:
they must send what httpx would have sent, and keep httpx's log line."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import ec_cache
import httpx
import pytest
import torch
from ec_cache._client_base import default_headers
from ec_cache._routes import direct_routes

from .fakeserver import FakeServer, Reply, Request, entry_reply
from .test_faults import BODY

Factory = Callable[..., Any]
PATHS = ["/ec/Qwen/Qwen2.5-VL-7B-Instruct@a1b2c3/bfloat16/ab.CD_9:x-y", "/ec/m/float32/h"]


@pytest.fixture()
def fake() -> Iterator[Callable[[Callable[[Request], Reply]], FakeServer]]:
    servers: list[FakeServer] = []

    def make(handler: Callable[[Request], Reply]) -> FakeServer:
        servers.append(FakeServer(handler))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8080", "http://cache-0", "http://h:81/prefix", "http://[::1]:9"]
)
def test_routes_send_what_httpx_would(url: str) -> None:
    headers = default_headers("tok", {"X-Extra": "1"})
    with httpx.Client(headers=headers) as http:
        route = direct_routes(http, [url])[url]
        for path in PATHS:
            request = http.build_request("GET", url + path)
            assert route.target(path) == request.url.raw_path
            assert route.headers == request.headers.raw
            assert route.key == (request.url.host, request.url.port or 80)


def test_urls_with_credentials_or_query_go_through_httpx() -> None:
    with httpx.Client() as http:
        urls = ["http://u:p@h:1", "http://h:1/?a=b", "https://h:1"]
        assert direct_routes(http, urls) == {}


def test_direct_get_and_head_headers_and_log(
    fake: Any, client_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    def answer(r: Request) -> Reply:
        reply = entry_reply(BODY, dtype="float32", shape="8,8")
        return Reply(reply.raw[: -len(BODY)]) if r.method == "HEAD" else reply

    srv = fake(answer)
    c = client_factory(
        srv.url + "/prefix", model="m", dtype="float32", token="tok", headers={"X-Extra": "1"}
    )
    with caplog.at_level(logging.INFO, logger="httpx"):
        got = c.get("h")
        info = c.head("h")
    assert got is not None and torch.equal(got, torch.arange(64.0).reshape(8, 8))
    assert info is not None and info.shape == (8, 8)
    assert [(r.method, r.path) for r in srv.requests] == [
        ("GET", "/prefix/ec/m/float32/h"),
        ("HEAD", "/prefix/ec/m/float32/h"),
    ]
    for r in srv.requests:
        assert r.headers["authorization"] == "Bearer tok"
        assert r.headers["x-extra"] == "1"
        assert r.headers["host"] == srv.url.removeprefix("http://")
        assert r.headers["accept-encoding"] == "identity"
        assert r.headers["user-agent"] == f"ec-cache-python/{ec_cache.__version__}"
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "httpx"]
    assert any(f"GET {srv.url}/prefix/ec/m/float32/h" in line for line in lines)
    assert any("HEAD" in line and '"HTTP/1.1 200 OK"' in line for line in lines)


def test_get_after_close_raises_as_before(fake: Any) -> None:
    srv = fake(lambda r: entry_reply(BODY, dtype="float32", shape="8,8"))
    c = ec_cache.Client(srv.url, model="m", dtype="float32")
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.get("h")
