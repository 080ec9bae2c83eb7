"""Unit tests of the SDK pieces that need no server: safetensors header building and
parsing, dtypes and keys, CRC32C, the buffer pool, routing, HTTP parsing, config, and
the CPU paths of receiving (direct, out=, staged), retrying."""

from __future__ import annotations

import asyncio
import io
import json
import struct
import threading
from typing import Any

import ec_cache
import google_crc32c
import httpx
import pytest
import safetensors.torch
import torch
from ec_cache import _crc
from ec_cache._async.retries import retried as retried_async
from ec_cache._buffers import BufferPool
from ec_cache._config import Limits, Retries, Timeouts, backoff
from ec_cache._put_body import encode_put
from ec_cache._receiver import Receiver
from ec_cache._routing import Router
from ec_cache._sync.retries import retried
from ec_cache._tensors import (
    DTYPES,
    build_header,
    check_hash,
    check_model,
    parse_dtype,
    parse_header,
    parse_header_length,
    tensor_memoryview,
)


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (5, 7)) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -100), min(info.max, 100), shape, dtype=dtype)
    return (torch.randn(shape) * 3).to(dtype)


def body_of(tensor: torch.Tensor, dtype: str) -> bytes:
    put = encode_put(tensor, dtype, BufferPool(pinned=False))
    try:
        return b"".join(bytes(c) for c in put)
    finally:
        put.release()


# -- safetensors ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(DTYPES))
def test_body_is_valid_safetensors_for_every_dtype(name: str) -> None:
    tensor = sample(DTYPES[name][0])
    body = body_of(tensor, name)
    assert (8 + struct.unpack("<Q", body[:8])[0]) % 8 == 0
    loaded = safetensors.torch.load(body)
    assert list(loaded) == ["tensor"]
    assert loaded["tensor"].dtype == tensor.dtype
    assert torch.equal(loaded["tensor"].view(torch.uint8), tensor.view(torch.uint8))


@pytest.mark.parametrize("name", list(DTYPES))
def test_parse_what_safetensors_writes(name: str) -> None:
    tensor = sample(DTYPES[name][0], (3, 4))
    data = safetensors.torch.save({"x": tensor}, metadata={"who": "me"})
    n = parse_header_length(data[:8], len(data))
    meta = parse_header(data[8 : 8 + n], total=len(data))
    assert (meta.dtype, meta.shape, meta.data_offset) == (name, (3, 4), 8 + n)
    assert meta.total == len(data)


def test_header_alignment_and_shapes() -> None:
    for shape in [(), (0,), (0, 4096), (576, 4096), (1, 2, 3, 4)]:
        header = build_header("float32", shape)
        assert len(header) % 8 == 0
        meta = parse_header(header[8:])
        assert meta.shape == shape and meta.data_offset == len(header)


@pytest.mark.parametrize(
    "header",
    [
        b"not json",
        b"[]",
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        b'"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
        b"{}",
        b'{"a":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}}',
        b'{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}',
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}',
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
    ],
)
def test_bad_headers_are_integrity_errors(header: bytes) -> None:
    with pytest.raises(ec_cache.IntegrityError):
        parse_header(header)


def test_header_total_and_length_checks() -> None:
    header = build_header("float16", (2, 2))
    with pytest.raises(ec_cache.IntegrityError):
        parse_header(header[8:], total=len(header) + 7)
    with pytest.raises(ec_cache.IntegrityError):
        parse_header_length(struct.pack("<Q", 10**12), 100)
    with pytest.raises(ec_cache.IntegrityError):
        parse_header_length(b"\x01", None)


def test_dtype_names() -> None:
    assert parse_dtype(torch.float8_e5m2) == "float8_e5m2"
    assert parse_dtype("torch.int64") == "int64"
    for bad in ["float", torch.complex64, "bfloat", 3]:
        with pytest.raises(ec_cache.InvalidKeyError):
            parse_dtype(bad)  # type: ignore[arg-type]


def test_keys() -> None:
    assert check_model("Qwen/Qwen2.5-VL-7B-Instruct@a1b2+c") == "Qwen/Qwen2.5-VL-7B-Instruct@a1b2+c"
    for bad in ["", "a//b", "a/../b", "/a", "a/", "a b", "x" * 257, "a/./b"]:
        with pytest.raises(ec_cache.InvalidKeyError):
            check_model(bad)
    assert check_hash("lora:" + "f" * 128) and check_hash("req-1-image-0")
    for bad in ["", "a/b", "x" * 257, "a b", "é"]:
        with pytest.raises(ec_cache.InvalidKeyError):
            check_hash(bad)
    with pytest.raises(ValueError):  # also a ValueError
        check_hash("a/b")


