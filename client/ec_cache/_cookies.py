"""The cookie jar of the clients' httpx clients: one that keeps nothing."""

from __future__ import annotations

import http.cookiejar
from typing import Any


class DiscardingCookieJar(http.cookiejar.CookieJar):
    """A cookie jar that keeps nothing, given to httpx's clients as their ``cookies``:
    ec-cache sets no cookies, so a ``Set-Cookie`` from a proxy in front of a server is
    never stored or sent back."""

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        return None

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None
