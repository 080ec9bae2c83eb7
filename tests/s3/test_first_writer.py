"""A PUT that loses the first-writer race answers with the stored entry (issue #12)."""

from __future__ import annotations

import httpx

from testkit.entries import body, crc_hex
from tests.s3.conftest import ServerFactory

URL = "/ec/m/uint8/race"


def test_losing_put_on_another_replica_answers_with_the_stored_entry(
    make_server: ServerFactory,
) -> None:
    first, second = body((1000,), "U8", 1, seed=1), body((2000,), "U8", 1, seed=2)
    a = make_server("a")  # write-through: 201 once S3 has it
    assert httpx.put(a.url + URL, content=first).status_code == 201
    b = make_server("b")  # its own, empty disk tier; the same bucket
    lost = httpx.put(b.url + URL, content=second)
    assert lost.status_code == 200, lost.text
    assert lost.json() == {"created": False, "size": len(first), "crc32c": crc_hex(first)}
    assert lost.headers["etag"] == f'"{crc_hex(first)}"'
    assert lost.headers["x-ec-crc32c"] == crc_hex(first)
    assert httpx.get(b.url + URL).content == first
