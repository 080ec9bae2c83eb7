"""Write-back DELETEs and purges racing an upload in flight, with S3 deletes failing,
across a SIGKILL: what was deleted is never served again, and S3 ends up without it.

A ``FaultProxy`` between the server and SeaweedFS holds the write-back upload in
flight (``put_gate``) and fails S3 DELETEs on demand: three in a row fail one call
(botocore retries a 503 twice with ``EC_S3_MAX_ATTEMPTS=2``), so the queue retries."""

from __future__ import annotations

from typing import Any

import httpx

from testkit.entries import body
from testkit.fault_proxy import FaultProxy
from testkit.polling import wait_for
from testkit.s3 import S3Endpoint
from testkit.server import ServerProcess
from tests.s3.conftest import ServerFactory

MODEL = "wb/model"
BIG = 2 * 1024 * 1024
WAIT_S = 60  # for the server and S3, not a timing check


def _queue(srv: ServerProcess) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(srv.url + "/stats", timeout=10).json()["upload_queue"]
    return stats


def _object(s3_prefix: str, model: str, name: str) -> str:
    return f"{s3_prefix}/{model}/uint8/{name}.safetensors"


def _held_upload(srv: ServerProcess, front: FaultProxy, path: str, data: bytes) -> None:
    """PUT ``data`` (201 from disk) and wait until its upload is held in flight."""
    front.put_gate.clear()
    assert httpx.put(srv.url + path, content=data, timeout=30).status_code == 201
    wait_for(lambda: front.puts_held == 1, "the upload to be in flight", WAIT_S)


def _not_served(srv: ServerProcess, name: str) -> None:
    path = f"/ec/{MODEL}/uint8/{name}"
    got = httpx.get(srv.url + path, timeout=30)
    assert got.status_code == 404, (got.status_code, got.headers.get("x-ec-tier"))
    assert httpx.head(srv.url + path, timeout=30).status_code == 404
    exists = httpx.post(f"{srv.url}/ec/{MODEL}/uint8/_exists", json={"hashes": [name]})
    assert exists.json() == {"present": [False]}


def test_a_delete_during_an_upload_is_not_undone_by_it(
    make_server: ServerFactory,
    s3_proxy: FaultProxy,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    srv = make_server("a", endpoint_url=s3_proxy.url, write_mode="write-back")
    _held_upload(srv, s3_proxy, f"/ec/{MODEL}/uint8/raced", body((BIG,), "U8", 1))
    assert httpx.delete(f"{srv.url}/ec/{MODEL}/uint8/raced").status_code == 204
    _not_served(srv, "raced")
    assert _queue(srv)["deletes"] == 1

    s3_proxy.failures["DELETE"] = 3  # the delete after the upload fails once
    s3_proxy.put_gate.set()  # the upload completes: the object is in S3 a moment
    wait_for(lambda: _queue(srv)["entries"] == 0, "the delete to be confirmed", WAIT_S)
    assert s3_proxy.count("DELETE") >= 4 and s3_proxy.failures["DELETE"] == 0
    _not_served(srv, "raced")
    assert s3_endpoint.list_keys(s3_prefix + "/") == []
    assert "deleted while its upload is in flight" in srv.log_path.read_text()


def test_a_delete_owed_survives_kill_9_and_a_put_after_it_wins(
    make_server: ServerFactory,
    s3_proxy: FaultProxy,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    srv = make_server("a", endpoint_url=s3_proxy.url, write_mode="write-back")
    old = body((BIG,), "U8", 1, seed=1)
    _held_upload(srv, s3_proxy, f"/ec/{MODEL}/uint8/killed", old)
    assert httpx.delete(f"{srv.url}/ec/{MODEL}/uint8/killed").status_code == 204
    s3_proxy.failures["DELETE"] = 10**6  # S3 refuses every delete from now on
    s3_proxy.put_gate.set()
    key = _object(s3_prefix, MODEL, "killed")
    wait_for(lambda: s3_endpoint.list_keys(s3_prefix + "/") == [key], "the upload to land", WAIT_S)
    wait_for(lambda: s3_proxy.count("DELETE") >= 2, "a delete to be refused", WAIT_S)

    srv.kill()  # the delete is owed only in the journal now
    srv.start()
    _not_served(srv, "killed")  # S3 still holds it: hidden
    assert _queue(srv)["deletes"] == 1
    new = body((1000,), "U8", 1, seed=2)
    put = httpx.put(f"{srv.url}/ec/{MODEL}/uint8/killed", content=new, timeout=30)
    assert put.status_code == 201
    assert httpx.get(f"{srv.url}/ec/{MODEL}/uint8/killed").content == new  # from disk

    s3_proxy.failures["DELETE"] = 0
    wait_for(lambda: _queue(srv)["entries"] == 0, "the delete, then the new upload", WAIT_S)
    replica = make_server("b", endpoint_url=s3_proxy.url, write_mode="write-back")
    got = httpx.get(f"{replica.url}/ec/{MODEL}/uint8/killed", timeout=30)
    assert got.headers["x-ec-tier"] == "s3" and got.content == new


def test_a_purge_waits_for_an_upload_in_flight(
    make_server: ServerFactory,
    s3_proxy: FaultProxy,
    s3_endpoint: S3Endpoint,
    s3_prefix: str,
) -> None:
    srv = make_server("a", endpoint_url=s3_proxy.url, write_mode="write-back")
    _held_upload(srv, s3_proxy, f"/ec/{MODEL}/uint8/purged", body((BIG,), "U8", 1))
    started = httpx.post(srv.url + "/namespaces/purge", json={"model": MODEL})
    assert started.status_code == 202

    def job() -> dict[str, Any]:
        (found,) = httpx.get(srv.url + "/namespaces/purges").json()["purges"]
        return dict(found)

    wait_for(
        lambda: job()["state"] == "done" or "a purge waits for 1" in srv.log_path.read_text(),
        "the purge to finish or to wait for the upload",
        WAIT_S,
    )
    s3_proxy.failures["DELETE"] = 3  # the object's own delete fails once
    s3_proxy.put_gate.set()
    wait_for(lambda: job()["state"] == "done", "the purge", WAIT_S)
    wait_for(lambda: _queue(srv)["entries"] == 0, "the queue to empty", WAIT_S)
    _not_served(srv, "purged")
    assert s3_endpoint.list_keys(s3_prefix + "/") == []
