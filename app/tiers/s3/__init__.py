"""The S3 backend (any S3-compatible endpoint), in small modules:

* ``errors``: :class:`S3Error` / :class:`S3Unavailable` and the mapping of botocore failures;
* ``client``: the S3 client of one bucket: thread pool, metrics, circuit breaker,
  streaming download (object keys only);
* ``http_session``: the transport of the tier's own requests, made as boto3's is;
* ``signing``: SigV4 of those requests (botocore's ``S3SigV4Auth``);
* ``loop_get``: the read path's GET, read on the event loop;
* ``signed_get``: the same GET on botocore's transport, for an endpoint behind a proxy;
* ``signed_put``: the single-part upload, without boto3's per-call pipeline;
* ``transfers``: single and multipart uploads with CRC32C checks;
* ``readiness``: bucket creation and the operator's diagnosis for ``/readyz``;
* ``backend``: :class:`S3Backend`, the :class:`app.tiers.base.Backend` the store uses
  (entry <-> object names and metadata, HEAD without the body, HTTP errors).

Nothing here imports the disk tier.
"""

from app.tiers.s3.backend import S3Backend
from app.tiers.s3.errors import S3Error, S3Unavailable

__all__ = ["S3Backend", "S3Error", "S3Unavailable"]
