"""``ec_cache._head`` against h11. ``parse_plain_head``: whatever head it accepts, h11
accepts too and reads the same way (status, reason, headers, where the body starts and
how long it is); what it declines goes to h11. ``plain_request_head``: whatever request
it writes, h11 writes the same bytes and is then done with the request, ready for the
answer, as after sending it itself. Property-based over heads built from valid and
hostile pieces, and on the real heads of an ec-cache server and its SDK (which must be
plain: that is the fast path)."""

from __future__ import annotations

import socket

import ec_cache
import h11
import httpx
import pytest
import torch
from ec_cache._head import PlainHead, parse_plain_head, plain_request_head
from ec_cache._routes import direct_routes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testkit.server import ServerProcess

STATUS_LINES = [
    b"HTTP/1.1 200 OK",
    b"HTTP/1.1 404 Not Found",
    b"HTTP/1.1 204 No Content",
    b"HTTP/1.1 304 Not Modified",
    b"HTTP/1.1 503 ",
    b"HTTP/1.1 200",
    b"HTTP/1.1 100 Continue",
    b"HTTP/1.1 199 Odd",
    b"HTTP/1.1 600 Beyond",
    b"HTTP/1.0 200 OK",
    b"HTTP/1.1 200 \x80obs text\tand tab",
    b"HTTP/1.1  200 OK",
    b"HTTP/1.1 20 OK",
    b"HTTP/2 200 OK",
    b"http/1.1 200 OK",
    b"HTTP/1.1 200 O\x00K",
]
NAMES = [
    b"Content-Length",
    b"content-length",
    b"X-EC-Shape",
    b"Connection",
    b"ETag",
    b"Transfer-Encoding",
    b"X!#$%&'*+-.^_`|~9",
    b"",
    b"Bad Name",
    b"Bad\x7fName",
    b"\xc3\xa9",
]
VALUES = [
    b"0",
    b"5",
    b"12",
    b"00012",
    b"5, 5",
    b"5,6",
    b"-1",
    b"1e3",
    b" 7 ",
    b"\t7",
    b"99999999999999999999999",
    b"close",
    b"keep-alive, close",
    b"chunked",
    b"64,1024",
    b"",
    b" ",
    b"a  b",
    b"\x80\xff",
    b"a\x00b",
    b"a\rb",
    b"a\nb",
    b'"x"',
]


def lines_strategy() -> st.SearchStrategy[bytes]:
    """Header lines: mostly well-formed ones (so that many heads are accepted), or any
    mix of hostile pieces."""
    well_formed = st.tuples(
        st.sampled_from([b"Content-Length", b"X-EC-Shape", b"Connection", b"ETag", b"x-Odd_1"]),
        st.sampled_from([b": ", b":", b":\t"]),
        st.sampled_from([b"0", b"12", b"00012", b"close", b"64,1024", b"a  b", b"\x80\xff", b""]),
        st.sampled_from([b"", b" "]),
    )
    anything = st.tuples(
        st.sampled_from(NAMES),
        st.sampled_from([b":", b": ", b":\t", b" :"]),
        st.sampled_from(VALUES),
        st.sampled_from([b"", b" ", b"\t"]),
    )
    hostile_line = st.one_of(
        anything.map(lambda f: b"".join(f)),
        st.sampled_from([b" folded", b"\tfolded", b"no colon", b""]),
        st.binary(max_size=12),
    )
    return st.one_of(
        st.lists(well_formed.map(lambda f: b"".join(f)), max_size=8),
        st.lists(st.one_of(well_formed.map(lambda f: b"".join(f)), hostile_line), max_size=8),
    ).map(lambda ls: b"".join(x + b"\r\n" for x in ls))