# -- tensors to bytes --------------------------------------------------------------------
def test_put_body_sends_tensor_memory_without_copy() -> None:
    tensor = torch.arange(1 << 20, dtype=torch.float32)
    put = encode_put(tensor, "float32", BufferPool(pinned=False))
    chunks = list(put)
    assert isinstance(chunks[1], memoryview)
    tensor[0] = 42.0  # the body aliases the tensor
    assert struct.unpack("<f", bytes(chunks[1][:4]))[0] == 42.0
    assert sum(len(c) for c in chunks) == put.length
    put.release()


def test_put_body_crc_and_progress() -> None:
    tensor = torch.randn(4096, 1100)  # > 8 MiB: several slices
    put = encode_put(tensor, "float32", BufferPool(pinned=False))
    seen: list[tuple[int, int]] = []
    put.progress = lambda done, total: seen.append((done, total))
    body = b"".join(bytes(c) for c in put)
    assert put.crc32c == f"{google_crc32c.value(body):08x}"
    assert put.headers()["Content-Length"] == str(len(body))
    assert seen[-1] == (len(body), len(body)) and len(seen) > 2
    # re-iterable: a retried PUT sends the same bytes
    assert b"".join(bytes(c) for c in put) == body
    put.release()


def test_non_contiguous_put_is_made_contiguous() -> None:
    base = torch.randn(64, 32)
    strided = base.t()
    assert not strided.is_contiguous()
    body = body_of(strided, "float32")
    assert torch.equal(safetensors.torch.load(body)["tensor"], strided)


def test_wrong_tensor_is_rejected() -> None:
    pool = BufferPool(pinned=False)
    with pytest.raises(ec_cache.InvalidTensorError):
        encode_put(torch.zeros(3, dtype=torch.float16), "bfloat16", pool)
    with pytest.raises(ec_cache.InvalidTensorError):
        encode_put(torch.zeros(3).to_sparse(), "float32", pool)
    with pytest.raises(ec_cache.InvalidTensorError):
        encode_put([1, 2], "float32", pool)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        encode_put(torch.zeros(3, device="meta"), "float32", pool)


def test_tensor_memoryview_keeps_tensor_alive() -> None:
    mv = tensor_memoryview(torch.full((1024,), 7, dtype=torch.uint8))
    import gc

    gc.collect()
    _ = [torch.zeros(1024, dtype=torch.uint8) for _ in range(10)]
    assert bytes(mv[:4]) == b"\x07\x07\x07\x07"
    assert len(tensor_memoryview(torch.empty(0, 5))) == 0


# -- CRC32C ------------------------------------------------------------------------------
def test_crc32c_matches_an_independent_implementation() -> None:
    data = bytes(range(256)) * 4099
    expected = google_crc32c.value(data)
    assert _crc.crc32c(data) == expected
    assert _crc.crc32c(bytearray(data)) == expected
    assert _crc.crc32c(memoryview(bytearray(data))[3:]) == google_crc32c.value(data[3:])
    c = _crc.Crc32c()
    for i in range(0, len(data), 1000):
        c.update(memoryview(bytearray(data[i : i + 1000])))
    assert c.value == expected
    assert _crc.crc32c(b"") == 0


# -- buffer pool -------------------------------------------------------------------------
def test_pool_reuses_and_bounds() -> None:
    pool = BufferPool(max_bytes=4 << 20, pinned=False)
    a = pool.acquire(100)
    assert a.capacity == 1 << 20 and not a.tensor.is_pinned()
    a_ptr = a.tensor.data_ptr()
    a.release()
    a.release()  # idempotent
    b = pool.acquire(1 << 20)
    assert b.tensor.data_ptr() == a_ptr
    c = pool.acquire((1 << 20) + 1)
    assert c.capacity == 2 << 20
    b.release()
    c.release()
    assert pool.stats()["idle_bytes"] == 3 << 20
    big = pool.acquire(8 << 20)
    big.release()  # over max_bytes: dropped
    assert pool.stats()["idle_bytes"] == 3 << 20
    pool.clear()
    assert pool.stats()["idle_bytes"] == 0


