"""The ways of moving one entry that the benchmark compares (GET and PUT)."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import ec_cache
import safetensors.torch
import torch
import urllib3
from botocore.config import Config

from app.keys import key_digest
from bench.payloads import DTYPE, MODEL, Payload
from bench.runner import Contender
from bench.services import wait_upload_queue_empty

# torch.frombuffer over the read-only bytes boto3 returns: zero-copy, and we never write.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


@dataclass
class Item:
    """One stored entry of a workload: its key and payload; ``tensor`` is its content."""

    key: str
    payload: Payload
    tensor: torch.Tensor

    def object_key(self, prefix: str) -> str:
        return f"{prefix}/{MODEL}/{DTYPE}/{self.key}.safetensors"

    @property
    def file_name(self) -> str:
        return f"{self.key}.safetensors"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (random bf16 bits include NaNs, which ``torch.equal`` rejects)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def boto3_client(endpoint_url: str, access_key: str, secret_key: str) -> Any:
    """What a user would write: boto3 defaults (checksums "when supported"), path style."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=64),
    )


def tensor_from_safetensors_bytes(data: bytes, payload: Payload) -> torch.Tensor:
    """Zero-copy tensor over a single-tensor safetensors body (as a boto3 user would)."""
    offset = 8 + int.from_bytes(data[:8], "little")
    return torch.frombuffer(
        data, dtype=torch.bfloat16, offset=offset, count=payload.nbytes // 2
    ).view(payload.shape)


class RawGet:
    """Ceiling: a keep-alive socket, ``recv_into`` a preallocated buffer, no parsing
    beyond Content-Length."""

    def __init__(self, port: int, max_size: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(max_size)
        self.view = memoryview(self.buf)
        self.head = bytearray(64 * 1024)

    def get(self, path: str) -> memoryview:
        sock = self.sock
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        head_view = memoryview(self.head)
        got = 0
        while True:
            n = sock.recv_into(head_view[got:])
            if n == 0:
                raise ConnectionError("server closed the connection")
            got += n
            end = self.head.find(b"\r\n\r\n", 0, got)
            if end >= 0:
                break
        length = -1
        for line in bytes(self.head[:end]).split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if not self.head.startswith(b"HTTP/1.1 200") or length < 0:
            raise RuntimeError(f"unexpected answer: {bytes(self.head[:end])!r}")
        extra = got - (end + 4)
        self.view[:extra] = head_view[end + 4 : got]
        filled = extra
        while filled < length:
            n = sock.recv_into(self.view[filled:length])
            if n == 0:
                raise ConnectionError("body ended early")
            filled += n
        return self.view[:length]

    def close(self) -> None:
        self.sock.close()


def cycle(items: list[Item]) -> Callable[[], Item]:
    """Each contender walks the items in the same strict cycle."""
    counter = itertools.count()
    return lambda: items[next(counter) % len(items)]


@dataclass
class Endpoints:
    """Clients of everything started, shared by the workloads."""

    nginx_port: int
    nginx_www: Path
    hot: ec_cache.Client
    hot_url: str
    writeback: ec_cache.Client
    writeback_url: str
    disk_only: ec_cache.Client
    s3: Any  # boto3 client
    bucket: str
    prefix: str
    local_dir: Path


class ColdCycle:
    """The keys a cold server is asked for, in one strict cycle longer than its disk
    tier, so that every GET is an S3 hit. A fill is published on disk (group commit)
    a little after its response ends: on a busy machine the key asked for next can
    still be the one on disk, and the last fill's disk write can still be running.
    ``settle`` (untimed; the server's CPU for it is still counted) waits until the next
    key's file is evicted and no write is in flight (``tmp/`` is empty), so a timed GET
    neither hits the disk nor shares the server's core with the previous fill."""

    SETTLE_TIMEOUT = 30.0

    def __init__(self, keys: list[str], data_dir: Path) -> None:
        self._keys = keys
        self._objects = data_dir / "objects"
        self._tmp = data_dir / "tmp"
        self._step = 1  # keys[0] is the entry on disk when the cycle starts

    def next_key(self) -> str:
        key = self._keys[self._step % len(self._keys)]
        self._step += 1
        return key

    def settle(self) -> None:
        digest = key_digest(MODEL, DTYPE, self._keys[self._step % len(self._keys)])
        deadline = time.monotonic() + self.SETTLE_TIMEOUT
        while any((self._objects / digest[:2]).glob(f"{digest}.*")) or any(self._tmp.iterdir()):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the cold server kept {digest} on disk, or a write in {self._tmp}"
                )
            time.sleep(0.001)


def local_path(root: Path, key: str) -> Path:
    """Where vLLM's example EC connector keeps an entry: ``{root}/{mm_hash}/...``."""
    return root / key / "encoder_cache.safetensors"


