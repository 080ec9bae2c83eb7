"""Is the SDK's hand-written ``Content-Length`` receive worth keeping?
(``python -m bench.zero_copy``)

The SDK lets h11 frame every response, except that once h11's buffer is empty the rest
of a ``Content-Length`` body is received with ``recv_into`` straight into the
destination tensor (``ec_cache/_async/transport.py``). This times ``Client.get`` of
disk hits with that path and with it switched off (h11 ``Data`` events copied into the
tensor), interleaved, against one ec-cache server. Median of 5 rounds.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from pathlib import Path

import ec_cache
import torch
from ec_cache._sync import transport

from tests.support.server import ServerProcess

SHAPES = (((576, 4096), 30), ((2040, 16384), 6))  # 4.7 MB, 67 MB (bf16); requests per round


def _median_get(client: ec_cache.Client, key: str, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client.get(key)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    torch.set_num_threads(1)
    framed = transport._content_length_framed
    with tempfile.TemporaryDirectory(prefix="ec-zero-copy-") as tmp:
        root = Path(tmp)
        with (
            ServerProcess(root / "d", root / "log", disk_max_bytes="2GiB") as srv,
            ec_cache.Client(srv.url, model="bench", dtype="bfloat16") as client,
        ):
            for shape, n in SHAPES:
                tensor = torch.randn(shape).to(torch.bfloat16)
                key = uuid.uuid4().hex
                client.put(key, tensor)
                assert torch.equal(client.get(key), tensor)
                res: dict[str, list[float]] = {"direct": [], "h11": []}
                try:
                    for r in range(5):
                        for mode in ("direct", "h11") if r % 2 == 0 else ("h11", "direct"):
                            transport._content_length_framed = (  # type: ignore[assignment]
                                framed if mode == "direct" else (lambda event, method: None)
                            )
                            res[mode].append(_median_get(client, key, n))
                finally:
                    transport._content_length_framed = framed
                mb = tensor.nbytes / 1e6
                d, h = statistics.median(res["direct"]), statistics.median(res["h11"])
                print(
                    f"{mb:.1f} MB: recv_into {d * 1e3:.2f} ms ({mb / d:.0f} MB/s), "
                    f"h11 Data {h * 1e3:.2f} ms ({mb / h:.0f} MB/s): h11 takes {h / d:.2f}x",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
