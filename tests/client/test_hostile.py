"""The SDK against a hostile server: every framing oddity ends in a typed SDK exception
(or the right tensor), never a hang past the timeouts, never a wrong tensor, never a
TypeError. Both clients (the blocking one is generated from the asyncio one) run every
case; property-based tests (hypothesis) vary the framing and corrupt the bytes."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ec_cache
import pytest
import torch
from ec_cache import Retries, Timeouts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testkit.ports import free_port
from testkit.server import ServerProcess

from .hostile import (
    BODY,
    HostileServer,
    Script,
    Step,
    T,
    chunked,
    entry_head,
    zero_elements_body,
)

Factory = Callable[..., Any]
pytestmark = pytest.mark.timeout(60)

FAST = Timeouts(connect=2.0, read=0.5, write=2.0, pool=2.0)


@pytest.fixture()
def hostile() -> Iterator[Callable[[Script], HostileServer]]:
    servers: list[HostileServer] = []

    def make(script: Script) -> HostileServer:
        servers.append(HostileServer(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def always(*steps: Step) -> Script:
    return lambda head: steps


def client_for(factory: Factory, srv: HostileServer, **kw: Any) -> Any:
    kw.setdefault("timeouts", FAST)
    kw.setdefault("retries", Retries(attempts=1))
    return factory(srv.url, model="m", dtype="float32", **kw)


# -- answers that must give the right tensor ---------------------------------------
GOOD: dict[str, tuple[Step, ...]] = {
    "content-length": (entry_head() + BODY,),
    "content-length, one byte at a time": (
        entry_head(),
        *(BODY[i : i + 1] for i in range(len(BODY))),
    ),
    "chunked": (entry_head(framing="Transfer-Encoding: chunked") + chunked(BODY, [1, 7, 100]),),
    "chunked, extensions and trailers": (
        entry_head(framing="Transfer-Encoding: chunked")
        + chunked(BODY, [3, 50], trailers=b"X-Trailer: 1\r\nX-Other: two\r\n").replace(
            b"3\r\n", b"3;name=value\r\n", 1
        ),
    ),
    "chunked, upper-case hex and leading zeros": (
        entry_head(framing="Transfer-Encoding: chunked")
        + b"%X\r\n" % len(BODY)
        + BODY
        + b"\r\n0000\r\n\r\n",
    ),
    "close-delimited (HTTP/1.0)": (entry_head(framing="", version="HTTP/1.0") + BODY, b""),
    "close-delimited (HTTP/1.1, Connection: close)": (
        entry_head(framing="Connection: close") + BODY,
        b"",
    ),
    "a few 1xx first": (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + entry_head() + BODY,
    ),
    "head and body in pieces, slower than nothing but faster than the timeout": (
        entry_head()[:10],
        0.05,
        entry_head()[10:] + BODY[:100],
        0.05,
        BODY[100:],
    ),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_good_framings_give_the_tensor(hostile: Any, client_factory: Factory, name: str) -> None:
    srv = hostile(always(*GOOD[name]))
    c = client_for(client_factory, srv)
    for _ in range(2):  # a second request: on the kept connection, or a fresh one
        assert torch.equal(c.get("h"), T)


# -- answers that must raise a typed error -----------------------------------------
def _chunked_with(size_line: bytes) -> tuple[Step, ...]:
    return (
        entry_head(framing="Transfer-Encoding: chunked") + size_line + b"\r\n" + BODY + b"\r\n",
        b"",
    )


BAD: dict[str, tuple[tuple[Step, ...], type[ec_cache.ECCacheError]]] = {
    "negative chunk size": (_chunked_with(b"-5"), ec_cache.TransportError),
    "hex-prefixed chunk size": (_chunked_with(b"0x1f"), ec_cache.TransportError),
    "underscored chunk size": (_chunked_with(b"1_0"), ec_cache.TransportError),
    "signed chunk size": (_chunked_with(b"+%x" % len(BODY)), ec_cache.TransportError),
    "chunk size with spaces inside": (_chunked_with(b"1 0"), ec_cache.TransportError),
    "chunk larger than announced data": (
        (
            entry_head(framing="Transfer-Encoding: chunked")
            + b"%x\r\n" % (len(BODY) + 10)
            + BODY
            + b"\r\n0\r\n\r\n",
            b"",
        ),
        ec_cache.ECCacheError,
    ),
    "early close in the head": ((entry_head()[:30], b""), ec_cache.TransportError),
    "early close in the body": ((entry_head() + BODY[:-10], b""), ec_cache.TransportError),
    "early close in a chunk": (
        (entry_head(framing="Transfer-Encoding: chunked") + chunked(BODY, [100])[:150], b""),
        ec_cache.TransportError,
    ),
    "Content-Length larger than the body": (
        (entry_head(framing=f"Content-Length: {len(BODY) + 5}") + BODY, b""),
        ec_cache.ECCacheError,
    ),
    "Content-Length smaller than the body": (
        (entry_head(framing=f"Content-Length: {len(BODY) - 4}") + BODY,),
        ec_cache.IntegrityError,
    ),
    "two different Content-Lengths": (
        (
            entry_head(framing=f"Content-Length: {len(BODY)}\r\nContent-Length: 5") + BODY,
            b"",
        ),
        ec_cache.TransportError,
    ),
    "negative Content-Length": (
        (entry_head(framing="Content-Length: -1") + BODY, b""),
        ec_cache.TransportError,
    ),
    "unknown Transfer-Encoding": (
        (entry_head(framing="Transfer-Encoding: gzip") + BODY, b""),
        ec_cache.TransportError,
    ),
    "too many 1xx": ((b"HTTP/1.1 102 Processing\r\n\r\n" * 100, b""), ec_cache.TransportError),
    "not HTTP at all": ((b"SSH-2.0-OpenSSH_9.2\r\n\r\n", b""), ec_cache.TransportError),
    "bad status line": ((b"HTTP/1.1 2x0 OK\r\n\r\n", b""), ec_cache.TransportError),
    "header line without a colon": (
        (b"HTTP/1.1 200 OK\r\nbroken\r\nContent-Length: 0\r\n\r\n", b""),
        ec_cache.TransportError,
    ),
    "head far larger than 64 KiB": (
        (b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 200_000 + b"\r\n\r\n", b""),
        ec_cache.TransportError,
    ),
    "closes without answering": ((b"",), ec_cache.TransportError),
    "a dimension of 2^70 and zero elements": (
        (
            entry_head(zero_elements_body([2**70, 0]), shape=f"{2**70},0")
            + zero_elements_body([2**70, 0]),
        ),
        ec_cache.IntegrityError,
    ),
    "a dimension of 2^70 and zero elements (no X-EC-Shape)": (
        (
            entry_head(zero_elements_body([0, 2**70]), shape="", extra="").replace(
                b"X-EC-Shape: \r\n", b""
            )
            + zero_elements_body([0, 2**70]),
        ),
        ec_cache.IntegrityError,
    ),
    "X-EC-Shape with an underscore": (
        (entry_head(shape="8,8_0") + BODY,),
        ec_cache.IntegrityError,
    ),
    "header describing a huge tensor, chunked": (
        (
            entry_head(framing="Transfer-Encoding: chunked", shape="").replace(
                b"X-EC-Shape: \r\n", b""
            )
            + chunked(
                zero_elements_body([2**40, 2**10]).replace(b"[0,0]", b"[0,0]"),
                [1000],
            ),
            b"",
        ),
        ec_cache.IntegrityError,
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_framings_raise_typed_errors(hostile: Any, client_factory: Factory, name: str) -> None:
    steps, kind = BAD[name]
    srv = hostile(always(*steps))
    c = client_for(client_factory, srv)
    with pytest.raises(kind):
        c.get("h")


def test_bytes_after_the_body_never_reach_the_next_request(
    hostile: Any, client_factory: Factory
) -> None:
    """The bytes after a body look like a complete (wrong) answer: the connection must
    not be reused, so the next request gets its own, right answer."""
    other = torch.full((8, 8), 7.0)
    from .hostile import body_of

    wrong = entry_head(body_of(other)) + body_of(other)
    srv = hostile(always(entry_head() + BODY + wrong))
    c = client_for(client_factory, srv)
    for _ in range(3):
        assert torch.equal(c.get("h"), T)
    assert srv.connections == 3


def test_bytes_after_a_chunked_body(hostile: Any, client_factory: Factory) -> None:
    srv = hostile(
        always(entry_head(framing="Transfer-Encoding: chunked") + chunked(BODY, [9]) + b"junk")
    )
    c = client_for(client_factory, srv)
    for _ in range(2):
        assert torch.equal(c.get("h"), T)
    assert srv.connections == 2


def test_keep_alive_is_used_when_both_sides_complete(hostile: Any, client_factory: Factory) -> None:
    srv = hostile(always(entry_head() + BODY))
    c = client_for(client_factory, srv)
    for _ in range(4):
        assert torch.equal(c.get("h"), T)
    head_answer = entry_head()  # HEAD: Content-Length without a body
    srv2 = hostile(
        lambda head: [head_answer] if head.startswith(b"HEAD") else [entry_head() + BODY]
    )
    c2 = client_for(client_factory, srv2)
    info = c2.head("h")
    assert info is not None and info.shape == (8, 8) and info.size == len(BODY)
    assert torch.equal(c2.get("h"), T)
    assert srv.connections == 1 and srv2.connections == 1


def test_a_kept_alive_connection_closed_without_an_answer_is_retried_once(
    hostile: Any, client_factory: Factory
) -> None:
    """A server that closes an idle connection just as a request arrives on it (its
    keep-alive deadline) answers nothing: that request goes again on a new connection,
    even with retries off, as after a reset."""
    answered = iter([True, False])

    def script(head: bytes) -> list[bytes]:
        return [entry_head() + BODY] if next(answered, True) else [b""]

    srv = hostile(script)
    c = client_for(client_factory, srv)
    assert torch.equal(c.get("h"), T)
    assert torch.equal(c.get("h"), T)
    assert srv.connections == 2 and len(srv.requests) == 3


def test_no_reuse_after_an_answer_to_an_unsent_body(hostile: Any, client_factory: Factory) -> None:
    """A 412 to an ``Expect: 100-continue`` PUT leaves the request incomplete (its body
    was never sent): the connection is closed even though the server keeps it open."""
    refused = b"HTTP/1.1 412 Precondition Failed\r\nContent-Length: 0\r\n\r\n"
    srv = hostile(lambda head: [refused] if head.startswith(b"PUT") else [entry_head() + BODY])
    c = client_for(client_factory, srv)
    assert c.put("h", T) is False
    assert b"expect: 100-continue" in srv.requests[0].lower()
    assert torch.equal(c.get("h"), T)
    assert srv.connections == 2


def test_an_early_answer_that_lands_as_the_wait_for_100_continue_ends_is_read(
    hostile: Any,
) -> None:
    """The 412 to an ``Expect: 100-continue`` PUT lands while the client's event loop is
    busy, and the loop comes back after the wait's deadline: the timeout must not take
    the answer with it (the body goes, then the 412 is read). Under load this PUT used
    to end in 'server closed the connection without answering'."""
    refused = b"HTTP/1.1 412 Precondition Failed\r\nContent-Length: 0\r\n\r\n"
    client_loop: list[asyncio.AbstractEventLoop] = []

    def script(head: bytes) -> list[Step]:
        # Block the client's loop past its wait for 100 Continue (FAST.read), answer meanwhile.
        client_loop[0].call_soon_threadsafe(time.sleep, 2 * (FAST.read or 0.0))
        return [0.1, refused]

    srv = hostile(script)

    async def put() -> bool:
        client_loop.append(asyncio.get_running_loop())
        async with ec_cache.AsyncClient(
            srv.url, model="m", dtype="float32", timeouts=FAST, retries=Retries(attempts=1)
        ) as c:
            return await c.put("h", T)

    assert asyncio.run(put()) is False
    assert b"expect: 100-continue" in srv.requests[0].lower()


def test_slow_drip_of_the_body_times_out(hostile: Any, client_factory: Factory) -> None:
    srv = hostile(always(entry_head() + BODY[:20], 2.0, BODY[20:]))
    c = client_for(client_factory, srv)
    with pytest.raises(ec_cache.TransportTimeout):
        c.get("h")


def test_slow_drip_of_the_head_is_bounded_by_the_read_timeout(
    hostile: Any, client_factory: Factory
) -> None:
    """Each byte comes well within the read timeout, but the head as a whole does not."""
    head = entry_head()
    steps: list[Step] = []
    for i in range(0, len(head), 4):
        steps += [head[i : i + 4], 0.1]
    srv = hostile(always(*steps, BODY))
    c = client_for(client_factory, srv)
    with pytest.raises(ec_cache.TransportTimeout):
        c.get("h")


def test_silent_server_times_out(hostile: Any, client_factory: Factory) -> None:
    srv = hostile(always(5.0))
    c = client_for(client_factory, srv)
    with pytest.raises(ec_cache.TransportTimeout):
        c.get("h")


def test_pool_timeout_is_honoured(hostile: Any) -> None:
    """With one connection allowed and it busy, the next request waits ``pool``
    seconds, then raises a typed timeout."""
    srv = hostile(always(1.5, entry_head() + BODY))
    c = ec_cache.Client(
        srv.url,
        model="m",
        dtype="float32",
        timeouts=Timeouts(connect=2.0, read=5.0, write=2.0, pool=0.2),
        retries=Retries(attempts=1),
        limits=ec_cache.Limits(max_connections=1),
    )
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(c.get("h")))
    first.start()
    while not srv.requests:
        threading.Event().wait(0.01)
    with pytest.raises(ec_cache.TransportTimeout):
        c.get("h")
    first.join()
    assert torch.equal(results[0], T)
    c.close()


# -- JSON answers: validated by type ------------------------------------------------
DEEP = b"[" * 100_000 + b"]" * 100_000
EXISTS_ANSWERS: dict[str, tuple[str, bytes, type[Exception]]] = {
    "nested too deep": ("200 OK", DEEP, ec_cache.TransportError),
    "present nested too deep": (
        "200 OK",
        b'{"present": ' + DEEP + b"}",
        ec_cache.TransportError,
    ),
    "strings, numbers, objects for booleans": (
        "200 OK",
        b'{"present": ["false", 0, {"a": 1}]}',
        ec_cache.TransportError,
    ),
    "1 and 0 for booleans": ("200 OK", b'{"present": [1, 0, 1]}', ec_cache.TransportError),
    "null in the list": ("200 OK", b'{"present": [true, null, false]}', ec_cache.TransportError),
    "too few answers": ("200 OK", b'{"present": [true, false]}', ec_cache.TransportError),
    "present not a list": ("200 OK", b'{"present": "yes"}', ec_cache.TransportError),
    "a bare list": ("200 OK", b"[true, false, true]", ec_cache.TransportError),
    "not JSON": ("200 OK", b"<html>", ec_cache.TransportError),
    "an error nested too deep": ("500 Internal Server Error", DEEP, ec_cache.ServerError),
}


@pytest.mark.parametrize("name", list(EXISTS_ANSWERS))
def test_malformed_exists_answers_raise_typed_errors(
    hostile: Any, client_factory: Factory, name: str
) -> None:
    status, payload, kind = EXISTS_ANSWERS[name]
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
    srv = hostile(always(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload))
    c = client_for(client_factory, srv)
    with pytest.raises(kind) as raised:
        c.exists_many(["a", "b", "c"])
    assert type(raised.value) is kind


def test_a_well_formed_exists_answer_is_taken_as_is(hostile: Any, client_factory: Factory) -> None:
    payload = b'{"present": [true, false, true]}'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    srv = hostile(always(head + b"Content-Length: %d\r\n\r\n" % len(payload) + payload))
    assert client_for(client_factory, srv).exists_many(["a", "b", "c"]) == [True, False, True]


# -- property-based ------------------------------------------------------------------
class Switchboard:
    """One hostile server whose next answer is set per example."""

    def __init__(self) -> None:
        self.steps: tuple[Step, ...] = ()
        self.server = HostileServer(lambda head: self.steps)


@pytest.fixture(scope="module")
def board() -> Iterator[Switchboard]:
    sb = Switchboard()
    yield sb
    sb.server.close()


@pytest.fixture(scope="module")
def clients(board: Switchboard) -> Iterator[dict[str, Any]]:
    from .conftest import SyncFacade

    kw: dict[str, Any] = {
        "model": "m",
        "dtype": "float32",
        "timeouts": FAST,
        "retries": Retries(attempts=1),
    }
    made: dict[str, Any] = {
        "sync": ec_cache.Client(board.server.url, **kw),
        "async": SyncFacade(board.server.url, **kw),
    }
    yield made
    for c in made.values():
        c.close()


def split(data: bytes, cuts: Iterable[int]) -> list[Step]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces: list[Step] = []
    last = 0
    for p in [*points, len(data)]:
        if p > last:
            pieces.append(data[last:p])
            last = p
    return pieces


framings = st.one_of(
    st.just("content-length").map(lambda _: entry_head() + BODY),
    st.lists(st.integers(1, 300), max_size=8).map(
        lambda sizes: entry_head(framing="Transfer-Encoding: chunked") + chunked(BODY, sizes)
    ),
)

PROP = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@PROP
@given(
    answer=framings,
    cuts=st.lists(st.integers(0, 10_000), max_size=6),
    close=st.booleans(),
    which=st.sampled_from(["sync", "async"]),
)
def test_any_valid_framing_in_any_pieces_gives_the_tensor(
    board: Switchboard,
    clients: dict[str, Any],
    answer: bytes,
    cuts: list[int],
    close: bool,
    which: str,
) -> None:
    board.steps = (*split(answer, cuts), *([b""] if close else []))
    assert torch.equal(clients[which].get("h"), T)


@PROP
@given(
    answer=framings,
    position=st.integers(0, 10_000),
    mutation=st.sampled_from(["flip", "insert", "delete", "truncate"]),
    byte=st.integers(0, 255),
    which=st.sampled_from(["sync", "async"]),
)
def test_corrupted_answers_give_the_tensor_or_a_typed_error(
    board: Switchboard,
    clients: dict[str, Any],
    answer: bytes,
    position: int,
    mutation: str,
    byte: int,
    which: str,
) -> None:
    data = bytearray(answer)
    i = position % len(data)
    if mutation == "flip":
        data[i] ^= byte or 1
    elif mutation == "insert":
        data.insert(i, byte)
    elif mutation == "delete":
        del data[i]
    else:
        del data[i:]
    board.steps = (bytes(data), b"")  # closed after, so nothing waits for more bytes
    try:
        got = clients[which].get("h")
    except ec_cache.ECCacheError:
        return
    assert got is None or torch.equal(got, T)  # never a wrong tensor


@PROP
@given(
    shape=st.lists(st.one_of(st.integers(0, 4), st.integers(2**62, 2**80), st.just(0)), max_size=5),
    offsets=st.one_of(st.just(None), st.lists(st.integers(-5, 2**70), min_size=2, max_size=2)),
    dtype=st.sampled_from(["F32", "BF16", "U8", "BOOL", "F4", "I64", ""]),
)
def test_header_parser_never_raises_anything_but_integrity_error(
    shape: list[int], offsets: list[int] | None, dtype: str
) -> None:
    import json
    import math

    from ec_cache._tensors import parse_header

    nbytes = math.prod(shape) * 4
    entry = {"dtype": dtype, "shape": shape, "data_offsets": offsets or [0, nbytes]}
    raw = json.dumps({"tensor": entry}).encode()
    try:
        meta = parse_header(raw)
    except ec_cache.IntegrityError:
        return
    assert all(0 <= d < 2**63 for d in meta.shape)


# -- Retries(retry_put=False) ----------------------------------------------------------
@pytest.mark.parametrize("retry_put", [False, True])
def test_put_dropped_after_its_body_is_resent_only_when_retry_put(
    hostile: Callable[[Script], HostileServer], client_factory: Factory, retry_put: bool
) -> None:
    """A server that reads a PUT's whole body, then drops the connection without an
    answer: the PUT may have landed. ``retry_put=False`` sends it exactly once and
    raises; the default sends it again (``attempts`` times in all)."""
    srv = hostile(always(b""))  # body read (no Expect), then the connection closed
    retries = Retries(attempts=3, backoff=0.0, retry_put=retry_put)
    c = client_for(client_factory, srv, retries=retries)
    with pytest.raises(ec_cache.TransportError) as caught:
        c.put("h", T, conditional=False)
    assert not isinstance(caught.value, ec_cache.ConnectError)
    puts = [head for head in srv.requests if head.startswith(b"PUT ")]
    assert len(puts) == (3 if retry_put else 1)
    assert srv.connections == len(puts)  # each try on a fresh connection, body and all


def test_put_without_retries_still_fails_over_a_refused_connection(
    server: ServerProcess, client_factory: Factory
) -> None:
    """``retry_put=False`` resends nothing that may have landed, but a refused connection
    sent nothing: the PUT goes to the key's next replica at once."""
    refused = f"http://127.0.0.1:{free_port()}"
    retries = Retries(attempts=1, retry_put=False)
    c = client_factory([refused, server.url], model="m", dtype="float32", retries=retries)
    keys = (f"failover-{uuid.uuid4().hex}" for _ in range(1000))
    h = next(k for k in keys if c._order(k)[0] == refused)  # the refusing replica first
    assert c.put(h, T) is True
    assert torch.equal(c.get(h), T)
