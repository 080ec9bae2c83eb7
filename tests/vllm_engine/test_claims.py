"""Encode once per cluster in real engines: two vLLM engines, one ec-cache server, the
same new images. The second engine's requests arrive while the first is computing them
(its uploads held back by a proxy, so that the overlap does not depend on timing): the
second waits and loads, and each image is encoded once in total. A first engine whose
uploads fail costs the second at most its lease, then the second encodes."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from testkit.fault_proxy import FaultProxy
from testkit.polling import wait_for
from testkit.server import ServerProcess
from testkit.vllm_engine import connector_config
from tests.vllm_engine.conftest import (
    UNIQUE_IMAGES,
    EngineRun,
    assert_same_outputs,
    request_counts,
)

# A busy machine must not turn a slow claim answer into a second encode.
PATIENT: dict[str, Any] = {"claim_timeout_s": 30, "exists_timeout_s": 30}


def gauge(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


class Background:
    """An engine run on a thread; ``result()`` joins it."""

    def __init__(self, run: Callable[[], dict[str, Any]]) -> None:
        self._out: list[dict[str, Any]] = []
        self._error: list[BaseException] = []

        def target() -> None:
            try:
                self._out.append(run())
            except BaseException as exc:  # re-raised in the test's thread
                self._error.append(exc)

        self._thread = threading.Thread(target=target, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 600) -> dict[str, Any]:
        self._thread.join(timeout)
        if self._error:
            raise self._error[0]
        assert self._out, "the engine run did not finish"
        return self._out[0]


@pytest.fixture
def go_line() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(600)
        yield listener


def address(listener: socket.socket) -> str:
    host, port = listener.getsockname()
    return f"{host}:{port}"


def test_the_second_engine_waits_for_the_first_and_loads_its_outputs(
    run_engine: EngineRun, baseline: dict[str, Any], ec_server: ServerProcess
) -> None:
    with FaultProxy(ec_server.url) as proxy:
        proxy.put_gate.clear()  # the first engine's uploads wait here
        first = Background(
            lambda: run_engine(
                connector_config(proxy.url, claim_lease_s=600, upload_timeout_s=600, **PATIENT)
            )
        )
        wait_for(
            lambda: gauge(ec_server, "ec_claims_held") == UNIQUE_IMAGES or first.done(),
            "the first engine's claims", timeout=300,
        )  # fmt: skip
        assert gauge(ec_server, "ec_claims_held") == UNIQUE_IMAGES
        second = Background(lambda: run_engine(connector_config(ec_server.url, **PATIENT)))
        wait_for(
            lambda: gauge(ec_server, "ec_claim_waiters") >= 1 or second.done(),
            "the second engine waiting", timeout=300,
        )  # fmt: skip
        # It waits for the first engine's outputs.
        assert not second.done(), second.result()["counters"]
        proxy.put_gate.set()
        computed, waited = first.result(), second.result()

    assert computed["encoder_rows"] == baseline["encoder_rows"]
    assert waited["encoder_rows"] == 0  # measured: its vision encoder never ran
    assert_same_outputs(computed, baseline)
    assert_same_outputs(waited, baseline)
    claimer, waiter = computed["counters"]["scheduler"], waited["counters"]["scheduler"]
    assert claimer["claims_granted"] == UNIQUE_IMAGES
    assert waiter["claims_landed"] == UNIQUE_IMAGES
    assert "claims_granted" not in waiter and "claims_computed_after_wait" not in waiter
    # Each image stored once, by the engine that computed it; the other uploads nothing.
    # (The held uploads may be sent twice: the SDK retries one held past its timeout.)
    assert request_counts(ec_server.url).get(("entry", "PUT", "201")) == UNIQUE_IMAGES
    assert "save_enqueued" not in waited["counters"]["worker"]
    assert gauge(ec_server, "ec_claims_held") == 0


def test_a_claimer_whose_uploads_fail_costs_the_other_engine_its_lease(
    run_engine: EngineRun,
    baseline: dict[str, Any],
    ec_server: ServerProcess,
    go_line: socket.socket,
) -> None:
    lease_s = 8
    # Built first, the second engine waits for its go while the first one claims.
    second = Background(
        lambda: run_engine(connector_config(ec_server.url, **PATIENT), go=address(go_line))
    )
    ready, _ = go_line.accept()
    assert ready.recv(1) == b"r"
    with FaultProxy(ec_server.url) as proxy:
        proxy.failures["PUT"] = 1000  # every upload of the first engine fails
        first = Background(
            lambda: run_engine(
                connector_config(proxy.url, claim_lease_s=lease_s, upload_timeout_s=5, **PATIENT)
            )
        )
        wait_for(
            lambda: gauge(ec_server, "ec_claims_held") == UNIQUE_IMAGES or first.done(),
            "the first engine's claims", timeout=300,
        )  # fmt: skip
        ready.sendall(b"g")
        ready.close()
        claimed, recomputed = first.result(), second.result()

    assert claimed["encoder_rows"] == baseline["encoder_rows"]
    assert recomputed["encoder_rows"] == baseline["encoder_rows"]  # after waiting
    assert_same_outputs(recomputed, baseline)
    waiter = recomputed["counters"]["scheduler"]
    assert waiter["claims_contended"] >= 1
    assert waiter["claims_computed_after_wait"] == waiter["claims_contended"]
    assert "claims_landed" not in waiter