def test_pool_view_bounds_and_threads() -> None:
    pool = BufferPool(max_bytes=64 << 20, pinned=False)
    with pool.acquire(10) as buf, pytest.raises(ValueError):
        buf.view(buf.capacity + 1)
    leased: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(50):
            with pool.acquire(3 << 20) as b:
                with lock:
                    assert b.tensor.data_ptr() not in leased
                    leased.append(b.tensor.data_ptr())
                b.view(10)[:] = b"x" * 10
                with lock:
                    leased.remove(b.tensor.data_ptr())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.stats()["allocated"] <= 1 + 4  # the 1 MiB buffer, one 4 MiB per thread


def test_pool_size_classes() -> None:
    coarse = BufferPool(pinned=False)
    fine = BufferPool(pinned=False, steps=16)
    assert coarse.acquire(4_718_592).capacity == 8 << 20
    assert fine.acquire(4_718_592).capacity == 4_718_592  # a multiple of 256 KiB
    assert fine.acquire(4_718_593).capacity == 4_718_592 + (256 << 10)
    assert fine.acquire(66_846_720 + 1).capacity <= (66_846_720 + 1) * 17 // 16


def test_pool_tensor_memory_comes_back_when_the_last_view_is_freed() -> None:
    pool = BufferPool(max_bytes=64 << 20, pinned=False, steps=16)
    first = pool.tensor((576, 4096), torch.bfloat16)
    assert first.shape == (576, 4096) and first.dtype == torch.bfloat16
    assert first.is_contiguous() and not first.is_pinned()
    first.fill_(1.5)
    ptr = first.data_ptr()
    view = first[10:20]
    array = first.view(torch.int16).numpy()  # numpy shares the storage too
    del first
    # still referred to: a new tensor must not get the same memory
    other = pool.tensor((576, 4096), torch.bfloat16)
    assert other.data_ptr() != ptr and pool.stats()["allocated"] == 2
    other.fill_(-3.0)
    assert torch.all(view == 1.5)
    del view
    assert pool.stats()["idle_buffers"] == 0
    del array
    assert pool.stats()["idle_buffers"] == 1
    again = pool.tensor((576, 4096), torch.bfloat16)
    assert again.data_ptr() == ptr and pool.stats()["reused"] == 1
    small = pool.tensor((64, 1024), torch.bfloat16)  # 128 KiB: a plain allocation
    assert small.shape == (64, 1024) and pool.stats()["allocated"] == 2


def test_pool_tensors_from_many_threads_never_share_memory() -> None:
    pool = BufferPool(max_bytes=64 << 20, pinned=False, steps=16)
    errors: list[str] = []

    def worker(value: int) -> None:
        for _ in range(40):
            t = pool.tensor((1 << 18,), torch.float32)  # 1 MiB
            t.fill_(value)
            kept = t[::2]
            del t
            if not torch.all(kept == value):
                errors.append(f"thread {value} saw another thread's data")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # each thread holds at most two (the last view lives on while the next is made)
    assert pool.stats()["allocated"] <= 16 and pool.stats()["idle_buffers"] >= 1


def test_pool_is_pinned_only_with_cuda() -> None:
    assert BufferPool().pinned == torch.cuda.is_available()


# -- receiving on CPU (the paths without a GPU) ------------------------------------------
def _fake_response(
    tensor: torch.Tensor, dtype: str, **override: str
) -> tuple[httpx.Response, bytes]:
    body = body_of(tensor, dtype)
    headers = {
        "content-length": str(len(body)),
        "x-ec-crc32c": f"{google_crc32c.value(body):08x}",
        "x-ec-dtype": dtype,
        "x-ec-shape": ",".join(str(d) for d in tensor.shape),
        "x-ec-data-offset": str(8 + struct.unpack("<Q", body[:8])[0]),
    }
    headers.update(override)
    return httpx.Response(200, headers=headers), body


def _receive(rx: Receiver, body: bytes) -> torch.Tensor:
    stream = io.BytesIO(body)
    prefix = stream.read(8)
    rx.crc.update(prefix)
    header = stream.read(rx.header_length(prefix))
    rx.crc.update(header)
    target = rx.plan(header)
    n = stream.readinto(target)
    assert n == len(target)
    rx.crc.update(target)
    try:
        return rx.finish()
    finally:
        rx.release()


def _rx(resp: httpx.Response, pool: BufferPool, **kw: Any) -> Receiver:
    args: dict[str, Any] = dict(
        dtype="bfloat16",
        resp=resp,
        url="u",
        device=None,
        out=None,
        pool=pool,
        results=BufferPool(pinned=False, steps=16),
        verify=True,
        max_bytes=Limits().max_body_bytes,
    )
    args.update(kw)
    return Receiver(**args)


