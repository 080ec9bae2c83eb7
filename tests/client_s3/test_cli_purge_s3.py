"""``ec-cache purge`` names S3 where the server has an S3 tier (tests/client checks
that it does not on disk-only servers)."""

from __future__ import annotations

import re

from tests.client.test_cli import run
from tests.client.test_cli_namespaces import _fill
from tests.s3.conftest import ServerFactory


def test_purge_with_an_s3_tier_names_its_objects(make_server: ServerFactory) -> None:
    srv = make_server("a")
    _fill(srv.url)  # written through to S3

    refused = run(srv, "purge", model="rev/a", dtype=None)
    assert refused.returncode == 2
    assert "on the disks of 1 replica(s), and every object of it in S3." in refused.stderr

    result = run(srv, "purge", "--yes", "--progress", "always", model="rev/a", dtype=None)
    assert result.returncode == 0, result.stderr
    assert "done: 3 disk entries" in result.stdout
    assert "3 S3 objects" in result.stdout
    # The progress bar's last state counts what the closing line counts: disk and S3
    # apart (the same bytes are in both), with their sizes.
    last = result.stderr.rstrip("\n").rsplit("\r", 1)[-1]
    closing = re.fullmatch(
        r".*: done: (\d+) disk entries \(([^)]*)\), (\d+) S3 objects \(([^)]*)\)",
        result.stdout.splitlines()[-1],
    )
    assert closing is not None, result.stdout
    entries, disk_size, objects, s3_size = closing.groups()
    assert f"disk {entries} entries ({disk_size})  S3 {objects} objects ({s3_size})" in last
