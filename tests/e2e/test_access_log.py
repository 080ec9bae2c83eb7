"""The access line: cache status (disk / s3 / miss), bytes and duration, text and JSON;
opt-in per-namespace lookup metrics with bounded cardinality."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from app import __version__
from testkit.entries import body
from testkit.server import ServerProcess

TEXT_LINE = re.compile(
    r"app\.access: (?P<method>[A-Z]+) (?P<path>\S+) (?P<status>\d{3}) cache=(?P<cache>\S+) "
    r"(?P<bytes>\d+)B (?P<ms>[\d.]+)ms id=(?P<id>\S+)$"
)


def _traffic(url: str) -> bytes:
    data = body((16, 4), "F32", 4, seed=3)
    assert httpx.put(f"{url}/ec/m/float32/h1", content=data).status_code == 201
    assert httpx.get(f"{url}/ec/m/float32/h1", headers={"X-Request-ID": "hit"}).content == data
    assert httpx.head(f"{url}/ec/m/float32/h1", headers={"X-Request-ID": "head"}).is_success
    miss = httpx.get(f"{url}/ec/m/float32/nope", headers={"X-Request-ID": "miss"})
    assert miss.status_code == 404
    assert httpx.get(f"{url}/healthz", headers={"X-Request-ID": "other"}).is_success
    return data


def test_text_access_line(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "d", tmp_path / "log", log_level="info") as srv:
        data = _traffic(srv.url)
    lines = {
        m["id"]: m
        for m in map(TEXT_LINE.search, (tmp_path / "log").read_text().splitlines())
        if m is not None
    }
    assert lines["hit"]["cache"] == "disk"
    assert int(lines["hit"]["bytes"]) == len(data)
    assert float(lines["hit"]["ms"]) >= 0
    assert lines["head"]["cache"] == "disk"
    assert lines["head"]["bytes"] == "0"
    assert lines["miss"]["cache"] == "miss"
    assert lines["miss"]["status"] == "404"
    assert lines["other"]["cache"] == "-"


def test_json_access_line(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "d", tmp_path / "log", log_level="info", log_format="json") as s:
        data = _traffic(s.url)
    lines = [
        json.loads(line)
        for line in (tmp_path / "log").read_text().splitlines()
        if line.startswith("{")
    ]
    access = {line["request_id"]: line for line in lines if line["logger"] == "app.access"}
    assert access["hit"]["cache"] == "disk"
    assert access["hit"]["bytes_sent"] == len(data)
    assert access["hit"]["duration_ms"] >= 0
    assert access["miss"]["cache"] == "miss"
    assert access["other"]["cache"] is None
    (put,) = [line for line in access.values() if line["method"] == "PUT"]
    assert put["bytes_received"] == len(data)
    assert put["status"] == 201


def _samples(text: str, name: str) -> dict[tuple[str, str, str], float]:
    """(model, dtype, result) -> value of each sample of ``name``."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            found[labels["model"], labels["dtype"], labels["result"]] = float(line.split()[-1])
    return found


def test_namespace_metrics_are_opt_in_and_bounded(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "d", tmp_path / "log") as srv:
        httpx.get(f"{srv.url}/ec/m/float32/x")
        assert "ec_namespace_lookups" not in httpx.get(srv.url + "/metrics").text
    with ServerProcess(tmp_path / "e", tmp_path / "log2", metrics_namespaces=2) as srv:
        data = body((4,), "U8", 1)
        assert httpx.put(f"{srv.url}/ec/Qwen/A/uint8/h", content=data).status_code == 201
        httpx.get(f"{srv.url}/ec/Qwen/A/uint8/h")
        httpx.get(f"{srv.url}/ec/Qwen/A/uint8/h")
        httpx.head(f"{srv.url}/ec/Qwen/A/uint8/missing")
        for i in range(5):  # namespaces that hold nothing: one _other series, not five
            httpx.get(f"{srv.url}/ec/tenant{i}/uint8/h")
        samples = _samples(httpx.get(srv.url + "/metrics").text, "ec_namespace_lookups_total")
    assert samples == {
        ("Qwen/A", "uint8", "disk"): 2,
        ("Qwen/A", "uint8", "miss"): 1,
        ("_other", "_other", "miss"): 5,
    }


ADMIN = "admin-token-0123456789ab"
QWEN = "qwen-token-0123456789abc"


