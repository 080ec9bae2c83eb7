"""``python -m app``: start the server with settings from ``EC_*`` variables."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError

from app.main import create_app
from app.settings import Settings


def _explain(exc: ValidationError) -> str:
    lines = ["ec-cache: invalid configuration"]
    for error in exc.errors():
        name = "EC_" + "_".join(str(part) for part in error["loc"]).upper()
        lines.append(f"  {name}={error.get('input')!r}: {error['msg']}")
    return "\n".join(lines)


def main() -> None:
    try:
        settings = Settings()
    except ValidationError as exc:
        sys.exit(_explain(exc))
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    backend = f"S3 {settings.s3_endpoint_url}" if settings.s3_enabled else "disk only"
    print(
        f"ec-cache on http://{settings.host}:{settings.port} "
        f"(data: {settings.data_dir.resolve()}, {backend})",
        flush=True,
    )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level.value,
        server_header=False,
    )


if __name__ == "__main__":
    main()
