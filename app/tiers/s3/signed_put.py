"""The single-part upload (``PutObject``) on botocore's transport: one request signed by
botocore's ``S3SigV4Auth`` (``signing``), sent on a botocore connection pool
(``http_session``).

Every write-back upload, every write-through PUT below the multipart threshold and every
small object goes through here. boto3's ``put_object`` spends about 1 ms of CPU per call
on its request pipeline (parameter validation, endpoint rules, event hooks, response
parsing), in the server's process and under its GIL: measured per 4.7 MB upload of a
cached file, 3.6 ms of process CPU through ``put_object`` against 2.8 ms through this.
This PUT keeps what matters from botocore and drops the rest:

* the request is the one boto3 sends (same headers, checksum and metadata), signed by
  botocore's ``S3SigV4Auth`` with the client's configuration (payload signing off:
  ``UNSIGNED-PAYLOAD``; the CRC32C header, which S3 verifies, is signed). One
  difference: boto3 asks for ``100 Continue`` before every body, this PUT only before
  one above ``EXPECT_CONTINUE_ABOVE``, where not sending a refused body is worth a
  round trip;
* transport: a ``URLLib3Session`` made as the boto3 client's is (TLS, proxies,
  timeouts, pool size), so its exceptions are botocore's;
* errors: a non-2xx answer becomes the ``ClientError`` boto3 raises
  (``errors.client_error``), so ``errors.map_error`` maps it like any boto3 failure;
* retries: ``app.retries.retried`` with ``errors.standard_retries`` (botocore's
  "standard" mode) up to ``max_attempts``,
  the body rewound for each; a body that cannot be rewound (a streaming upload's
  pipe) gets one attempt.

Path-style addressing only (``client.ADDRESSING_STYLE``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.retries import retried
from app.tiers.s3.botocore_adapter import AWSRequest, URLLib3Session
from app.tiers.s3.errors import ERROR_BODY_BYTES, client_error, standard_retries
from app.tiers.s3.signing import Signer

#: A body above this size waits for ``100 Continue`` (S3's go-ahead after checking the
#: signature and the request) before it is sent, so a refused upload is not sent whole.
EXPECT_CONTINUE_ABOVE = 1024 * 1024


class SignedPut:
    """Single PUTs signed by ``signer``, sent on ``http`` (a botocore ``URLLib3Session``)."""

    def __init__(self, http: URLLib3Session, signer: Signer, max_attempts: int) -> None:
        self._http = http
        self._signer = signer
        self._retries = standard_retries(max_attempts)
        self._no_retries = standard_retries(1)

    def put(
        self,
        key: str,
        body: Any,
        size: int,
        *,
        content_type: str,
        checksum_crc32c: str,
        metadata: Mapping[str, str],
        if_absent: bool = False,
    ) -> None:
        """PUT ``size`` bytes of ``body`` as ``key``: a file-like object (``read``,
        ``seekable``; when seekable, ``tell`` and ``seek`` rewind it for a retry).
        ``if_absent``: only if the key has no object (``If-None-Match: *``; S3 answers
        412 otherwise). Raises botocore's exceptions, as ``put_object`` would.
        Blocking: call it on the S3 thread pool."""
        headers = {
            "Content-Length": str(size),
            "Content-Type": content_type,
            "x-amz-sdk-checksum-algorithm": "CRC32C",
            "x-amz-checksum-crc32c": checksum_crc32c,
            **{f"x-amz-meta-{name}": value for name, value in metadata.items()},
        }
        if if_absent:
            headers["If-None-Match"] = "*"
        if size > EXPECT_CONTINUE_ABOVE:
            headers["Expect"] = "100-continue"
        rewindable = body.seekable()
        start = body.tell() if rewindable else 0
        retried(
            lambda: self._put_once(key, headers, body),
            self._retries if rewindable else self._no_retries,
            lambda: body.seek(start),
        )

    def _put_once(self, key: str, headers: Mapping[str, str], body: Any) -> None:
        signed = self._signer.put(key, headers, body)
        request = AWSRequest(method="PUT", url=signed.url, headers=signed.headers, data=body)
        # Read whole (an answer to a PUT is empty, or a short error document), so the
        # connection goes back to the pool.
        response = self._http.send(request.prepare())
        if response.status_code >= 300:
            document = response.content[:ERROR_BODY_BYTES]
            raise client_error(response.status_code, response.headers, document, "PutObject")
