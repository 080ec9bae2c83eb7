"""app.retries: the backoff, and calls retried in place as a policy says."""

from __future__ import annotations

import asyncio

import pytest

from app.retries import RetryPolicy, backoff, retried, retried_async


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff(n, 1.0, 60.0) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff(5000, 0.05, 20.0) == 20.0  # no float overflow, however many attempts


def up_to(attempts: int) -> RetryPolicy:
    def delay(exc: Exception, attempt: int) -> float | None:
        return 0.0 if isinstance(exc, ConnectionError) and attempt < attempts else None

    return delay


def test_a_call_is_retried_with_its_body_rewound() -> None:
    calls: list[str] = []

    def flaky() -> str:
        calls.append("call")
        if calls.count("call") < 3:
            raise ConnectionError("reset")
        return "done"

    assert retried(flaky, up_to(3), lambda: calls.append("rewind")) == "done"
    assert calls == ["call", "rewind", "call", "rewind", "call"]


def test_the_last_failure_is_raised() -> None:
    calls = 0

    def failing() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError(f"attempt {calls}")

    with pytest.raises(ConnectionError, match="attempt 2"):
        retried(failing, up_to(2))
    with pytest.raises(ValueError):  # a failure the policy does not retry: at once
        retried(lambda: int("x"), up_to(5))


def test_a_coroutine_is_retried_on_the_event_loop() -> None:
    calls = 0

    async def flaky() -> int:
        nonlocal calls
        calls += 1
        if calls < 2:
            raise ConnectionError("refused")
        return calls

    assert asyncio.run(retried_async(flaky, up_to(3))) == 2
