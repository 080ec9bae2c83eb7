"""An S3 behind a network link of bounded rate, on loopback: Linux traffic control.

S3 in production sits across a network whose rate per connection is well below what a
loopback copy moves (AWS documents about 90 MB/s per S3 connection; an in-cluster MinIO
gets a share of a 10-25 Gbit/s NIC). On loopback, S3 answers as fast as the CPUs copy,
so a proxy in front of it is measured on how much CPU it takes from the client's core
rather than on its design. :class:`ShapedLink` limits the traffic to and from S3's port
to ``rate`` each way (an HTB class selected by a u32 filter on the TCP port; all other
loopback traffic goes through an unlimited class): boto3 straight to S3 and ec-cache's
read-through then share the same bottleneck, and the ratio says how much a read-through
adds to S3's own time: its first-byte delay and whatever of the body it cannot pass on
at S3's pace.

:class:`ConnectionLink` models S3 as it serves a node: each connection limited to about
90 MB/s (AWS's per-connection figure: "about 85-90 MB/s" per request,
https://docs.aws.amazon.com/whitepapers/latest/s3-optimizing-performance-best-practices/horizontal-scaling-and-request-parallelization-for-high-throughput.html),
all of them behind the node's link. A classic-BPF classifier (``tc filter ... bpf
bytecode``: this kernel has cls_bpf but neither the flow classifier nor fq/sfq) picks
one HTB class per client port (the low 10 bits of it: 1024 classes, so two concurrent
connections share one with a chance of ~N^2/2048), each at the per-connection rate,
under one parent class at the node's rate. What it does not model: the round trip
(netem is absent here, so every request starts as fast as loopback answers: S3's first
byte latency of 10-30 ms is missing, which flatters many small requests), TCP's slow
start over a long path, and S3's per-prefix request rates.

It needs ``tc`` (iproute2) and CAP_NET_ADMIN, and loopback without a queueing discipline
of its own (left untouched otherwise); :func:`why_not` says what is missing.
Netem (added delay) would model the round trip too, but kernels without
``CONFIG_NET_SCH_NETEM`` (this VM's) lack it, so only the rate is shaped: the time to
first byte is measured on the unshaped loopback.
"""

from __future__ import annotations

import shutil
import subprocess
from types import TracebackType

DEVICE = "lo"
#: Bytes an HTB class may send at once above its rate: at least one 64 KiB loopback
#: packet (GSO), small against the payloads (>= 4.7 MB) so the rate holds per request.
BURST = "256k"
UNLIMITED = "100gbit"


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=check)


def why_not() -> str:
    """Empty when the link can be shaped here; else why not."""
    if shutil.which("tc") is None:
        return "tc (iproute2) is not installed"
    try:
        shown = _tc("qdisc", "show", "dev", DEVICE)
    except subprocess.CalledProcessError as exc:
        return f"tc qdisc show failed: {exc.stderr.strip()}"
    if shown.stdout.split()[1:2] not in (["noqueue"], []):
        return f"{DEVICE} already has a queueing discipline: {shown.stdout.strip()}"
    probe = _tc("qdisc", "add", "dev", DEVICE, "root", "handle", "1:", "htb", check=False)
    if probe.returncode != 0:
        return f"cannot add an HTB qdisc to {DEVICE}: {probe.stderr.strip()}"
    _tc("qdisc", "del", "dev", DEVICE, "root")
    return ""


class ShapedLink:
    """Traffic from and to TCP ``port`` on loopback limited to ``rate`` (tc syntax,
    e.g. ``1gbit``) each way, while the context is open."""

    def __init__(self, port: int, rate: str) -> None:
        self.port = port
        self.rate = rate

    def __enter__(self) -> ShapedLink:
        _tc("qdisc", "add", "dev", DEVICE, "root", "handle", "1:", "htb", "default", "10")
        try:
            self._add_class("1:10", UNLIMITED)
            self._add_class("1:20", self.rate)
            for direction in ("sport", "dport"):
                _tc(
                    "filter", "add", "dev", DEVICE, "parent", "1:", "protocol", "ip",
                    "prio", "1", "u32", "match", "ip", direction, str(self.port), "0xffff",
                    "flowid", "1:20",
                )  # fmt: skip
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._remove()

    @staticmethod
    def _add_class(classid: str, rate: str) -> None:
        _tc(
            "class", "add", "dev", DEVICE, "parent", "1:", "classid", classid, "htb",
            "rate", rate, "ceil", rate, "burst", BURST, "cburst", BURST,
        )  # fmt: skip

    @staticmethod
    def _remove() -> None:
        _tc("qdisc", "del", "dev", DEVICE, "root", check=False)


