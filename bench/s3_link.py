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
