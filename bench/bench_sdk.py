#!/usr/bin/env python
"""Side-by-side benchmark of the ec-cache SDK against nginx + urllib3.

Starts nginx (a static location serving the same safetensors bodies, and a DAV location
for PUT) and an ec-cache server (``python -m app``, disk tier), both on 127.0.0.1, then
runs interleaved rounds of:

GET (body -> memory), per size:
  * ``urllib3_nginx``       urllib3 ``.data`` from nginx (the reference)
  * ``sdk_get``             ``Client.get`` from ec-cache into a fresh CPU tensor (CRC checked)
  * ``sdk_get_out``         same into a reused ``out=`` tensor
  * ``async_sdk_get``       ``AsyncClient.get`` from ec-cache, fresh CPU tensor
  * ``sdk_get_nginx``       ``Client.get`` from nginx (client-side cost only: nginx sends
                            the ``X-EC-*`` headers from its config)
  * ``httpx_content_nginx`` stock httpx ``.content`` from nginx (what the SDK replaces)
PUT (memory -> server), per size:
  * ``urllib3_nginx_dav``   urllib3 PUT of the body to nginx DAV
  * ``urllib3_ec_put``      urllib3 PUT of the same body (+ X-EC-CRC32C) to ec-cache: the
                            server's own ingest speed, to separate client and server cost
  * ``sdk_put``             ``Client.put`` of a CPU tensor to ec-cache (CRC32C computed per
                            call)
Both PUTs to ec-cache use a new key each time; the entry is deleted again outside the
timed section.

Each round times ``--requests`` sequential requests per method on one keep-alive
connection; methods are interleaved and their order rotates every round; the result
is the median MB/s over ``--rounds``. Raw numbers go to ``bench/results/``.

    .venv/bin/python bench/bench_sdk.py            # ~1 minute on the 2-core build VM
    .venv/bin/python bench/bench_sdk.py --rounds 9 --requests 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "client"))
sys.path.insert(0, str(ROOT))  # run as a script: tests.support is found from the root

import ec_cache  # noqa: E402
import httpx  # noqa: E402
import torch  # noqa: E402
import urllib3  # noqa: E402
from ec_cache._crc import crc32c  # noqa: E402
from ec_cache._tensors import build_header, tensor_memoryview  # noqa: E402

from tests.support.server import ServerProcess, free_port  # noqa: E402

MODEL = "bench/llava"
DTYPE = "bfloat16"
SIZES = {  # name -> shape (bf16)
    "4.7MB": (576, 4096),
    "16MiB": (2048, 4096),
}


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def start_nginx(
    work: Path, bodies: dict[str, tuple[bytes, torch.Tensor]]
) -> tuple[subprocess.Popen[bytes], int]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(nginx):
        sys.exit("nginx not found: apt-get install -y nginx")
    port = free_port()
    www = work / "www"
    (www / "dav").mkdir(parents=True)
    locations = []
    for name, (body, tensor) in bodies.items():
        path = f"/ec/{MODEL}/{DTYPE}/{name}"
        target = www / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(body)
        shape = ",".join(str(d) for d in tensor.shape)
        locations.append(
            f"location = {path} {{ add_header X-EC-CRC32C {crc32c(body):08x}; "
            f"add_header X-EC-Dtype {DTYPE}; add_header X-EC-Shape {shape}; }}"
        )
    conf = work / "nginx.conf"
    conf.write_text(
        f"""
