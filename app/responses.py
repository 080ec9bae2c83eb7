"""The response of an entry GET or HEAD: its headers, then its body in one of two forms.

* **A disk entry** (``EntryBody.buffer``): one ``http.response.body`` message straight
  from its mmap, which uvicorn hands to the transport without copying (Starlette's
  ``FileResponse`` sends 64 KiB chunks with a thread hop each, ~0.2x nginx).
* **A read-through** (``EntryBody.chunks``): S3's body relayed chunk by chunk as it
  arrives. A client that goes away stops the relay at once (its download slot is
  freed); a failure after the headers are out ends the body early, which makes uvicorn
  drop the connection: the client sees an incomplete body, never a wrong one.

A HEAD sends the headers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.errors import ECError
from app.tiers.base import EntryBody, EntryInfo

log = logging.getLogger(__name__)


class EntryResponse(Response):
    """An entry's headers and, unless this is a HEAD, its body."""

    def __init__(self, info: EntryInfo, body: EntryBody | None = None) -> None:
        # Not Response.__init__: its header normalisation costs more than the headers.
        self.status_code = 200
        self.raw_headers = info.raw_headers()
        self.background = None
        self.entry = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        body = self.entry
        if body is None or scope["method"] == "HEAD":
            await send({"type": "http.response.body", "body": b""})
        elif body.buffer is not None:
            await send({"type": "http.response.body", "body": body.buffer})
        else:
            assert body.chunks is not None
            # A client that is gone (or dropped by EC_SEND_TIMEOUT) makes uvicorn's send
            # a no-op: stop the relay then, even while it waits for the next chunk, so
            # the download slot is freed and the read-through learns it at once.
            relay = asyncio.ensure_future(_relay(scope, body, send))
            watcher = asyncio.ensure_future(_watch_disconnect(receive))
            try:
                await asyncio.wait((relay, watcher), return_when=asyncio.FIRST_COMPLETED)
                if not relay.done():
                    log.info("client of %s is gone: stopped sending", scope["path"])
                    relay.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await relay
                    return
                if not relay.result():
                    return
            finally:
                relay.cancel()
                watcher.cancel()
                await body.aclose()
            await send({"type": "http.response.body", "body": b""})


async def _relay(scope: Scope, body: EntryBody, send: Send) -> bool:
    """Send the chunks of ``body``; False when it broke off after the headers."""
    assert body.chunks is not None
    try:
        async for chunk in body.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except ECError as exc:
        # Headers are out: the only honest signal left is an incomplete body.
        # Returning without the final message makes uvicorn drop the connection.
        log.warning("stopped sending %s after the headers: %s", scope["path"], exc)
        return False
    return True


async def _watch_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
