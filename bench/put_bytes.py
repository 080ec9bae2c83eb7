"""Bytes a client sends for a duplicate PUT (``python -m bench.put_bytes``).

Starts an ec-cache server (disk only) and a counting TCP proxy in front of it on
127.0.0.1, stores one entry, then PUTs the same entry again through the proxy and
reports the bytes that went from the client to the server:

* ``sdk default``: ``Client.put`` (``Expect: 100-continue`` + ``If-None-Match: *``);
* ``sdk conditional=False``: the body is sent at once (what the SDK did before);
* ``urllib3``: a plain PUT of the same body, for reference.

Only counts bytes; no timing. ``--shape`` sets the bf16 tensor (default 2040x16384,
67 MB, Qwen3-VL at 1080p).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import ec_cache
import torch
import urllib3
from ec_cache._crc import crc32c
from ec_cache._tensors import build_header, tensor_memoryview

from tests.support.server import ServerProcess


class CountingProxy:
    """Forwards one port to another and counts client -> server bytes."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.upstream_bytes = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                if upstream:
                    with self._lock:
                        self.upstream_bytes += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def take(self) -> int:
        with self._lock:
            n, self.upstream_bytes = self.upstream_bytes, 0
        return n

    def close(self) -> None:
        self._listener.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.put_bytes", description=__doc__)
    parser.add_argument("--shape", default="2040x16384", help="bf16 tensor shape, AxB")
    args = parser.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split("x"))
    tensor = torch.randn(shape).to(torch.bfloat16)
    body = build_header("bfloat16", shape) + bytes(tensor_memoryview(tensor))
    key = uuid.uuid4().hex
    path = f"/ec/bench/bfloat16/{key}"
    results: dict[str, Any] = {"shape": list(shape), "body_bytes": len(body)}
    with tempfile.TemporaryDirectory(prefix="ec-put-bytes-") as tmp:
        root = Path(tmp)
        with ServerProcess(root / "data", root / "server.log", max_body_bytes="1GiB") as srv:
            proxy = CountingProxy(srv.port)
            url = f"http://127.0.0.1:{proxy.port}"
            try:
                with ec_cache.Client(url, model="bench", dtype="bfloat16") as c:
                    assert c.put(key, tensor) is True
                    results["first put"] = proxy.take()
                    assert c.put(key, tensor) is False
                    results["sdk default (Expect + If-None-Match)"] = proxy.take()
                    assert c.put(key, tensor, conditional=False) is False
                    results["sdk conditional=False"] = proxy.take()
                pool = urllib3.HTTPConnectionPool("127.0.0.1", proxy.port)
                answer = pool.request(
                    "PUT",
                    path,
                    body=body,
                    headers={"X-EC-CRC32C": f"{crc32c(body):08x}"},
                )
                assert answer.status == 200, answer.status
                results["urllib3 plain PUT"] = proxy.take()
                pool.close()
            finally:
                proxy.close()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
