"""The SDK's claims (claim_many, release_many, wait_many, status_many) against real
servers, with both clients: one engine computes, another waits and then gets it."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import ec_cache
import pytest
import torch

from testkit.ports import free_port
from testkit.server import ServerProcess

MODEL = "org/claims-sdk"


@pytest.fixture
def fresh() -> Callable[[str], str]:
    """Hashes new to the session's server (it is shared by both clients' runs)."""
    run = uuid.uuid4().hex[:8]
    return lambda name: f"{name}-{run}"


def test_one_engine_computes_while_another_waits_and_loads(
    server: ServerProcess, client_factory: Callable[..., Any], fresh: Callable[[str], str]
) -> None:
    hashes = [fresh("new-image-1"), fresh("new-image-2")]
    first = client_factory(server.url, model=MODEL, dtype="float32", owner="engine-a")
    second = client_factory(server.url, model=MODEL, dtype="float32", owner="engine-b")
    assert [s.granted for s in first.claim_many(hashes, lease=20)] == [True, True]
    contested = second.claim_many(hashes, lease=20)
    assert [s.state for s in contested] == ["computing", "computing"]
    assert not any(s.granted for s in contested)
    assert all(s.expires_in is not None and 0 < s.expires_in <= 20 for s in contested)
    assert [s.state for s in second.status_many([*hashes, "other"])] == [
        "computing",
        "computing",
        "absent",
    ]

    outputs = {h: torch.randn(16, 8) for h in hashes}
    waited: list[list[ec_cache.KeyStatus]] = []
    waiter = threading.Thread(target=lambda: waited.append(second.wait_many(hashes, timeout=30)))
    waiter.start()
    for h, tensor in outputs.items():  # the claimer stores what it computed
        assert first.put(h, tensor) is True
    waiter.join(timeout=60)
    assert waited and [s.state for s in waited[0]] == ["present", "present"]
    for h, tensor in outputs.items():
        assert torch.equal(second.get(h), tensor)


def test_a_released_claim_goes_to_the_next_asker(
    server: ServerProcess, client_factory: Callable[..., Any], fresh: Callable[[str], str]
) -> None:
    key = fresh("given-up")
    first = client_factory(server.url, model=MODEL, dtype="float32", owner="engine-a")
    second = client_factory(server.url, model=MODEL, dtype="float32", owner="engine-b")
    first.claim_many([key], lease=20)
    assert second.release_many([key]) == [False]  # not its claim
    assert first.release_many([key]) == [True]
    assert [s.state for s in second.wait_many([key], timeout=5)] == ["absent"]
    assert second.claim_many([key], lease=1)[0].granted


def test_a_wait_shorter_than_the_lease_answers_computing(
    server: ServerProcess, client_factory: Callable[..., Any], fresh: Callable[[str], str]
) -> None:
    key = fresh("slow-encode")
    first = client_factory(server.url, model=MODEL, dtype="float32", owner="engine-a")
    first.claim_many([key], lease=20)
    (status,) = first.wait_many([key], timeout=0.05)
    assert status.state == "computing" and not status.granted


def test_claims_follow_the_keys_replica_and_fail_over_with_it(
    make_server: Callable[..., ServerProcess], client_factory: Callable[..., Any]
) -> None:
    up = make_server()
    down = f"http://127.0.0.1:{free_port()}"
    client = client_factory([up.url, down], model=MODEL, dtype="float32", owner="engine-a")
    other = client_factory([up.url, down], model=MODEL, dtype="float32", owner="engine-b")
    hashes = [f"spread-{n}" for n in range(24)]
    # Every key is claimed on the live replica, its own or the next in its order.
    assert all(s.granted for s in client.claim_many(hashes, lease=20))
    assert {s.state for s in other.claim_many(hashes, lease=20)} == {"computing"}
    direct = ec_cache.Client(up.url, model=MODEL, dtype="float32", owner="engine-c")
    try:
        assert {s.state for s in direct.status_many(hashes)} == {"computing"}
    finally:
        direct.close()


def test_an_owner_that_is_not_printable_ascii_is_refused(server: ServerProcess) -> None:
    with pytest.raises(ValueError, match="owner"):
        ec_cache.Client(server.url, model=MODEL, dtype="float32", owner="engine 7")
