"""Where a small request's server time goes. (``python -m bench.server_profile``)

Starts ``python -m app`` (disk only, a 128 KiB entry), sends HEADs or GETs of it in a
loop from one keep-alive urllib3 connection, samples the server with py-spy (``pip
install py-spy``; it needs ptrace, so root or CAP_SYS_PTRACE) and prints, for each part
of the request path, the share of the server's samples spent inside it. Samples are
wall-clock samples of the main thread, idle time included, so the shares of one run
compare with each other, not across machines.

    python -m bench.server_profile --method GET --log-level info --seconds 10
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ec_cache
import torch
import urllib3

from tests.support.server import ServerProcess

#: (part, the functions whose inclusive samples measure it). Inclusive shares nest:
#: "app" contains every part below it except the uvicorn ones.
PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("uvicorn: parse the request", ("HttpToolsProtocol.data_received",)),
    ("uvicorn: write the response", ("RequestResponseCycle.send",)),
    ("app (everything inside the ASGI call)", ("ECApp.__call__",)),
    ("edge: admission, request id, counting", ("EdgeMiddleware.__call__",)),
    ("entry routes (request, handler, response incl. its writes)", ("EntryRoutes.__call__",)),
    ("metrics", ("Metrics.request", "Metrics.lookup")),
    ("access log", ("Logger.handle", "Logger.makeRecord")),
    ("routing (entry path match)", ("EntryRoutes.match",)),
    ("auth", ("Authenticator.authorize",)),
    ("key validation", ("parse_key",)),
    ("store lookup + file open/mmap", ("Store.get", "Store.head")),
    ("  of which DiskTier.open", ("DiskTier.open",)),
    ("response headers", ("EntryResponse.__init__",)),
    ("FastAPI (other routes only)", ("FastAPI.__call__",)),
]


def _frame_name(frame: str) -> str:
    return frame.split(" (", 1)[0]


def shares(raw: Path) -> tuple[int, dict[str, float]]:
    """Inclusive share of samples per function name, from py-spy's ``raw`` output."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples = int(count)
        total += samples
        for name in {_frame_name(frame) for frame in stack.split(";")}:
            counts[name] += samples
    return total, {name: n / total for name, n in counts.items()} if total else {}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.server_profile", description=__doc__)
    parser.add_argument("--method", choices=("GET", "HEAD"), default="GET")
    parser.add_argument("--log-level", default="warning", help="EC_LOG_LEVEL of the server")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    args = parser.parse_args()
    # pip puts it next to the interpreter, which need not be on PATH (a venv not activated)
    py_spy = shutil.which(
        "py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    if py_spy is None:
        parser.error("py-spy is not installed (pip install py-spy)")
    with tempfile.TemporaryDirectory(prefix="ec-profile-") as tmp:
        root = Path(tmp)
        with ServerProcess(root / "data", root / "log", log_level=args.log_level) as server:
            assert server.proc is not None
            with ec_cache.Client(server.url, model="bench", dtype="bfloat16") as client:
                client.put("small", torch.zeros(64, 1024, dtype=torch.bfloat16))
            pool = urllib3.HTTPConnectionPool("127.0.0.1", server.port, maxsize=1)
            stop = threading.Event()
            done = [0]

            def load() -> None:
                while not stop.is_set():
                    if pool.request(args.method, "/ec/bench/bfloat16/small").status != 200:
                        raise RuntimeError("the entry is gone")
                    done[0] += 1

            worker = threading.Thread(target=load, daemon=True)
            worker.start()
            time.sleep(1.0)  # warm: connection, page cache, key cache
            raw = root / "raw.txt"
            pid = str(server.proc.pid)
            sampling = ["-r", str(args.rate), "-d", str(args.seconds), "-f", "raw", "-o", str(raw)]
            subprocess.run(
                [py_spy, "record", *sampling, "-p", pid],
                check=True,
                capture_output=True,
            )
            stop.set()
            worker.join()
            pool.close()
        total, share = shares(raw)
    print(
        f"{args.method} 128 KiB, EC_LOG_LEVEL={args.log_level}: {done[0]} requests, {total} samples"
    )
    for part, functions in PARTS:
        print(f"{100 * sum(share.get(f, 0.0) for f in functions):5.1f}%  {part}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
