"""Storage URIs: local paths and s3:// through pyarrow.fs, uploads through boto3
(against moto's server on 127.0.0.1)."""

from __future__ import annotations

import logging
import os

import boto3
import pyarrow.fs as pafs
import pytest

from splitvit.storage import (
    StorageError,
    exists,
    filesystem_for,
    is_s3,
    join_uri,
    list_files,
    read_bytes,
    s3_settings,
    split_s3_uri,
    upload_dir,
    write_bytes,
)


def test_uri_parsing():
    assert is_s3("s3://bucket/a/b") and not is_s3("/tmp/x") and not is_s3("bucket/s3://x")
    assert split_s3_uri("s3://bucket/a/b/") == ("bucket", "a/b")
    assert split_s3_uri("s3://bucket") == ("bucket", "")
    with pytest.raises(ValueError, match="s3:///key"):
        split_s3_uri("s3:///key")
    with pytest.raises(ValueError, match="gs://b/x"):
        filesystem_for("gs://b/x")
    assert join_uri("s3://b/p/", "train", "x.parquet") == "s3://b/p/train/x.parquet"
    assert join_uri("/data", "train") == os.path.join("/data", "train")


def test_local_filesystem_and_listing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = filesystem_for("rel/dir")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path / "rel" / "dir")
    write_bytes(str(tmp_path / "d" / "a.parquet"), b"A")
    write_bytes(str(tmp_path / "d" / "sub" / "b.parquet"), b"BB")
    write_bytes(str(tmp_path / "d" / "c.json"), b"{}")
    assert read_bytes(str(tmp_path / "d" / "sub" / "b.parquet")) == b"BB"
    assert list_files(str(tmp_path / "d"), ".parquet") == [
        str(tmp_path / "d" / "a.parquet"),
        str(tmp_path / "d" / "sub" / "b.parquet"),
    ]
    assert list_files(str(tmp_path / "d"), ".parquet", recursive=False) == [str(tmp_path / "d" / "a.parquet")]
    assert exists(str(tmp_path / "d")) and not exists(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="nope"):
        list_files(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        read_bytes(str(tmp_path / "missing.bin"))


def test_s3_settings_from_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://general:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:2")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    settings = s3_settings()
    assert settings.endpoint_url == "http://s3-only:2" and settings.region == "us-east-1"
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    assert s3_settings().endpoint_url == "http://general:1" and s3_settings().region == "eu-west-3"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    assert "very-secret-value" not in repr(s3_settings())


def test_s3_read_write_list(s3_bucket, caplog):
    caplog.set_level(logging.DEBUG)
    base = f"s3://{s3_bucket}/prefix"
    fs, path = filesystem_for(base)
    assert isinstance(fs, pafs.S3FileSystem) and path == f"{s3_bucket}/prefix"
    write_bytes(join_uri(base, "a.parquet"), b"hello")
    write_bytes(join_uri(base, "sub", "b.parquet"), b"world")
    write_bytes(join_uri(base, "c.txt"), b"!")
    assert read_bytes(join_uri(base, "sub", "b.parquet")) == b"world"
    assert list_files(base, ".parquet") == [f"{base}/a.parquet", f"{base}/sub/b.parquet"]
    assert list_files(base, ".parquet", recursive=False) == [f"{base}/a.parquet"]
    assert exists(base) and not exists(f"s3://{s3_bucket}/other")
    with pytest.raises(FileNotFoundError, match=f"s3://{s3_bucket}/other"):
        list_files(f"s3://{s3_bucket}/other")
    with pytest.raises((FileNotFoundError, StorageError), match="s3://no-such-bucket-x/k"):
        read_bytes("s3://no-such-bucket-x/k")
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in caplog.text


def test_upload_dir(s3_bucket, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-log-this-secret")  # moto accepts any credentials
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "src" / "sub" / "b.bin").write_bytes(b"y" * 5)
    result = upload_dir(tmp_path / "src", f"s3://{s3_bucket}/pre/fix")
    assert (result.files, result.bytes) == (2, 15)
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert keys == ["pre/fix/a.bin", "pre/fix/sub/b.bin"]
    assert client.get_object(Bucket=s3_bucket, Key="pre/fix/sub/b.bin")["Body"].read() == b"y" * 5
    # a missing bucket: one clear error naming the destination, no secret in it or in the logs
    with pytest.raises(StorageError, match="s3://missing-bucket-zz/p") as info:
        upload_dir(tmp_path / "src", "s3://missing-bucket-zz/p")
    assert "do-not-log-this-secret" not in str(info.value) and "do-not-log-this-secret" not in caplog.text
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        upload_dir(tmp_path / "nothing-here", f"s3://{s3_bucket}/x")
