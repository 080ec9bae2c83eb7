"""Property-based fuzzing from the server's own OpenAPI spec (schemathesis + hypothesis).

Every generated request, valid or not, must get an answer below 500 with a JSON error
body, the server must stay up, and no temp file may be left behind.
(schemathesis' pytest plugin does not load under pytest 9, so the strategies are
driven with hypothesis directly.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.core.result import Ok

from testkit.server import ServerProcess

EXAMPLES_PER_OPERATION = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Generated claims and waits may meet (a ``_wait`` on a hash a ``_claim`` took):
    short caps keep each such wait under the client's timeout."""
    root = tmp_path_factory.mktemp("fuzz")
    with ServerProcess(
        root / "data",
        root / "server.log",
        max_body_bytes="64MiB",
        claim_max_lease="1",
        claim_max_wait="1",
    ) as srv:
        yield srv


def test_no_generated_request_makes_a_server_error(server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    tried: dict[str, int] = {}
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result.err()
        operation = result.ok()
        tried[f"{operation.method.upper()} {operation.path}"] = 0

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case: schemathesis.Case[Any]) -> None:
            label = f"{case.method.upper()} {case.operation.path}"
            tried[label] += 1
            response = case.call(base_url=server.url, timeout=30)
            assert response.status_code < 500, (label, case.path_parameters, response.text[:300])
            if response.status_code >= 400 and case.method.upper() != "HEAD":
                # Also what the HTTP parser refuses before the app sees it (app.http_protocol).
                assert "error" in response.json(), (label, response.status_code, response.text)

        check()
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    assert list((server.data_dir / "tmp").iterdir()) == []
    assert len(tried) >= 8
    print(f"fuzzed {sum(tried.values())} requests over {len(tried)} operations: {tried}")
