"""During an S3 outage a replica answers 503 for what its disk lacks: the message says
S3 is unavailable and never names another request's key (the circuit breaker keeps the
reason of the failure that opened it, for every request it refuses meanwhile)."""

from __future__ import annotations

import httpx

from testkit.fault_proxy import FaultProxy
from tests.s3.conftest import ServerFactory


def test_a_503_names_no_other_key(make_server: ServerFactory, s3_proxy: FaultProxy) -> None:
    srv = make_server(
        endpoint_url=s3_proxy.url,
        s3_max_attempts="1",
        s3_unavailable_cooldown="60",  # every request after the first meets the open breaker
    )
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        assert client.get("/readyz").status_code == 200
        s3_proxy.close()  # connections refused: botocore's error names the URL it tried
        first = client.head("/ec/m/uint8/first-secret-key")
        assert first.status_code == 503
        for name in ("second", "third"):
            answer = client.get(f"/ec/m/uint8/{name}")
            assert answer.status_code == 503
            assert answer.headers["retry-after"]
            message = answer.json()["message"]
            assert "unavailable" in message or "unreachable" in message, message
            assert "first-secret-key" not in message, message
