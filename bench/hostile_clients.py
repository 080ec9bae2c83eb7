"""Hostile clients against a real server with its default deadlines: how many
connections are held, how many dropped, and how long each takes to drop
(``make bench-hostile``).

    python -m bench.hostile_clients [--idle 1000] [--slowloris 300] [--tricklers 64]
                                    [--stalled 16] [--excess 100]

Phases, one after the other, against servers with the default deadlines (the first
takes bodies up to 128 MiB for the 64 MB entry; the last sets ``EC_MAX_CONNECTIONS``
and a 60 s keep-alive, so held connections stay open): idle sockets that never send a request,
slowloris heads (a header line a second), upload tricklers (a byte a second) taking
every upload slot, readers that stop reading a 64 MB GET, and connections beyond the
bound. Prints one Markdown table row per phase. While each phase runs, a well-behaved
client times a request to show the server still answers.
"""

from __future__ import annotations

import argparse
import contextlib
import selectors
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.lifecycle import unwind_on_sigterm
from testkit.entries import body
from testkit.server import ServerProcess


def _open(port: int, count: int, rcvbuf: int | None = None) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(("127.0.0.1", port))
        socks.append(sock)
    return socks


def _wait_closed(
    socks: list[socket.socket], start: float, limit: float, drain: bool = False
) -> tuple[list[float], list[bytes]]:
    """Seconds from ``start`` until each socket is closed by the server (EOF/reset);
    the first bytes each received. Sockets still open after ``limit`` get no time."""
    sel = selectors.DefaultSelector()
    first: dict[int, bytes] = {}
    for i, sock in enumerate(socks):
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, i)
        first[i] = b""
    times: list[float] = []
    while len(times) < len(socks) and time.monotonic() - start < limit:
        for key, _ in sel.select(timeout=0.5):
            sock = socks[key.data]
            try:
                chunk = sock.recv(1 << 20)
            except ConnectionResetError:
                chunk = b""
            except BlockingIOError:
                continue
            if chunk:
                if len(first[key.data]) < 200:
                    first[key.data] += chunk[:200]
                continue
            sel.unregister(sock)
            times.append(time.monotonic() - start)
    sel.close()
    return times, [first[i] for i in range(len(socks))]


