"""Server configuration: one pydantic-settings class, read from ``EC_*`` variables."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.auth import AnonymousAccess

# re.ASCII: \d is 0-9 only (int() would take any Unicode digit), \s ASCII whitespace.
_SIZE_RE = re.compile(r"\s*([0-9]+)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE | re.ASCII)
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(value: Any) -> int:
    """Parse ``1048576``, ``512KiB``, ``10GiB`` (binary units) into bytes."""
    if isinstance(value, int):
        return value
    match = _SIZE_RE.fullmatch(str(value))
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


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


class Settings(BaseSettings):
    """Every setting of the server; each field is read from ``EC_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="EC_", extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    data_dir: Path = Path("./ec-data")
    disk_max_bytes: ByteSize = Field(default=10 * 1024**3, gt=0)
    #: Group commit: how long the disk tier's committer may wait for other uploads in
    #: flight to finish, so that one batch of fsyncs covers them all (0: never wait;
    #: uploads that finish while a batch is being synced still share the next one).
    disk_commit_delay: float = Field(default=0.0, ge=0, le=10)
    max_body_bytes: ByteSize = Field(default=1024**3, gt=0)
    log_level: LogLevel = LogLevel.INFO

    s3_endpoint_url: str | None = None
    s3_bucket: str | None = None
    s3_prefix: str = "ec"
    s3_region: str = "us-east-1"
    s3_create_bucket: bool = False
    write_mode: WriteMode = WriteMode.WRITE_THROUGH

    # S3 tuning (see app/tiers/s3/). Credentials come from the standard AWS chain.
    s3_connect_timeout: float = Field(default=3.0, gt=0)
    s3_read_timeout: float = Field(default=30.0, gt=0)
    s3_max_attempts: int = Field(default=3, ge=1, le=10)
    s3_max_pool_connections: int = Field(default=32, ge=1, le=1024)
    s3_multipart_threshold: ByteSize = Field(default=64 * 1024**2, ge=5 * 1024**2)
    s3_multipart_part_size: ByteSize = Field(default=16 * 1024**2, ge=5 * 1024**2)
    s3_multipart_concurrency: int = Field(default=4, ge=1, le=64)
    s3_get_chunk_size: ByteSize = Field(default=4 * 1024**2, ge=64 * 1024)
    #: A read-through GET of an object larger than one part is read as concurrent
    #: ranged GETs of this size, this many at once (1: one GET per object); at most
    #: their product is held in memory per read (app/tiers/s3/ranged_get.py). Parts are
    #: relayed in order, so a smaller part lets the client drain one while later ones
    #: arrive: 4 MiB beat 8 MiB and 2 MiB on bench/s3_readthrough.py's link.
    s3_get_part_size: ByteSize = Field(default=4 * 1024**2, ge=256 * 1024)
    s3_get_concurrency: int = Field(default=8, ge=1, le=64)
    #: Bytes of ranged parts received ahead of their turn, all read-throughs together;
    #: when spent, a read-through reads one part at a time.
    s3_get_buffer_bytes: ByteSize = Field(default=512 * 1024**2, ge=0)
    #: After S3 failed as unreachable, answer 503 at once for this long (and advertise it
    #: in Retry-After) instead of waiting for a timeout on every request.
    s3_unavailable_cooldown: float = Field(default=2.0, gt=0, le=300)
    s3_verify_tls: bool = True

    # write-back: uploads journaled under {data_dir}/upload-queue, retried with backoff.
    writeback_queue_max_entries: int = Field(default=10_000, ge=1)
    #: 0 = half of EC_DISK_MAX_BYTES (queued entries are pinned on disk until uploaded).
    writeback_queue_max_bytes: ByteSize = Field(default=0, ge=0)
    writeback_workers: int = Field(default=4, ge=1, le=64)
    writeback_retry_min: float = Field(default=1.0, gt=0)
    writeback_retry_max: float = Field(default=60.0, gt=0)
    #: At shutdown, wait this long for pending uploads (the rest stay in the journal).
    writeback_drain_timeout: float = Field(default=10.0, ge=0, le=3600)

    # access control (see app/auth.py for the token format)
    auth_tokens: SecretStr | None = None
    auth_tokens_file: Path | None = None
    #: Unset: admin (everything) when no tokens are configured and the server listens
    #: on loopback only, else none. Set it to allow anonymous access explicitly.
    anonymous: AnonymousAccess | None = None
    metrics_public: bool = True
    #: > 0: count lookups per namespace (model, dtype), exported for this many of the
    #: namespaces holding the most bytes on this disk; misses in namespaces holding
    #: nothing here as ``_other`` (bounded cardinality, see app.metrics); 0: off.
    metrics_namespaces: int = Field(default=0, ge=0, le=10_000)

    # limits
    max_concurrent_uploads: int = Field(default=64, ge=1)
    max_concurrent_downloads: int = Field(default=512, ge=1)
    #: An upload that sends nothing for this long is cut off and leaves nothing behind.
    body_read_timeout: float = Field(default=30.0, gt=0)
    #: An upload must average at least this many bytes per second once its grace
    #: period is over (0: no minimum); slower ones are cut off (408).
    upload_min_rate: ByteSize = Field(default=1024**2, ge=0)
    upload_rate_grace: float = Field(default=10.0, ge=0)
    #: No upload body takes longer than this, however fast it still goes (408).
    upload_timeout: float = Field(default=300.0, gt=0)
    max_header_bytes: ByteSize = Field(default=16 * 1024, ge=1024)
    # connections (see app/http_protocol/guarded.py)
    #: Open connections beyond this are answered 503 and closed at once.
    max_connections: int = Field(default=4096, ge=1)
    #: A connection with no request in progress (a new one too) is closed after this.
    keepalive_timeout: float = Field(default=5.0, gt=0)
    #: A request head (and any body but a PUT's) must be in this long after its first
    #: byte, else 408 and the connection is closed (slowloris).
    header_timeout: float = Field(default=10.0, gt=0)
    #: A client that accepts no response bytes for this long is dropped.
    send_timeout: float = Field(default=30.0, gt=0)
    #: SIGTERM: stop accepting, then wait this long (seconds, fractions too: the Helm
    #: chart's schema takes any number) for in-flight requests.
    shutdown_timeout: float = Field(default=30.0, ge=0)

    # claims on missing keys (app/claims.py: one engine encodes, the others wait)
    #: The longest lease a claim may get, whatever its claimer asks (seconds).
    claim_max_lease: float = Field(default=60.0, gt=0, le=3600)
    #: Live claims at most; beyond, claims are not granted (askers compute).
    claim_max_keys: int = Field(default=100_000, ge=1)
    #: Requests waiting for claimed keys at most; beyond, ``_wait`` answers 503.
    claim_max_waiters: int = Field(default=1024, ge=1)
    #: The longest a ``_wait`` request may wait (seconds).
    claim_max_wait: float = Field(default=60.0, gt=0, le=3600)

    log_format: LogFormat = LogFormat.TEXT

    @field_validator("s3_endpoint_url", "s3_bucket", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("s3_prefix")
    @classmethod
    def _strip_prefix(cls, value: str) -> str:
        return value.strip("/")

    @model_validator(mode="after")
    def _s3_needs_bucket(self) -> Settings:
        if self.s3_endpoint_url is not None and not self.s3_bucket:
            raise ValueError(
                f"EC_S3_BUCKET must be set when EC_S3_ENDPOINT_URL is set ({self.s3_endpoint_url})"
            )
        return self

    @property
    def s3_enabled(self) -> bool:
        return self.s3_endpoint_url is not None

    @property
    def writeback_max_bytes(self) -> int:
        return self.writeback_queue_max_bytes or self.disk_max_bytes // 2

    @property
    def listens_on_loopback_only(self) -> bool:
        return self.host in ("127.0.0.1", "::1", "localhost")

    def anonymous_access(self, tokens_configured: bool) -> AnonymousAccess:
        if self.anonymous is not None:
            return self.anonymous
        if not tokens_configured and self.listens_on_loopback_only:
            return AnonymousAccess.ADMIN
        return AnonymousAccess.NONE


#: ``EC_*`` names read by something else than the server: the SDK and its CLI (a shell
#: may hold both), and the test suite's ``EC_TEST_*``.
NOT_SERVER_NAMES = frozenset({"EC_CACHE_URL", "EC_CACHE_MODEL", "EC_CACHE_DTYPE", "EC_CACHE_TOKEN"})
NOT_SERVER_PREFIX = "EC_TEST_"
#: Names docker-compose.yml reads that look like server settings, and what to set.
COMPOSE_ONLY_NAMES = {
    "EC_S3_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
    "EC_S3_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
}


def setting_names() -> list[str]:
    """Every ``EC_*`` variable the server reads."""
    prefix = Settings.model_config.get("env_prefix", "")
    return [prefix + name.upper() for name in Settings.model_fields]


def _shown_size(size: int) -> str:
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def setting_defaults() -> list[tuple[str, str]]:
    """``(variable, default as it would be written)`` for every setting."""
    shown = []
    for name, variable in zip(Settings.model_fields, setting_names(), strict=True):
        field = Settings.model_fields[name]
        default = field.default
        is_size = any(getattr(meta, "func", None) is parse_size for meta in field.metadata)
        if default is None:
            text = "unset"
        elif is_size:
            text = _shown_size(default)
        elif isinstance(default, bool):
            text = str(default).lower()
        elif isinstance(default, float):
            text = f"{default:g}"
        else:
            text = str(default)
        shown.append((variable, text))
    return shown


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``EC_*`` variable in ``environ`` that is no setting (and so is
    ignored): a misspelling names the settings it is close to."""
    names = setting_names()
    known = set(names)
    warnings = []
    for name in sorted(environ):
        upper = name.upper()  # pydantic-settings reads the names case-insensitively
        if not upper.startswith("EC_") or upper in known or upper in NOT_SERVER_NAMES:
            continue
        if upper.startswith(NOT_SERVER_PREFIX):
            continue
        if upper in COMPOSE_ONLY_NAMES:
            warnings.append(
                f"{name} is read by docker-compose.yml, not by the server: the server takes "
                f"S3 credentials from the AWS chain ({COMPOSE_ONLY_NAMES[upper]}, ...)"
            )
            continue
        close = difflib.get_close_matches(upper, names, n=2, cutoff=0.8)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        warnings.append(f"{name} is not a setting and is ignored{hint}")
    return warnings