def test_receive_direct_into_fresh_tensor() -> None:
    pool = BufferPool(pinned=False)
    tensor = sample(torch.bfloat16, (16, 8))
    resp, body = _fake_response(tensor, "bfloat16")
    out = _receive(_rx(resp, pool), body)
    assert torch.equal(out, tensor) and out.dtype == torch.bfloat16
    assert pool.stats()["allocated"] == 0  # no staging for a CPU destination


def test_receive_into_out_contiguous_and_strided() -> None:
    pool = BufferPool(pinned=False)
    tensor = sample(torch.bfloat16, (16, 8))
    resp, body = _fake_response(tensor, "bfloat16")
    out = torch.empty(16, 8, dtype=torch.bfloat16)
    assert _receive(_rx(resp, pool, out=out), body) is out
    assert torch.equal(out, tensor)
    strided = torch.empty(8, 16, dtype=torch.bfloat16).t()  # non-contiguous: staged + copy
    result = _receive(_rx(resp, pool, out=strided), body)
    assert result is strided and torch.equal(strided, tensor)
    assert pool.stats()["allocated"] == 1 and pool.stats()["idle_buffers"] == 1
    with pytest.raises(ec_cache.InvalidTensorError):
        _receive(_rx(resp, pool, out=torch.empty(16, 9, dtype=torch.bfloat16)), body)


def test_staged_result_never_aliases_the_pool() -> None:
    """The staged path (used for devices) copies out of the pooled buffer."""
    pool = BufferPool(pinned=False)
    tensor = sample(torch.bfloat16, (16, 8))
    resp, body = _fake_response(tensor, "bfloat16")
    strided = torch.empty(8, 16, dtype=torch.bfloat16).t()
    result = _receive(_rx(resp, pool, out=strided), body)
    with pool.acquire(1) as buf:
        buf.tensor.fill_(0)
    assert torch.equal(result, tensor)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "bool", "int64"])
def test_receive_other_dtypes(name: str) -> None:
    tensor = sample(DTYPES[name][0], (3, 5))
    resp, body = _fake_response(tensor, name)
    out = _receive(_rx(resp, BufferPool(pinned=False), dtype=name), body)
    assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))


@pytest.mark.parametrize(
    "override",
    [
        {"x-ec-crc32c": "00000000"},
        {"x-ec-dtype": "float16"},
        {"x-ec-shape": "8,16"},
        {"x-ec-data-offset": "16"},
    ],
)
def test_receive_header_mismatch_is_integrity_error(override: dict[str, str]) -> None:
    tensor = sample(torch.bfloat16, (16, 8))
    resp, body = _fake_response(tensor, "bfloat16", **override)
    with pytest.raises(ec_cache.IntegrityError):
        _receive(_rx(resp, BufferPool(pinned=False)), body)


def test_receive_wrong_dtype_for_client() -> None:
    tensor = sample(torch.float16, (4,))
    resp, body = _fake_response(tensor, "float16")
    with pytest.raises(ec_cache.IntegrityError):
        _receive(_rx(resp, BufferPool(pinned=False)), body)


def test_missing_checksum_header() -> None:
    tensor = sample(torch.bfloat16, (4,))
    resp, body = _fake_response(tensor, "bfloat16")
    del resp.headers["x-ec-crc32c"]
    with pytest.raises(ec_cache.IntegrityError):
        _receive(_rx(resp, BufferPool(pinned=False)), body)
    assert torch.equal(_receive(_rx(resp, BufferPool(pinned=False), verify=False), body), tensor)


# -- routing -----------------------------------------------------------------------------
def test_rendezvous_is_stable_and_spreads() -> None:
    urls = [f"http://10.0.0.{i}:8080" for i in range(4)]
    r1, r2 = Router(urls), Router([*list(reversed(urls)), "http://10.0.0.0:8080/"])
    counts = dict.fromkeys(r1.urls, 0)
    for i in range(4000):
        order = r1.order("m", "bfloat16", f"h{i}")
        assert order == r2.order("m", "bfloat16", f"h{i}")
        assert sorted(order) == r1.urls
        counts[order[0]] += 1
    assert all(800 < c < 1200 for c in counts.values()), counts


def test_orders_of_many_keys_are_each_keys_order() -> None:
    hashes = [f"h{i}" for i in range(50)]
    for urls in (["http://a:1"], ["http://a:1", "http://b:1", "http://c:1"]):
        router = Router(urls)
        assert router.orders("m", "f", hashes) == [router.order("m", "f", h) for h in hashes]
        assert router.orders("m", "f", []) == []


