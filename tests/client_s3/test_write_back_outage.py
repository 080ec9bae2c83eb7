"""Write-back takes our own clients' PUTs while S3 is down (issue #45): the SDK sends
``If-None-Match: *`` by default, which the server answers from its disk and upload
journal then, and the uploads settle once S3 is back, a race with another replica
included (S3 keeps the first body; this replica converges on it)."""

from __future__ import annotations

from typing import Any

import ec_cache
import httpx
import torch

from testkit.polling import wait_for
from testkit.s3 import S3Endpoint
from testkit.server import ServerProcess
from tests.s3.conftest import S3Control, ServerFactory

MODEL = "outage/m"
WAIT_S = 60  # for the servers and S3, not a timing check


def _queue_empty(srv: ServerProcess) -> bool:
    stats: dict[str, Any] = httpx.get(srv.url + "/stats", timeout=10).json()
    return bool(stats["upload_queue"]["entries"] == 0)


def _s3_body(endpoint: S3Endpoint, prefix: str, name: str) -> bytes:
    key = f"{prefix}/{MODEL}/float32/{name}.safetensors"
    data: bytes = endpoint.client().get_object(Bucket=endpoint.bucket, Key=key)["Body"].read()
    return data


def test_sdk_puts_are_taken_during_an_s3_outage_and_settle_after_it(
    make_server: ServerFactory,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
    s3_control: S3Control,
) -> None:
    here = make_server("a", write_mode="write-back")
    there = make_server("b", write_mode="write-back")
    tensors = {f"k{i}": torch.full((16, 8), float(i)) for i in range(3)}
    theirs, ours = torch.zeros(4, 4), torch.ones(4, 4)
    with ec_cache.Client(there.url, model=MODEL, dtype="float32") as client:
        assert client.put("shared", theirs) is True
    wait_for(lambda: _queue_empty(there), "the other replica's upload", WAIT_S)

    s3_control.stop()
    with ec_cache.Client(here.url, model=MODEL, dtype="float32") as client:
        for name, tensor in tensors.items():
            assert client.put(name, tensor) is True  # conditional, decided from disk
        assert client.put("k0", tensors["k0"]) is False  # on this disk already
        assert client.put("shared", ours) is True  # S3 cannot say it has one
        for name, tensor in tensors.items():
            got = client.get(name)
            assert got is not None and torch.equal(got, tensor)
    assert not _queue_empty(here)

    s3_control.start()
    wait_for(lambda: _queue_empty(here), "the uploads after the outage", WAIT_S)
    with ec_cache.Client(here.url, model=MODEL, dtype="float32") as client:
        for name, tensor in tensors.items():
            got = client.get(name)
            assert got is not None and torch.equal(got, tensor)
            raw = httpx.get(f"{here.url}/ec/{MODEL}/float32/{name}", timeout=WAIT_S).content
            assert _s3_body(s3_endpoint, s3_prefix, name) == raw
        # The other replica wrote "shared" first: S3 kept its body, and so does this one.
        got = client.get("shared")
        assert got is not None and torch.equal(got, theirs)
