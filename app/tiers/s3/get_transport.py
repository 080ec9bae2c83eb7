"""Which transport the read path's GET takes, and how it reads a large object.

``loop_get`` reads S3's answer on the event loop, over connections of its own to the
endpoint: the fast path, taken everywhere it can be. It does not speak to proxies, so
where ``HTTP_PROXY`` / ``HTTPS_PROXY`` (or the client's proxy configuration) puts a proxy
between the server and the endpoint, the GET goes through ``signed_get`` on botocore's
transport instead, which uses the proxy as boto3 would. Either is read in concurrent ranged parts
by ``ranged_get`` unless ``EC_S3_GET_CONCURRENCY`` is 1.
"""

from __future__ import annotations

from concurrent.futures import Executor

from botocore.config import Config

from app.settings import Settings
from app.tiers.s3.errors import standard_retries
from app.tiers.s3.http_session import S3Transport
from app.tiers.s3.loop_get import LoopGet
from app.tiers.s3.ranged_get import RangedGet, SpanGet
from app.tiers.s3.signed_get import SignedGet
from app.tiers.s3.signing import Signer


def ranged(get: SpanGet, settings: Settings) -> SpanGet | RangedGet:
    """``get`` reading large objects in ranged parts, unless ``EC_S3_GET_CONCURRENCY``
    is 1."""
    if settings.s3_get_concurrency <= 1:
        return get
    return RangedGet(
        get,
        settings.s3_get_part_size,
        settings.s3_get_concurrency,
        standard_retries(settings.s3_max_attempts),
        settings.s3_get_buffer_bytes,
    )


def object_get(
    transport: S3Transport,
    config: Config,
    signer: Signer,
    settings: Settings,
    executor: Executor,
) -> LoopGet | SignedGet:
    """The GET of the read path for ``transport``'s endpoint; ``config`` is the boto3
    client's, ``executor`` the S3 thread pool (``signed_get`` reads bodies on it)."""
    if transport.proxy_url:
        return SignedGet(
            transport.session,
            signer,
            settings.s3_max_attempts,
            executor,
            settings.s3_get_chunk_size,
        )
    return LoopGet(transport, config, signer, settings.s3_max_attempts, settings.s3_get_chunk_size)
