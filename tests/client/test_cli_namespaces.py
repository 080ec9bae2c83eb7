"""``ec-cache ls``, ``du`` and ``purge`` as subprocesses against real servers."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from testkit.entries import body
from testkit.server import ServerProcess

from .test_cli import run


def _fill(url: str) -> None:
    for i in range(3):
        data = body((4, 2), "F16", 2, seed=i)
        assert httpx.put(f"{url}/ec/rev/a/float16/h{i}", content=data).status_code == 201
    data = body((4,), "U8", 1)
    assert httpx.put(f"{url}/ec/rev/b/uint8/k", content=data).status_code == 201


def test_ls_du_purge(tmp_path: Path) -> None:
    with (
        ServerProcess(tmp_path / "a", tmp_path / "a.log") as a,
        ServerProcess(tmp_path / "b", tmp_path / "b.log") as b,
    ):
        _fill(a.url)
        _fill(b.url)
        urls = ["--url", a.url, "--url", b.url]

        result = run(None, *urls, "ls", "--json", model="", dtype=None)
        assert result.returncode == 0, result.stderr
        listing = json.loads(result.stdout)
        assert {n["model"] for n in listing[a.url]} == {"rev/a", "rev/b"}

        result = run(None, "--url", a.url, "ls", model="rev/a", dtype="float16")
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert [line.split()[0] for line in lines] == ["h0", "h1", "h2"]
        assert lines[0].split()[2:] == ["4x2", "disk"]

        result = run(None, *urls, "du", "--json", model="", dtype=None)
        usage = json.loads(result.stdout)
        assert {(n["model"], n["entries"]) for n in usage["namespaces"]} == {
            ("rev/a", 6),
            ("rev/b", 2),
        }
        text = run(None, *urls, "du", model="", dtype=None).stdout
        assert "total over 2 replica(s)" in text

        # No terminal and no --yes: refused, nothing removed.
        refused = run(None, *urls, "purge", model="rev/a", dtype=None)
        assert refused.returncode == 2
        assert "--yes" in refused.stderr
        # Disk-only servers: the prompt promises nothing of S3.
        assert "on the disks of 2 replica(s). This cannot be undone" in refused.stderr
        assert "S3" not in refused.stderr
        assert httpx.get(f"{a.url}/ec/rev/a/float16/h0").status_code == 200

        result = run(
            None,
            *urls,
            "purge",
            "--yes",
            "--json",
            "--progress",
            "always",
            model="rev/a",
            dtype=None,
        )
        assert result.returncode == 0, result.stderr
        jobs = json.loads(result.stdout)["purges"]
        assert {url: job["disk_entries"] for url, job in jobs.items()} == {a.url: 3, b.url: 3}
        assert all(job["state"] == "done" for job in jobs.values())
        assert "2/2 replicas" in result.stderr  # the progress line
        assert "S3" not in result.stderr
        for srv in (a, b):
            assert httpx.get(f"{srv.url}/ec/rev/a/float16/h0").status_code == 404
            assert httpx.get(f"{srv.url}/ec/rev/b/uint8/k").status_code == 200

        again = run(None, *urls, "purge", "--yes", model="rev/a", dtype=None)
        assert again.returncode == 0
        assert "done: 0 disk entries" in again.stdout
        assert "S3" not in again.stdout


def test_purge_without_admin_fails_with_the_servers_message(tmp_path: Path) -> None:
    tokens = "r:read:reader-token-0123456789;m:admin,model=m:model-admin-0123456789"
    with ServerProcess(tmp_path / "a", tmp_path / "a.log", auth_tokens=tokens) as a:
        # A token limited to a model may not read /stats: whether the server has an S3
        # tier is unknown, and the prompt says so.
        refused = run(
            a, "purge", model="m", dtype=None, env={"EC_CACHE_TOKEN": "model-admin-0123456789"}
        )
        assert refused.returncode == 2
        assert "and every object of it in S3 if the servers have an S3 tier" in refused.stderr
        result = run(
            a,
            "purge",
            "--yes",
            model="m",
            dtype=None,
            env={"EC_CACHE_TOKEN": "reader-token-0123456789"},
        )
        assert result.returncode == 3
        assert "HTTP 403" in result.stderr
        assert "admin" in result.stderr


def test_ls_limit_says_when_more_entries_exist(tmp_path: Path) -> None:
    with (
        ServerProcess(tmp_path / "a", tmp_path / "a.log") as a,
        ServerProcess(tmp_path / "b", tmp_path / "b.log") as b,
    ):
        _fill(a.url)  # rev/a float16: h0, h1, h2 on each
        _fill(b.url)
        note = "ec-cache: more entries exist than --limit"
        for urls, limit, shown, more in [
            ([a.url], 2, 2, True),
            ([a.url], 3, 3, False),  # exactly all: nothing more
            ([a.url, b.url], 3, 3, True),  # the rest are on the second replica
            ([a.url, b.url], 6, 6, False),
        ]:
            flags = [arg for url in urls for arg in ("--url", url)]
            result = run(None, *flags, "ls", "--limit", str(limit), model="rev/a", dtype="float16")
            assert result.returncode == 0, result.stderr
            assert len(result.stdout.splitlines()) == shown
            assert (f"{note} {limit} shows" in result.stderr) is more, (urls, limit)
            listed = run(
                None, *flags, "ls", "--limit", str(limit), "--json", model="rev/a", dtype="float16"
            )
            assert len(json.loads(listed.stdout)) == shown
            assert (note in listed.stderr) is more
