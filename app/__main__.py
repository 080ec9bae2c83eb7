"""``python -m app``: start the server with settings from ``EC_*`` variables."""

from __future__ import annotations

import logging.config
import sys

import uvicorn
from pydantic import ValidationError

from app.logs import logging_config
from app.main import ConfigurationError, create_app
from app.protocol import JSONErrorsHttpToolsProtocol
from app.settings import Settings


def _explain(exc: ValidationError) -> str:
    lines = ["ec-cache: invalid configuration"]
    for error in exc.errors():
        if not error["loc"]:  # a check across several settings: its message names them
            lines.append(f"  {error['msg'].removeprefix('Value error, ')}")
            continue
        name = "EC_" + "_".join(str(part) for part in error["loc"]).upper()
        shown = "<redacted>" if "TOKEN" in name else repr(error.get("input"))
        lines.append(f"  {name}={shown}: {error['msg']}")
    return "\n".join(lines)


def main() -> None:
    try:
        settings = Settings()
    except ValidationError as exc:
        sys.exit(_explain(exc))
    log_config = logging_config(settings)
    logging.config.dictConfig(log_config)
    try:
        app = create_app(settings)
    except ConfigurationError as exc:
        sys.exit(f"ec-cache: invalid configuration\n  {exc}")
    backend = f"S3 {settings.s3_endpoint_url}" if settings.s3_enabled else "disk only"
    print(
        f"ec-cache on http://{settings.host}:{settings.port} "
        f"(data: {settings.data_dir.resolve()}, {backend})",
        flush=True,
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=JSONErrorsHttpToolsProtocol,  # httptools, with JSON 400s from its parser
        log_config=log_config,
        access_log=False,  # app.middleware writes access lines with request ids
        server_header=False,
        timeout_graceful_shutdown=settings.shutdown_timeout,
    )


if __name__ == "__main__":
    main()
