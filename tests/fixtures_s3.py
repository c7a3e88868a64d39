"""S3 for tests: moto's server mode on 127.0.0.1, as Ray's own tests do.

``s3_endpoint`` (session) starts the server on a free port and points the AWS
environment variables at it for the session; ``s3_bucket`` makes a fresh bucket.
"""

from __future__ import annotations

import logging
import uuid

import pytest

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Variables that would send requests elsewhere or mix in real credentials.
_UNSET = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_REGION")


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a local S3-compatible server; AWS_* variables point at it during the session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    patch = pytest.MonkeyPatch()
    for key in _UNSET:
        patch.delenv(key, raising=False)
    for key, value in _ENV.items():
        patch.setenv(key, value)
    patch.setenv("AWS_ENDPOINT_URL", endpoint)
    try:
        yield endpoint
    finally:
        patch.undo()
        server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """Name of a new, empty bucket on the local endpoint."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name=_ENV["AWS_DEFAULT_REGION"]).create_bucket(Bucket=name)
    return name
