"""Every Prometheus metric of the server, defined here and nowhere else.

One registry per app (so tests can run several apps): :class:`Metrics` holds the HTTP,
lookup, readiness and disk series; the S3 backend, read-through and write-back queue
register theirs on the same registry through :class:`S3Metrics`,
:class:`ReadThroughMetrics` and :class:`UploadQueueMetrics` when they exist (a
disk-only server exports no ``ec_s3_*`` series); the connection guard of ``python -m
app`` through :class:`ConnectionMetrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # metrics import no tier: every tier may import metrics
    from app.tiers.disk import DiskStats

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


# ``*_created`` series double the output and no dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]


#: The label values of the namespaces beyond ``EC_METRICS_NAMESPACES``.
OTHER_NAMESPACE = "_other"


class Metrics:
    """The server's metrics; tiers report through the objects defined here.

    ``namespaces`` > 0 (``EC_METRICS_NAMESPACES``) also counts lookups per namespace
    (model, dtype), for the first ``namespaces`` namespaces seen; the rest are counted
    under ``_other``, so the number of series stays bounded whatever clients send.
    """

    def __init__(self, namespaces: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.max_namespaces = namespaces
        self._namespaces: set[tuple[str, str]] = set()
        self.namespace_lookups = (
            Counter(
                "ec_namespace_lookups",
                "Entry reads (GET and HEAD) per namespace (model, dtype) by the tier that "
                "answered or miss; only with EC_METRICS_NAMESPACES > 0, namespaces beyond "
                "it counted as _other.",
                ["model", "dtype", "result"],
                registry=self.registry,
            )
            if namespaces > 0
            else None
        )
        self.requests = Counter(
            "ec_http_requests",
            "HTTP requests answered, by route, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "ec_http_request_duration_seconds",
            "Time from request start to the last byte of the response.",
            ["route", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.lookups = Counter(
            "ec_cache_lookups",
            "Entry reads (GET and HEAD) by the tier that answered or miss.",
            ["result"],
            registry=self.registry,
        )
        self.bytes_received = Counter(
            "ec_put_bytes",
            "Body bytes of PUTs that were stored.",
            registry=self.registry,
        )
        self.bytes_sent = Counter(
            "ec_get_bytes",
            "Body bytes of GETs answered with 200 (an aborted send still counts).",
            registry=self.registry,
        )
        self.rejected_puts = Counter(
            "ec_put_rejected",
            "PUTs refused, by error code.",
            ["code"],
            registry=self.registry,
        )

        self.ready = Gauge(
            "ec_ready",
            "1 when the last readiness check (/readyz) passed, else 0.",
            registry=self.registry,
        )
        self.readiness_changes = Counter(
            "ec_readiness_changes",
            "Times the readiness check result changed (ready <-> not ready).",
            registry=self.registry,
        )
        self._last_ready: bool | None = None
        # labels() takes a lock and builds a tuple per call: each series is resolved once.
        self._request_series: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        self._lookup_series: dict[str, Counter] = {}

    def readiness(self, ready: bool) -> None:
        """Record one readiness check's result."""
        self.ready.set(1 if ready else 0)
        if self._last_ready is not None and ready != self._last_ready:
            self.readiness_changes.inc()
        self._last_ready = ready

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count and time one answered HTTP request."""
        key = (route, method, status)
        series = self._request_series.get(key)
        if series is None:
            series = (
                self.requests.labels(route, method, str(status)),
                self.request_seconds.labels(route, method),
            )
            self._request_series[key] = series
        series[0].inc()
        series[1].observe(seconds)

    def watch_s3(self, up: Callable[[], bool]) -> None:
        self.registry.register(_S3UpCollector(up))

    def lookup(self, model: str, dtype: str, result: str) -> None:
        """Count one entry read answered by ``result`` (``disk``, ``s3`` or ``miss``)."""
        series = self._lookup_series.get(result)
        if series is None:
            series = self._lookup_series[result] = self.lookups.labels(result)
        series.inc()
        if self.namespace_lookups is None:
            return
        namespace = (model, dtype)
        if namespace not in self._namespaces:
            if len(self._namespaces) >= self.max_namespaces:
                namespace = (OTHER_NAMESPACE, OTHER_NAMESPACE)
            else:
                self._namespaces.add(namespace)
        self.namespace_lookups.labels(*namespace, result).inc()

    def watch_disk(self, stats: Callable[[], DiskStats]) -> None:
        self.registry.register(_DiskCollector(stats))


class S3Metrics:
    """The S3 client's series. Pass the server's registry; with none, the metrics go
    to a private registry (useful in tests that build many clients)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = reg
        self.requests = Counter(
            "ec_s3_requests_total",
            "S3 requests by operation and outcome (ok, not_found, error, unavailable)",
            ["operation", "outcome"],
            registry=reg,
        )
        self.bytes = Counter(
            "ec_s3_bytes_total",
            "Body bytes moved to (up) and from (down) S3",
            ["direction"],
            registry=reg,
        )
        self.latency = Histogram(
            "ec_s3_request_duration_seconds",
            "S3 request latency by operation (get: until the response headers arrived)",
            ["operation"],
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=reg,
        )
        self.fast_failures = Counter(
            "ec_s3_fast_failures_total",
            "S3 calls refused locally while the endpoint was marked unavailable",
            registry=reg,
        )
        self.bytes_up = self.bytes.labels("up")
        self.bytes_down = self.bytes.labels("down")


