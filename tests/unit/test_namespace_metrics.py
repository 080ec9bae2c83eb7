"""``ec_namespace_lookups_total`` (``EC_METRICS_NAMESPACES``): series only for namespaces
that exist, the ones holding the most bytes on this disk, memory bounded likewise."""

from __future__ import annotations

from app.metrics import OTHER_NAMESPACE, Metrics
from app.tiers.disk import NamespaceUsage


class FakeDisk:
    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = {}

    def holds(self, model: str, dtype: str) -> bool:
        return (model, dtype) in self.bytes

    def usage(self) -> list[NamespaceUsage]:
        return [NamespaceUsage(m, d, 1, b) for (m, d), b in self.bytes.items()]


def _exported(metrics: Metrics) -> dict[tuple[str, str], float]:
    found: dict[tuple[str, str], float] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "ec_namespace_lookups_total":
                key = (sample.labels["model"], sample.labels["result"])
                found[key] = sample.value
    return found


def test_series_follow_the_bytes_on_disk_and_memory_stays_bounded() -> None:
    disk = FakeDisk()
    metrics = Metrics(namespaces=2)
    metrics.watch_namespaces(disk.holds, disk.usage)
    disk.bytes = {("a", "u8"): 300, ("b", "u8"): 200, ("c", "u8"): 100}
    for model in ("a", "b", "c", "c"):
        metrics.lookup(model, "u8", "disk")
    metrics.lookup("c", "u8", "miss")  # a miss in a namespace that holds entries
    for i in range(50):
        metrics.lookup(f"invented{i}", "u8", "miss")
    assert _exported(metrics) == {
        ("a", "disk"): 1,
        ("b", "disk"): 1,
        (OTHER_NAMESPACE, "miss"): 50,
    }
    disk.bytes["c", "u8"] = 1000  # c now holds the most: its counts were kept
    assert _exported(metrics) == {
        ("c", "disk"): 2,
        ("c", "miss"): 1,
        ("a", "disk"): 1,
        (OTHER_NAMESPACE, "miss"): 50,
    }
    metrics.lookup("s3-only", "u8", "s3")  # found in S3, not on this disk (yet)
    assert ("s3-only", "s3") not in _exported(metrics)  # and forgotten: memory is bounded
    disk.bytes["s3-only", "u8"] = 5000  # its read-through copy is committed
    metrics.lookup("s3-only", "u8", "disk")
    del disk.bytes["a", "u8"]
    assert _exported(metrics) == {
        ("s3-only", "disk"): 1,
        ("c", "disk"): 2,
        ("c", "miss"): 1,
        (OTHER_NAMESPACE, "miss"): 50,
    }
    disk.bytes["a", "u8"] = 10_000  # back, with more bytes: its old count is gone
    metrics.lookup("a", "u8", "disk")
    assert _exported(metrics)[("a", "disk")] == 1
