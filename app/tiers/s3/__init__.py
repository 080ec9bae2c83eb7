"""The S3 backend (any S3-compatible endpoint), in small modules:

* ``errors``: :class:`S3Error` / :class:`S3Unavailable` and the mapping of botocore failures;
* ``client``: the S3 client of one bucket: thread pool, metrics, circuit breaker,
  streaming download (object keys only);
* ``sigv4``: the read path's GET signed (SigV4, what botocore signs, by hand);
* ``loop_get``: the read path's GET, read on the event loop;
* ``signed_get``: the same GET on boto3's transport, for an endpoint behind a proxy;
* ``transfers``: single and multipart uploads with CRC32C checks;
* ``readiness``: bucket creation and the operator's diagnosis for ``/readyz``;
* ``backend``: :class:`S3Backend`, the :class:`app.tiers.base.Backend` the store uses
  (entry <-> object names and metadata, HEAD without the body, HTTP errors).

Nothing here imports the disk tier.
"""

from app.tiers.s3.backend import S3Backend
from app.tiers.s3.errors import S3Error, S3Unavailable

__all__ = ["S3Backend", "S3Error", "S3Unavailable"]