class ReadThroughMetrics:
    """Single-flight joins and backend -> disk copies (``app.tiers.read_through``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.joins = Counter(
            "ec_s3_singleflight_joins",
            "Disk misses that joined an S3 read already in flight instead of starting one.",
            registry=registry,
        )
        self.fills = Counter(
            "ec_s3_fills",
            "S3 -> disk copies by outcome (committed, not_found, failed, exists).",
            ["outcome"],
            registry=registry,
        )


class DiskCommitMetrics:
    """The disk tier's group commit (``app.tiers.disk``): how many uploads each batch
    of fsyncs covered, the fsyncs themselves and how long a batch took."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batch_size = Histogram(
            "ec_disk_commit_batch_size",
            "Entries (uploads and S3 fills) made durable by one group commit.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=registry,
        )
        self.fsyncs = Counter(
            "ec_disk_commit_fsyncs",
            "fsync/fdatasync calls of group commits: file (an entry's or a write-back "
            "journal record's bytes) and directory (its new name), once per batch each.",
            ["kind"],
            registry=registry,
        )
        for kind in ("file", "directory"):
            self.fsyncs.labels(kind)
        self.seconds = Histogram(
            "ec_disk_commit_duration_seconds",
            "Time one group commit took (syncs, renames, publishing).",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )


class UploadQueueMetrics:
    """The write-back queue's series; the gauges read the queue when scraped."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        depth: Callable[[], float],
        pending_bytes: Callable[[], float],
        oldest_age: Callable[[], float],
    ) -> None:
        self.registry = registry
        self.depth = Gauge(
            "ec_s3_upload_queue_depth",
            "Entries committed to disk and waiting for their write-back upload to S3.",
            registry=registry,
        )
        self.depth.set_function(depth)
        self.bytes = Gauge(
            "ec_s3_upload_queue_bytes",
            "Bytes of the entries waiting for their write-back upload.",
            registry=registry,
        )
        self.bytes.set_function(pending_bytes)
        self.oldest = Gauge(
            "ec_s3_upload_queue_oldest_seconds",
            "Age of the longest-waiting write-back upload (0 when the queue is empty).",
            registry=registry,
        )
        self.oldest.set_function(oldest_age)
        self.uploads = Counter(
            "ec_s3_uploads",
            "Write-back upload attempts by outcome (ok, retry, dropped).",
            ["outcome"],
            registry=registry,
        )
        self.full = Counter(
            "ec_s3_upload_queue_full",
            "Write-back PUTs done as write-through because the upload queue was full.",
            registry=registry,
        )


#: Why ``app.http_protocol.guarded`` closes a connection (the label values of its counter).
CONNECTION_DROP_REASONS = ("limit", "idle", "header_timeout", "send_timeout")


class ConnectionMetrics:
    """Open connections and those dropped by ``app.http_protocol.guarded``' bounds."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.open = Gauge("ec_connections_open", "Open HTTP connections.", registry=registry)
        self.dropped = Counter(
            "ec_connections_dropped",
            "Connections closed by the server's bounds: limit (over EC_MAX_CONNECTIONS), "
            "idle (EC_KEEPALIVE_TIMEOUT), header_timeout (EC_HEADER_TIMEOUT), "
            "send_timeout (EC_SEND_TIMEOUT).",
            ["reason"],
            registry=registry,
        )
        for reason in CONNECTION_DROP_REASONS:
            self.dropped.labels(reason)


class _S3UpCollector(Collector):
    def __init__(self, up: Callable[[], bool]) -> None:
        self._up = up

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "ec_s3_up",
            "1 while S3 is reachable: the last readiness check of S3 passed and no "
            "unavailable error is cooling down; else 0.",
            value=1 if self._up() else 0,
        )


class _DiskCollector(Collector):
    def __init__(self, stats: Callable[[], DiskStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("ec_disk_entries", "Entries in the disk tier.", value=s.entries)
        yield GaugeMetricFamily("ec_disk_used_bytes", "Bytes in the disk tier.", value=s.used_bytes)
        yield GaugeMetricFamily("ec_disk_max_bytes", "Disk tier bound.", value=s.max_bytes)
        yield GaugeMetricFamily(
            "ec_disk_pinned_entries", "Entries that may not be evicted yet.", value=s.pinned
        )
        yield CounterMetricFamily("ec_disk_evictions", "Entries evicted.", value=s.evictions)
        yield CounterMetricFamily("ec_disk_evicted_bytes", "Bytes evicted.", value=s.evicted_bytes)
        yield CounterMetricFamily(
            "ec_disk_corrupt_removed",
            "Entries dropped because their bytes changed on disk.",
            value=s.corrupt_removed,
        )
