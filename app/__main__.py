"""``python -m app``: start the server with settings from ``EC_*`` variables (``--help``
lists them), or only check them (``--check``)."""

from __future__ import annotations

import argparse
import logging.config
import os
import resource
import sys
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from app import __version__
from app.allocator import keep_freed_memory
from app.check import run_checks
from app.http_protocol import uvicorn_options
from app.logs import logging_config
from app.main import ConfigurationError, create_app
from app.settings import Settings, setting_defaults, unknown_variables
from app.tiers.disk.data_dir import DataDirError

log = logging.getLogger("app")


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


def _raise_open_files_limit(connections: int) -> None:
    """Each connection is a file descriptor (an upload holds a second one): raise the
    soft limit towards the hard one when it is below what the bound needs."""
    needed = 2 * connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning(
            "open files limit %d is below the %d that EC_MAX_CONNECTIONS=%d may need",
            target,
            needed,
            connections,
        )


def _arguments() -> argparse.ArgumentParser:
    width = max(len(name) for name, _ in setting_defaults())
    settings = "\n".join(f"  {name:<{width}}  {default}" for name, default in setting_defaults())
    parser = argparse.ArgumentParser(
        prog="python -m app",
        description="ec-cache server: a shared cache for multimodal encoder outputs.\n\n"
        "All settings come from EC_* environment variables (sizes take bytes or a\n"
        "KiB/MiB/GiB/TiB suffix), S3 credentials from the AWS chain (AWS_ACCESS_KEY_ID,\n"
        "...); docs/operations.md explains each. An EC_* variable that is no setting\n"
        "is named in a warning at start-up.",
        epilog=f"settings and their defaults:\n{settings}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ec-cache {__version__}")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the settings, the data directory (free to use, layout) and S3 "
        "(reachable, credentials, bucket), print one line each and exit: 0 when all "
        "are usable, else 1; serve nothing",
    )
    return parser


def main() -> None:
    arguments = _arguments().parse_args()
    try:
        settings = Settings()
    except ValidationError as exc:
        sys.exit(_explain(exc))
    log_config = logging_config(settings)
    logging.config.dictConfig(log_config)
    for warning in unknown_variables(os.environ):
        log.warning("%s", warning)
    try:
        app = create_app(settings)
    except ConfigurationError as exc:
        sys.exit(f"ec-cache: invalid configuration\n  {exc}")
    if arguments.check:
        print(f"ec-cache {__version__}: settings ok")
        sys.exit(run_checks(settings, app))
    try:  # before anything in it is touched, and held until the process ends
        app.state.store.disk.claim()
    except DataDirError as exc:
        sys.exit(f"ec-cache: {exc}")
    backend = f"S3 {settings.s3_endpoint_url}" if settings.s3_enabled else "disk only"
    log.info(
        "ec-cache %s on http://%s:%d (data: %s, %s)",
        __version__,
        settings.host,
        settings.port,
        settings.data_dir.resolve(),
        backend,
    )
    _raise_open_files_limit(settings.max_connections)
    keep_freed_memory()
    uvicorn.run(app, **server_options(settings, app.state.metrics.registry, log_config))


def server_options(
    settings: Settings, registry: CollectorRegistry, log_config: dict[str, Any]
) -> dict[str, Any]:
    """``uvicorn.run`` options for the app (the benchmark's ASGI floor uses them too)."""
    return {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        # httptools, with connection deadlines and a bound (app.http_protocol)
        **uvicorn_options(settings, registry),
        "ws": "none",  # no WebSocket routes: an Upgrade request stays a plain HTTP request
        "log_config": log_config,
        "access_log": False,  # app.middleware writes access lines with request ids
        "server_header": False,
        "timeout_graceful_shutdown": settings.shutdown_timeout,
    }


if __name__ == "__main__":
    main()
