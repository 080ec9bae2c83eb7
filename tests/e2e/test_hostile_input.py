"""Hostile inputs found by the outside attack of issue #12, against a real server process."""

from __future__ import annotations

import struct

import httpx
import pytest

from testkit.entries import body, crc_hex
from testkit.server import ServerProcess
from tests.e2e import rawhttp


def _body(header: str, data: bytes = b"") -> bytes:
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw + data


HOSTILE_HEADERS = {
    "deep nesting": "[" * 60_000 + "]" * 60_000,
    "deep objects": '{"t":' * 20_000 + "1" + "}" * 20_000,
    "int past int() limit": '{"t":{"dtype":"U8","shape":['
    + "9" * 5000
    + '],"data_offsets":[0,1]}}',
    "float overflow": '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1e999999]}}',
    "NaN": '{"t":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}',
    "duplicate field": '{"t":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    "float offsets": '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}}',
    "boolean offsets": '{"t":{"dtype":"U8","shape":[1],"data_offsets":[false,true]}}',
    "2**63 dimension": '{"t":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}}',
}


@pytest.mark.parametrize("name", list(HOSTILE_HEADERS))
def test_hostile_headers_answer_a_json_400(server: ServerProcess, name: str) -> None:
    header = HOSTILE_HEADERS[name]
    data = _body(header, b"" if "[0,0]" in header else b"\0")
    key = f"/ec/m/uint8/hostile-{abs(hash(name))}"
    response = rawhttp.request(server.port, "PUT", key, body=data)
    assert response.status == 400, response.body[:300]
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"] == "invalid_body"
    assert httpx.get(server.url + key).status_code == 404
    assert "Traceback" not in server.log_path.read_text()


def _concrete(path: str) -> str:
    return (
        path.replace("{model}", "m")
        .replace("{dtype}", "uint8")
        .replace("{hash}", "h")
        .replace("{model:path}", "m")
    )


def test_no_path_answers_a_redirect(server: ServerProcess) -> None:
    spec = httpx.get(server.url + "/openapi.json").json()
    targets = {_concrete(path) for path in spec["paths"]} | {"/docs", "/redoc", "/openapi.json"}
    assert len(targets) >= 10
    tried = 0
    for target in sorted(targets):
        for variant in (target + "/", target + "//", target.rstrip("/") + "/./", "/" + target):
            for method in ("GET", "HEAD", "PUT", "POST", "DELETE"):
                response = rawhttp.request(
                    server.port, method, variant, {"Host": "evil.example"}, body=b"{}"
                )
                tried += 1
                assert not 300 <= response.status < 400, (method, variant, response.headers)
                assert "location" not in response.headers
                assert response.status >= 400, (method, variant, response.status)
                if method != "HEAD":
                    assert "error" in response.json(), (method, variant, response.body[:200])
    assert tried >= 200
    print(f"{tried} requests to {len(targets)} paths, none redirected")


def test_losing_put_answers_with_the_stored_entry(fresh_server: ServerProcess) -> None:
    fresh_server.start()
    url = fresh_server.url + "/ec/m/uint8/first-writer"
    first, second = body((1000,), "U8", 1, seed=1), body((2000,), "U8", 1, seed=2)
    assert httpx.put(url, content=first).status_code == 201
    for restarted in (False, True):  # after a restart the disk tier re-reads the entry
        lost = httpx.put(url, content=second, headers={"X-EC-CRC32C": crc_hex(second)})
        assert lost.status_code == 200, (restarted, lost.text)
        assert lost.json() == {"created": False, "size": len(first), "crc32c": crc_hex(first)}
        assert lost.headers["etag"] == f'"{crc_hex(first)}"'
        assert lost.headers["x-ec-crc32c"] == crc_hex(first)
        assert httpx.get(url).content == first
        fresh_server.stop()
        fresh_server.start()


def _entry_with_letters_in_its_crc() -> tuple[bytes, str]:
    for seed in range(100):
        data = body((16,), "U8", 1, seed=seed)
        if any(c in "abcdef" for c in crc_hex(data)[1:]):
            return data, crc_hex(data)
    raise AssertionError("no seed gave a CRC with hex letters")


def test_crc_header_takes_exactly_8_lowercase_hex_digits(server: ServerProcess) -> None:
    data, crc = _entry_with_letters_in_its_crc()
    url = server.url + "/ec/m/uint8/crc-grammar"
    for value in ("+" + crc[1:], "0x" + crc[2:], crc[:4] + "_" + crc[5:], crc.upper(), crc[1:]):
        refused = httpx.put(url, content=data, headers={"X-EC-CRC32C": value})
        assert refused.status_code == 400, (value, refused.text)
        assert refused.json()["error"] == "invalid_request"
        assert refused.json()["part"] == "checksum"
        assert httpx.get(url).status_code == 404
    assert httpx.put(url, content=data, headers={"X-EC-CRC32C": crc}).status_code == 201


def test_query_integers_take_ascii_digits_only(server: ServerProcess) -> None:
    url = server.url + "/namespaces/entries"
    for value in ("+5", " 5", "5_0", "\u0665", "5.0"):
        response = httpx.get(url, params={"model": "m", "dtype": "uint8", "limit": value})
        assert response.status_code == 400, (value, response.text)
        assert response.json()["error"] == "invalid_request"
    ok = httpx.get(url, params={"model": "m", "dtype": "uint8", "limit": "05"})
    assert ok.status_code == 200


PARSER_REFUSALS = {
    "raw UTF-8 in the path": ("GET", "/ec/m/uint8/\xc3\xa9", {}),
    "raw byte in the query": ("GET", "/healthz?x=\xff", {}),
    "raw high byte alone": ("GET", "/\x80", {}),
    "space in the target": ("GET", "/ec/m/uint8/a b", {}),
    "signed Content-Length": ("PUT", "/ec/m/uint8/cl", {"Content-Length": "+4"}),
    "Content-Length list": ("PUT", "/ec/m/uint8/cl", {"Content-Length": "4,4"}),
}


@pytest.mark.parametrize("name", list(PARSER_REFUSALS))
def test_requests_the_http_parser_refuses_answer_a_json_400(
    server: ServerProcess, name: str
) -> None:
    method, target, headers = PARSER_REFUSALS[name]
    response = rawhttp.request(server.port, method, target, headers, body=b"\0\0\0\0")
    assert response.status == 400
    assert response.headers["content-type"] == "application/json"
    assert response.headers["connection"] == "close"
    assert response.json()["error"] == "malformed_request"


def test_percent_encoded_non_ascii_reaches_the_app(server: ServerProcess) -> None:
    response = rawhttp.request(server.port, "GET", "/ec/m/uint8/%C3%A9")
    assert response.status == 400
    assert response.json()["error"] == "invalid_hash"
