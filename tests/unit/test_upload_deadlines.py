"""``app.upload_deadlines``: one timer per upload cuts off a client that stalls, and
only a client (the e2e tests drive the same rules through a real server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.errors import SlowClient
from app.settings import Settings
from app.upload_deadlines import with_deadlines
from testkit.polling import async_wait_for


def _settings(tmp_path: Path, **limits: float) -> Settings:
    values: dict[str, float] = {
        "body_read_timeout": 30.0,
        "upload_timeout": 300.0,
        "upload_min_rate": 0,
        "upload_rate_grace": 10.0,
    }
    values.update(limits)
    return Settings(data_dir=tmp_path, **values)  # type: ignore[arg-type]


async def _client(
    gaps: list[float], size: int = 1000, sent: list[int] | None = None
) -> AsyncIterator[bytes]:
    """A client sending ``size``-byte chunks, each after a pause of ``gaps[i]`` s (the
    pacing under test); ``sent`` gets each chunk's number as it goes."""
    for number, gap in enumerate(gaps):
        await asyncio.sleep(gap)
        if sent is not None:
            sent.append(number)
        yield b"x" * size


async def _read(chunks: AsyncIterator[bytes], per_chunk: float = 0.0) -> int:
    """The server's side: ``per_chunk`` seconds of its own work after each chunk."""
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if per_chunk:
            await asyncio.sleep(per_chunk)
    return total


def test_a_client_within_every_deadline_gets_through(tmp_path: Path) -> None:
    settings = _settings(tmp_path, body_read_timeout=0.2)
    got = asyncio.run(_read(with_deadlines(_client([0.05] * 10), settings)))
    assert got == 10_000


def test_a_stalled_client_is_cut_off_after_the_idle_timeout(tmp_path: Path) -> None:
    settings = _settings(tmp_path, body_read_timeout=0.1)
    with pytest.raises(SlowClient, match=r"no body bytes received for 0.1 s: 2000 bytes in"):
        asyncio.run(_read(with_deadlines(_client([0.0, 0.0, 5.0]), settings)))


def test_time_the_server_spends_on_a_chunk_is_not_the_clients(tmp_path: Path) -> None:
    # Each chunk costs the server 0.15 s, more than the idle timeout; the client
    # always has its next chunk ready.
    settings = _settings(tmp_path, body_read_timeout=0.1)
    got = asyncio.run(_read(with_deadlines(_client([0.0] * 4), settings), per_chunk=0.15))
    assert got == 4000


def test_a_trickling_client_is_cut_off_after_the_grace_period(tmp_path: Path) -> None:
    # 1000 bytes every 0.05 s is 20 kB/s, under the 100 kB/s minimum.
    settings = _settings(tmp_path, upload_min_rate=100_000, upload_rate_grace=0.2)
    with pytest.raises(SlowClient, match=r"upload slower than 100000 bytes/s"):
        asyncio.run(_read(with_deadlines(_client([0.05] * 200), settings)))


def test_the_whole_body_has_a_deadline(tmp_path: Path) -> None:
    settings = _settings(tmp_path, upload_timeout=0.3, body_read_timeout=0.2)
    with pytest.raises(SlowClient, match=r"upload took over 0.3 s"):
        asyncio.run(_read(with_deadlines(_client([0.05] * 200), settings)))


def test_a_cancellation_from_elsewhere_stays_a_cancellation(tmp_path: Path) -> None:
    settings = _settings(tmp_path, body_read_timeout=0.1)

    async def main() -> None:
        sent: list[int] = []
        reader = asyncio.create_task(
            _read(with_deadlines(_client([0.0, 5.0], sent=sent), settings))
        )
        await async_wait_for(lambda: sent, "the first chunk")  # its deadline is armed
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        # Its timer went with it: nothing cancels this task later (twice the timeout).
        await asyncio.sleep(0.2)

    asyncio.run(main())
