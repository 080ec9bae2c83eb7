"""Logging set-up: text for people, JSON (one object per line) for log pipelines.

The same configuration is handed to uvicorn so its own lines share the format (in JSON
without the ``color_message`` uvicorn adds to some: a copy of the message with ANSI
colour escapes). Every line the server writes is a log record, the start-up banner of
``app.__main__`` included. Access lines come from ``app.middleware`` (uvicorn's access
log is off) and carry the request id; no line ever contains a token or a request body.
"""

from __future__ import annotations

from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS

from app.settings import LogFormat, Settings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s"


def logging_config(settings: Settings) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` dict for the app and uvicorn alike."""
    if settings.log_format is LogFormat.JSON:
        formatter: dict[str, Any] = {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": JSON_FIELDS,
            "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"},
            # Record attributes left out of the object: logging's own, and uvicorn's
            # coloured copy of the message.
            "reserved_attrs": [*RESERVED_ATTRS, "color_message"],
        }
    else:
        formatter = {"format": TEXT_FORMAT}
    level = settings.log_level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["default"], "level": level},
        "loggers": {
            "uvicorn": {"handlers": [], "level": level, "propagate": True},
            "uvicorn.error": {"handlers": [], "level": level, "propagate": True},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }
