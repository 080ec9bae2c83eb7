"""EntryResponse stops pulling a streamed body once its client is gone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from app.responses import EntryResponse
from app.safetensors_format import validate_body
from app.tiers.base import EntryBody, EntryInfo
from testkit.entries import body


def test_a_streamed_body_stops_when_the_client_is_gone() -> None:
    data = body((1000,), "U8", 1)
    info = EntryInfo(len(data), 0, validate_body(data, "uint8"), "s3")
    pulled: list[int] = []
    closed = asyncio.Event()

    async def chunks() -> AsyncGenerator[bytes, None]:
        try:
            for i in range(1000):
                pulled.append(i)
                await asyncio.sleep(0.001)  # the behaviour under test: a slow producer
                yield b"x"
        finally:
            closed.set()

    sent: list[dict[str, Any]] = []
    disconnect = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if not sent:
            return {"type": "http.request", "body": b"", "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) == 5:
            disconnect.set()  # the server dropped the client (send deadline)

    async def main() -> None:
        response = EntryResponse(info, EntryBody(info, chunks=chunks()))
        scope = {"type": "http", "method": "GET", "path": "/ec/m/uint8/h"}
        await asyncio.wait_for(response(scope, receive, send), 5)  # type: ignore[arg-type]

    asyncio.run(main())
    assert len(pulled) < 20  # not all 1000 chunks
    assert closed.is_set()
    assert all(m.get("more_body", False) for m in sent[1:])  # never completed
