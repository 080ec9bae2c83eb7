"""SigV4 for the data plane's own requests (``loop_get``, ``signed_http``): botocore's
``S3SigV4Auth``, with the session's credentials frozen per request (so refreshable ones
refresh as they do in boto3). Path-style URLs only (``client.ADDRESSING_STYLE``). Every
request carries ``USER_AGENT`` (unsigned, as botocore leaves it), which tells the data
plane's requests from boto3's in a proxy's log."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import botocore.exceptions as bce
from botocore.config import Config
from botocore.credentials import Credentials

from app.tiers.s3.botocore_adapter import AWSRequest, S3SigV4Auth
from app.tiers.s3.http_session import S3Transport
from app.tiers.s3.objects import ByteSpan

#: The ``User-Agent`` of the data plane's requests.
USER_AGENT = "ec-cache"


@dataclass(frozen=True)
class SignedRequest:
    """A signed request: its URL, the path for its request line, and its headers (``Host``
    among them, as signed)."""

    url: str
    path: str
    headers: dict[str, str]


class Signer:
    """Signs requests for objects of ``bucket`` at ``transport``'s endpoint, in ``region``,
    with ``credentials`` (None: none found; each request then fails the way boto3 would).
    ``config`` is the boto3 client's: its ``payload_signing_enabled`` applies to uploads."""

    def __init__(
        self,
        transport: S3Transport,
        bucket: str,
        region: str,
        config: Config,
        credentials: Credentials | None,
    ) -> None:
        self._host = transport.host
        self._base = f"{transport.endpoint}/{bucket}/"
        self._base_path = f"{urlsplit(transport.endpoint).path}/{bucket}/"
        self._region = region
        self._config = config
        self._credentials = credentials

    def get(
        self, key: str, span: ByteSpan | None = None, if_match: str | None = None
    ) -> SignedRequest:
        """The signed GET of ``key``, its CRC32C asked for (``x-amz-checksum-mode``); of
        the bytes ``span`` only when given, and only while the object's ETag is
        ``if_match`` when given."""
        headers = {"x-amz-checksum-mode": "ENABLED"}
        if span is not None:
            headers["Range"] = span.header
        if if_match is not None:
            headers["If-Match"] = if_match
        return self._sign("GET", key, headers, None, upload=False)

    def put(
        self, key: str, headers: Mapping[str, str], body: Any, query: str = ""
    ) -> SignedRequest:
        """The signed PUT of ``body`` as ``key`` with ``headers``; ``query`` (encoded,
        without ``?``) names a part of a multipart upload."""
        return self._sign("PUT", key, headers, body, upload=True, query=query)

    def _sign(
        self,
        method: str,
        key: str,
        headers: Mapping[str, str],
        body: Any,
        *,
        upload: bool,
        query: str = "",
    ) -> SignedRequest:
        if self._credentials is None:
            raise bce.NoCredentialsError()
        quoted = quote(key, safe="/~") + (f"?{query}" if query else "")
        request = AWSRequest(
            method=method,
            url=self._base + quoted,
            headers={"host": self._host, **headers},
            data=body,
        )
        if upload:  # S3SigV4Auth reads the payload-signing choice from the configuration
            request.context["client_config"] = self._config
        S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self._region).add_auth(
            request
        )
        signed = dict(request.headers.items())
        signed["User-Agent"] = USER_AGENT
        return SignedRequest(request.url, self._base_path + quoted, signed)
