"""S3 settings from the environment and folder uploads with boto3."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class S3Settings:
    """Where S3 requests go. Deliberately holds no credentials, so it is safe to log."""

    endpoint_url: str | None
    region: str | None
    has_credentials: bool


def s3_settings() -> S3Settings:
    """Read the S3 endpoint and region from the environment.

    ``AWS_ENDPOINT_URL_S3`` wins over ``AWS_ENDPOINT_URL`` (the AWS SDKs' own rule);
    with a custom endpoint and no region, ``us-east-1`` is used, which is what
    S3-compatible servers expect.
    """
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or None
    if endpoint and not region:
        region = "us-east-1"
    has_credentials = bool(os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"))
    return S3Settings(endpoint_url=endpoint, region=region, has_credentials=has_credentials)


def s3_client(timeout: float | None = None) -> Any:
    """A boto3 S3 client for the configured endpoint and region (credentials: boto3's own
    chain); with ``timeout``, one that gives up after that many seconds and one attempt
    (checks that must answer in seconds)."""
    import boto3

    settings = s3_settings()
    config = None
    if timeout is not None:
        from botocore.config import Config

        config = Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 1, "mode": "standard"})
    return boto3.client("s3", endpoint_url=settings.endpoint_url, region_name=settings.region, config=config)


def s3_error_reason(exc: BaseException) -> str:
    """What a boto3 error means, in a few words (never credentials)."""
    from botocore.exceptions import ClientError, NoCredentialsError, ReadTimeoutError
    from botocore.exceptions import ConnectionError as EndpointDown  # refused, unresolved, connect timeout

    if isinstance(exc, NoCredentialsError):
        return "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile)"
    if isinstance(exc, (EndpointDown, ReadTimeoutError)):
        return f"the endpoint does not answer ({exc})"
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchBucket"):
            return "the bucket does not exist (create it first, e.g. `aws s3 mb`)"
        if code in (
            "403",
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "InvalidToken",
        ) or status in (401, 403):
            return f"the credentials were rejected or lack access (HTTP {status} {code})"
        return f"HTTP {status} {code} {error.get('Message', '')}".strip()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def check_bucket(s3_uri: str, *, client: Any = None) -> str:
    """Check that the bucket of ``s3_uri`` exists and the credentials reach it
    (one ``HeadBucket``); returns the endpoint asked ("AWS" by default).

    Raises ``StorageError`` naming the URI and the endpoint, and saying whether the
    endpoint does not answer, the bucket is missing or the credentials are rejected.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    from .uri import StorageError, split_s3_uri

    bucket, _ = split_s3_uri(s3_uri)
    client = client or s3_client()
    where = s3_settings().endpoint_url or "AWS"
    try:
        client.head_bucket(Bucket=bucket)
    except (ClientError, BotoCoreError) as exc:
        raise StorageError(
            f"{s3_uri}: bucket {bucket!r} is missing or not accessible at {where}: {s3_error_reason(exc)}"
        ) from exc
    return where


@dataclass
class UploadResult:
    """What ``upload_dir`` wrote."""

    source: str
    destination: str
    files: int
    bytes: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def upload_dir(local: str | os.PathLike, s3_uri: str, *, client: Any = None) -> UploadResult:
    """Upload every file under folder ``local`` to ``s3_uri`` keeping relative paths.

    Raises ``FileNotFoundError`` for a missing or empty folder and ``StorageError``
    naming the destination for a missing bucket or a failed upload.
    """
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    from .uri import StorageError, split_s3_uri

    root = Path(local)
    if not root.is_dir():
        raise FileNotFoundError(f"{local}: no such folder to upload")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        raise FileNotFoundError(f"{local}: folder has no files to upload")
    bucket, prefix = split_s3_uri(s3_uri)
    client = client or s3_client()
    check_bucket(s3_uri, client=client)
    start = time.perf_counter()
    total = 0
    for path in files:
        key = "/".join(x for x in (prefix, path.relative_to(root).as_posix()) if x)
        try:
            client.upload_file(str(path), bucket, key)
        except (ClientError, BotoCoreError, S3UploadFailedError) as exc:
            raise StorageError(f"s3://{bucket}/{key}: upload of {path} failed: {exc}") from exc
        total += path.stat().st_size
        log.debug("uploaded %s -> s3://%s/%s", path, bucket, key)
    result = UploadResult(
        source=str(root), destination=s3_uri, files=len(files), bytes=total, seconds=time.perf_counter() - start
    )
    log.info("uploaded %d files (%d bytes) from %s to %s", result.files, result.bytes, root, s3_uri)
    return result
