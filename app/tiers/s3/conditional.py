"""Does the configured store honour S3's conditional write (``If-None-Match: *``)?

Entries are immutable and the first writer wins, also between replicas sharing a
bucket. S3 settles that race itself when a write carries ``If-None-Match: *``: it
stores the object only if the key has none, and answers ``412 PreconditionFailed``
otherwise (AWS S3 on ``PutObject`` and ``CompleteMultipartUpload``; SeaweedFS 4.48 on
both, checked by ``tests/s3/test_conditional_writes.py``). A store that ignores the
header overwrites, one that does not know it may refuse the request, so the backend
sends it only where :func:`probe` found it honoured, operation by operation, at
start-up; elsewhere it asks first (``HEAD``), which leaves a window in which two
writers both store (docs/s3.md says what holds then).

The probe writes one small object twice under ``{prefix}/_ec-probe/`` (a name of its
own per probe, so replicas starting together never meet) with a single ``PutObject``,
then once more with a one-part multipart upload, and deletes it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import botocore.exceptions as bce

from app.tiers.s3.client import S3Client
from app.tiers.s3.errors import client_error_info

log = logging.getLogger(__name__)

PROBE_PREFIX = "_ec-probe"


@dataclass(frozen=True)
class ConditionalWrites:
    """Which writes of the store honour ``If-None-Match: *``."""

    put: bool
    complete_multipart: bool


#: Before a probe succeeded (S3 unreachable at start-up): ask first, send no header.
UNKNOWN = ConditionalWrites(put=False, complete_multipart=False)


async def probe(s3: S3Client) -> ConditionalWrites:
    """Find out, with a few small requests (one attempt each, short timeouts); raises
    botocore's exceptions when the store cannot be reached or refuses the writes."""
    return await s3.run(lambda: _probe_sync(s3))


def _probe_sync(s3: S3Client) -> ConditionalWrites:
    client = s3.probe_client
    key = f"{s3.prefix}/{PROBE_PREFIX}/{uuid.uuid4().hex}" if s3.prefix else uuid.uuid4().hex
    try:
        put = honours_if_none_match(
            lambda: client.put_object(Bucket=s3.bucket, Key=key, Body=b"1", IfNoneMatch="*")
        )
        complete = honours_if_none_match(lambda: _multipart(client, s3.bucket, key))
    finally:
        client.delete_object(Bucket=s3.bucket, Key=key)
    return ConditionalWrites(put=put, complete_multipart=complete)


def _multipart(client: Any, bucket: str, key: str) -> None:
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    try:
        part = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"2"
        )
        client.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
            IfNoneMatch="*",
        )
    except BaseException:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        raise


def honours_if_none_match(write: Callable[[], object]) -> bool:
    """Whether ``write``, a conditional write of one key made twice (so the key has an
    object by the second at the latest), is refused with 412. Taken twice (the store
    ignored the header) or the header refused (400, 501): not honoured; any other
    failure is raised (the probe failed)."""
    try:
        write()
        write()
    except bce.ClientError as exc:
        code, status, _ = client_error_info(exc)
        if status == 412 or code == "PreconditionFailed":
            return True
        if status in (400, 501) or code in ("NotImplemented", "InvalidArgument"):
            return False
        raise
    return False
