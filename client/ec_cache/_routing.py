"""Rendezvous (highest-random-weight) hashing of keys over replicas.

Every client orders the replicas of a key the same way, so a key is always served by
the same replica (whose disk tier then holds it) while that replica is up; when it is
not, the next one in the key's order takes over, and only the keys of a removed
replica move.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from urllib.parse import urlsplit

__all__ = ["Router", "normalize_url"]


def normalize_url(url: str) -> str:
    """``http://host:port[/prefix]`` without a trailing slash; ``host:port`` gets
    ``http://``. A prefix ending in ``/ec`` is refused: it is the API's own path, pasted
    into the base URL, and would turn every model ``M`` into ``ec/M``."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"unsupported URL scheme in {url!r}")
    url = url.rstrip("/")
    if urlsplit(url).path.endswith("/ec"):
        raise ValueError(
            f"server URL {url!r} ends in /ec: give the server's base URL "
            f"({url.removesuffix('/ec')!r}); the client adds /ec/MODEL/DTYPE/HASH itself"
        )
    return url


def _score(replica: str, key: str) -> int:
    digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Router:
    """Orders replicas for a key.

    >>> r = Router(["http://a:1", "http://b:1", "http://c:1"])
    >>> order = r.order("m", "float32", "h1")
    >>> sorted(order) == r.urls and order == r.order("m", "float32", "h1")
    True
    """

    def __init__(self, urls: Sequence[str]) -> None:
        if isinstance(urls, str):
            urls = [urls]
        normalized = [normalize_url(u) for u in urls]
        if not normalized:
            raise ValueError("at least one server URL is needed")
        self.urls = sorted(dict.fromkeys(normalized))

    def order(self, model: str, dtype: str, hash: str) -> list[str]:
        """Replicas for ``(model, dtype, hash)``, preferred first."""
        if len(self.urls) == 1:
            return self.urls
        key = f"{model}\x00{dtype}\x00{hash}"
        return sorted(self.urls, key=lambda u: _score(u, key), reverse=True)

    def orders(self, model: str, dtype: str, hashes: Sequence[str]) -> list[list[str]]:
        """:meth:`order` of each of ``hashes``."""
        return [self.order(model, dtype, hash) for hash in hashes]
