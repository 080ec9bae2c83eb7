"""The framework floor: a raw ASGI app on ec-cache's own uvicorn options.

``python -m bench.asgi_floor FILE`` (host and port from ``EC_HOST``/``EC_PORT``, like
the server) answers every GET and HEAD with FILE the least a disk-hit entry read can
do: open, fstat, mmap, one ``http.response.start`` and one ``http.response.body``
message; and every PUT with 201 once it has received (and dropped) the whole body: the
receive floor of a PUT, with no file, checksum or sync. No routing, validation, auth,
metrics or logging; the uvicorn options are
``app.__main__.server_options`` (uvloop, the guarded httptools protocol, whose body
reader receives PUT bodies here too), so the gap between this and ec-cache is what
ec-cache's own code costs per request.
"""

from __future__ import annotations

import logging.config
import mmap
import os
import sys
from pathlib import Path

import uvicorn
from prometheus_client import CollectorRegistry
from starlette.types import Receive, Scope, Send

from app.__main__ import server_options
from app.logs import logging_config
from app.settings import Settings


def file_app(path: Path):  # type: ignore[no-untyped-def]
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: nothing to start
            message = await receive()
            while message["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
                message = await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "PUT":
            more_body = True
            while more_body:
                message = await receive()
                more_body = message.get("more_body", False)
            await send(
                {
                    "type": "http.response.start",
                    "status": 201,
                    "headers": [(b"content-length", b"0")],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            body = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/octet-stream"),
                    (b"content-length", str(size).encode()),
                    (b"etag", b'"00000000"'),
                ],
            }
        )
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )

    return app


def main() -> None:
    settings = Settings()
    log_config = logging_config(settings)
    logging.config.dictConfig(log_config)
    print(f"ASGI floor on http://{settings.host}:{settings.port}", flush=True)
    uvicorn.run(
        file_app(Path(sys.argv[1])), **server_options(settings, CollectorRegistry(), log_config)
    )


if __name__ == "__main__":
    main()