def test_no_tenant_crowds_another_out_of_the_namespace_series(tmp_path: Path) -> None:
    """A token limited to Qwen/* reads 25 invented models (misses) and stores tiny
    entries in three of its own: the series (2) stay with the namespaces that hold the
    most bytes, another tenant's; lookups of namespaces holding nothing are _other.
    Only by storing more bytes than a namespace does a client take its series."""
    tokens = f"ops:admin:{ADMIN}; qwen:read,write,model=Qwen/*:{QWEN}"
    with ServerProcess(
        tmp_path / "d", tmp_path / "log", metrics_namespaces=2, auth_tokens=tokens
    ) as srv:
        ops = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {ADMIN}"})
        qwen = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {QWEN}"})
        for model, size in (("llava/big", 40_000), ("llava/mid", 20_000)):
            put = ops.put(f"/ec/{model}/uint8/h", content=body((size,), "U8", 1))
            assert put.status_code == 201
        for i in range(25):
            assert qwen.get(f"/ec/Qwen/invented{i}/uint8/h").status_code == 404
        for i in range(3):
            put = qwen.put(f"/ec/Qwen/t{i}/uint8/h", content=body((100,), "U8", 1))
            assert put.status_code == 201
            assert qwen.get(f"/ec/Qwen/t{i}/uint8/h").status_code == 200
        assert ops.get("/ec/llava/big/uint8/h").status_code == 200
        assert ops.get("/ec/llava/big/uint8/absent").status_code == 404
        assert ops.head("/ec/llava/mid/uint8/h").status_code == 200
        samples = _samples(ops.get("/metrics").text, "ec_namespace_lookups_total")
        assert samples == {
            ("llava/big", "uint8", "disk"): 1,
            ("llava/big", "uint8", "miss"): 1,
            ("llava/mid", "uint8", "disk"): 1,
            ("_other", "_other", "miss"): 25,
        }
        # Storing more bytes than llava/mid holds: Qwen/t0 now ranks before it.
        put = qwen.put("/ec/Qwen/t0/uint8/large", content=body((30_000,), "U8", 1))
        assert put.status_code == 201
        samples = _samples(ops.get("/metrics").text, "ec_namespace_lookups_total")
        assert set(samples) == {
            ("llava/big", "uint8", "disk"),
            ("llava/big", "uint8", "miss"),
            ("Qwen/t0", "uint8", "disk"),
            ("_other", "_other", "miss"),
        }
        ops.close()
        qwen.close()


def test_readiness_gauge_and_changes() -> None:
    from app.metrics import Metrics

    metrics = Metrics()
    for ready in (True, True, False, True):
        metrics.readiness(ready)
    value = metrics.registry.get_sample_value
    assert value("ec_ready") == 1
    assert value("ec_readiness_changes_total") == 2


def test_readyz_sets_ec_ready(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "d", tmp_path / "log") as srv:
        assert httpx.get(srv.url + "/readyz").status_code == 200
        assert "\nec_ready 1.0\n" in httpx.get(srv.url + "/metrics").text


def test_json_log_format_makes_every_line_json(tmp_path: Path) -> None:
    """The start-up banner and uvicorn's own lines too, without uvicorn's coloured
    ``color_message`` copy."""
    with ServerProcess(tmp_path / "d", tmp_path / "log", log_level="info", log_format="json") as s:
        httpx.get(s.url + "/healthz")
    text = (tmp_path / "log").read_text()
    lines = [json.loads(line) for line in text.splitlines()]  # raises on a plain line
    assert "\x1b[" not in text
    assert not [line for line in lines if "color_message" in line]
    assert any(line["message"].startswith(f"ec-cache {__version__} on http://") for line in lines)
    assert any(line["logger"].startswith("uvicorn") for line in lines)


def test_paths_are_logged_quoted(tmp_path: Path) -> None:
    """uvicorn decodes the path: a logged space would split the line's fields, a
    newline would forge a line."""
    target = "/ec/m@rev+1/float32/a%20b%0Aforged%25"
    with (
        ServerProcess(tmp_path / "d", tmp_path / "log", log_level="info") as srv,
        httpx.Client(base_url=srv.url) as client,
    ):
        request = client.build_request("GET", target, headers={"X-Request-ID": "odd"})
        assert client.send(request).status_code == 400  # no such hash
    text = (tmp_path / "log").read_text()
    lines = {m["id"]: m for m in map(TEXT_LINE.search, text.splitlines()) if m is not None}
    assert lines["odd"]["path"] == target
    assert not any(line.startswith("forged") for line in text.splitlines())
