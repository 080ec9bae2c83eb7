"""``ec-cache ls``, ``du`` and ``purge``: namespace operations over plain httpx.

They speak to every replica given by ``--url`` (each has its own disk tier) through the
server's ``/namespaces`` routes; see docs/http-api.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from ._routing import normalize_url

EXIT_OK, EXIT_USAGE, EXIT_ERROR = 0, 2, 3
POLL_SECONDS = 0.5


class OpsError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def add_commands(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    p = add(
        "ls",
        "without --dtype: list the namespaces (model, dtype) on each replica's disk with "
        "entries and bytes (--model filters); with --model and --dtype: list that "
        "namespace's entries (hash, size, shape, tier), page by page",
    )
    p.add_argument("--s3", action="store_true", help="list the namespace's objects in S3")
    p.add_argument(
        "--limit",
        type=int,
        default=0,
        help="stop after this many entries (stderr says when more exist)",
    )
    p = add("du", "disk usage per namespace, summed over the replicas (--model filters); totals")
    p = add(
        "purge",
        "remove every entry of --model (of --dtype, or of every dtype) from each replica's "
        "disk and, where the servers have an S3 tier, from S3; asks for confirmation "
        "unless --yes; shows progress",
    )
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.add_argument("--no-wait", action="store_true", help="start the purge and return at once")


def _urls(args: argparse.Namespace) -> list[str]:
    urls = args.url or [
        u for u in os.environ.get("EC_CACHE_URL", "http://127.0.0.1:8080").split(",") if u
    ]
    try:
        return [normalize_url(u) for u in urls]
    except ValueError as exc:
        raise OpsError(EXIT_USAGE, str(exc)) from None


def _http(args: argparse.Namespace) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    return httpx.Client(headers=headers, timeout=args.timeout)


def _json(response: httpx.Response, url: str) -> Any:
    if response.status_code >= 400:
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        raise OpsError(EXIT_ERROR, f"{url}: HTTP {response.status_code}: {message}")
    return response.json()


def _request(http: httpx.Client, method: str, url: str, **kwargs: Any) -> Any:
    try:
        return _json(http.request(method, url, **kwargs), url)
    except httpx.HTTPError as exc:
        raise OpsError(EXIT_ERROR, f"{url}: {type(exc).__name__}: {exc}") from None


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _namespaces(http: httpx.Client, url: str, model: str | None) -> list[dict[str, Any]]:
    data = _request(http, "GET", url + "/namespaces")
    return [n for n in data["namespaces"] if model is None or n["model"] == model]


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except OpsError as exc:
            print(f"ec-cache: {exc}", file=sys.stderr)
            return exc.code

    return run


def _entries(
    http: httpx.Client, urls: list[str], args: argparse.Namespace
) -> Iterator[dict[str, Any]]:
    """The entries of ``--model``/``--dtype`` on each of ``urls``, page by page as they
    are read, each with its ``url``."""
    for url in urls:
        after = None
        while True:
            params: dict[str, Any] = {
                "model": args.model,
                "dtype": args.dtype,
                "tier": "s3" if args.s3 else "disk",
                "limit": min(args.limit + 1, 1000) if args.limit else 1000,
            }
            if after:
                params["after"] = after
            page = _request(http, "GET", url + "/namespaces/entries", params=params)
            for entry in page["entries"]:
                yield {**entry, "url": url}
            after = page["next"]
            if after is None:
                break


@_guard
def cmd_ls(args: argparse.Namespace) -> int:
    urls = _urls(args)
    with _http(args) as http:
        if not args.dtype:
            rows = {url: _namespaces(http, url, args.model) for url in urls}
            if args.json:
                print(json.dumps(rows))
                return EXIT_OK
            for url, namespaces in rows.items():
                if len(urls) > 1:
                    print(url)
                for n in namespaces:
                    print(
                        f"{n['model']}  {n['dtype']}  {n['entries']} entries  {_size(n['bytes'])}"
                    )
            return EXIT_OK
        if not args.model:
            raise OpsError(EXIT_USAGE, "ls --dtype needs --model")
        entries: list[dict[str, Any]] = []
        more = False  # --limit cut the listing short
        for entry in _entries(http, urls[:1] if args.s3 else urls, args):
            if args.limit and len(entries) == args.limit:
                more = True
                break
            entries.append(entry)
            if not args.json:
                shape = "x".join(map(str, entry["shape"] or [])) or "?"
                where = f"  {entry['url']}" if len(urls) > 1 and not args.s3 else ""
                print(f"{entry['hash']}  {entry['size']}  {shape}  {entry['tier']}{where}")
    if args.json:
        print(json.dumps(entries))
    if more:
        print(f"ec-cache: more entries exist than --limit {args.limit} shows", file=sys.stderr)
    return EXIT_OK


@_guard
def cmd_du(args: argparse.Namespace) -> int:
    urls = _urls(args)
    totals: dict[tuple[str, str], list[int]] = {}
    replicas = {}
    with _http(args) as http:
        for url in urls:
            data = _request(http, "GET", url + "/namespaces")
            replicas[url] = data.get("disk")
            for n in data["namespaces"]:
                if args.model and n["model"] != args.model:
                    continue
                if args.dtype and n["dtype"] != args.dtype:
                    continue
                total = totals.setdefault((n["model"], n["dtype"]), [0, 0])
                total[0] += n["entries"]
                total[1] += n["bytes"]
    rows: list[dict[str, Any]] = [
        {"model": m, "dtype": d, "entries": e, "bytes": b}
        for (m, d), (e, b) in sorted(totals.items(), key=lambda item: -item[1][1])
    ]
    entries = sum(r["entries"] for r in rows)
    nbytes = sum(r["bytes"] for r in rows)
    if args.json:
        print(
            json.dumps(
                {"namespaces": rows, "entries": entries, "bytes": nbytes, "replicas": replicas}
            )
        )
        return EXIT_OK
    for r in rows:
        print(f"{_size(r['bytes']):>12}  {r['entries']:>9}  {r['model']}  {r['dtype']}")
    print(f"{_size(nbytes):>12}  {entries:>9}  total over {len(urls)} replica(s)")
    for url, disk in replicas.items():
        if disk:
            pct = 100.0 * disk["used_bytes"] / max(disk["max_bytes"], 1)
            print(
                f"  {url}: disk {_size(disk['used_bytes'])} of "
                f"{_size(disk['max_bytes'])} ({pct:.0f}%)"
            )
    return EXIT_OK


def _s3_tiers(http: httpx.Client, urls: list[str]) -> dict[str, bool | None]:
    """Whether each replica has an S3 tier, as its ``/stats`` says; ``None`` where it
    does not say (``/stats`` refuses a token limited to some models)."""
    tiers: dict[str, bool | None] = {}
    for url in urls:
        try:
            response = http.get(url + "/stats")
            known = response.status_code == 200
            tiers[url] = bool(response.json()["s3_configured"]) if known else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            tiers[url] = None
    return tiers


def _s3_part(tiers: dict[str, bool | None]) -> str:
    """What a purge removes from S3, for the confirmation: nothing on disk-only servers."""
    if any(tiers.values()):
        return ", and every object of it in S3"
    if None in tiers.values():
        return ", and every object of it in S3 if the servers have an S3 tier"
    return ""


def _confirm(
    args: argparse.Namespace, http: httpx.Client, urls: list[str], tiers: dict[str, bool | None]
) -> bool:
    entries = nbytes = 0
    for url in urls:
        for n in _namespaces(http, url, args.model):
            if args.dtype is None or n["dtype"] == args.dtype:
                entries += n["entries"]
                nbytes += n["bytes"]
    what = f"{args.model} ({args.dtype or 'every dtype'})"
    prompt = (
        f"Purge {what}: {entries} entries ({_size(nbytes)}) on the disks of {len(urls)} "
        f"replica(s){_s3_part(tiers)}. This cannot be undone. Proceed? [y/N] "
    )
    if not sys.stdin.isatty():
        print(prompt, file=sys.stderr)
        print("ec-cache: not a terminal: pass --yes to purge", file=sys.stderr)
        return False
    sys.stderr.write(prompt)
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _progress(jobs: dict[str, dict[str, Any]], started: float, s3: bool) -> str:
    done = sum(1 for job in jobs.values() if job["state"] == "done")

    def total(field: str) -> int:
        return sum(int(job[field]) for job in jobs.values())

    width = 20
    filled = width * done // max(len(jobs), 1)
    errors = {job["last_error"] for job in jobs.values() if job.get("last_error")}
    note = f"  retrying: {sorted(errors)[0]}" if errors else ""
    # Disk and S3 apart, as the closing lines count them: the same bytes are in both.
    objects = f"  S3 {total('s3_objects')} objects ({_size(total('s3_bytes'))})" if s3 else ""
    return (
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{len(jobs)} replicas  "
        f"disk {total('disk_entries')} entries ({_size(total('disk_bytes'))}){objects}  "
        f"{time.monotonic() - started:.0f}s{note}"
    )


@_guard
def cmd_purge(args: argparse.Namespace) -> int:
    if not args.model:
        raise OpsError(EXIT_USAGE, "purge needs --model")
    urls = _urls(args)
    body = {"model": args.model, "dtype": args.dtype}
    with _http(args) as http:
        tiers = _s3_tiers(http, urls)
        s3 = any(has is not False for has in tiers.values())
        if not args.yes and not _confirm(args, http, urls, tiers):
            return EXIT_USAGE
        # Start on every replica first: each stops writes of the namespace at once.
        jobs = {
            url: _request(http, "POST", url + "/namespaces/purge", json=body)["purge"]
            for url in urls
        }
        started = time.monotonic()
        show = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
        while not args.no_wait and any(job["state"] != "done" for job in jobs.values()):
            if show:
                sys.stderr.write(_progress(jobs, started, s3))
                sys.stderr.flush()
            time.sleep(POLL_SECONDS)
            for url, job in jobs.items():
                if job["state"] != "done":
                    listed = _request(
                        http, "GET", url + "/namespaces/purges", params={"model": args.model}
                    )["purges"]
                    jobs[url] = next((j for j in listed if j["id"] == job["id"]), job)
        if show:
            sys.stderr.write(_progress(jobs, started, s3) + "\n")
    if args.json:
        print(json.dumps({"purges": jobs}))
    else:
        for url, job in jobs.items():
            objects = (
                f", {job['s3_objects']} S3 objects ({_size(job['s3_bytes'])})"
                if tiers[url] is not False
                else ""
            )
            print(
                f"{url}: {job['state']}: {job['disk_entries']} disk entries "
                f"({_size(job['disk_bytes'])}){objects}"
            )
    return EXIT_OK


COMMANDS = {"ls": cmd_ls, "du": cmd_du, "purge": cmd_purge}
