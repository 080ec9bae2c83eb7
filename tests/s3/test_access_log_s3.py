"""The access line says ``cache=s3`` when S3 answered (a replica with an empty disk)."""

from __future__ import annotations

import json

import httpx

from testkit.entries import body, crc_hex
from tests.s3.conftest import ServerFactory


def test_access_line_names_the_s3_tier(make_server: ServerFactory) -> None:
    a = make_server("a")
    b = make_server("b", log_format="json", metrics_namespaces=10)
    data = body((64, 8), "F16", 2, seed=5)
    path = "/ec/Qwen/Qwen2-VL/float16/via-s3"
    assert (
        httpx.put(a.url + path, content=data, headers={"X-EC-CRC32C": crc_hex(data)}).status_code
        == 201
    )
    first = httpx.get(b.url + path, headers={"X-Request-ID": "from-s3"})
    assert first.content == data
    assert first.headers["x-ec-tier"] == "s3"
    second = httpx.get(b.url + path, headers={"X-Request-ID": "from-disk"})
    assert second.content == data
    metrics = httpx.get(b.url + "/metrics").text
    b.stop()
    lines = [json.loads(x) for x in b.log_path.read_text().splitlines() if x.startswith("{")]
    access = {x["request_id"]: x for x in lines if x.get("logger") == "app.access"}
    assert access["from-s3"]["cache"] == "s3"
    assert access["from-s3"]["bytes_sent"] == len(data)
    assert access["from-disk"]["cache"] == "disk"
    assert (
        'ec_namespace_lookups_total{dtype="float16",model="Qwen/Qwen2-VL",result="s3"} 1.0'
        in metrics
    )
