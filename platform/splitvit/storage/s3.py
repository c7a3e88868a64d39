"""S3 settings from the environment and folder uploads with boto3."""

from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

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


def s3_client(timeout: float | None = None, *, max_pool_connections: int | None = None) -> Any:
    """A boto3 S3 client for the configured endpoint and region (credentials: boto3's own
    chain); with ``timeout``, one that gives up after that many seconds and one attempt
    (checks that must answer in seconds); ``max_pool_connections`` for a client shared by
    that many threads (botocore keeps 10 otherwise and warns when more are in use)."""
    import boto3
    from botocore.config import Config

    settings = s3_settings()
    options: dict[str, Any] = {}
    if timeout is not None:
        options.update(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 1, "mode": "standard"})
    if max_pool_connections is not None:
        options["max_pool_connections"] = max_pool_connections
    config = Config(**options) if options else None
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

    def as_dict(self) -> dict[str, str | int | float]:
        return dict(self.__dict__)


class _UploadProgress:
    """Upload progress: an updating bar on ``stream`` when it is a terminal, otherwise
    (a log file, CI) an INFO log line every ``every`` files and one at the end, so logs
    stay short."""

    def __init__(self, total_files: int, total_bytes: int, destination: str, stream: TextIO, every: int) -> None:
        self.total_files, self.total_bytes, self.stream, self.every = total_files, total_bytes, stream, max(1, every)
        self.files = self.bytes = 0
        self.bar = None
        isatty = getattr(stream, "isatty", None)
        if isatty is not None and isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"push -> {destination}", file=stream)

    def update(self, size: int) -> None:
        self.files += 1
        self.bytes += size
        if self.bar is not None:
            self.bar.update(size)
        elif self.files % self.every == 0 or self.files == self.total_files:
            log.info("uploaded %d/%d files, %d/%d bytes", self.files, self.total_files, self.bytes, self.total_bytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def upload_dir(
    local: str | os.PathLike,
    s3_uri: str,
    *,
    client: Any = None,
    workers: int = 8,
    progress: bool = False,
    progress_every: int = 100,
    stream: TextIO | None = None,
) -> UploadResult:
    """Upload every file under folder ``local`` to ``s3_uri`` keeping relative paths.

    ``workers`` files go up at once (one boto3 client, which is thread-safe; large
    files are additionally split into parts by boto3's transfer manager). With
    ``progress``: a bar on ``stream`` (default stderr) when it is a terminal, else an
    INFO log line every ``progress_every`` files.

    Raises ``FileNotFoundError`` for a missing or empty folder and ``StorageError``
    naming the destination for a missing bucket, and the file and its key for a failed
    upload (the first failure stops the files not yet started).
    """
    from boto3.s3.transfer import TransferConfig

    from .uri import split_s3_uri

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    root = Path(local)
    if not root.is_dir():
        raise FileNotFoundError(f"{local}: no such folder to upload")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        raise FileNotFoundError(f"{local}: folder has no files to upload")
    bucket, prefix = split_s3_uri(s3_uri)
    # the pool holds a connection per concurrent request: files at once x parts at once
    parts_at_once = 4
    client = client or s3_client(max_pool_connections=workers * parts_at_once + 2)
    check_bucket(s3_uri, client=client)
    transfer = TransferConfig(
        multipart_threshold=64 * 2**20, multipart_chunksize=16 * 2**20, max_concurrency=parts_at_once
    )
    sizes = {path: path.stat().st_size for path in files}
    bar = (
        _UploadProgress(len(files), sum(sizes.values()), s3_uri, stream or sys.stderr, progress_every)
        if progress
        else None
    )
    start = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=min(workers, len(files)), thread_name_prefix="s3-upload")
    try:
        futures = {pool.submit(_upload_one, client, path, root, bucket, prefix, transfer): path for path in files}
        for future in as_completed(futures):
            future.result()  # raises the first failure, naming its file
            if bar is not None:
                bar.update(sizes[futures[future]])
    finally:
        # on a failure, files not yet started are dropped rather than uploaded behind the error
        pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
    result = UploadResult(
        source=str(root),
        destination=s3_uri,
        files=len(files),
        bytes=sum(sizes.values()),
        seconds=time.perf_counter() - start,
    )
    log.info("uploaded %d files (%d bytes) from %s to %s", result.files, result.bytes, root, s3_uri)
    return result


def _upload_one(client: Any, path: Path, root: Path, bucket: str, prefix: str, transfer: Any) -> None:
    """Upload one file; a failure is a ``StorageError`` naming the file and its key."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    from .uri import StorageError

    key = "/".join(x for x in (prefix, path.relative_to(root).as_posix()) if x)
    try:
        client.upload_file(str(path), bucket, key, Config=transfer)
    except (ClientError, BotoCoreError, S3UploadFailedError, OSError) as exc:
        raise StorageError(f"s3://{bucket}/{key}: upload of {path} failed: {exc}") from exc
    log.debug("uploaded %s -> s3://%s/%s", path, bucket, key)
