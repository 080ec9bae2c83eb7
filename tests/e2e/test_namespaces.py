"""Namespaces on a disk-only server process: usage, entries page by page, purge."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from app.namespaces import purge_id
from testkit.entries import body
from testkit.server import ServerProcess


def _put(url: str, model: str, dtype: str, hash_: str, rows: int = 4) -> bytes:
    code, size = {"uint8": ("U8", 1), "float16": ("F16", 2)}[dtype]
    data = body((rows, 2), code, size, seed=hash(hash_) % 1000)
    response = httpx.put(f"{url}/ec/{model}/{dtype}/{hash_}", content=data)
    assert response.status_code == 201, response.text
    return data


def wait_purged(url: str, model: str, timeout: float = 30) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (job,) = httpx.get(f"{url}/namespaces/purges", params={"model": model}).json()["purges"]
        if job["state"] == "done":
            return dict(job)
        time.sleep(0.05)
    raise AssertionError(f"purge of {model} did not finish in {timeout}s")


def test_usage_entries_and_purge(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "d", tmp_path / "log") as srv:
        url = srv.url
        old = [_put(url, "Qwen/VL@rev1", "float16", f"h{i:03d}") for i in range(25)]
        _put(url, "Qwen/VL@rev1", "uint8", "u1")
        keep = _put(url, "Qwen/VL@rev2", "float16", "h000", rows=3)
        usage = httpx.get(url + "/namespaces").json()
        assert usage["namespaces"] == [
            {
                "model": "Qwen/VL@rev1",
                "dtype": "float16",
                "entries": 25,
                "bytes": sum(map(len, old)),
            },
            {
                "model": "Qwen/VL@rev1",
                "dtype": "uint8",
                "entries": 1,
                "bytes": usage["namespaces"][1]["bytes"],
            },
            {"model": "Qwen/VL@rev2", "dtype": "float16", "entries": 1, "bytes": len(keep)},
        ]
        assert usage["unattributed"] == {"entries": 0, "bytes": 0}
        assert usage["disk"]["entries"] == 27

        seen: list[dict[str, object]] = []
        after = None
        pages = 0
        while True:
            params: dict[str, str | int] = {
                "model": "Qwen/VL@rev1",
                "dtype": "float16",
                "limit": 10,
            }
            page = httpx.get(
                url + "/namespaces/entries",
                params={**params, **({"after": after} if after else {})},
            ).json()
            seen += page["entries"]
            pages += 1
            after = page["next"]
            if after is None:
                break
        assert pages == 3
        assert [e["hash"] for e in seen] == [f"h{i:03d}" for i in range(25)]
        assert seen[0] == {"hash": "h000", "size": len(old[0]), "shape": [4, 2], "tier": "disk"}

        bad = httpx.get(url + "/namespaces/entries", params={"model": "a/../b", "dtype": "uint8"})
        assert bad.status_code == 400
        no_s3 = httpx.get(
            url + "/namespaces/entries", params={"model": "m", "dtype": "uint8", "tier": "s3"}
        )
        assert no_s3.status_code == 400

        started = httpx.post(url + "/namespaces/purge", json={"model": "Qwen/VL@rev1"})
        assert started.status_code in (200, 202), started.text
        assert started.json()["purge"]["id"] == purge_id("Qwen/VL@rev1", None)
        job = wait_purged(url, "Qwen/VL@rev1")
        assert job["disk_entries"] == 26
        assert job["s3_objects"] == 0
        models = {n["model"] for n in httpx.get(url + "/namespaces").json()["namespaces"]}
        assert models == {"Qwen/VL@rev2"}
        assert httpx.get(f"{url}/ec/Qwen/VL@rev1/float16/h000").status_code == 404
        assert httpx.get(f"{url}/ec/Qwen/VL@rev2/float16/h000").content == keep

        again = httpx.post(url + "/namespaces/purge", json={"model": "Qwen/VL@rev1"})
        assert again.status_code == 202  # a new, empty job: idempotent
        assert wait_purged(url, "Qwen/VL@rev1")["disk_entries"] == 0
        # the namespace is usable again once the purge is over
        _put(url, "Qwen/VL@rev1", "float16", "h000")

    with ServerProcess(tmp_path / "d", tmp_path / "log") as srv:  # survives a restart
        usage = httpx.get(srv.url + "/namespaces").json()["namespaces"]
        assert {(n["model"], n["entries"]) for n in usage} == {
            ("Qwen/VL@rev1", 1),
            ("Qwen/VL@rev2", 1),
        }
        (job,) = httpx.get(srv.url + "/namespaces/purges").json()["purges"]
        assert job["state"] == "done"


def test_purge_journal_resumes_at_start_up(tmp_path: Path) -> None:
    """A purge that was running when the server died is finished at the next start,
    and its namespace is guarded from the first request on."""
    with ServerProcess(tmp_path / "d", tmp_path / "log") as srv:
        _put(srv.url, "old", "uint8", "a")
        _put(srv.url, "old", "uint8", "b")
        _put(srv.url, "new", "uint8", "c")
    journal = tmp_path / "d" / "purges"
    journal.mkdir(exist_ok=True)
    job_id = purge_id("old", "uint8")
    (journal / f"{job_id}.json").write_text(
        f'{{"id": "{job_id}", "model": "old", "dtype": "uint8", "state": "running"}}'
    )
    with ServerProcess(tmp_path / "d", tmp_path / "log") as srv:
        assert httpx.get(f"{srv.url}/ec/old/uint8/a").status_code == 404
        job = wait_purged(srv.url, "old")
        assert job["disk_entries"] == 2
        assert job["attempts"] == 1
        assert httpx.get(f"{srv.url}/ec/new/uint8/c").status_code == 200
        names = [n["model"] for n in httpx.get(srv.url + "/namespaces").json()["namespaces"]]
        assert names == ["new"]


def test_a_keys_log_replaced_by_a_directory_does_not_stop_start_up(tmp_path: Path) -> None:
    """The server starts, logs what is wrong and rebuilds the log; entries are served."""
    with ServerProcess(tmp_path / "d", tmp_path / "log") as srv:
        data = _put(srv.url, "m", "uint8", "kept")
    keys_log = tmp_path / "d" / "keys.log"
    keys_log.unlink()
    keys_log.mkdir()
    with ServerProcess(tmp_path / "d", tmp_path / "log") as srv:
        assert httpx.get(f"{srv.url}/ec/m/uint8/kept").content == data
        _put(srv.url, "m", "uint8", "new")
        usage = httpx.get(srv.url + "/namespaces").json()
        assert [(n["model"], n["entries"]) for n in usage["namespaces"]] == [("m", 1)]
    assert "keys.log is not a regular file: moved to" in (tmp_path / "log").read_text()
    assert keys_log.is_file()


def test_purge_needs_admin(tmp_path: Path) -> None:
    tokens = "r:read:reader-token-0123456789; w:read,write:writer-token-0123456789"
    with ServerProcess(tmp_path / "d", tmp_path / "log", auth_tokens=tokens) as srv:
        for token in ("reader-token-0123456789", "writer-token-0123456789"):
            response = httpx.post(
                srv.url + "/namespaces/purge",
                json={"model": "m"},
                headers={"Authorization": f"Bearer {token}"},
            )
            assert response.status_code == 403
        assert httpx.post(srv.url + "/namespaces/purge", json={"model": "m"}).status_code == 401
        listing = httpx.get(
            srv.url + "/namespaces", headers={"Authorization": "Bearer reader-token-0123456789"}
        )
        assert listing.status_code == 200
