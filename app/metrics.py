"""Prometheus metrics, kept in one registry per app so tests can run several apps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


class Metrics:
    """The server's metrics; tiers report through the objects defined here."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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

    def watch_disk(self, stats: Callable[[], DiskStats]) -> None:
        self.registry.register(_DiskCollector(stats))


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


def route_label(method: str, path: str) -> str:
    """A bounded label for a request path (never the key itself)."""
    if path.startswith("/ec/"):
        return "exists" if method == "POST" and path.endswith("/_exists") else "entry"
    if path in ("/healthz", "/readyz", "/metrics", "/stats", "/docs", "/openapi.json"):
        return path[1:]
    return "other"


class MetricsMiddleware:
    """Counts and times every HTTP request (pure ASGI: no body buffering)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = route_label(scope["method"], scope["path"])
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.request_seconds.labels(route, scope["method"]).observe(
                time.perf_counter() - start
            )
