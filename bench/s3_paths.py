"""The ``s3`` section: ec-cache's S3 paths against boto3 straight to the same S3, with
S3 kept off the cores that the client and the server use.

On a machine with at least 2 CPUs, a SeaweedFS of this section's own is pinned to the
last CPU (``sched_setaffinity`` on every thread of ``weed``, stdlib only) and the
benchmark process and the ec-cache servers to the others, so that boto3 and ec-cache
talk to an S3 that does not compete with them for CPU: the ratios then measure the
design, not who got the shared core. Where pinning is impossible (one CPU, no
``sched_setaffinity``) the section still runs, unpinned, and says so in its output
(``isolation``).

Per payload (4.7, 19.3 and 67 MB; interleaved rounds, sequential requests, one
keep-alive connection each):

* **PUT**: ec-cache SDK write-through (201 once disk and S3 hold the verified bytes)
  against boto3 ``put_object`` of the same body to the same S3;
* **read-through GET**: a "cold" server whose disk holds one entry reads three keys in
  one strict cycle, so every GET is an S3 hit (``ColdCycle``; its ``/stats`` lookups
  are recorded).
  Through the SDK, and through urllib3 streaming (``read(1)`` then the rest) for the
  time to first body byte (TTFB), against boto3 ``get_object`` (``Body.read(1)`` then
  the rest: the same urllib3 underneath);
* the same SDK and boto3 GETs **behind S3's per-connection link** (``LINK_RATES``:
  each connection at ~90 MB/s behind a 10 Gbit/s node link, ``s3_link.ConnectionLink``),
  where ``tc`` allows: S3 then answers each connection at its production pace rather
  than at a loopback copy's, and the read-through's ranged parts (one connection each)
  count. ``python -m bench.s3_readthrough`` compares it with boto3's TransferManager;
* the same TTFB **with the client on a core of its own**: with two CPUs, the client and
  the server share one, and a read-through's first bytes wait for the client to win
  that core back from the server's fill (about 1 ms on this VM: measured from the
  server's side, first chunk handed to the socket -> client's first byte, 1.0-1.4 ms
  shared, 0.13 ms apart). For these rounds the cold server moves to S3's core, which
  slows S3 for ec-cache only;
* **disk-hit GET** from the write-through server, for its CPU cost.

Server CPU-seconds per GB: ``utime + stime`` of ``/proc/<pid>/stat`` of the server that
answered, read before and after each contender's timed round (nothing else talks to
that server then), divided by the bytes moved; the same for SeaweedFS and for the
benchmark process (the client) for comparison.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ec_cache
import urllib3

from bench import s3_link
from bench.contenders import ColdCycle, boto3_client, same_bits, tensor_from_safetensors_bytes
from bench.payloads import DTYPE, FULL_PAYLOADS, MODEL, QUICK_PAYLOADS, Payload
from bench.provenance import load_average
from bench.services import Services, http_json
from bench.stats import median, target_row
from testkit.s3 import S3Endpoint, SeaweedFS, seaweedfs_endpoint
from testkit.server import ServerProcess

PREFIX = "ec-s3paths"
BUCKET = "ec-bench-s3paths"
TICKS = os.sysconf("SC_CLK_TCK")
SDK_PUT = "ec-cache SDK PUT, write-through"
BOTO3_PUT = "boto3 put_object"
SDK_S3_GET = "ec-cache SDK GET, S3 hit (read-through)"
URLLIB3_S3_GET = "ec-cache urllib3 stream, S3 hit (read-through)"
BOTO3_GET = "boto3 get_object"
SDK_DISK_GET = "ec-cache SDK GET, disk hit"
#: Per-connection rates (tc syntax) of the S3 links the read-through is measured
#: behind, besides loopback: AWS's ~90 MB/s per connection (``s3_link``).
LINK_RATES = [s3_link.PER_CONNECTION]


# --------------------------------------------------------------------------- isolation


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` (``/proc/<pid>/stat``), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` to ``cpus`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(tid), cpus)


@dataclass
class Isolation:
    s3_cpus: set[int] = field(default_factory=set)
    other_cpus: set[int] = field(default_factory=set)
    why_not: str = ""

    @property
    def pinned(self) -> bool:
        return bool(self.s3_cpus)

    @classmethod
    def plan(cls) -> Isolation:
        if not hasattr(os, "sched_setaffinity"):
            return cls(why_not="os.sched_setaffinity is not available on this platform")
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return cls(why_not=f"only {len(cpus)} CPU usable: S3 shares it with everything")
        return cls({cpus[-1]}, set(cpus[:-1]))

    def describe(self) -> str:
        if not self.pinned:
            return f"NOT isolated ({self.why_not}); S3, server and client share the CPUs"
        return (
            f"SeaweedFS pinned to CPU {sorted(self.s3_cpus)}, benchmark client and "
            f"ec-cache servers to CPU {sorted(self.other_cpus)}"
        )


# --------------------------------------------------------------------------- timing


@dataclass
class Row:
    label: str
    pid_of: Callable[[], int | None]
    #: Called before each request, outside its timing.
    before: Callable[[], None] | None = None
    seconds: list[list[float]] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    round_bytes: list[int] = field(default_factory=list)
    server_cpu: float = 0.0
    s3_cpu: float = 0.0
    client_cpu: float = 0.0

    def summary(self) -> dict[str, Any]:
        flat = [s for r in self.seconds for s in r]
        per_round = [b / sum(r) / 1e6 for b, r in zip(self.round_bytes, self.seconds, strict=True)]
        moved_gb = sum(self.round_bytes) / 1e9
        out: dict[str, Any] = {
            "requests": len(flat),
            "mb_per_s_median": median(per_round),
            "mb_per_s_rounds": [round(x, 1) for x in per_round],
            "p50_ms": median(flat) * 1e3,
            "raw_seconds": [[round(s, 6) for s in r] for r in self.seconds],
            "s3_cpu_s_per_gb": self.s3_cpu / moved_gb,
            "client_cpu_s_per_gb": self.client_cpu / moved_gb,
        }
        if self.pid_of() is not None:
            out["server_cpu_s_per_gb"] = self.server_cpu / moved_gb
        if self.ttfb:
            out["ttfb_p50_ms"] = median(self.ttfb) * 1e3
            out["ttfb_ms"] = [round(t * 1e3, 3) for t in self.ttfb]
        return out


Op = Callable[[int], tuple[int, float | None]]


def run_rounds(
    contenders: list[tuple[Row, Op]], *, rounds: int, requests: int, s3_pid: int
) -> dict[str, Any]:
    """Interleaved rounds (order rotated and reversed), CPU read around each round."""
    for row, op in contenders:  # connections, page cache
        if row.before is not None:
            row.before()
        op(0)
    for round_index in range(rounds):
        shift = round_index % len(contenders)
        order = contenders[shift:] + contenders[:shift]
        if round_index % 2:
            order.reverse()
        for row, op in order:
            pid = row.pid_of()
            server_before = cpu_seconds(pid) if pid else 0.0
            s3_before = cpu_seconds(s3_pid)
            client_before = cpu_seconds(os.getpid())
            seconds: list[float] = []
            moved = 0
            for i in range(requests):
                if row.before is not None:
                    row.before()
                start = time.perf_counter()
                n, first = op(i)
                seconds.append(time.perf_counter() - start)
                moved += n
                if first is not None:
                    row.ttfb.append(first - start)
            row.client_cpu += cpu_seconds(os.getpid()) - client_before
            row.s3_cpu += cpu_seconds(s3_pid) - s3_before
            if pid:
                row.server_cpu += cpu_seconds(pid) - server_before
            row.seconds.append(seconds)
            row.round_bytes.append(moved)
    return {row.label: row.summary() for row, _ in contenders}


# --------------------------------------------------------------------------- section


def _plan(quick: bool) -> tuple[list[Payload], dict[str, tuple[int, int]], list[str]]:
    """Payloads, (requests, rounds) per payload, and the S3 link rates to shape."""
    if quick:
        return QUICK_PAYLOADS[1:2], {QUICK_PAYLOADS[1].name: (4, 2)}, LINK_RATES
    payloads = FULL_PAYLOADS[1:4]
    return (
        payloads,
        {
            "llava-576x4096": (12, 5),
            "qwen25vl-2691x3584": (6, 5),
            "qwen3vl-2040x16384": (3, 5),
        },
        LINK_RATES,
    )


def section(svc: Services, plan: Any, log: Any) -> dict[str, Any]:
    """See the module docstring."""
    return measure(svc, *_plan(plan.quick), log)


def measure(
    svc: Services,
    payloads: list[Payload],
    requests: dict[str, tuple[int, int]],
    rates: list[str],
    log: Any,
    *,
    gets_only: bool = False,
) -> dict[str, Any]:
    """The section's measurements for ``payloads`` ((requests, rounds) per payload name),
    behind each S3 link rate in ``rates`` where tc allows; ``gets_only``: the SDK's and
    boto3's GETs, without the PUTs and the TTFB rounds with the client alone
    (``bench/break_even.py`` runs that on the entry sizes of its models)."""
    isolation = Isolation.plan()
    log(f"s3: {isolation.describe()}")
    why_not_shaped = s3_link.why_not() if rates else "no link rate asked for"
    if why_not_shaped:
        log(f"s3: S3 link NOT shaped ({why_not_shaped})")
        rates = []
    root: Path = svc.root / "s3paths"
    with seaweedfs_endpoint(root / "seaweedfs", BUCKET) as endpoint:
        weed = endpoint.managed
        assert weed is not None and weed.proc is not None
        s3_pid = weed.proc.pid
        try:
            if isolation.pinned:
                pin_process(s3_pid, isolation.s3_cpus)
                pin_process(os.getpid(), isolation.other_cpus)
            out: dict[str, Any] = {
                "isolation": isolation.describe(),
                "pinned": isolation.pinned,
                "link_rates": rates,
                "link_not_shaped": why_not_shaped,
                "loadavg_before": load_average(),
                "payloads": {},
            }
            for payload in payloads:
                count, rounds = requests[payload.name]
                log(f"s3: {payload.name} ({count} requests x {rounds} rounds)")
                out["payloads"][payload.name] = _payload(
                    svc, root, endpoint, isolation, weed, payload, count, rounds, rates, gets_only
                )
            out["loadavg_after"] = load_average()
            return out
        finally:
            if isolation.pinned:
                pin_process(os.getpid(), isolation.s3_cpus | isolation.other_cpus)


def _server(
    svc: Services, root: Path, name: str, endpoint: S3Endpoint, iso: Isolation, **settings: Any
) -> ServerProcess:
    proc = ServerProcess(root / f"ec-{name}", root / f"ec-{name}.log", **settings)
    proc.env.update(endpoint.env(prefix=PREFIX))
    proc.start()
    svc._stack.callback(proc.stop)
    assert proc.proc is not None
    if iso.pinned:
        pin_process(proc.proc.pid, iso.other_cpus)
    return proc


def _pid(proc: ServerProcess) -> Callable[[], int | None]:
    return lambda: proc.proc.pid if proc.proc is not None else None


def _payload(
    svc: Services,
    root: Path,
    endpoint: S3Endpoint,
    iso: Isolation,
    weed: SeaweedFS,
    payload: Payload,
    count: int,
    rounds: int,
    rates: list[str],
    gets_only: bool,
) -> dict[str, Any]:
    assert weed.proc is not None
    s3_pid = weed.proc.pid
    s3 = boto3_client(endpoint.endpoint_url, endpoint.access_key, endpoint.secret_key)
    body = payload.body(payload.tensor(seed=1))
    tensors = [payload.tensor(seed=10 + k) for k in range(3)]
    keys = [f"{payload.name}-s3-{k}" for k in range(3)]
    wt = _server(
        svc, root, f"wt-{payload.name}", endpoint, iso, disk_max_bytes="8GiB", max_body_bytes="1GiB"
    )
    cold = _server(
        svc,
        root,
        f"cold-{payload.name}",
        endpoint,
        iso,
        disk_max_bytes=payload.size,
        max_body_bytes="1GiB",
    )
    hot_client = ec_cache.Client(wt.url, model=MODEL, dtype=DTYPE)
    cold_client = ec_cache.Client(cold.url, model=MODEL, dtype=DTYPE)
    cold_pool = urllib3.HTTPConnectionPool("127.0.0.1", cold.port, maxsize=1)
    entry: dict[str, Any] = {"entry_bytes": payload.size, "shape": list(payload.shape)}
    try:
        for key, tensor in zip(keys, tensors, strict=True):
            assert hot_client.put(key, tensor)
        object_key = [f"{PREFIX}/{MODEL}/{DTYPE}/{key}.safetensors" for key in keys]
        # Right bits from every way before anything is timed.
        got = cold_client.get(keys[0])
        assert got is not None and same_bits(got, tensors[0])
        data = s3.get_object(Bucket=BUCKET, Key=object_key[1])["Body"].read()
        assert same_bits(tensor_from_safetensors_bytes(data, payload), tensors[1])

        # One strict cycle shared by both cold contenders: every GET misses the disk.
        cold_cycle = ColdCycle(keys, cold.data_dir)
        boto_cycle = itertools.count()

        def sdk_s3(_: int) -> tuple[int, float | None]:
            key = cold_cycle.next_key()
            if cold_client.get(key) is None:
                raise RuntimeError(f"miss on {key}")
            return payload.size, None

        def urllib3_s3(_: int) -> tuple[int, float | None]:
            key = cold_cycle.next_key()
            resp = cold_pool.urlopen(
                "GET", f"/ec/{MODEL}/{DTYPE}/{key}", preload_content=False, retries=False
            )
            first = resp.read(1)
            t_first = time.perf_counter()
            rest = resp.read()
            resp.release_conn()
            if resp.status != 200 or len(first) + len(rest) != payload.size:
                raise RuntimeError(f"ec-cache answered {resp.status}")
            return payload.size, t_first

        def boto3_get(_: int) -> tuple[int, float | None]:
            stream = s3.get_object(Bucket=BUCKET, Key=object_key[next(boto_cycle) % 3])["Body"]
            first = stream.read(1)
            t_first = time.perf_counter()
            rest = stream.read()
            if len(first) + len(rest) != payload.size:
                raise RuntimeError("boto3 returned a short body")
            return payload.size, t_first

        def sdk_disk(i: int) -> tuple[int, float | None]:
            if hot_client.get(keys[i % 3]) is None:
                raise RuntimeError("miss on the hot server")
            return payload.size, None

        lookups_before = http_json(cold.url + "/stats")["lookups"]
        entry["get"] = run_rounds(
            [
                (Row(BOTO3_GET, lambda: None), boto3_get),
                (Row(SDK_S3_GET, _pid(cold), cold_cycle.settle), sdk_s3),
                (Row(URLLIB3_S3_GET, _pid(cold), cold_cycle.settle), urllib3_s3),
                (Row(SDK_DISK_GET, _pid(wt)), sdk_disk),
            ],
            rounds=rounds,
            requests=count,
            s3_pid=s3_pid,
        )
        # The same two ways to S3's body, behind a link of bounded rate (s3_link).
        entry["get_shaped"] = {}
        for rate in rates:
            with s3_link.ConnectionLink(weed.s3_port, rate):
                entry["get_shaped"][rate] = run_rounds(
                    [
                        (Row(BOTO3_GET, lambda: None), boto3_get),
                        (Row(SDK_S3_GET, _pid(cold), cold_cycle.settle), sdk_s3),
                    ],
                    rounds=rounds,
                    requests=count,
                    s3_pid=s3_pid,
                )
        # Time to first byte with the client on a core of its own: the cold server moves
        # to S3's core, so its reply does not wait for the client to win the core back
        # from the server's own fill (see the module docstring).
        if iso.pinned and not gets_only:
            assert cold.proc is not None
            pin_process(cold.proc.pid, iso.s3_cpus)
            try:
                entry["ttfb_client_alone"] = run_rounds(
                    [
                        (Row(BOTO3_GET, lambda: None), boto3_get),
                        (Row(URLLIB3_S3_GET, _pid(cold), cold_cycle.settle), urllib3_s3),
                    ],
                    rounds=rounds,
                    requests=count,
                    s3_pid=s3_pid,
                )
            finally:
                pin_process(cold.proc.pid, iso.other_cpus)
        after = http_json(cold.url + "/stats")["lookups"]
        entry["cold_server_lookups"] = {k: after[k] - lookups_before.get(k, 0) for k in after}
        if gets_only:
            return entry

        put_counter = itertools.count()
        written: list[str] = []
        sdk_body = payload.tensor(seed=1)

        def sdk_put(_: int) -> tuple[int, float | None]:
            key = f"{payload.name}-put-{next(put_counter)}"
            written.append(key)
            if not hot_client.put(key, sdk_body):
                raise RuntimeError("PUT did not create the entry")
            return payload.size, None

        def boto3_put(_: int) -> tuple[int, float | None]:
            key = f"alt/{payload.name}-put-{next(put_counter)}"
            s3.put_object(Bucket=BUCKET, Key=key, Body=body)
            return payload.size, None

        entry["put"] = run_rounds(
            [(Row(BOTO3_PUT, lambda: None), boto3_put), (Row(SDK_PUT, _pid(wt)), sdk_put)],
            rounds=rounds,
            requests=count,
            s3_pid=s3_pid,
        )
        for key in written:
            hot_client.delete(key)
    finally:
        hot_client.close()
        cold_client.close()
        cold_pool.close()
        svc.stop_server(cold)
        svc.stop_server(wt)
    return entry


# --------------------------------------------------------------------------- report


def _read_through(where: str, rows: dict[str, Any]) -> dict[str, Any]:
    return target_row(
        f"read-through GET via SDK vs boto3 get_object, {where}",
        0.9,
        rows[SDK_S3_GET]["mb_per_s_median"],
        rows[BOTO3_GET]["mb_per_s_median"],
    )


def _first_byte(where: str, rows: dict[str, Any]) -> dict[str, Any]:
    return target_row(
        f"read-through time to first byte vs boto3's, {where}",
        1.2,
        rows[URLLIB3_S3_GET]["ttfb_p50_ms"],
        rows[BOTO3_GET]["ttfb_p50_ms"],
        higher_is_better=False,
    )


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    section_results = results.get("s3")
    if not section_results:
        return rows
    tag = "" if section_results["pinned"] else " (S3 NOT isolated)"
    for name, entry in section_results["payloads"].items():
        put = entry["put"]
        rows.append(
            target_row(
                f"write-through PUT via SDK vs boto3 put_object, {name}{tag}",
                0.9,
                put[SDK_PUT]["mb_per_s_median"],
                put[BOTO3_PUT]["mb_per_s_median"],
            )
        )
        rows.append(_read_through(f"{name}{tag}", entry["get"]))
        rows.append(_first_byte(f"{name}{tag}", entry["get"]))
        for rate, shaped in entry["get_shaped"].items():
            rows.append(_read_through(f"{name}, S3 link {rate}", shaped))
        if "ttfb_client_alone" in entry:
            rows.append(_first_byte(f"{name}, client on its own core", entry["ttfb_client_alone"]))
    return rows


def _link_line(section_results: dict[str, Any]) -> str:
    if not section_results["link_rates"]:
        return f"S3 link NOT shaped: {section_results['link_not_shaped']}."
    rates = ", ".join(section_results["link_rates"])
    return (
        f'Rows marked "S3 link": the same GETs with each S3 connection limited to {rates} '
        f'each way behind a {s3_link.NODE_LINK} node link (`bench/s3_link.py`); "client on '
        "its own core\": the cold server moved to S3's core."
    )


def markdown(results: dict[str, Any]) -> str:
    section_results = results.get("s3")
    if not section_results:
        return ""
    out = [
        "## S3 paths (section `s3`)",
        "",
        f"{section_results['isolation']}. Load {section_results['loadavg_before']} -> "
        f"{section_results['loadavg_after']}.",
        "",
        _link_line(section_results),
        "",
        "| payload | contender | MB/s (median) | p50 ms | TTFB p50 ms | server CPU s/GB "
        "| S3 CPU s/GB | client CPU s/GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in section_results["payloads"].items():
        groups = [("", entry["get"])]
        groups += [(f", S3 link {rate}", rows) for rate, rows in entry["get_shaped"].items()]
        if "ttfb_client_alone" in entry:
            groups.append((", client on its own core", entry["ttfb_client_alone"]))
        groups.append(("", entry["put"]))
        for where, rows in groups:
            for label, row in rows.items():
                ttfb = f"{row['ttfb_p50_ms']:.2f}" if "ttfb_p50_ms" in row else ""
                server = f"{row['server_cpu_s_per_gb']:.2f}" if "server_cpu_s_per_gb" in row else ""
                out.append(
                    f"| {name} | {label}{where} | {row['mb_per_s_median']:.0f} | {row['p50_ms']:.1f} "
                    f"| {ttfb} | {server} | {row['s3_cpu_s_per_gb']:.2f} "
                    f"| {row['client_cpu_s_per_gb']:.2f} |"
                )
        out.append(f"| {name} | cold-server lookups | {entry['cold_server_lookups']} | | | | | |")
    return "\n".join(out) + "\n"


def readme_sentence(section_results: dict[str, Any]) -> str:
    """README.md's words on the read-through behind S3's link (bench/report.py)."""
    if not section_results["link_rates"]:
        return f"the S3 link was not shaped in this run ({section_results['link_not_shaped']})."
    reads, first_bytes = [], []
    for entry in section_results["payloads"].values():
        for shaped in entry["get_shaped"].values():
            reads.append(
                shaped[SDK_S3_GET]["mb_per_s_median"] / shaped[BOTO3_GET]["mb_per_s_median"]
            )
        get = entry["get"]
        first_bytes.append(get[URLLIB3_S3_GET]["ttfb_p50_ms"] / get[BOTO3_GET]["ttfb_p50_ms"])
    return (
        f"behind S3's link (each connection at {', '.join(section_results['link_rates'])}, "
        f"`bench/s3_link.py`) it reads at {ratio_span(reads)} boto3's `get_object`, and "
        f"its time to first byte is {ratio_span(first_bytes)} boto3's. Against boto3's "
        "TransferManager on that link: "
        "[s3-readthrough.md](bench/results/s3-readthrough.md)."
    )


def ratio_span(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"
