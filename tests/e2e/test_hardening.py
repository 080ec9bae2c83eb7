"""Access control, limits, request ids and logs, shutdown: against real server processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.entries import body
from testkit.polling import wait_for
from testkit.server import ServerProcess
from tests.e2e import rawhttp

READER = "reader-token-0123456789"
WRITER = "writer-token-0123456789"
ADMIN = "admin-token-0123456789ab"
TOKENS = f"reader:read:{READER}; writer:read,write:{WRITER}\nops:admin:{ADMIN}"
ENTRY = "/ec/m/uint8/authz"


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("secured")
    with ServerProcess(root / "data", root / "log", auth_tokens=TOKENS) as srv:
        yield srv


# (method, path, json body or entry body, scope needed); None scope = public
ENDPOINTS = [
    ("GET", ENTRY, None, "read"),
    ("HEAD", ENTRY, None, "read"),
    ("POST", "/ec/m/uint8/_exists", {"hashes": ["authz"]}, "read"),
    ("GET", "/stats", None, "read"),
    ("PUT", ENTRY, "entry", "write"),
    ("DELETE", ENTRY, None, "admin"),
    ("GET", "/metrics", None, None),
    ("GET", "/healthz", None, None),
    ("GET", "/readyz", None, None),
]
WHO = {
    "none": None,
    "wrong": "not-a-valid-token-at-all",
    "reader": READER,
    "writer": WRITER,
    "admin": ADMIN,
}
GRANTS = {
    "none": set(),
    "wrong": set(),
    "reader": {"read"},
    "writer": {"read", "write"},
    "admin": {"read", "write", "admin"},
}


@pytest.mark.parametrize("who", list(WHO))
@pytest.mark.parametrize(("method", "path", "payload", "scope"), ENDPOINTS)
def test_each_endpoint_with_each_credential(
    secured: ServerProcess, who: str, method: str, path: str, payload: object, scope: str | None
) -> None:
    kwargs: dict[str, object] = {}
    if payload == "entry":
        kwargs["content"] = body((16,), "U8", 1)
    elif payload is not None:
        kwargs["json"] = payload
    response = httpx.request(method, secured.url + path, headers=_auth(WHO[who]), **kwargs)  # type: ignore[arg-type]
    if scope is None:
        assert response.status_code < 400
    elif who in ("none", "wrong"):
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Bearer")
    elif scope in GRANTS[who]:
        assert response.status_code < 400 or response.status_code == 404
    else:
        assert response.status_code == 403
        assert response.json()["error"] == "forbidden"


def test_overwrite_needs_admin_delete(secured: ServerProcess) -> None:
    url = secured.url + "/ec/m/uint8/immutable"
    first, second = body((16,), "U8", 1, seed=1), body((16,), "U8", 1, seed=2)
    assert httpx.put(url, content=first, headers=_auth(WRITER)).status_code == 201
    assert httpx.put(url, content=second, headers=_auth(WRITER)).status_code == 200
    assert httpx.delete(url, headers=_auth(WRITER)).status_code == 403
    assert httpx.get(url, headers=_auth(READER)).content == first
    assert httpx.delete(url, headers=_auth(ADMIN)).status_code == 204
    assert httpx.put(url, content=second, headers=_auth(WRITER)).status_code == 201
    assert httpx.get(url, headers=_auth(READER)).content == second


def test_malformed_authorization(secured: ServerProcess) -> None:
    for header in ("Basic dXNlcjpwYXNz", "Bearer", "Bearer  ", READER):
        response = rawhttp.request(secured.port, "GET", ENTRY, {"Authorization": header})
        assert response.status == 401


def test_tokens_never_reach_the_logs(secured: ServerProcess) -> None:
    httpx.get(secured.url + ENTRY, headers=_auth(READER))
    httpx.get(secured.url + ENTRY, headers=_auth("wrong-token-wrong-token"))
    log = secured.log_path.read_text()
    for secret in (READER, WRITER, ADMIN, "wrong-token-wrong-token"):
        assert secret not in log


def test_anonymous_read_when_enabled(tmp_path: Path) -> None:
    with ServerProcess(
        tmp_path / "d", tmp_path / "log", auth_tokens=TOKENS, anonymous="read"
    ) as srv:
        url = srv.url + "/ec/m/uint8/anon"
        assert httpx.put(url, content=body((4,), "U8", 1)).status_code == 401
        assert httpx.put(url, content=body((4,), "U8", 1), headers=_auth(WRITER)).status_code == 201
        assert httpx.get(url).status_code == 200


def test_private_metrics(tmp_path: Path) -> None:
    with ServerProcess(
        tmp_path / "d", tmp_path / "log", auth_tokens=TOKENS, metrics_public="false"
    ) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/metrics", headers=_auth(READER)).status_code == 200
        assert httpx.get(srv.url + "/healthz").status_code == 200


def _start_fails(tmp_path: Path, **env: str) -> str:
    full = {**os.environ, "EC_DATA_DIR": str(tmp_path / "d"), "EC_PORT": "1"}
    full.update({f"EC_{k.upper()}": v for k, v in env.items()})
    result = subprocess.run(
        [sys.executable, "-m", "app"], env=full, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    return result.stderr


def test_exposed_without_tokens_refuses_to_start(tmp_path: Path) -> None:
    # Exits while validating settings, before it would bind the address.
    stderr = _start_fails(tmp_path, host="0.0.0.0")
    assert "EC_AUTH_TOKENS" in stderr
    assert "EC_ANONYMOUS" in stderr


def test_bad_tokens_file_names_the_file_not_the_secret(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(
        "# ops tokens\nok:read:a-long-enough-token-here\nbroken:superuser:secret-secret-secret\n"
    )
    stderr = _start_fails(tmp_path, auth_tokens_file=str(tokens))
    assert str(tokens) in stderr
    assert "entry 3" in stderr
    assert "secret-secret-secret" not in stderr
    assert "a-long-enough-token-here" not in stderr
    stderr = _start_fails(tmp_path, auth_tokens_file=str(tmp_path / "missing"))
    assert "missing" in stderr


def test_tokens_file_is_read(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"reader:read:{READER}\n")
    with ServerProcess(tmp_path / "d", tmp_path / "log", auth_tokens_file=str(tokens)) as srv:
        assert httpx.get(srv.url + "/stats", headers=_auth(READER)).status_code == 200
        assert httpx.get(srv.url + "/stats").status_code == 401


def test_request_id_is_echoed_or_generated(server: ServerProcess) -> None:
    given = httpx.get(server.url + "/healthz", headers={"X-Request-ID": "trace-abc.123"})
    assert given.headers["x-request-id"] == "trace-abc.123"
    generated = httpx.get(server.url + "/healthz")
    assert len(generated.headers["x-request-id"]) == 32
    hostile = httpx.get(server.url + "/healthz", headers={"X-Request-ID": "a b\tc" * 50})
    assert hostile.headers["x-request-id"] != "a b\tc" * 50


def test_json_access_log_carries_the_request_id(tmp_path: Path) -> None:
    with ServerProcess(
        tmp_path / "d", tmp_path / "log", log_format="json", log_level="info"
    ) as srv:
        httpx.get(srv.url + "/ec/m/uint8/logged", headers={"X-Request-ID": "req-json-1"})
    lines = [
        json.loads(line)
        for line in (tmp_path / "log").read_text().splitlines()
        if line.startswith("{")
    ]
    access = [line for line in lines if line.get("request_id") == "req-json-1"]
    assert len(access) == 1
    assert access[0]["status"] == 404
    assert access[0]["method"] == "GET"
    assert access[0]["level"] == "INFO"
    assert any(line["logger"].startswith("uvicorn") for line in lines)


def test_oversized_headers_and_targets(server: ServerProcess) -> None:
    big = rawhttp.request(server.port, "GET", "/healthz", {"X-Filler": "x" * 20_000})
    assert big.status == 431
    long_target = rawhttp.request(server.port, "GET", "/ec/m/uint8/" + "h" * 3000)
    assert long_target.status == 414
    assert long_target.json()["error"] == "uri_too_long"


@pytest.mark.parametrize("path", ["/ec/m/uint8/_exists", "/namespaces/purge"])
def test_oversized_json_bodies_are_refused_not_buffered(server: ServerProcess, path: str) -> None:
    """A body other than an upload's is read whole by its route: past 1 MiB it is
    refused, up front for its Content-Length, else as soon as that much has come in
    (a chunked body of 8 MiB gets its 413 and the connection is closed)."""
    declared = rawhttp.request(
        server.port,
        "POST",
        path,
        {"Content-Type": "application/json", "Content-Length": str(400_000_000)},
        send_body=False,
    )
    assert (declared.status, declared.json()["error"]) == (413, "body_too_large")
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    piece = b"100000\r\n" + b" " * 0x100000 + b"\r\n"  # chunks of 1 MiB of whitespace
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        with contextlib.suppress(OSError):  # the server closes once it has answered
            for _ in range(8):
                sock.sendall(piece)
        chunked = rawhttp.read_response(sock)
    assert (chunked.status, chunked.json()["error"]) == (413, "body_too_large")
    small = httpx.post(f"{server.url}/ec/m/uint8/_exists", json={"hashes": ["a"] * 1000})
    assert small.json() == {"present": [False] * 1000}


def _open_upload(port: int, path: str, declared: int, first: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode() + first
    )
    return sock


def test_stalled_upload_is_cut_off_and_leaves_nothing(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "d", tmp_path / "log", body_read_timeout="1") as srv:
        data = body((100_000,), "U8", 1)
        sock = _open_upload(srv.port, "/ec/m/uint8/stalled", len(data), data[:1000])
        started = time.monotonic()
        response = rawhttp.read_response(sock)
        sock.close()
        assert response.status == 408
        assert response.json()["error"] == "request_timeout"
        assert time.monotonic() - started < 10
        assert list((tmp_path / "d" / "tmp").iterdir()) == []
        assert httpx.get(srv.url + "/ec/m/uint8/stalled").status_code == 404


def test_concurrent_upload_cap_answers_503(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "d", tmp_path / "log", max_concurrent_uploads="1") as srv:
        data = body((100_000,), "U8", 1)
        sock = _open_upload(srv.port, "/ec/m/uint8/slow", len(data), data[:1000])
        wait_for(lambda: srv.uploads_in_flight() == 1, "the first upload to hold the slot")
        refused = httpx.put(srv.url + "/ec/m/uint8/other", content=body((4,), "U8", 1))
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        sock.sendall(data[1000:])
        assert rawhttp.read_response(sock).status == 201
        sock.close()
        assert (
            httpx.put(srv.url + "/ec/m/uint8/other", content=body((4,), "U8", 1)).status_code == 201
        )


def test_sigterm_lets_in_flight_uploads_finish(fresh_server: ServerProcess) -> None:
    fresh_server.start()
    data = body((2_000_000,), "U8", 1)
    sock = _open_upload(fresh_server.port, "/ec/m/uint8/inflight", len(data), data[:100_000])
    wait_for(lambda: fresh_server.uploads_in_flight() == 1, "the upload to be under way")
    assert fresh_server.proc is not None
    fresh_server.proc.send_signal(signal.SIGTERM)

    def refuses_connections() -> bool:
        try:
            httpx.get(fresh_server.url + "/healthz", timeout=2)
        except httpx.TransportError:
            return True
        return False

    wait_for(refuses_connections, "no new connections once draining", timeout=10)
    sock.sendall(data[100_000:])
    assert rawhttp.read_response(sock).status == 201
    sock.close()
    fresh_server.proc.wait(15)
    fresh_server.start()
    assert httpx.get(fresh_server.url + "/ec/m/uint8/inflight").content == data


def test_full_file_system_evicts_then_answers_507(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)]).returncode:
        pytest.fail("this test needs root to mount a 3 MiB tmpfs (CI and dev machines run as root)")
    try:
        # The tier's own bound is far above the file system's size: ENOSPC comes first.
        with ServerProcess(mount / "d", tmp_path / "log", disk_max_bytes="1GiB") as srv:
            entries = [body((900_000,), "U8", 1, seed=i) for i in range(3)]
            for i, data in enumerate(entries):
                assert httpx.put(f"{srv.url}/ec/m/uint8/f{i}", content=data).status_code == 201
            # No room for a fourth: the oldest entries are evicted to make it.
            assert (
                httpx.put(
                    f"{srv.url}/ec/m/uint8/f3", content=body((900_000,), "U8", 1, seed=3)
                ).status_code
                == 201
            )
            assert httpx.get(f"{srv.url}/ec/m/uint8/f0").status_code == 404
            assert httpx.get(f"{srv.url}/ec/m/uint8/f2").content == entries[2]
            # Larger than the whole file system: 507 and nothing partial.
            too_big = httpx.put(f"{srv.url}/ec/m/uint8/huge", content=body((4_000_000,), "U8", 1))
            assert too_big.status_code == 507
            assert too_big.json()["error"] == "insufficient_storage"
            assert list((mount / "d" / "tmp").iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_concurrent_readers_during_eviction_never_see_partial_bytes(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "d", tmp_path / "log", disk_max_bytes="2MiB") as srv:
        entries = {f"ev{i}": body((300_000,), "U8", 1, seed=i) for i in range(12)}
        problems: list[str] = []

        def read_loop() -> None:
            with httpx.Client(base_url=srv.url) as http:
                for _ in range(40):
                    for name, data in entries.items():
                        got = http.get(f"/ec/m/uint8/{name}")
                        if got.status_code == 200 and got.content != data:
                            problems.append(name)

        readers = [threading.Thread(target=read_loop) for _ in range(3)]
        for reader in readers:
            reader.start()
        with httpx.Client(base_url=srv.url) as http:
            for _ in range(3):
                for name, data in entries.items():
                    http.put(f"/ec/m/uint8/{name}", content=data)
                    if name.endswith("0"):  # deletes race the readers too
                        http.delete(f"/ec/m/uint8/{name}")
        for reader in readers:
            reader.join()
        assert problems == []
