"""The CLI against servers with an S3 tier uses the S3 suite's fixtures (a real
SeaweedFS, a prefix of its own per test). It lives outside tests/s3 because the CLI
needs the SDK (torch), and outside tests/client because the SDK's floor venv (make
sdk-floor-tests) has no S3 server."""

from tests.s3.conftest import make_server, s3_control, s3_endpoint, s3_prefix

__all__ = ["make_server", "s3_control", "s3_endpoint", "s3_prefix"]
