"""Server configuration: one pydantic-settings class, read from ``EC_*`` variables."""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(value: Any) -> int:
    """Parse ``1048576``, ``512KiB``, ``10GiB`` (binary units) into bytes."""
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(str(value))
    if match is None:
        raise ValueError(f"{value!r} is not a size: use bytes or a KiB/MiB/GiB/TiB suffix")
    number, unit = match.groups()
    return int(number) * _UNITS[(unit or "").upper()[:1]]


ByteSize = Annotated[int, BeforeValidator(parse_size)]


class WriteMode(StrEnum):
    WRITE_THROUGH = "write-through"
    WRITE_BACK = "write-back"


class LogLevel(StrEnum):
    CRITICAL = "critical"
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"
    DEBUG = "debug"


class Settings(BaseSettings):
    """Every setting of the server; each field is read from ``EC_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="EC_", extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    data_dir: Path = Path("./ec-data")
    disk_max_bytes: ByteSize = Field(default=10 * 1024**3, gt=0)
    max_body_bytes: ByteSize = Field(default=1024**3, gt=0)
    log_level: LogLevel = LogLevel.INFO

    s3_endpoint_url: str | None = None
    s3_bucket: str | None = None
    s3_prefix: str = "ec"
    s3_region: str = "us-east-1"
    s3_create_bucket: bool = False
    write_mode: WriteMode = WriteMode.WRITE_THROUGH

    @field_validator("s3_endpoint_url", "s3_bucket", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("s3_prefix")
    @classmethod
    def _strip_prefix(cls, value: str) -> str:
        return value.strip("/")

    @property
    def s3_enabled(self) -> bool:
        return self.s3_endpoint_url is not None
