"""Storage URIs: local paths and ``s3://bucket/prefix``.

Reads and listings go through ``pyarrow.fs`` (one API for both kinds of URI);
uploads of whole folders go through boto3. S3 settings come from the standard
environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``), so a
local S3-compatible endpoint (MinIO, moto) works the same as AWS. Credentials are
never logged or put into error messages.
"""

from __future__ import annotations

from .s3 import S3Settings, UploadResult, check_bucket, s3_client, s3_error_reason, s3_settings, upload_dir
from .uri import (
    StorageError,
    delete_file,
    exists,
    filesystem_for,
    is_s3,
    join_uri,
    list_files,
    makedirs,
    ray_storage,
    read_bytes,
    s3_filesystem,
    split_s3_uri,
    write_bytes,
)

__all__ = [
    "S3Settings",
    "StorageError",
    "check_bucket",
    "delete_file",
    "UploadResult",
    "exists",
    "filesystem_for",
    "is_s3",
    "join_uri",
    "list_files",
    "makedirs",
    "ray_storage",
    "read_bytes",
    "s3_client",
    "s3_error_reason",
    "s3_filesystem",
    "s3_settings",
    "split_s3_uri",
    "upload_dir",
    "write_bytes",
]
