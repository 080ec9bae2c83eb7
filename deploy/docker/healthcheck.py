#!/usr/bin/env python3
"""Container health probe for ec-cache: GET /healthz on the local listener.

Used by the image's HEALTHCHECK and by docker-compose.yml. The slim base image has
no curl, so this uses the standard library only. Exit 0 when the server answers
200, 1 otherwise (Docker's HEALTHCHECK contract). Reads the same EC_HOST / EC_PORT
variables as the server, so a changed port needs no change here.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def probe_url() -> str:
    host = os.environ.get("EC_HOST", "127.0.0.1").strip() or "127.0.0.1"
    # A wildcard listen address is reached through loopback.
    if host in {"0.0.0.0", "::", "[::]"}:
        host = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = os.environ.get("EC_PORT", "8080").strip() or "8080"
    return f"http://{host}:{port}/healthz"


def main() -> int:
    timeout = float(os.environ.get("EC_HEALTHCHECK_TIMEOUT", "4"))
    url = probe_url()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            ok = response.status == 200
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print(f"unhealthy: {url}: HTTP {response.status}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
