"""The load test's servers use the S3 suite's fixtures (a real SeaweedFS, a prefix of
its own per test). The load test lives outside tests/s3 because it drives the SDK
(torch): tests/s3 runs in the image's test stage, which has neither."""

from tests.s3.conftest import make_server, s3_endpoint, s3_prefix

__all__ = ["make_server", "s3_endpoint", "s3_prefix"]
