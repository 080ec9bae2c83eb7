"""The S3 backend (any S3-compatible endpoint), in small modules:

* ``backend``: :class:`S3Backend`, the :class:`app.tiers.base.Backend` the store uses
  (entry <-> object names and metadata, HEAD without the body, HTTP errors);
* ``client``: the S3 client of one bucket: thread pool, metrics, error mapping, the
  calls (object keys only);
* ``breaker``: the circuit breaker that fails calls fast while the endpoint is down;
* ``errors``: :class:`S3Error` / :class:`S3Unavailable`, the mapping of botocore
  failures, and botocore's "standard" retry policy (``app.retries`` retries);
* ``objects``: what S3 says about an object (size, CRC32C, metadata), parsed;
* ``download``: an open GET, its body read in chunks;
* ``data_plane``: :class:`S3DataPlane`, the one way GETs, ranged GETs, PUTs and part
  uploads reach S3, its HTTP layer chosen once (boto3 keeps the control plane);
* ``botocore_adapter``: the one door to botocore's internals and the check of its
  version (another botocore: the data plane is plain boto3 calls);
* ``ranged_get``: a large object's GET as concurrent ranged GETs, handed on in order;
* ``loop_get``: the data plane's GET read on the event loop (no proxy);
* ``signed_http``: the data plane's requests on botocore's pool: uploads, and GETs
  behind a proxy;
* ``http_session``: the transport of the data plane's requests, made as boto3's is;
* ``signing``: SigV4 of those requests (botocore's ``S3SigV4Auth``);
* ``transfers``: single, multipart and streaming uploads with CRC32C checks;
* ``readiness``: bucket creation and the operator's diagnosis for ``/readyz``.

Nothing here imports the disk tier.
"""

from app.tiers.s3.backend import S3Backend
from app.tiers.s3.errors import S3Error, S3Unavailable

__all__ = ["S3Backend", "S3Error", "S3Unavailable"]