#: AWS: about 85-90 MB/s per S3 connection (see the module docstring); 720 Mbit/s.
PER_CONNECTION = "720mbit"
#: The node's link to S3 (10-25 Gbit/s in production; loopback moves less than that on
#: a small machine, so the cores bind first there).
NODE_LINK = "10gbit"
#: Classes of per-connection rate: one per value of a client port's low 10 bits.
CONNECTION_CLASSES = 1024
FIRST_MINOR = 0x100
#: Bytes a class may send above its rate at once: at least one 64 KiB loopback packet.
QUANTUM = "200000"


def connection_classifier(port: int) -> str:
    """Classic BPF (tc's ``bytecode`` syntax) for a packet on loopback (Ethernet header,
    IPv4, TCP) from or to ``port``: classid ``1:(0x100 + client port % 1024)``; 0 (no
    match) for any other packet."""
    program = [
        (0x28, 0, 0, 12),  # ldh [12]: EtherType
        (0x15, 0, 14, 0x0800),  # IPv4, else no match
        (0x30, 0, 0, 23),  # ldb [23]: IP protocol
        (0x15, 0, 12, 6),  # TCP, else no match
        (0xB1, 0, 0, 14),  # ldxb 4*([14]&0xf): IP header length
        (0x48, 0, 0, 14),  # ldh [x+14]: source port
        (0x15, 0, 2, port),  # from the port: the client is the destination
        (0x48, 0, 0, 16),  # ldh [x+16]: destination port
        (0x05, 0, 0, 4),  # ja -> and
        (0x02, 0, 0, 0),  # st M[0]: the source port, the client's if ...
        (0x48, 0, 0, 16),  # ldh [x+16]
        (0x15, 0, 4, port),  # ... the destination is the port, else no match
        (0x60, 0, 0, 0),  # ld M[0]
        (0x54, 0, 0, CONNECTION_CLASSES - 1),  # and: the client port's low bits
        (0x04, 0, 0, (1 << 16) + FIRST_MINOR),  # add: major 1, minor from 0x100
        (0x16, 0, 0, 0),  # ret a: the classid
        (0x06, 0, 0, 0),  # ret #0: no match
    ]
    return f"{len(program)}," + ",".join(f"{c} {t} {f} {k}" for c, t, f, k in program)


class ConnectionLink:
    """Each TCP connection to or from ``port`` on loopback limited to ``per_connection``
    each way, all of them together to ``node`` (tc syntax), while the context is open;
    other loopback traffic unlimited. See the module docstring."""

    def __init__(self, port: int, per_connection: str = PER_CONNECTION, node: str = NODE_LINK):
        self.port = port
        self.per_connection = per_connection
        self.node = node

    def __enter__(self) -> ConnectionLink:
        lines = [
            f"qdisc add dev {DEVICE} root handle 1: htb default 2",
            f"class add dev {DEVICE} parent 1: classid 1:2 htb rate {UNLIMITED} "
            f"burst {BURST} cburst {BURST} quantum {QUANTUM}",
            f"class add dev {DEVICE} parent 1: classid 1:1 htb rate {self.node} "
            f"burst {BURST} cburst {BURST} quantum {QUANTUM}",
        ]
        lines += [
            f"class add dev {DEVICE} parent 1:1 classid 1:{FIRST_MINOR + i:x} htb "
            f"rate {self.per_connection} ceil {self.per_connection} "
            f"burst {BURST} cburst {BURST} quantum {QUANTUM}"
            for i in range(CONNECTION_CLASSES)
        ]
        lines.append(
            f"filter add dev {DEVICE} parent 1: protocol ip prio 1 bpf "
            f"bytecode '{connection_classifier(self.port)}'"
        )
        try:
            subprocess.run(
                ["tc", "-batch", "-"], input="\n".join(lines) + "\n", text=True,
                capture_output=True, check=True,
            )  # fmt: skip
        except subprocess.CalledProcessError as exc:
            ShapedLink._remove()
            raise RuntimeError(f"tc could not shape {DEVICE}: {exc.stderr.strip()}") from exc
        except BaseException:
            ShapedLink._remove()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        ShapedLink._remove()

    def describe(self) -> str:
        return (
            f"each S3 connection at {self.per_connection}, all behind a {self.node} node "
            f"link (HTB, {CONNECTION_CLASSES} classes by client port, cls_bpf); no added "
            "round trip (netem absent)"
        )