def get_contenders(
    ep: Endpoints, items: list[Item], cold: ec_cache.Client, cold_dir: Path
) -> tuple[list[Contender], Callable[[], None]]:
    """GET contenders over ``items`` (stored everywhere beforehand); and a closer.
    ``cold`` talks to a server (data in ``cold_dir``) whose disk holds one entry."""
    nginx = urllib3.HTTPConnectionPool("127.0.0.1", ep.nginx_port, maxsize=1)
    hot_raw = urllib3.HTTPConnectionPool("127.0.0.1", int(ep.hot_url.rsplit(":", 1)[1]), maxsize=1)
    raw = RawGet(ep.nginx_port, max(item.payload.size for item in items))

    def nginx_get(next_item: Callable[[], Item]) -> Callable[[int], int]:
        def op(_: int) -> int:
            item = next_item()
            data = nginx.request("GET", "/" + item.file_name).data
            if len(data) != item.payload.size:
                raise RuntimeError(f"nginx answered {len(data)} bytes")
            return len(data)

        return op

    def raw_get(next_item: Callable[[], Item]) -> Callable[[int], int]:
        return lambda _: len(raw.get("/" + next_item().file_name))

    def sdk(client: ec_cache.Client, next_item: Callable[[], Item]) -> Callable[[int], int]:
        def op(_: int) -> int:
            item = next_item()
            tensor = client.get(item.key)
            if tensor is None:
                raise RuntimeError(f"miss on {item.key}")
            return item.payload.size

        return op

    def hot_urllib3(next_item: Callable[[], Item]) -> Callable[[int], int]:
        def op(_: int) -> int:
            item = next_item()
            response = hot_raw.request("GET", f"/ec/{MODEL}/{DTYPE}/{item.key}")
            if response.status != 200:
                raise RuntimeError(f"ec-cache answered {response.status}")
            return len(response.data)

        return op

    def boto3_get(next_item: Callable[[], Item]) -> Callable[[int], int]:
        def op(_: int) -> int:
            item = next_item()
            data = ep.s3.get_object(Bucket=ep.bucket, Key=item.object_key(ep.prefix))["Body"].read()
            tensor_from_safetensors_bytes(data, item.payload)
            return len(data)

        return op

    def local_load(next_item: Callable[[], Item]) -> Callable[[int], int]:
        def op(_: int) -> int:
            item = next_item()
            lazy = safetensors.torch.load_file(local_path(ep.local_dir, item.key), device="cpu")
            lazy["ec_cache"].clone()  # on CPU load_file maps the file: read the bytes
            return item.payload.size

        return op

    # Every way must return the right bits once before it is timed.
    first = items[0]
    assert nginx.request("GET", "/" + first.file_name).data == first.payload.body(first.tensor)
    assert bytes(raw.get("/" + first.file_name)) == first.payload.body(first.tensor)
    for client in (ep.hot, cold):
        got = client.get(first.key)
        assert got is not None and same_bits(got, first.tensor), "SDK GET returned other bits"
    data = ep.s3.get_object(Bucket=ep.bucket, Key=first.object_key(ep.prefix))["Body"].read()
    assert same_bits(tensor_from_safetensors_bytes(data, first.payload), first.tensor)
    loaded = safetensors.torch.load_file(local_path(ep.local_dir, first.key))["ec_cache"]
    assert same_bits(loaded, first.tensor)

    # The check above left items[0] on the cold server's disk.
    cold_cycle = ColdCycle([item.key for item in items], cold_dir)
    by_key = {item.key: item for item in items}
    contenders = [
        Contender(
            "nginx+urllib3", "ceiling", nginx_get(cycle(items)), note="sendfile; urllib3 .data"
        ),
        Contender(
            "raw socket recv_into",
            "ceiling",
            raw_get(cycle(items)),
            note="from nginx into a preallocated buffer",
        ),
        Contender(
            "ec-cache SDK, disk hit",
            "ec-cache",
            sdk(ep.hot, cycle(items)),
            note="Client.get -> CPU tensor, CRC32C checked",
        ),
        Contender(
            "ec-cache urllib3, disk hit",
            "diagnostic",
            hot_urllib3(cycle(items)),
            note="server cost alone: urllib3 .data",
        ),
        Contender(
            "ec-cache SDK, S3 hit",
            "ec-cache",
            sdk(cold, lambda: by_key[cold_cycle.next_key()]),
            note="cold disk tier: read-through from S3 (fills disk)",
            before_each=cold_cycle.settle,
        ),
        Contender(
            "boto3 get_object",
            "alternative",
            boto3_get(cycle(items)),
            note="same S3 objects; .read() -> torch.frombuffer",
        ),
        Contender(
            "safetensors load_file (node-local)",
            "alternative",
            local_load(cycle(items)),
            note="vLLM example EC connector; page-cached file, mmap'd by load_file, "
            ".clone() reads it (as the copy to the GPU would)",
        ),
    ]

    def close() -> None:
        nginx.close()
        hot_raw.close()
        raw.close()

    return contenders, close


