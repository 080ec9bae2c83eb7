"""Every Prometheus metric of the server, defined here and nowhere else.

One registry per app (so tests can run several apps): :class:`Metrics` holds the HTTP,
lookup, readiness and disk series; the S3 backend, read-through and write-back queue
register theirs on the same registry through :class:`S3Metrics`,
:class:`ReadThroughMetrics` and :class:`UploadQueueMetrics` when they exist (a
disk-only server exports no ``ec_s3_*`` series); the connection guard of ``python -m
app`` through :class:`ConnectionMetrics`.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app import __version__

if TYPE_CHECKING:  # metrics import no tier: every tier may import metrics
    from app.tiers.disk import DiskStats, NamespaceUsage

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


#: The label values of lookups in namespaces that hold nothing here (see ``Metrics``).
OTHER_NAMESPACE = "_other"


class Metrics:
    """The server's metrics; tiers report through the objects defined here.

    ``namespaces`` > 0 (``EC_METRICS_NAMESPACES``) also counts lookups per namespace
    (model, dtype), once ``watch_namespaces`` is given the disk tier's namespaces: see
    ``_NamespaceLookups``. Series exist only for namespaces that exist, at most
    ``namespaces`` of them, whatever clients send.
    """

    def __init__(self, namespaces: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.max_namespaces = namespaces
        # process_*: resident memory, open fds, CPU seconds, start time (the default
        # registry's collector, which this registry does not inherit).
        ProcessCollector(registry=self.registry)
        Info(
            "ec_build", "The server's version, one series of value 1.", registry=self.registry
        ).info({"version": __version__, "python": platform.python_version()})
        self._namespace_lookups: _NamespaceLookups | None = None
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
        if self._namespace_lookups is not None:
            self._namespace_lookups.count(model, dtype, result)

    def watch_disk(self, stats: Callable[[], DiskStats]) -> None:
        self.registry.register(_DiskCollector(stats))

    def watch_namespaces(
        self,
        holds: Callable[[str, str], bool],
        usage: Callable[[], Iterable[NamespaceUsage]],
    ) -> None:
        """Count lookups per namespace (if ``namespaces`` > 0): ``holds(model, dtype)``
        says whether the disk tier holds entries of a namespace, ``usage`` gives the
        bytes of each namespace it holds."""
        if self.max_namespaces > 0:
            self._namespace_lookups = _NamespaceLookups(self.max_namespaces, holds, usage)
            self.registry.register(self._namespace_lookups)


class ClaimMetrics:
    """Claims on missing keys and the requests waiting for them (``app.claims``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.claims = Counter(
            "ec_claims",
            "Claims asked for absent keys, by outcome: granted, computing (held by "
            "another owner), full (EC_CLAIM_MAX_KEYS claims live: not granted).",
            ["outcome"],
            registry=registry,
        )
        self.ended = Counter(
            "ec_claims_ended",
            "Claims ended, by reason: stored (the entry was PUT), released, expired.",
            ["reason"],
            registry=registry,
        )
        self.waits = Counter(
            "ec_claim_waits",
            "Requests that waited for claimed keys, by outcome: ended (every claim "
            "ended), timeout, gone (the client left), refused (EC_CLAIM_MAX_WAITERS).",
            ["outcome"],
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "ec_claim_wait_seconds",
            "Time a request waited for claimed keys.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )

    def watch(self, held: Callable[[], int], waiting: Callable[[], int]) -> None:
        for name, text, value in (
            ("ec_claims_held", "Live claims on this replica.", held),
            ("ec_claim_waiters", "Requests waiting for claimed keys.", waiting),
        ):
            Gauge(name, text, registry=self.registry).set_function(value)


class S3Metrics:
    """The S3 client's series. Pass the server's registry; with none, the metrics go
    to a private registry (useful in tests that build many clients)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = reg
        self.requests = Counter(
            "ec_s3_requests_total",
            "S3 requests by operation and outcome (ok, not_found, exists: a conditional write "
            "found the key taken, error, unavailable)",
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
            "S3 -> disk copies by outcome (committed, not_found, failed, exists, abandoned).",
            ["outcome"],
            registry=registry,
        )


class DiskCommitMetrics:
    """The disk tier's group commit (``app.tiers.disk.group_commit``): how many uploads
    each batch of fsyncs covered, the fsyncs themselves and how long a batch took."""

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
            "Write-back upload attempts by outcome (ok, retry, dropped; lost: S3 held another "
            "body, which replaced this replica's copy).",
            ["outcome"],
            registry=registry,
        )
        self.deletes = Counter(
            "ec_s3_upload_queue_deletes",
            "Write-back S3 deletes (owed by DELETEs and purges, journaled) by outcome (ok, retry).",
            ["outcome"],
            registry=registry,
        )
        self.full = Counter(
            "ec_s3_upload_queue_full",
            "Write-back PUTs done as write-through because the upload queue was full.",
            registry=registry,
        )


#: Why ``app.http_protocol.guarded`` closes a connection (the label values of its counter).
CONNECTION_DROP_REASONS = (
    "limit",
    "idle",
    "header_timeout",
    "headers_too_large",
    "send_timeout",
)


class ConnectionMetrics:
    """Open connections and those dropped by ``app.http_protocol.guarded``' bounds."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.open = Gauge("ec_connections_open", "Open HTTP connections.", registry=registry)
        self.dropped = Counter(
            "ec_connections_dropped",
            "Connections closed by the server's bounds: limit (over EC_MAX_CONNECTIONS), "
            "idle (EC_KEEPALIVE_TIMEOUT), header_timeout (EC_HEADER_TIMEOUT), "
            "headers_too_large (a head past EC_MAX_HEADER_BYTES while it arrived), "
            "send_timeout (EC_SEND_TIMEOUT).",
            ["reason"],
            registry=registry,
        )
        for reason in CONNECTION_DROP_REASONS:
            self.dropped.labels(reason)


class _NamespaceLookups(Collector):
    """``ec_namespace_lookups_total``: entry reads per namespace (model, dtype) by
    result, bounded by what exists so that no client can crowd another out.

    A read is counted under its namespace when the namespace exists: the read found
    its entry (on disk or in S3) or the disk tier holds entries of it; a miss in a
    namespace that holds nothing here is counted under ``_other``, so reads of
    invented namespaces make no series. Each scrape exports, of the namespaces read,
    the ``limit`` that hold the most bytes on this disk: a client takes a series from
    another namespace only by storing more bytes than it. A namespace's counts are kept
    while it holds entries here (one ranked again goes on from its count) and dropped
    at the first scrape where it holds none, so memory stays bounded too."""

    def __init__(
        self,
        limit: int,
        holds: Callable[[str, str], bool],
        usage: Callable[[], Iterable[NamespaceUsage]],
    ) -> None:
        self._limit = limit
        self._holds = holds
        self._usage = usage
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], dict[str, int]] = {}
        self._other: dict[str, int] = {}

    def count(self, model: str, dtype: str, result: str) -> None:
        namespace = (model, dtype)
        # The disk tier is asked (under its lock) only on a miss of a namespace not
        # counted yet.
        exists = result != "miss" or namespace in self._counts or self._holds(model, dtype)
        with self._lock:
            counts = self._counts.setdefault(namespace, {}) if exists else self._other
            counts[result] = counts.get(result, 0) + 1

    def collect(self) -> Iterable[Metric]:
        on_disk = {(u.model, u.dtype): u.bytes for u in self._usage() if u.model and u.dtype}
        family = CounterMetricFamily(
            "ec_namespace_lookups",
            "Entry reads (GET and HEAD) per namespace (model, dtype) by the tier that "
            "answered or miss; only with EC_METRICS_NAMESPACES > 0: the namespaces that "
            "hold the most bytes on this disk, up to that many; misses in namespaces "
            "that hold nothing here counted as _other.",
            labels=["model", "dtype", "result"],
        )
        with self._lock:
            for namespace in [n for n in self._counts if n not in on_disk]:
                del self._counts[namespace]
            ranked = sorted(self._counts, key=lambda n: (-on_disk[n], n))
            samples = [(n, dict(self._counts[n])) for n in ranked[: self._limit]]
            samples.append(((OTHER_NAMESPACE, OTHER_NAMESPACE), dict(self._other)))
        for (model, dtype), counts in samples:
            for result, value in sorted(counts.items()):
                family.add_metric([model, dtype, result], value)
        yield family


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
