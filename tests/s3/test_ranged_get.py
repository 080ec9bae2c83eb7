"""The read path's GET of a large object as concurrent ranged GETs
(``app/tiers/s3/ranged_get.py``), against the real S3 endpoint behind the fault proxy:
bytes identical around every part boundary, parts that fail mid-way (reset, 500, held),
objects of other tools, the boto3 data plane of another botocore, and, through a
server, a read-through that fails cleanly and one whose client left stopping its part
GETs."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import httpx
import pytest

from app.checksum import crc32c as crc
from app.tiers.s3 import botocore_adapter
from app.tiers.s3.client import S3Client
from app.tiers.s3.errors import S3Unavailable
from testkit.fault_proxy import FaultProxy
from testkit.polling import wait_for
from tests.s3.conftest import MiB, ServerFactory, StoreFactory, read_object, write_object
from tests.s3.test_server_s3 import client_for, entry, metric, put, url

pytestmark = pytest.mark.anyio

PART = 256 * 1024


def _data(size: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(size))


async def _stored(
    make_store: StoreFactory, proxy: FaultProxy, name: str, size: int, **settings: Any
) -> tuple[S3Client, str, bytes]:
    """An object of ``size`` bytes written as the server writes entries, and a client
    reading it through ``proxy`` in parts of ``PART`` bytes, 3 at once (``settings``
    override), the proxy's log cleared."""
    writer = make_store()
    key = f"{writer.prefix}/{name}.safetensors"
    data = _data(size, seed=size)
    await write_object(writer, key, data, crc32c=crc(data))
    settings = {"s3_get_part_size": PART, "s3_get_concurrency": 3, **settings}
    store = make_store(s3_endpoint_url=proxy.url, **settings)
    proxy.reset()
    return store, key, data


def _ranges(proxy: FaultProxy) -> list[str | None]:
    """The ``Range`` of every GET the proxy saw, in order."""
    return [
        next((value for name, value in h.items() if name.lower() == "range"), None)
        for h in proxy.headers_of("GET")
    ]