def test_rendezvous_moves_only_the_removed_replicas_keys() -> None:
    urls = [f"http://h{i}:1" for i in range(5)]
    full, less = Router(urls), Router(urls[:-1])
    for i in range(2000):
        before = full.order("m", "f", str(i))[0]
        after = less.order("m", "f", str(i))[0]
        if before != urls[-1]:
            assert before == after
        else:
            assert after == full.order("m", "f", str(i))[1]


def test_router_urls() -> None:
    assert Router("127.0.0.1:8080").urls == ["http://127.0.0.1:8080"]
    with pytest.raises(ValueError):
        Router([])
    with pytest.raises(ValueError):
        Router(["ftp://x"])


# -- config ------------------------------------------------------------------------------
def test_config_values() -> None:
    assert Timeouts.of(2.5) == Timeouts(2.5, 2.5, 2.5, 2.5)
    assert Timeouts.of(None).read is None
    assert Retries.of(5).attempts == 5
    with pytest.raises(ValueError):
        Retries(attempts=0)
    with pytest.raises(ValueError):
        Limits(concurrency=0)
    r = Retries(backoff=0.1, max_backoff=0.3)
    assert all(0.05 <= r.delay(1) <= 0.1 for _ in range(20))
    assert all(r.delay(9) <= 0.3 for _ in range(20))
    with pytest.raises(AttributeError):
        Timeouts().read = 1  # type: ignore[misc]


def test_backoff_doubles_up_to_its_cap_at_any_retry() -> None:
    assert [backoff(n, 0.05, 1.0) for n in range(1, 8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    # Past retry 1024 the power overflowed a float: no longer.
    assert backoff(5000, 0.05, 2.0) == 2.0
    assert 1.0 <= Retries(attempts=5000, backoff=0.05, max_backoff=2.0).delay(4999) <= 2.0


class _Flaky:
    """Fails with ``errors`` in turn, then answers ``"done"``; records the delays."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.asked: list[tuple[str, int]] = []

    def call(self) -> str:
        if self.errors:
            raise self.errors.pop(0)
        return "done"

    async def acall(self) -> str:
        return self.call()

    def policy(self, error: Exception, attempt: int) -> float | None:
        self.asked.append((type(error).__name__, attempt))
        return 0.0 if isinstance(error, OSError) else None


def test_retried_follows_its_policy_in_both_forms() -> None:
    for form in ("sync", "async"):
        flaky = _Flaky(OSError("reset"), OSError("reset"))
        if form == "sync":
            assert retried(flaky.call, flaky.policy) == "done"
        else:
            assert asyncio.run(retried_async(flaky.acall, flaky.policy)) == "done"
        assert flaky.asked == [("OSError", 1), ("OSError", 2)]
        # The policy gives up: the failure itself is raised, no further call.
        flaky = _Flaky(OSError("reset"), ValueError("final"), OSError("unreached"))
        with pytest.raises(ValueError, match="final"):
            if form == "sync":
                retried(flaky.call, flaky.policy)
            else:
                asyncio.run(retried_async(flaky.acall, flaky.policy))
        assert flaky.asked == [("OSError", 1), ("ValueError", 2)]
        assert len(flaky.errors) == 1


def test_server_error_from_json() -> None:
    body = json.dumps({"error": "invalid_hash", "message": "bad", "part": "hash"}).encode()
    err = ec_cache.ServerError.from_response(400, body, url="u", retry_after=None)
    assert (err.status_code, err.code, err.part, err.message) == (
        400,
        "invalid_hash",
        "hash",
        "bad",
    )
    err = ec_cache.ServerError.from_response(503, b"<html>", url="u", retry_after="3")
    assert (
        isinstance(err, ec_cache.UnavailableError) and err.retry_after == 3.0 and err.code is None
    )


def test_public_surface() -> None:
    assert set(ec_cache.__all__) >= {
        "Client",
        "AsyncClient",
        "ECCacheError",
        "Timeouts",
        "Retries",
        "Limits",
        "IntegrityError",
    }
    for name in ec_cache.__all__:
        assert getattr(ec_cache, name) is not None
    assert issubclass(ec_cache.ConnectError, ec_cache.TransportError)
    assert issubclass(ec_cache.UnavailableError, ec_cache.ServerError)
    assert issubclass(ec_cache.InvalidTensorError, ValueError)


def test_sdk_never_imports_server_packages() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.path.insert(0, 'client'); import ec_cache, ec_cache._cli; "
        "bad = {'fastapi', 'uvicorn', 'boto3', 'app', 'starlette'} & set(sys.modules); "
        "print(sorted(bad)); sys.exit(1 if bad else 0)"
    )
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
