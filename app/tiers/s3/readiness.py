"""Is the bucket usable, and if not, what should the operator fix?

:func:`check_ready` probes the endpoint and bucket with one attempt and short timeouts
and names the problem (unreachable, credentials, access denied, missing bucket) in words
an operator can act on; :func:`ensure_bucket` creates the bucket when
``EC_S3_CREATE_BUCKET`` asks for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import botocore.exceptions as bce

from app.tiers.s3.client import S3Client
from app.tiers.s3.errors import S3Unavailable, client_error_info, map_error, outage_reason

log = logging.getLogger(__name__)

_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
    }
)


@dataclass(frozen=True)
class Readiness:
    ok: bool
    reason: str
    #: "ok", "unreachable", "credentials", "access_denied", "no_bucket", "error"
    state: str


async def ensure_bucket(s3: S3Client) -> bool:
    """Create the bucket when it is missing and ``EC_S3_CREATE_BUCKET`` is set. Returns
    True when the bucket exists afterwards. Raises ``S3Error`` for other problems."""
    exists = await s3.call(
        "head_bucket",
        lambda: s3.client.head_bucket(Bucket=s3.bucket),
        not_found_ok=True,
        breaker=False,
    )
    if exists is not None:
        return True
    if not s3.settings.s3_create_bucket:
        return False
    region = s3.settings.s3_region

    def _create() -> None:
        kwargs: dict[str, Any] = {"Bucket": s3.bucket}
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            s3.client.create_bucket(**kwargs)
        except bce.ClientError as exc:
            code, _, _ = client_error_info(exc)
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    await s3.call("create_bucket", _create, breaker=False)
    log.info("created S3 bucket %s at %s", s3.bucket, s3.endpoint)
    return True


async def check_ready(s3: S3Client) -> Readiness:
    """Probe the endpoint and bucket (one attempt, short timeouts) and say what is
    wrong in words an operator can act on."""
    return await s3.run(lambda: _check_ready_sync(s3))


def _check_ready_sync(s3: S3Client) -> Readiness:
    endpoint = s3.endpoint
    where = f"{endpoint} bucket {s3.bucket!r}"
    client = s3.probe_client
    try:
        client.head_bucket(Bucket=s3.bucket)
    except Exception as exc:
        first = exc
    else:
        s3.breaker.mark_available()
        return Readiness(True, f"{where} reachable", "ok")
    if isinstance(first, bce.NoCredentialsError | bce.PartialCredentialsError):
        return Readiness(
            False,
            f"no AWS credentials found for {where}: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or another standard AWS credential source)",
            "credentials",
        )
    mapped = map_error(first, "head_bucket")
    if isinstance(mapped, S3Unavailable):
        s3.breaker.mark_unavailable(outage_reason(first))
        return Readiness(False, f"{where} unreachable: {mapped}", "unreachable")
    s3.breaker.mark_available()
    code, status, _ = (
        client_error_info(first) if isinstance(first, bce.ClientError) else ("", 0, "")
    )
    if status == 404 or code == "NoSuchBucket":
        return Readiness(
            False,
            f"bucket {s3.bucket!r} does not exist at {endpoint} "
            "(create it, or set EC_S3_CREATE_BUCKET=true)",
            "no_bucket",
        )
    if status in (400, 401, 403):
        # HEAD answers carry no error code; ask again with a request that has a body.
        try:
            client.list_objects_v2(Bucket=s3.bucket, MaxKeys=1, Prefix=s3.prefix)
            detail_code = code
        except bce.ClientError as exc2:
            detail_code, _, _ = client_error_info(exc2)
        except Exception:
            detail_code = code
        if detail_code in _CREDENTIAL_CODES:
            what = {
                "InvalidAccessKeyId": "the access key id is not known to the endpoint",
                "SignatureDoesNotMatch": "the secret access key is wrong",
                "AuthorizationHeaderMalformed": "the region or credentials are malformed",
            }.get(detail_code, "the session token is invalid or expired")
            return Readiness(
                False,
                f"wrong S3 credentials for {where}: {what} ({detail_code})",
                "credentials",
            )
        if detail_code == "NoSuchBucket":
            return Readiness(
                False,
                f"bucket {s3.bucket!r} does not exist (set EC_S3_CREATE_BUCKET=true to create it)",
                "no_bucket",
            )
        return Readiness(
            False,
            f"access denied to {where} ({detail_code or status}): check the credentials' "
            "permissions on the bucket",
            "access_denied",
        )
    return Readiness(False, f"{where}: {mapped}", "error")