def _dropped(url: str, reason: str) -> float:
    name = f'ec_connections_dropped_total{{reason="{reason}"}}'
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _probe(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            t = time.monotonic()
            try:
                client.get(url + "/healthz").raise_for_status()
                out.append(time.monotonic() - t)
            except httpx.HTTPError:
                out.append(float("inf"))
            stop.wait(0.5)


def _row(name: str, held: int, times: list[float], note: str, probes: list[float]) -> str:
    dropped = len(times)
    span = f"{min(times):.1f}-{max(times):.1f} s" if times else "-"
    worst = max(probes) if probes else float("nan")
    return (
        f"| {name} | {held} | {dropped} of {held} | {span} | {note}; "
        f"a /healthz alongside: worst {worst * 1e3:.0f} ms |"
    )


def _phase(srv: ServerProcess, name: str, run: Callable[[], tuple[int, list[float], str]]) -> str:
    stop = threading.Event()
    probes: list[float] = []
    thread = threading.Thread(target=_probe, args=(srv.url, stop, probes), daemon=True)
    thread.start()
    try:
        held, times, note = run()
    finally:
        stop.set()
        thread.join()
    return _row(name, held, times, note, probes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--slowloris", type=int, default=300)
    parser.add_argument("--tricklers", type=int, default=64)
    parser.add_argument("--stalled", type=int, default=16)
    parser.add_argument("--excess", type=int, default=100)
    args = parser.parse_args()
    unwind_on_sigterm()
    rows = [
        "| hostile clients | held | dropped | time to drop | notes |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with ServerProcess(root / "d", root / "log", max_body_bytes="128MiB") as srv:

            def idle() -> tuple[int, list[float], str]:
                socks = _open(srv.port, args.idle)
                start = time.monotonic()
                times, _ = _wait_closed(socks, start, 30)
                for sock in socks:
                    sock.close()
                return len(socks), times, "never send a byte (EC_KEEPALIVE_TIMEOUT 5 s)"

            def slowloris() -> tuple[int, list[float], str]:
                socks = _open(srv.port, args.slowloris)
                start = time.monotonic()
                stop = threading.Event()

                def trickle() -> None:
                    for sock in socks:
                        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
                    i = 0
                    while not stop.wait(1.0):
                        for sock in socks:
                            with contextlib.suppress(OSError):
                                sock.send(f"X-{i}: y\r\n".encode())
                        i += 1

                thread = threading.Thread(target=trickle, daemon=True)
                thread.start()
                times, first = _wait_closed(socks, start, 40)
                stop.set()
                thread.join()
                answered = sum(b" 408 " in f.split(b"\r\n", 1)[0] for f in first)
                for sock in socks:
                    sock.close()
                return (
                    len(socks),
                    times,
                    f"a header line a second (EC_HEADER_TIMEOUT 10 s); {answered} answered 408",
                )

            def tricklers() -> tuple[int, list[float], str]:
                data = body((200_000,), "U8", 1)
                socks = _open(srv.port, args.tricklers)
                for i, sock in enumerate(socks):
                    sock.sendall(
                        f"PUT /ec/m/uint8/t{i} HTTP/1.1\r\nHost: x\r\n"
                        f"Content-Length: {len(data)}\r\n\r\n".encode()
                    )
                start = time.monotonic()
                stop = threading.Event()

                def trickle() -> None:
                    n = 0
                    while not stop.wait(1.0):
                        for sock in socks:
                            with contextlib.suppress(OSError):
                                sock.send(data[n : n + 1])
                        n += 1

                thread = threading.Thread(target=trickle, daemon=True)
                thread.start()
                time.sleep(1)
                during = httpx.put(
                    srv.url + "/ec/m/uint8/during", content=body((1000,), "U8", 1)
                ).status_code
                times, first = _wait_closed(socks, start, 40)
                stop.set()
                thread.join()
                answered = sum(b" 408 " in f.split(b"\r\n", 1)[0] for f in first)
                after = httpx.put(
                    srv.url + "/ec/m/uint8/after", content=body((1000,), "U8", 1)
                ).status_code
                for sock in socks:
                    sock.close()
                return (
                    len(socks),
                    times,
                    f"PUT a byte a second on all {args.tricklers} upload slots "
                    f"(EC_UPLOAD_RATE_GRACE 10 s, EC_UPLOAD_MIN_RATE 1 MiB/s); {answered} "
                    f"answered 408; a PUT meanwhile {during}, after {after}",
                )

            def stalled() -> tuple[int, list[float], str]:
                data = body((64_000_000,), "U8", 1)
                httpx.put(srv.url + "/ec/m/uint8/big", content=data, timeout=60)
                socks = _open(srv.port, args.stalled, rcvbuf=64 * 1024)
                for sock in socks:
                    sock.sendall(b"GET /ec/m/uint8/big HTTP/1.1\r\nHost: x\r\n\r\n")
                start = time.monotonic()
                # Read nothing; time the server's drops by its own counter.
                times: list[float] = []
                while len(times) < len(socks) and time.monotonic() - start < 60:
                    dropped = _dropped(srv.url, "send_timeout")
                    times += [time.monotonic() - start] * int(dropped - len(times))
                    time.sleep(0.5)
                got = httpx.get(srv.url + "/ec/m/uint8/big", timeout=60).content == data
                for sock in socks:
                    sock.close()
                return (
                    len(socks),
                    times,
                    f"GET 64 MB, read nothing (EC_SEND_TIMEOUT 30 s; times from the "
                    f"server's drop counter); a full GET after them: {got}",
                )

            rows.append(_phase(srv, f"{args.idle} idle sockets", idle))
            rows.append(_phase(srv, f"{args.slowloris} slowloris heads", slowloris))
            rows.append(_phase(srv, f"{args.tricklers} upload tricklers", tricklers))
            rows.append(_phase(srv, f"{args.stalled} stalled readers", stalled))
        bound = 1000
        with ServerProcess(
            root / "d2", root / "log2", max_connections=str(bound), keepalive_timeout="60"
        ) as srv:

            def excess() -> tuple[int, list[float], str]:
                held = _open(srv.port, bound - 10)  # the probe needs room too
                time.sleep(1)
                extra = _open(srv.port, args.excess)
                start = time.monotonic()
                times, first = _wait_closed(extra, start, 10)
                refused = sum(b" 503 " in f.split(b"\r\n", 1)[0] for f in first)
                for sock in held + extra:
                    sock.close()
                return (
                    len(extra),
                    times,
                    f"beyond EC_MAX_CONNECTIONS={bound} ({bound - 10} held open); "
                    f"{refused} answered 503 too_many_connections",
                )

            rows.append(_phase(srv, f"{args.excess} connections over the bound", excess))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