@pytest.mark.parametrize(
    "size",
    [1, PART - 1, PART, PART + 1, 2 * PART - 1, 2 * PART, 2 * PART + 1, 7 * PART + 12_345],
)
async def test_bytes_identical_around_every_part_boundary(
    make_store: StoreFactory, s3_proxy: FaultProxy, size: int
) -> None:
    store, key, data = await _stored(make_store, s3_proxy, f"parts-{size}", size)
    download = await store.open(key)
    assert download is not None
    assert download.info.size == size and download.info.crc32c == crc(data)
    async with contextlib.aclosing(download):
        got = b"".join([bytes(chunk) async for chunk in download.chunks()])
    assert got == data
    # One ranged GET per part, each asking for its own bytes.
    parts = -(-size // PART)
    assert s3_proxy.count("GET", key) == parts
    assert sorted(map(str, _ranges(s3_proxy))) == sorted(
        f"bytes={i * PART}-{min((i + 1) * PART, size if i else PART) - 1}" for i in range(parts)
    )


@pytest.mark.parametrize("fault", ["reset", "500"])
async def test_a_part_failing_mid_way_is_asked_again(
    make_store: StoreFactory, s3_proxy: FaultProxy, fault: str
) -> None:
    store, key, data = await _stored(make_store, s3_proxy, f"retried-{fault}", 5 * PART + 99)
    s3_proxy.span_faults[2 * PART] = [fault]
    assert await read_object(store, key) == data
    assert s3_proxy.count("GET", key) == 6 + 1  # the broken part once more
    # Asked again for the bytes it still lacks (all of them after a 500; after a reset,
    # what the reset lost).
    asked = [r for r in _ranges(s3_proxy) if str(r).endswith(f"-{3 * PART - 1}")]
    assert len(asked) == 2 and asked[0] == f"bytes={2 * PART}-{3 * PART - 1}", asked


async def test_a_part_that_keeps_failing_fails_the_read(
    make_store: StoreFactory, s3_proxy: FaultProxy
) -> None:
    store, key, _ = await _stored(
        make_store, s3_proxy, "broken", 4 * PART, s3_get_concurrency=2, s3_max_attempts=2
    )
    s3_proxy.span_faults[3 * PART] = ["500", "500"]
    download = await store.open(key)
    assert download is not None
    received = 0
    with pytest.raises(S3Unavailable):
        async with contextlib.aclosing(download):
            async for chunk in download.chunks():
                received += len(chunk)
    assert received == 3 * PART  # the parts before it, in order, and nothing after


@pytest.mark.parametrize(("budget", "started"), [(64 * PART, 4), (2 * PART, 3), (0, 2)])
async def test_a_held_part_leaves_later_parts_buffered_in_order(
    make_store: StoreFactory, s3_proxy: FaultProxy, budget: int, started: int
) -> None:
    """Part 1 held while the consumer waits for it: parts ahead of it started as the
    window (3) allows, and as the budget for parts ahead (``EC_S3_GET_BUFFER_BYTES``)
    has room: 64 parts' worth, parts 2 and 3; two parts' worth, part 2 (part 1 took the
    other when it started ahead of part 0); none, part 1 only, once it is the
    consumer's."""
    store, key, data = await _stored(
        make_store, s3_proxy, f"held-{budget}", 6 * PART, s3_get_buffer_bytes=budget
    )
    s3_proxy.span_gate.clear()
    s3_proxy.span_faults[PART] = ["hold"]
    download = await store.open(key)
    assert download is not None
    chunks = download.chunks()
    first = bytearray()
    while len(first) < PART:
        first += await anext(chunks)
    waiting = asyncio.ensure_future(anext(chunks))  # for part 1, held
    await asyncio.to_thread(
        wait_for, lambda: s3_proxy.spans_held == 1, "the held part to reach the proxy", 10
    )
    # A part started with the held one may reach the proxy just after it.
    await asyncio.to_thread(
        wait_for, lambda: s3_proxy.count("GET", key) >= started, "the window's parts", 10
    )
    assert s3_proxy.count("GET", key) == started
    s3_proxy.span_gate.set()
    rest = bytes(await waiting) + b"".join([bytes(chunk) async for chunk in chunks])
    await download.aclose()
    assert bytes(first) + rest == data


async def test_objects_without_ec_metadata_or_bytes_are_read_whole(
    make_store: StoreFactory, s3_proxy: FaultProxy
) -> None:
    writer = make_store()
    key = f"{writer.prefix}/foreign.safetensors"
    data = _data(3 * PART, seed=6)
    await writer.run(lambda: writer.client.put_object(Bucket=writer.bucket, Key=key, Body=data))
    store = make_store(s3_endpoint_url=s3_proxy.url, s3_get_part_size=PART, s3_get_concurrency=3)
    s3_proxy.reset()
    assert await read_object(store, key) == data
    # The first part's answer says it has no ec-crc32c: one plain GET for the body.
    assert _ranges(s3_proxy) == [f"bytes=0-{PART - 1}", None]
    # An empty object has no byte 0 (416): one plain GET as well.
    empty = f"{writer.prefix}/empty.safetensors"
    await writer.run(lambda: writer.client.put_object(Bucket=writer.bucket, Key=empty, Body=b""))
    s3_proxy.reset()
    assert await read_object(store, empty) == b""
    assert _ranges(s3_proxy) == [f"bytes=0-{PART - 1}", None]


def test_read_through_with_a_failing_part_keeps_nothing(
    make_server: ServerFactory, s3_proxy: FaultProxy
) -> None:
    a = client_for(make_server("a"))
    data = entry(2_000, seed=21)  # ~4 MB: 16 parts of 256 KiB
    assert put(a, "failing", data).status_code == 201
    srv = make_server(
        "b",
        endpoint_url=s3_proxy.url,
        s3_get_part_size=str(PART),
        s3_get_concurrency="4",
        s3_max_attempts="2",
    )
    s3_proxy.span_faults[5 * PART] = ["500", "500"]  # S3 fails it as often as retried
    with pytest.raises(httpx.HTTPError), client_for(srv) as b:
        b.get(url("failing"))  # the body ends short of its Content-Length
    b = client_for(srv)
    assert metric(b, "ec_s3_fills_total", outcome="failed") == 1
    assert metric(b, "ec_s3_fills_total", outcome="committed") == 0
    # S3 failing opened the breaker (503 for its cooldown); then, nothing having been
    # kept, the entry is read from S3 again, whole.
    answers: list[httpx.Response] = []

    def answered() -> bool:
        answers.append(b.get(url("failing")))
        return answers[-1].status_code == 200

    wait_for(answered, "the breaker to close", 10)
    assert answers[-1].headers["X-EC-Tier"] == "s3" and answers[-1].content == data


def test_client_gone_mid_body_stops_the_part_gets(
    make_server: ServerFactory, s3_proxy: FaultProxy
) -> None:
    a = client_for(make_server("a"))
    data = entry(4_000, seed=22)  # ~8 MB: 32 parts of 256 KiB
    assert put(a, "gone", data).status_code == 201
    srv = make_server(
        "b", endpoint_url=s3_proxy.url, s3_get_part_size=str(PART), s3_get_concurrency="3"
    )
    b = client_for(srv)
    s3_proxy.reset()
    s3_proxy.span_gate.clear()
    s3_proxy.span_faults[4 * PART] = ["hold"]  # the fill cannot pass part 4
    with b.stream("GET", url("gone")) as resp:
        assert resp.headers["X-EC-Tier"] == "s3"
        chunks = resp.iter_raw(64 * 1024)  # kept: a dropped iterator closes the stream
        next(chunks)
        wait_for(lambda: s3_proxy.spans_held == 1, "the fill to reach the held part", 10)
    b.close()  # drops the connection with most of the body unread
    b = client_for(srv)
    wait_for(
        lambda: metric(b, "ec_s3_fills_total", outcome="abandoned") == 1,
        "the fill to stop once its client left",
        20,
    )
    started = s3_proxy.count("GET", "/gone.safetensors")
    s3_proxy.span_gate.set()
    # Parts 0-6 at most (the window of 3 behind the held part 4): not the other 25.
    assert started <= 7, s3_proxy.snapshot()
    assert metric(b, "ec_s3_fills_total", outcome="committed") == 0
    got = b.get(url("gone"))  # nothing kept: read from S3 again
    assert got.headers["X-EC-Tier"] == "s3" and got.content == data
    assert s3_proxy.count("GET", "/gone.safetensors") == started + 32


async def test_another_botocore_falls_back_to_boto3_calls(
    make_store: StoreFactory, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(botocore_adapter, "installed", lambda: "1.0.0")
    store = make_store(s3_endpoint_url=s3_proxy.url, s3_get_part_size=PART, s3_get_concurrency=3)
    assert store.data_plane.layer == "boto3"
    key = f"{store.prefix}/fallback.safetensors"
    data = _data(3 * PART + 5, seed=7)
    await write_object(store, key, data, crc32c=crc(data))  # put_object
    large = os.urandom(2 * 5 * MiB + 3)  # above the 8 MiB threshold: upload_part
    await write_object(store, key + "-parts", large, crc32c=crc(large))
    parts = s3_proxy.count("PUT", "partNumber=")
    assert parts == 3 and s3_proxy.count("PUT") == 1 + parts
    agents = [h.get("User-Agent", "") for h in s3_proxy.headers_of("PUT")]
    assert all("Boto3" in agent for agent in agents)
    assert await read_object(store, key + "-parts") == large
    s3_proxy.reset()
    download = await store.open(key)
    assert download is not None and download.info.crc32c == crc(data)
    async with contextlib.aclosing(download):
        assert b"".join([bytes(chunk) async for chunk in download.chunks()]) == data
    assert sorted(map(str, _ranges(s3_proxy))) == sorted(
        f"bytes={i * PART}-{min((i + 1) * PART, len(data)) - 1}" for i in range(4)
    )
    assert await store.open(f"{store.prefix}/absent.safetensors") is None


async def test_behind_a_proxy_parts_go_through_it(
    make_store: StoreFactory, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = make_store()
    key = f"{writer.prefix}/proxied-parts.safetensors"
    data = _data(3 * PART + 1, seed=8)
    await write_object(writer, key, data, crc32c=crc(data))
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", s3_proxy.url)  # signed_http, on botocore's transport
    store = make_store(s3_get_part_size=PART, s3_get_concurrency=3)
    assert store.data_plane.layer == "botocore"
    s3_proxy.reset()
    assert await read_object(store, key) == data
    assert s3_proxy.count("GET", key) == 4  # each part through the proxy
