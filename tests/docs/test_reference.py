"""The reference tables agree with the code: every metric family a real server exports
is in docs/operations.md's table (``ec_s3_*`` in docs/s3.md's), with every ``operation``
label value the S3 client counts; the Dockerfile's header names every ``EC_*`` it sets."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from app.tiers.s3 import client as s3_client
from testkit.server import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
S3 = ROOT / "docs" / "s3.md"


def _documented_metrics(document: Path) -> set[str]:
    """Metric names in the first column of a document's tables."""
    names: set[str] = set()
    for line in document.read_text().splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return names


def _family(sample: str) -> str:
    return re.sub(r"_(bucket|count|sum)$", "", sample)


def test_every_exported_metric_is_documented(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data", tmp_path / "log") as srv:
        text = httpx.get(f"{srv.url}/metrics").text
    exported = {
        _family(line.split("{")[0].split(" ")[0])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    documented = _documented_metrics(OPERATIONS)
    # process_*: one row names the main ones of Prometheus' standard collector.
    missing = {n for n in exported if n not in documented and not n.startswith("process_")}
    assert missing == set(), sorted(missing)
    assert {"process_resident_memory_bytes", "process_open_fds"} <= documented


def test_every_counted_s3_operation_is_documented() -> None:
    source = Path(s3_client.__file__).read_text()
    counted = set(re.findall(r'self\.call(?:_sync|_on_loop)?\(\s*"([a-z_]+)"', source))
    assert {"list", "delete_many", "head"} <= counted, counted
    row = next(line for line in S3.read_text().splitlines() if "`ec_s3_requests_total`" in line)
    listed = set(re.search(r"`operation` \(([^)]*)\)", row).group(1).split(", "))  # type: ignore[union-attr]
    assert counted <= listed, sorted(counted - listed)


def test_the_dockerfile_header_names_what_the_image_sets() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    header = dockerfile.split("\nARG ")[0]
    set_names = set(re.findall(r"^\s+(EC_[A-Z_]+)=", dockerfile, re.MULTILINE))
    assert set_names == {"EC_HOST", "EC_PORT", "EC_DATA_DIR"}
    for name in set_names:
        assert name in header, name
