"""Round trips through a real ec-cache server, for ``Client`` and ``AsyncClient``
(``client_factory`` runs every test with both)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import ec_cache
import httpx
import pytest
import torch
from ec_cache._tensors import DTYPES

from testkit.server import ServerProcess

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct@a1b2"


def key() -> str:
    return uuid.uuid4().hex


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)
    return (torch.randn(shape) * 4).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


Factory = Callable[..., Any]


@pytest.mark.parametrize("name", list(DTYPES))
def test_round_trip_every_dtype(server: ServerProcess, client_factory: Factory, name: str) -> None:
    dtype = DTYPES[name][0]
    c = client_factory(server.url, model=MODEL, dtype=dtype)
    t = sample(dtype, (37, 64))
    h = key()
    assert c.put(h, t) is True
    assert c.put(h, t) is False  # first writer wins
    got = c.get(h)
    assert got is not None and same(got, t) and got.device.type == "cpu"
    info = c.head(h)
    assert info.dtype == name and info.shape == (37, 64) and info.tier == "disk"
    assert info.size == 8 + (info.size - t.numel() * t.element_size() - 8) + t.nbytes


def test_dtype_by_name_and_torch_prefix(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model="m", dtype="torch.bfloat16")
    assert c.dtype == "bfloat16" and DTYPES[c.dtype][0] == torch.bfloat16


def test_non_contiguous_and_sliced_inputs(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model=MODEL, dtype=torch.bfloat16)
    base = sample(torch.bfloat16, (64, 96))
    for t in [base.t(), base[::2, 1::3], base[5:9], base[:, 7]]:
        h = key()
        assert c.put(h, t)
        got = c.get(h)
        assert same(got, t.contiguous())


def test_zero_token_and_scalar_tensors(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model=MODEL, dtype=torch.float16)
    for t in [torch.empty(0, 4096, dtype=torch.float16), torch.tensor(3.5, dtype=torch.float16)]:
        h = key()
        assert c.put(h, t)
        got = c.get(h)
        assert got.shape == t.shape and same(got, t)
        assert c.head(h).shape == tuple(t.shape)


def test_large_tensor_over_100_mb(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model=MODEL, dtype=torch.bfloat16)
    t = torch.randn(14000, 4096).to(torch.bfloat16)  # 114.7 MB
    h = key()
    seen: list[tuple[int, int]] = []
    assert c.put(h, t, progress=lambda d, n: seen.append((d, n)))
    assert seen[-1][0] == seen[-1][1] > 100e6
    got = c.get(h)
    assert same(got, t)
    del got
    out = torch.empty_like(t)
    assert c.get(h, out=out) is out and same(out, t)
    c.delete(h)


def test_miss_is_none(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model=MODEL, dtype=torch.float32)
    h = key()
    assert c.get(h) is None
    assert c.head(h) is None
    assert c.exists(h) is False


def test_get_into_out(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model=MODEL, dtype=torch.float32)
    t, h = torch.randn(8, 16), key()
    c.put(h, t)
    out = torch.empty(8, 16)
    assert c.get(h, out=out) is out and torch.equal(out, t)
    strided = torch.empty(16, 8).t()
    assert c.get(h, out=strided) is strided and torch.equal(strided, t)
    with pytest.raises(ec_cache.InvalidTensorError):
        c.get(h, out=torch.empty(8, 15))
    assert c.get(h, device="cpu").equal(t)  # the connection is still usable


def test_returned_tensors_are_independent(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model=MODEL, dtype=torch.float32)
    h = key()
    c.put(h, torch.ones(1000, 100))
    a = c.get(h)
    b = c.get(h)
    a.zero_()
    assert torch.equal(b, torch.ones(1000, 100))


def test_freed_results_are_reused_and_held_ones_are_not(
    server: ServerProcess, client_factory: Factory
) -> None:
    """A 4 MB result's memory goes back to the client when the caller drops it (the
    next GET reuses it instead of faulting in fresh pages), never while a view of it
    lives."""
    c = client_factory(server.url, model=MODEL, dtype=torch.float32)
    h1, h2 = key(), key()
    t1, t2 = torch.randn(1024, 1024), torch.randn(1024, 1024)
    c.put(h1, t1)
    c.put(h2, t2)
    first = c.get(h1)
    row = first[7]
    ptr = first.data_ptr()
    del first
    second = c.get(h2)  # ``row`` still holds the first result's memory
    assert second.data_ptr() != ptr
    assert torch.equal(row, t1[7]) and torch.equal(second, t2)
    del row
    third = c.get(h2)
    assert third.data_ptr() == ptr and torch.equal(third, t2)
    assert torch.equal(second, t2)


def test_exists_many_and_chunking(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model=MODEL, dtype=torch.int8)
    stored = [key() for _ in range(3)]
    for h in stored:
        c.put(h, torch.zeros(2, dtype=torch.int8))
    hashes = [key() for _ in range(2500)]
    hashes[10], hashes[1500], hashes[2499] = stored
    present = c.exists_many(hashes)
    assert len(present) == 2500
    assert [i for i, p in enumerate(present) if p] == [10, 1500, 2499]
    assert c.exists_many([]) == []


def test_get_many_and_put_many_concurrently(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(
        server.url, model=MODEL, dtype=torch.bfloat16, limits=ec_cache.Limits(concurrency=6)
    )
    items = {key(): sample(torch.bfloat16, (64 + i, 256)) for i in range(24)}
    assert c.put_many(items) == [True] * 24
    assert c.put_many(list(items.items())[:3]) == [False] * 3
    hashes = [*list(items), key()]
    got = c.get_many(hashes)
    assert got[-1] is None
    for h, t in zip(hashes[:-1], got[:-1], strict=True):
        assert same(t, items[h])


def test_delete(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model=MODEL, dtype=torch.float32)
    h = key()
    c.put(h, torch.ones(3))
    c.delete(h)
    assert c.get(h) is None
    c.delete(h)  # absent: fine


def test_wrong_dtype_tensor(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model=MODEL, dtype=torch.bfloat16)
    with pytest.raises(ec_cache.InvalidTensorError):
        c.put(key(), torch.ones(3, dtype=torch.float16))


def test_invalid_keys_fail_before_sending(server: ServerProcess, client_factory: Factory) -> None:
    with pytest.raises(ec_cache.InvalidKeyError):
        client_factory(server.url, model="a/../b", dtype="float32")
    with pytest.raises(ec_cache.InvalidKeyError):
        client_factory(server.url, model="m", dtype="complex64")
    c = client_factory(server.url, model="m", dtype="float32")
    with pytest.raises(ec_cache.InvalidKeyError):
        c.get("a/b")
    with pytest.raises(ec_cache.InvalidKeyError):
        c.exists_many(["ok", "not ok"])


def test_server_errors_are_typed(server: ServerProcess, client_factory: Factory) -> None:
    # 413 from the server's body limit (512MiB in conftest): a 600 MB tensor
    c = client_factory(server.url, model=MODEL, dtype=torch.uint8)
    with pytest.raises(ec_cache.ServerError) as info:
        c.put(key(), torch.zeros(600 * 1024 * 1024 // 1, dtype=torch.uint8)[: 513 << 20])
    assert info.value.status_code == 413 and info.value.code == "body_too_large"


def test_model_with_slashes_is_sent_plainly(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model="org/sub/model", dtype=torch.float32)
    h = key()
    c.put(h, torch.ones(2))
    r = httpx.head(f"{server.url}/ec/org%2Fsub%2Fmodel/float32/{h}")
    assert r.status_code == 200
    r = httpx.head(f"{server.url}/ec/org/sub/model/float32/{h}")
    assert r.status_code == 200


def test_stats(server: ServerProcess, client_factory: Factory) -> None:
    c = client_factory(server.url, model="m", dtype="float32")
    stats = c.stats()
    assert list(stats) == [server.url] and "disk" in stats[server.url]


def test_token_is_sent_as_bearer(
    make_server: Callable[..., ServerProcess], client_factory: Factory
) -> None:
    secret = "s3cr3t-token-0123456789"
    srv = make_server(auth_tokens=f"ci:admin:{secret}", anonymous="none")
    anon = client_factory(srv.url, model="m", dtype="float32", retries=1)
    with pytest.raises(ec_cache.ServerError) as info:
        anon.put("h", torch.ones(2))
    assert info.value.status_code == 401 and info.value.code == "unauthorized"
    authed = client_factory(srv.url, model="m", dtype="float32", token=secret)
    assert authed.put("h", torch.ones(2))
    assert torch.equal(authed.get("h"), torch.ones(2))
