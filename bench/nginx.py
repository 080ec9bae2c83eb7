"""nginx from Debian's packages as the reference server: static files and WebDAV PUT."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from testkit.ports import free_port

_CONFIG = """
daemon off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    client_max_body_size 2g;
    client_body_buffer_size 1m;
    server {{
        listen 127.0.0.1:{port};
        root {root}/www;
        location /dav/ {{
            dav_methods PUT DELETE;
            create_full_put_path on;
        }}
    }}
}}
"""


class Nginx:
    """One nginx worker serving ``{root}/www``; ``/dav/`` accepts PUT."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.www = root / "www"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Nginx:
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        (self.www / "dav").mkdir(parents=True, exist_ok=True)
        for path in (self.root, self.www, self.www / "dav"):
            path.chmod(0o777)  # workers run as an unprivileged user; DAV writes here
        config = self.root / "nginx.conf"
        config.write_text(_CONFIG.format(root=self.root, port=self.port))
        self.proc = subprocess.Popen(
            [binary, "-c", str(config), "-p", str(self.root), "-e", str(self.root / "error.log")]
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/", timeout=1)
                return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("nginx did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
