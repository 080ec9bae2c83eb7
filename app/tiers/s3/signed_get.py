"""The read path's GET: one SigV4-signed request on boto3's own connection pool.

A read-through GET waits for S3's first byte before it can answer, so everything spent
before that byte is paid by the client. boto3's ``get_object`` spends about 1 ms of CPU
per call on its request pipeline (parameter validation, endpoint rules, event hooks,
response parsing), as much as the whole request costs S3 for a small object. This GET
keeps what matters from botocore and drops the rest:

* signing: botocore's ``S3SigV4Auth`` with the session's credentials, frozen per
  request (refreshable credentials refresh themselves, as in boto3);
* transport: the boto3 client's own ``URLLib3Session`` (TLS verification and CA
  bundle, proxies, timeouts, pool size, keep-alive as configured), so both share one
  connection pool, and its exceptions are botocore's;
* errors: a non-200 answer becomes a botocore ``ClientError`` (code and message from
  S3's XML error document), so ``errors.map_error`` maps it like any boto3 failure;
* retries: failures that ``map_error`` calls unavailable (connection errors, 5xx,
  throttling) are retried up to ``EC_S3_MAX_ATTEMPTS`` with botocore's "standard"
  backoff (full jitter, 50 ms base, 1 s for throttling).

Path-style addressing only (``client.ADDRESSING_STYLE``). The body is returned unread,
a urllib3 response read exactly as botocore's ``StreamingBody`` reads it.
"""

from __future__ import annotations

import random
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import botocore.exceptions as bce
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from app.tiers.s3.errors import S3Unavailable, is_throttling, map_error

#: botocore's standard retry mode: full jitter over min(base * 2**attempt, MAX_BACKOFF).
BASE_BACKOFF = 0.05
THROTTLING_BACKOFF = 1.0
MAX_BACKOFF = 20.0
#: Bytes of an error answer read for its XML document.
ERROR_BODY_BYTES = 64 * 1024


class SignedGet:
    """GETs of objects in ``bucket`` through the boto3 ``client``'s endpoint, region and
    connection pool, signed with ``credentials`` (None: none found; each GET then fails
    the way boto3 would)."""

    def __init__(
        self, client: Any, bucket: str, credentials: Credentials | None, max_attempts: int
    ) -> None:
        self._endpoint = client.meta.endpoint_url.rstrip("/")
        self._region: str = client.meta.region_name
        # botocore keeps its HTTP session on the client's endpoint; there is no public
        # accessor. Using it keeps one pool and one set of transport settings.
        self._http = client._endpoint.http_session
        self._bucket = bucket
        self._credentials = credentials
        self._max_attempts = max_attempts

    def get(self, key: str) -> tuple[Mapping[str, str], Any]:
        """The response headers and the unread body (a urllib3 response) of ``key``.
        Raises botocore's exceptions: ``ClientError`` for an error answer (a missing
        object included), connection errors after the last attempt."""
        attempt = 0
        while True:
            try:
                return self._get_once(key)
            except Exception as exc:
                attempt += 1
                if attempt >= self._max_attempts or not isinstance(
                    map_error(exc, "get"), S3Unavailable
                ):
                    raise
                scale = THROTTLING_BACKOFF if is_throttling(exc) else BASE_BACKOFF
                time.sleep(random.random() * min(scale * 2 ** (attempt - 1), MAX_BACKOFF))

    def _get_once(self, key: str) -> tuple[Mapping[str, str], Any]:
        if self._credentials is None:
            raise bce.NoCredentialsError()
        url = f"{self._endpoint}/{self._bucket}/{quote(key, safe='/~')}"
        request = AWSRequest(method="GET", url=url, headers={"x-amz-checksum-mode": "ENABLED"})
        S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self._region).add_auth(
            request
        )
        prepared = request.prepare()
        prepared.stream_output = True
        response = self._http.send(prepared)
        raw = response.raw
        if response.status_code == 200:
            return response.headers, raw
        try:
            document = raw.read(ERROR_BODY_BYTES)
        finally:
            raw.close()
        raise _client_error(response.status_code, response.headers, document)


def _client_error(status: int, headers: Mapping[str, str], document: bytes) -> bce.ClientError:
    """The ``ClientError`` boto3 raises for this error answer."""
    code, message = str(status), ""
    try:
        root = ET.fromstring(document)
    except ET.ParseError:
        pass
    else:
        code = root.findtext("Code") or code
        message = root.findtext("Message") or ""
    return bce.ClientError(
        {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": dict(headers)},
        },
        "GetObject",
    )
