"""Claims on missing keys against a real server: one winner of many racing claimers,
waiters woken by a PUT or a release, leases that end, scopes, and the waiters' bounds."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Iterator

import httpx
import pytest

from testkit.entries import body
from testkit.polling import async_wait_for, wait_for
from testkit.server import ServerProcess

NAMESPACE = "/ec/org/claimed-model/float32"
WRITER = "writer-token-0123456789abcdef"
READER = "reader-token-0123456789abcdef"
MAX_WAITERS = 400


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("claims")
    tokens = f"writer:read,write:{WRITER}\nreader:read:{READER}"
    with ServerProcess(
        root / "data",
        root / "server.log",
        auth_tokens=tokens,
        claim_max_lease="30",
        claim_max_waiters=MAX_WAITERS,
    ) as srv:
        yield srv


def headers(token: str = WRITER) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def post(url: str, op: str, document: dict[str, object], token: str = WRITER) -> httpx.Response:
    return httpx.post(f"{url}{NAMESPACE}/{op}", json=document, headers=headers(token), timeout=60)


def _sample(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def metric(url: str, name: str) -> float:
    return _sample(httpx.get(f"{url}/metrics", headers=headers()).text, name)


async def until_waiting(http: httpx.AsyncClient, waiters: int, timeout: float = 30) -> None:
    """A bounded poll of the server's waiter gauge, on the test's event loop."""

    async def enough() -> bool:
        return _sample((await http.get("/metrics")).text, "ec_claim_waiters") >= waiters

    await async_wait_for(enough, f"{waiters} waiters", timeout, interval=0.02)


def test_of_many_racing_claimers_exactly_one_wins(server: ServerProcess) -> None:
    async def race() -> list[dict[str, list[object]]]:
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=60) as http:
            answers = await asyncio.gather(
                *(
                    http.post(
                        f"{NAMESPACE}/_claim",
                        json={
                            "hashes": ["raced", f"own-{n}"],
                            "owner": f"engine-{n}",
                            "lease_ms": 20_000,
                        },
                    )
                    for n in range(32)
                )
            )
        return [answer.raise_for_status().json() for answer in answers]

    answers = asyncio.run(race())
    winners = [a for a in answers if a["granted"][0]]
    assert len(winners) == 1
    for answer in answers:
        assert answer["granted"][1] is True  # each engine's own key is its own
        if answer is not winners[0]:
            assert answer["state"][0] == "computing"
            lease_left = answer["expires_in_ms"][0]
            assert isinstance(lease_left, int) and 0 < lease_left <= 20_000
    asked = post(server.url, "_exists", {"hashes": ["raced", "never"], "claims": True}).json()
    assert asked["present"] == [False, False]
    assert asked["state"] == ["computing", "absent"]
    assert asked["expires_in_ms"][1] is None


def test_waiters_wake_when_the_claimer_stores_the_entry(server: ServerProcess) -> None:
    assert post(
        server.url, "_claim", {"hashes": ["landing"], "owner": "a", "lease_ms": 25_000}
    ).json()["granted"] == [True]
    entry = body((8, 4), seed=3)
    ended_before = metric(server.url, 'ec_claim_waits_total{outcome="ended"}')

    async def wait_then_put() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=60) as http:
            waiters = [
                asyncio.create_task(
                    http.post(
                        f"{NAMESPACE}/_wait", json={"hashes": ["landing"], "timeout_ms": 25_000}
                    )
                )
                for _ in range(20)
            ]
            await until_waiting(http, 20)
            stored = await http.put(f"{NAMESPACE}/landing", content=entry)
            assert stored.status_code == 201
            return await asyncio.gather(*waiters)

    answers = asyncio.run(wait_then_put())
    for answer in answers:
        assert answer.json() == {"present": [True], "state": ["present"], "expires_in_ms": [None]}
    # Woken by the PUT, not by their timeout: the claim ended.
    assert metric(server.url, 'ec_claim_waits_total{outcome="ended"}') == ended_before + 20
    assert httpx.get(f"{server.url}{NAMESPACE}/landing", headers=headers()).content == entry
    again = post(server.url, "_claim", {"hashes": ["landing"], "owner": "b", "lease_ms": 1000})
    assert again.json() == {"granted": [False], "state": ["present"], "expires_in_ms": [None]}


def test_a_release_or_an_expired_lease_lets_the_next_engine_compute(
    server: ServerProcess,
) -> None:
    post(
        server.url, "_claim", {"hashes": ["given-up", "crashed"], "owner": "a", "lease_ms": 20_000}
    )
    post(server.url, "_claim", {"hashes": ["crashed"], "owner": "a", "lease_ms": 300})
    assert post(server.url, "_release", {"hashes": ["given-up"], "owner": "b"}).json() == {
        "released": [False]
    }
    assert post(server.url, "_release", {"hashes": ["given-up"], "owner": "a"}).json() == {
        "released": [True]
    }
    # The claimer of "crashed" never comes back: the wait ends with its lease.
    answer = post(server.url, "_wait", {"hashes": ["given-up", "crashed"], "timeout_ms": 20_000})
    assert answer.json()["state"] == ["absent", "absent"]
    taken = post(server.url, "_claim", {"hashes": ["crashed"], "owner": "b", "lease_ms": 1000})
    assert taken.json()["granted"] == [True]


def test_a_wait_ends_at_its_timeout_while_the_claim_lives_on(server: ServerProcess) -> None:
    post(server.url, "_claim", {"hashes": ["slow"], "owner": "a", "lease_ms": 25_000})
    answer = post(server.url, "_wait", {"hashes": ["slow"], "timeout_ms": 50})
    assert answer.json()["state"] == ["computing"]


def test_a_read_token_may_ask_and_wait_but_not_claim(server: ServerProcess) -> None:
    refused = post(server.url, "_claim", {"hashes": ["r"], "owner": "a", "lease_ms": 1}, READER)
    assert refused.status_code == 403
    assert post(server.url, "_release", {"hashes": ["r"], "owner": "a"}, READER).status_code == 403
    assert post(server.url, "_wait", {"hashes": ["r"], "timeout_ms": 0}, READER).status_code == 200
    asked = post(server.url, "_exists", {"hashes": ["r"], "claims": True}, READER)
    assert asked.json()["state"] == ["absent"]
    anonymous = httpx.post(
        f"{server.url}{NAMESPACE}/_claim", json={"hashes": ["r"], "owner": "a", "lease_ms": 1}
    )
    assert anonymous.status_code == 401


@pytest.mark.parametrize(
    ("op", "document", "part"),
    [
        ("_claim", {"hashes": ["ok"], "owner": "a b", "lease_ms": 1}, "owner"),
        ("_claim", {"hashes": ["ok"], "owner": "a", "lease_ms": 0}, "lease_ms"),
        ("_claim", {"hashes": ["ok", "bad/hash"], "owner": "a", "lease_ms": 1}, "hashes"),
        ("_wait", {"hashes": ["ok"], "timeout_ms": -1}, "timeout_ms"),
        ("_release", {"hashes": ["x"] * 1001, "owner": "a"}, "hashes"),
    ],
)
def test_bad_requests_name_the_bad_part(
    server: ServerProcess, op: str, document: dict[str, object], part: str
) -> None:
    answer = post(server.url, op, document)
    assert answer.status_code == 400
    assert answer.json()["part"] == part


def test_hundreds_of_waiters_are_bounded_and_woken_by_one_put(server: ServerProcess) -> None:
    post(server.url, "_claim", {"hashes": ["popular"], "owner": "a", "lease_ms": 25_000})

    async def crowd() -> tuple[list[httpx.Response], httpx.Response]:
        limits = httpx.Limits(max_connections=MAX_WAITERS + 10)
        async with httpx.AsyncClient(
            base_url=server.url, headers=headers(), timeout=60, limits=limits
        ) as http:
            ask = {"hashes": ["popular"], "timeout_ms": 25_000}
            waiters = [
                asyncio.create_task(http.post(f"{NAMESPACE}/_wait", json=ask))
                for _ in range(MAX_WAITERS)
            ]
            await until_waiting(http, MAX_WAITERS, timeout=60)
            one_too_many = await http.post(f"{NAMESPACE}/_wait", json=ask)
            await http.put(f"{NAMESPACE}/popular", content=body(seed=9))
            return await asyncio.gather(*waiters), one_too_many

    answers, refused = asyncio.run(crowd())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert {tuple(answer.json()["state"]) for answer in answers} == {("present",)}
    assert metric(server.url, "ec_claim_waiters") == 0


def test_a_waiter_that_goes_away_is_forgotten_at_once(server: ServerProcess) -> None:
    post(server.url, "_claim", {"hashes": ["abandoned"], "owner": "a", "lease_ms": 25_000})
    gone_before = metric(server.url, 'ec_claim_waits_total{outcome="gone"}')
    document = b'{"hashes": ["abandoned"], "timeout_ms": 25000}'
    request = (
        f"POST {NAMESPACE}/_wait HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {WRITER}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(document)}\r\n\r\n"
    ).encode() + document
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
        wait_for(lambda: metric(server.url, "ec_claim_waiters") == 1, "the waiter registered")
    wait_for(lambda: metric(server.url, "ec_claim_waiters") == 0, "the waiter forgotten")
    assert metric(server.url, 'ec_claim_waits_total{outcome="gone"}') == gone_before + 1


def test_claims_are_per_namespace(server: ServerProcess) -> None:
    post(server.url, "_claim", {"hashes": ["shared-hash"], "owner": "a", "lease_ms": 20_000})
    other = f"{server.url}/ec/org/other-model/float32/_claim"
    answer = httpx.post(
        other, json={"hashes": ["shared-hash"], "owner": "b", "lease_ms": 1000}, headers=headers()
    )
    assert answer.json()["granted"] == [True]


def test_the_openapi_document_describes_the_claim_operations(server: ServerProcess) -> None:
    paths = httpx.get(f"{server.url}/openapi.json", headers=headers()).json()["paths"]
    for op in ("_exists", "_claim", "_release", "_wait"):
        assert "post" in paths[f"/ec/{{model}}/{{dtype}}/{op}"]
    counted = 'ec_http_requests_total{method="POST",route="claim",status="200"}'
    assert metric(server.url, counted) > 0