def h11_reading(data: bytes, method: bytes) -> tuple[h11.Response, bytes] | None:
    """What h11 makes of ``data`` as the answer to ``method``: the final response and
    the body bytes it delivers (up to 64 KiB), or ``None`` when it does not give one."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target=b"/x", headers=[(b"Host", b"h")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    try:
        event = conn.next_event()
        if not isinstance(event, h11.Response):
            return None
        body = b""
        while True:
            more = conn.next_event()
            if isinstance(more, h11.Data):
                body += more.data
            else:
                return event, body
    except h11.RemoteProtocolError:
        return None


def assert_same_reading(plain: PlainHead, data: bytes, method: bytes) -> None:
    reading = h11_reading(data, method)
    assert reading is not None, "accepted a head that h11 rejects"
    event, h11_body = reading
    head = plain.head
    assert (head.status_code, head.reason, head.http_version) == (
        event.status_code,
        event.reason,
        event.http_version,
    )
    assert head.fields == list(event.headers)
    assert head.raw == event.headers.raw_items()
    body = data[plain.body_start : plain.body_start + plain.body_length]
    assert body == h11_body


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    status=st.one_of(st.sampled_from(STATUS_LINES[:5]), st.sampled_from(STATUS_LINES)),
    lines=lines_strategy(),
    end=st.sampled_from([b"\r\n", b"\r\n", b"\n", b"", b"\r\n\r\n"]),
    body=st.binary(max_size=40),
    method=st.sampled_from([b"GET", b"HEAD"]),
)
def test_what_it_accepts_h11_reads_the_same_way(
    status: bytes, lines: bytes, end: bytes, body: bytes, method: bytes
) -> None:
    data = status + b"\r\n" + lines + end + body
    plain = parse_plain_head(bytearray(data), len(data), method)
    if plain is not None:
        assert_same_reading(plain, data, method)


def test_it_reads_only_within_the_bytes_received() -> None:
    data = bytearray(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")
    assert parse_plain_head(data, len(data), b"GET") is not None
    assert parse_plain_head(data, len(data) - 4, b"GET") is None  # blank line not in yet


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\nclose-delimited",
        b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n folded\r\n\r\nx",
    ],
)
def test_what_h11_frames_is_declined(data: bytes) -> None:
    assert parse_plain_head(bytearray(data), len(data), b"GET") is None


def _raw_answer(srv: ServerProcess, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize("method", [b"GET", b"HEAD"])
def test_an_ec_cache_servers_answers_are_plain(server: ServerProcess, method: bytes) -> None:
    with ec_cache.Client(server.url, model="head-test", dtype="float32") as client:
        client.put("plain", torch.arange(12, dtype=torch.float32).reshape(3, 4))
    for path in (b"/ec/head-test/float32/plain", b"/ec/head-test/float32/absent"):
        data = _raw_answer(
            server, method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        plain = parse_plain_head(bytearray(data), len(data), method)
        assert plain is not None, data[:300]
        assert_same_reading(plain, data, method)
        assert plain.body_start + plain.body_length == len(data)


REQUEST_FIELDS = [
    (b"Accept", b"*/*"),
    (b"Accept-Encoding", b"gzip, deflate"),
    (b"Connection", b"keep-alive"),
    (b"Connection", b"close"),
    (b"Connection", b"Keep-Alive, Upgrade"),
    (b"User-Agent", b"python-httpx/0.28"),
    (b"Authorization", b"Bearer t0k3n"),
    (b"X-Empty", b""),
    (b"X-Obs", b"\x80\xff"),
    (b"Host", b"second"),
    (b"content-length", b"0"),
    (b"Transfer-Encoding", b"chunked"),
    (b"Expect", b"100-continue"),
    (b"Upgrade", b"h2c"),
    (b"Bad Name", b"x"),
    (b"", b"x"),
    (b"X-Inject", b"a\r\nX-Evil: 1"),
    (b"X-Inject", b"a\nb"),
    (b"X-Nul", b"a\x00b"),
    (b"X-Ctl", b"a\x01b"),
    (b"X-Space", b" padded "),
    (b"X-Tab", b"a\tb"),
]


def h11_writing(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]
) -> tuple[bytes, h11.Connection] | None:
    """The head h11 writes for a bodiless request and its connection after the request,
    or ``None`` when h11 refuses to write it."""
    conn = h11.Connection(h11.CLIENT)
    try:
        head = conn.send(h11.Request(method=method, target=target, headers=headers))
        conn.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        return None
    return head, conn


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from([b"GET", b"HEAD", b"DELETE", b"CONNECT", b"G ET", b"GET\r\n", b""]),
    target=st.sampled_from([b"/ec/m/bfloat16/k", b"/a?b=c", b"*", b"/a b", b"/\x80", b""]),
    host=st.sampled_from([[(b"Host", b"127.0.0.1:8080")], [(b"host", b"h")], []]),
    fields=st.lists(
        st.one_of(
            st.sampled_from(REQUEST_FIELDS[:9]),
            st.sampled_from(REQUEST_FIELDS),
            st.tuples(st.binary(max_size=6), st.binary(max_size=6)),
        ),
        max_size=6,
    ),
)
def test_a_plain_request_head_is_what_h11_writes(
    method: bytes,
    target: bytes,
    host: list[tuple[bytes, bytes]],
    fields: list[tuple[bytes, bytes]],
) -> None:
    headers = host + fields
    plain = plain_request_head(method, target, headers)
    if plain is None:
        return
    writing = h11_writing(method, target, headers)
    assert writing is not None, "wrote a request that h11 refuses"
    head, conn = writing
    assert plain == head
    # h11 waits for the answer of a finished, kept-alive request: nothing of the
    # request's framing or connection rules was skipped
    assert conn.our_state is h11.DONE
    assert conn.their_state is h11.SEND_RESPONSE
    assert not conn.client_is_waiting_for_100_continue


@pytest.mark.parametrize(
    "field",
    [
        f
        for f in REQUEST_FIELDS
        if f[0].lower() in {b"host", b"content-length", b"transfer-encoding", b"expect", b"upgrade"}
    ]
    + [(b"Connection", b"close"), (b"X-Inject", b"a\r\nX-Evil: 1"), (b"X-Nul", b"a\x00b")],
)
def test_what_h11_must_frame_or_check_is_declined(field: tuple[bytes, bytes]) -> None:
    headers = [(b"Host", b"h"), (b"Accept", b"*/*"), field]
    assert plain_request_head(b"GET", b"/x", headers) is None
    assert plain_request_head(b"GET", b"/x", headers[:2]) is not None


@pytest.mark.parametrize(
    "options",
    [{}, {"headers": {"Authorization": "Bearer t0k3n", "X-Tenant": "a b"}}],
)
def test_the_sdks_get_and_head_are_plain(options: dict[str, object]) -> None:
    with httpx.Client(**options) as http:  # type: ignore[arg-type]
        (route,) = direct_routes(http, ["http://127.0.0.1:8080/prefix"]).values()
    target = route.target("/ec/m/bfloat16/" + "a" * 64)
    for method in (b"GET", b"HEAD"):
        head = plain_request_head(method, target, route.headers)
        assert head is not None
        writing = h11_writing(method, target, route.headers)
        assert writing is not None and writing[0] == head