user root;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    default_type application/octet-stream;
    client_body_temp_path {work}/body-temp;
    server {{
        listen 127.0.0.1:{port};
        root {www};
        {chr(10).join(locations)}
        location /dav/ {{
            dav_methods PUT DELETE;
            create_full_put_path on;
            client_max_body_size 0;
            client_body_buffer_size 1m;
        }}
    }}
}}
"""
    )
    proc = subprocess.Popen([nginx, "-p", str(work), "-c", str(conf), "-g", "daemon off;"])
    wait_http(f"http://127.0.0.1:{port}/dav/")
    return proc, port


def timed(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=10, help="requests per method per round")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    torch.manual_seed(0)
    tensors = {name: torch.randn(shape).to(torch.bfloat16) for name, shape in SIZES.items()}
    bodies = {
        name: (build_header(DTYPE, tuple(t.shape)) + bytes(tensor_memoryview(t)), t)
        for name, t in tensors.items()
    }
    work = Path(tempfile.mkdtemp(prefix="ec-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    servers: list[ServerProcess] = []
    try:
        ngx, ngx_port = start_nginx(work, bodies)
        procs.append(ngx)
        server = ServerProcess(work / "ec-data", work / "ec.log", disk_max_bytes="4GiB")
        servers.append(server.start())
        srv_port = server.port
        ngx_url, srv_url = f"http://127.0.0.1:{ngx_port}", server.url

        client = ec_cache.Client(srv_url, model=MODEL, dtype=DTYPE)
        client_ngx = ec_cache.Client(ngx_url, model=MODEL, dtype=DTYPE)
        loop = asyncio.new_event_loop()
        aclient = ec_cache.AsyncClient(srv_url, model=MODEL, dtype=DTYPE)
        pool = urllib3.HTTPConnectionPool("127.0.0.1", ngx_port, maxsize=1)
        stock = httpx.Client()
        for name, t in tensors.items():
            client.put(name, t)
        outs = {name: torch.empty_like(t) for name, t in tensors.items()}

        counter = [0]

        put_clock = [0.0]

        def sdk_put(name: str) -> None:
            counter[0] += 1
            key = f"{name}-put-{counter[0]}"
            t0 = time.perf_counter()
            assert client.put(key, tensors[name])
            put_clock[0] += time.perf_counter() - t0
            client.delete(key)

        ec_pool = urllib3.HTTPConnectionPool("127.0.0.1", srv_port, maxsize=1)

        def urllib3_ec_put(name: str) -> None:
            counter[0] += 1
            key = f"{name}-put-{counter[0]}"
            body = bodies[name][0]
            t0 = time.perf_counter()
            r = ec_pool.request(
                "PUT",
                f"/ec/{MODEL}/{DTYPE}/{key}",
                body=body,
                headers={"X-EC-CRC32C": f"{crc32c(body):08x}"},
            )
            put_clock[0] += time.perf_counter() - t0
            assert r.status == 201, r.data
            client.delete(key)

        results: dict[str, dict[str, list[float]]] = {}
        for name, (body, tensor) in bodies.items():
            path = f"/ec/{MODEL}/{DTYPE}/{name}"
            size = len(body)
            # sanity: every method gets the right bytes
            assert pool.request("GET", path).data == body
            assert torch.equal(client.get(name), tensor)
            assert torch.equal(client_ngx.get(name), tensor)
            assert torch.equal(loop.run_until_complete(aclient.get(name)), tensor)
            gets: dict[str, Callable[[], object]] = {
                "urllib3_nginx": lambda p=path: pool.request("GET", p).data,
                "sdk_get": lambda n=name: client.get(n),
                "sdk_get_out": lambda n=name: client.get(n, out=outs[n]),
                "async_sdk_get": lambda n=name: loop.run_until_complete(aclient.get(n)),
                "sdk_get_nginx": lambda n=name: client_ngx.get(n),
                "httpx_content_nginx": lambda p=path: stock.get(ngx_url + p).content,
            }
            dav = f"/dav/{name}.safetensors"
            puts: dict[str, Callable[[], object]] = {
                "urllib3_nginx_dav": lambda d=dav, b=body: pool.request("PUT", d, body=b),
                "urllib3_ec_put": lambda n=name: urllib3_ec_put(n),
                "sdk_put": lambda n=name: sdk_put(n),
            }
            methods = {
                **{f"GET {k}": v for k, v in gets.items()},
                **{f"PUT {k}": v for k, v in puts.items()},
            }
            per = {k: [] for k in methods}
            for fn in methods.values():  # warm-up: connections, buffers, page cache
                timed(fn, 2)
            keys = list(methods)
            for r in range(args.rounds):
                order = keys[r % len(keys) :] + keys[: r % len(keys)]
                for key in order:
                    if key in ("PUT sdk_put", "PUT urllib3_ec_put"):
                        put_clock[0] = 0.0
                        timed(methods[key], args.requests)
                        elapsed = put_clock[0]
                    else:
                        elapsed = timed(methods[key], args.requests)
                    per[key].append(size * args.requests / elapsed / 1e6)
            results[name] = per

        summary: dict[str, dict[str, float]] = {}
        print(f"\nmedian MB/s over {args.rounds} rounds x {args.requests} requests")
        for name, per in results.items():
            med = {k: statistics.median(v) for k, v in per.items()}
            ref_get, ref_put = med["GET urllib3_nginx"], med["PUT urllib3_nginx_dav"]
            summary[name] = med
            print(f"\n{name} (body {len(bodies[name][0])} B)")
            for k, v in med.items():
                ref = ref_put if k.startswith("PUT") else ref_get
                print(f"  {k:28s} {v:8.0f} MB/s   {v / ref:5.2f}x")
            sdk_vs_server = med["PUT sdk_put"] / med["PUT urllib3_ec_put"]
            print(f"  PUT sdk_put / urllib3_ec_put: {sdk_vs_server:.2f}x")
        out = args.out / f"sdk-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "host": platform.node(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "rounds": args.rounds,
                    "requests": args.requests,
                    "units": "MB/s (1e6 bytes/s), per round",
                    "raw": results,
                    "median": summary,
                },
                indent=1,
            )
        )
        print(f"\nraw results: {out}")
        client.close()
        client_ngx.close()
        loop.run_until_complete(aclient.aclose())
        loop.close()
    finally:
        for server in servers:
            server.stop()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
