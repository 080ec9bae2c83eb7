"""The chart's Grafana dashboard and PrometheusRule: rendered only when enabled, every
PromQL expression parsed (promql-parser), every metric it names present in the
/metrics output of a real server process, the dashboard JSON loadable."""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from testkit.server import ServerProcess
from tests.deploy.tooling import CHART, FULLNAME, ROOT, find, one, render, require_server_venv

MONITORING = CHART / "ci" / "hpa-monitoring-netpol-values.yaml"
ALERTS = {
    "ECCacheS3Unreachable",
    "ECCacheWriteBackBacklog",
    "ECCacheWriteBackStale",
    "ECCacheWriteBackQueueFull",
    "ECCacheDiskChurn",
    "ECCacheHigh5xxRate",
    "ECCacheHighP99Latency",
    "ECCacheReadinessFlapping",
    "ECCacheNotReady",
}
# Grafana's own variables, replaced as Grafana does before the query is sent.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def _promql() -> Any:
    try:
        import promql_parser
    except ImportError:
        message = "promql-parser missing: run `bash deploy/setup.sh` (deploy/requirements.txt)"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(message)
        pytest.skip(message)
    return promql_parser


def metric_names(expr: str) -> set[str]:
    """Parse ``expr`` (raises on a syntax error) and return the metric names it selects."""
    promql = _promql()
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql.VectorSelector) and node.name:
            names.add(node.name)

    promql.walk(promql.parse(expr), visit)
    return names


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


@functools.cache
def server_metric_names() -> frozenset[str]:
    """Sample names a real server exports with every tier on: S3 (unreachable) in
    write-back mode, per-namespace lookups, after one lookup and one readiness check."""
    require_server_venv()
    root = Path(tempfile.mkdtemp())
    server = ServerProcess(
        root / "data",
        root / "server.log",
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "y",
        },
        s3_endpoint_url="http://127.0.0.1:1",
        s3_bucket="b",
        s3_connect_timeout="0.2",
        s3_max_attempts="1",
        write_mode="write-back",
        metrics_namespaces="5",
    )
    server.start(timeout=60)
    try:
        _get(server.url + "/readyz")
        _get(server.url + "/ec/m/uint8/h")
        text = _get(server.url + "/metrics")
    finally:
        server.stop()
    names = set()
    for line in text.splitlines():
        match = re.match(r"# TYPE (\S+) (\S+)", line)
        if match:
            name, kind = match.groups()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return frozenset(names)


def rule_exprs(docs: list[dict[str, Any]]) -> dict[str, str]:
    rule = one(docs, "PrometheusRule")
    return {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}


def dashboard(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    (text,) = cm["data"].values()
    data: dict[str, Any] = json.loads(text)
    return data


def dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(re.sub(r"^label_values\((.*), \w+\)$", r"\1", var["definition"]))
    out = []
    for expr in exprs:
        for name, value in GRAFANA_VARS.items():
            expr = expr.replace(name, value)
        out.append(expr)
    return out


def test_off_by_default() -> None:
    docs = render()
    assert find(docs, "PrometheusRule") == []
    assert [
        d for d in find(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")
    ] == []


def test_rule_has_the_on_call_alerts_with_labels_and_thresholds() -> None:
    docs = render(files=[MONITORING])
    rule = one(docs, "PrometheusRule")
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical")
        assert r["labels"]["team"] == "inference"
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert 'job="ec-cache", namespace="cache"' in r["expr"], r["alert"]
    assert rule_exprs(docs)["ECCacheHighP99Latency"].rstrip().endswith("> 0.5")


def test_every_rule_expression_parses_and_names_real_metrics() -> None:
    exported = server_metric_names()
    for alert, expr in rule_exprs(render(files=[MONITORING])).items():
        names = metric_names(expr)
        assert names, alert
        assert names <= exported, f"{alert}: {sorted(names - exported)} not in /metrics"


def test_dashboard_loads_and_every_query_names_real_metrics() -> None:
    docs = render(files=[MONITORING])
    cm = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "ec-cache"
    dash = dashboard(docs)
    assert dash["uid"] and dash["title"] == "ec-cache"
    assert dash == json.loads((CHART / "dashboards" / "ec-cache.json").read_text())
    exported = server_metric_names()
    used: set[str] = set()
    for expr in dashboard_exprs(dash):
        names = metric_names(expr)
        assert names, expr
        assert names <= exported, f"{sorted(names - exported)} not in /metrics: {expr}"
        used |= names
    # the dashboard shows every family of the server, histograms by their buckets
    families = {n for n in exported if n.startswith("ec_")}
    families -= {n for n in families if n.endswith(("_sum", "_count"))}
    families -= {n.removesuffix("_bucket") for n in families if n.endswith("_bucket")}
    unused = (
        families
        - used
        - {
            "ec_disk_evicted_bytes_total",
            "ec_disk_corrupt_removed_total",
            "ec_s3_bytes_total",
            "ec_s3_fast_failures_total",
            "ec_s3_singleflight_joins_total",
            "ec_s3_upload_queue_bytes",
        }
    )
    assert not unused, f"no panel for {sorted(unused)}"
    ids = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panels overlap"


def test_parser_rejects_bad_promql() -> None:
    with pytest.raises(ValueError):
        metric_names("sum(rate(ec_http_requests_total[5m])")