def put_contenders(
    ep: Endpoints, payload: Payload, tensor: torch.Tensor
) -> tuple[list[Contender], Callable[[], None]]:
    """PUT contenders of one payload; every request writes a new key, removed after
    each round outside the timed section."""
    body = payload.body(tensor)
    dav = urllib3.HTTPConnectionPool("127.0.0.1", ep.nginx_port, maxsize=1)
    counter = itertools.count()
    written: dict[str, list[str]] = {}

    def new_key(label: str) -> str:
        key = f"{payload.name}-put-{label}-{next(counter)}"
        written.setdefault(label, []).append(key)
        return key

    def taken(label: str) -> list[str]:
        keys = written.get(label, [])
        written[label] = []
        return keys

    def nginx_put(_: int) -> int:
        response = dav.request("PUT", f"/dav/{new_key('dav')}", body=body)
        if response.status not in (201, 204):
            raise RuntimeError(f"nginx DAV PUT: {response.status}")
        return len(body)

    def nginx_cleanup() -> None:
        for key in taken("dav"):
            dav.request("DELETE", f"/dav/{key}")

    def sdk_put(client: ec_cache.Client, label: str) -> Callable[[int], int]:
        def op(_: int) -> int:
            if not client.put(new_key(label), tensor):
                raise RuntimeError("PUT did not create the entry")
            return payload.size

        return op

    def sdk_cleanup(client: ec_cache.Client, label: str) -> None:
        for key in taken(label):
            client.delete(key)

    def writeback_after(label: str) -> Callable[[], dict[str, Any]]:
        def after() -> dict[str, Any]:
            drain = wait_upload_queue_empty(ep.writeback_url)
            sdk_cleanup(ep.writeback, label)
            return {"upload_queue_drain_s": round(drain, 4)}

        return after

    def idle_queue() -> None:
        wait_upload_queue_empty(ep.writeback_url)

    def boto3_put(_: int) -> int:
        ep.s3.put_object(Bucket=ep.bucket, Key=f"alt/{new_key('boto3')}", Body=body)
        return len(body)

    def boto3_cleanup() -> None:
        for key in taken("boto3"):
            ep.s3.delete_object(Bucket=ep.bucket, Key=f"alt/{key}")

    def local_save(_: int) -> int:
        path = local_path(ep.local_dir / "put", new_key("local"))
        path.parent.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file({"ec_cache": tensor}, path)
        return payload.size

    def local_cleanup() -> None:
        for key in taken("local"):
            shutil.rmtree(ep.local_dir / "put" / key, ignore_errors=True)

    def cleanup_with(action: Callable[[], None]) -> Callable[[], None]:
        def after() -> None:
            action()

        return after

    contenders = [
        Contender(
            "nginx DAV PUT",
            "ceiling",
            nginx_put,
            cleanup_with(nginx_cleanup),
            note="urllib3; temp file + rename, no fsync",
        ),
        Contender(
            "ec-cache SDK PUT, write-back",
            "ec-cache",
            sdk_put(ep.writeback, "wb"),
            writeback_after("wb"),
            note="201 on disk (fsync) + journal; back to back, so earlier uploads run "
            "meanwhile; queue drained after each round, untimed",
        ),
        Contender(
            "ec-cache SDK PUT, write-back, idle queue",
            "diagnostic",
            sdk_put(ep.writeback, "wb-idle"),
            writeback_after("wb-idle"),
            note="same, but the upload queue is drained before each PUT (untimed)",
            before_each=idle_queue,
        ),
        Contender(
            "ec-cache SDK PUT, disk only",
            "diagnostic",
            sdk_put(ep.disk_only, "disk"),
            cleanup_with(lambda: sdk_cleanup(ep.disk_only, "disk")),
            note="server without S3: receive, validate, CRC32C, write, fsync, rename",
        ),
        Contender(
            "ec-cache SDK PUT, write-through",
            "ec-cache",
            sdk_put(ep.hot, "wt"),
            cleanup_with(lambda: sdk_cleanup(ep.hot, "wt")),
            note="201 once S3 has it (multipart >= 64 MiB)",
        ),
        Contender(
            "boto3 put_object",
            "alternative",
            boto3_put,
            cleanup_with(boto3_cleanup),
            note="boto3 defaults (CRC32 checksum), one request",
        ),
        Contender(
            "safetensors save_file (node-local)",
            "alternative",
            local_save,
            cleanup_with(local_cleanup),
            note="vLLM example EC connector; no fsync",
        ),
    ]

    def close() -> None:
        dav.close()
        for label in list(written):
            written[label] = []

    return contenders, close


def write_nginx_file(www: Path, item: Item) -> None:
    from ec_cache._tensors import tensor_memoryview

    with (www / item.file_name).open("wb") as out:
        out.write(item.payload.header)
        out.write(tensor_memoryview(item.tensor))


def write_local_file(root: Path, item: Item) -> None:
    path = local_path(root, item.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({"ec_cache": item.tensor}, path)


def remove_quietly(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
