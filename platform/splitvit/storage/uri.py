"""Local paths and ``s3://`` URIs through one ``pyarrow.fs`` interface."""

from __future__ import annotations

import logging
import os
from urllib.parse import urlparse

import pyarrow.fs as pafs

from .s3 import s3_settings

log = logging.getLogger(__name__)


class StorageError(OSError):
    """A storage operation failed; the message names the URI (never credentials)."""


def is_s3(uri: str) -> bool:
    """True for ``s3://bucket/...`` URIs."""
    return str(uri).startswith("s3://")


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``; a ValueError naming the URI otherwise."""
    if not is_s3(uri):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    rest = uri[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"s3 URI without a bucket: {uri!r}")
    return bucket, key.strip("/")


def _local_path(uri: str) -> str:
    if uri.startswith("file://"):
        uri = urlparse(uri).path
    return os.path.abspath(os.path.expanduser(uri))


def s3_filesystem() -> pafs.S3FileSystem:
    """A pyarrow ``S3FileSystem`` with the project's S3 settings: the endpoint and region
    of :func:`s3_settings`, credentials from the environment (else the SDK's own chain)."""
    settings = s3_settings()
    kwargs: dict = {}
    if settings.endpoint_url:
        parsed = urlparse(
            settings.endpoint_url if "://" in settings.endpoint_url else f"https://{settings.endpoint_url}"
        )
        kwargs["endpoint_override"] = parsed.netloc
        kwargs["scheme"] = parsed.scheme or "https"
    if settings.region:
        kwargs["region"] = settings.region
    # Credentials go straight from the environment to the SDK; they are never stored or logged.
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        kwargs["access_key"] = key
        kwargs["secret_key"] = secret
        if os.environ.get("AWS_SESSION_TOKEN"):
            kwargs["session_token"] = os.environ["AWS_SESSION_TOKEN"]
    log.debug(
        "S3 filesystem: endpoint=%s region=%s", settings.endpoint_url or "(AWS default)", settings.region or "(default)"
    )
    return pafs.S3FileSystem(**kwargs)


def filesystem_for(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem for ``uri`` and the path inside it.

    ``s3://bucket/prefix`` gives an ``S3FileSystem`` (endpoint, region and credentials
    from the environment) and ``"bucket/prefix"``; anything else is a local path
    (``file://`` accepted), made absolute.
    """
    uri = str(uri)
    if is_s3(uri):
        bucket, key = split_s3_uri(uri)
        return s3_filesystem(), f"{bucket}/{key}" if key else bucket
    if "://" in uri and not uri.startswith("file://"):
        raise ValueError(f"unsupported storage URI {uri!r}: expected a local path or s3://bucket/prefix")
    return pafs.LocalFileSystem(), _local_path(uri)


def ray_storage(uri: str) -> tuple[str, pafs.FileSystem | None]:
    """``storage_path`` and ``storage_filesystem`` for a Ray ``RunConfig`` storing at ``uri``.

    For ``s3://bucket/prefix``: ``("bucket/prefix", S3FileSystem)`` with the project's
    S3 settings, so Ray writes checkpoints with the same endpoint, region and credentials
    as everything else here, not with a filesystem pyarrow infers from the URI on its
    own. Ray expects the path without its scheme when it is given a filesystem.
    A local path is returned as it is, with no filesystem (Ray's default is right there).
    """
    uri = str(uri)
    if is_s3(uri):
        bucket, key = split_s3_uri(uri)
        return (f"{bucket}/{key}" if key else bucket), s3_filesystem()
    return uri, None


def join_uri(base: str, *parts: str) -> str:
    """Join path parts onto a local path or an ``s3://`` URI."""
    base = str(base)
    if is_s3(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts if p)])
    return os.path.join(base, *parts)


def _wrap(uri: str, action: str, exc: Exception) -> Exception:
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(f"{uri}: not found ({action})")
    return StorageError(f"{uri}: {action} failed: {exc}")


def exists(uri: str) -> bool:
    """True when ``uri`` is an existing file or folder (an S3 prefix with objects counts)."""
    fs, path = filesystem_for(uri)
    try:
        return fs.get_file_info(path).type != pafs.FileType.NotFound
    except OSError as exc:
        raise _wrap(uri, "stat", exc) from exc


def list_files(uri: str, suffix: str | tuple[str, ...] = "", *, recursive: bool = True) -> list[str]:
    """Files under ``uri`` (in subfolders too unless ``recursive=False``) whose names end
    with ``suffix``, as sorted URIs.

    A missing folder or empty S3 prefix raises ``FileNotFoundError`` naming ``uri``.
    """
    fs, path = filesystem_for(uri)
    suffixes = (suffix,) if isinstance(suffix, str) else tuple(suffix)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=recursive, allow_not_found=False))
    except OSError as exc:
        raise _wrap(uri, "list", exc) from exc
    base = str(uri).rstrip("/")
    out = []
    for info in infos:
        if info.type != pafs.FileType.File or not info.base_name.endswith(suffixes):
            continue
        rel = info.path[len(path.rstrip("/")) + 1 :]
        out.append(join_uri(base, rel) if is_s3(base) else os.path.join(_local_path(base), rel))
    return sorted(out)


def read_bytes(uri: str) -> bytes:
    """The whole content of file ``uri``."""
    fs, path = filesystem_for(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except OSError as exc:
        raise _wrap(uri, "read", exc) from exc


def makedirs(uri: str) -> None:
    """Create folder ``uri`` (and parents) where the filesystem has folders; a no-op on S3."""
    if is_s3(uri):
        return  # S3 prefixes exist as soon as an object is written under them
    fs, path = filesystem_for(uri)
    try:
        fs.create_dir(path, recursive=True)
    except OSError as exc:
        raise _wrap(uri, "create folder", exc) from exc


def write_bytes(uri: str, data: bytes) -> None:
    """Write ``data`` to file ``uri``, replacing it; local parent folders are created."""
    fs, path = filesystem_for(uri)
    try:
        if not is_s3(uri):
            fs.create_dir(os.path.dirname(path), recursive=True)
        with fs.open_output_stream(path) as f:
            f.write(data)
    except OSError as exc:
        raise _wrap(uri, "write", exc) from exc


def delete_file(uri: str) -> None:
    """Delete file ``uri``."""
    fs, path = filesystem_for(uri)
    try:
        fs.delete_file(path)
    except OSError as exc:
        raise _wrap(uri, "delete", exc) from exc
