"""Data that scales: the row-group-aware shuffle of parquet shards, read amplification
on S3 (the data benchmark), Ray's storage filesystem, parallel uploads with progress."""

from __future__ import annotations

import io
import json
import logging
import re

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from splitvit.bench.data import AMPLIFICATION_TARGET, CountingFileSystem, DataBenchSettings, run_data_benchmark
from splitvit.cli import main
from splitvit.config import PolicyConfig
from splitvit.data import ParquetShards, SyntheticObjects, write_shards
from splitvit.data.parquet import RowGroupSampler, training_sampler
from splitvit.storage import StorageError, filesystem_for, ray_storage, upload_dir


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """150 rows in 3 shards of 50, row groups of 8 (7 groups a shard, the last one of 2 rows)."""
    out = tmp_path_factory.mktemp("shards")
    write_shards(SyntheticObjects(150, image_size=16, object_size=4, seed=3), str(out), 50, row_group_size=8)
    return str(out)


def _groups_of(ds: ParquetShards, indices) -> np.ndarray:
    return ds.row_group_of_items()[np.asarray(indices, dtype=np.int64)]


def test_row_group_sampler_yields_every_item_once_per_epoch_and_reshuffles(shards):
    ds = ParquetShards(shards, cache_row_groups=3)
    assert ds.num_row_groups == 21
    sampler = RowGroupSampler(ds, seed=5)
    first = list(sampler)
    assert sorted(first) == list(range(150)) and len(sampler) == 150
    assert list(RowGroupSampler(ds, seed=5)) == first  # deterministic per seed and epoch
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(second) == list(range(150)) and second != first
    assert list(RowGroupSampler(ds, seed=6)) != first
    # rows are shuffled within windows of 3 row groups: a window's groups come and go together
    groups = _groups_of(ds, first)
    seen_groups = list(dict.fromkeys(groups.tolist()))  # groups in the order they first appear
    assert sorted(seen_groups) == list(range(21)) and seen_groups != sorted(seen_groups)
    for k in range(0, 21, 3):
        window = set(seen_groups[k : k + 3])
        positions = np.flatnonzero(np.isin(groups, list(window)))
        assert positions.max() - positions.min() + 1 == len(positions)  # contiguous in the stream
    assert not all(np.all(np.diff(groups[i : i + 8]) == 0) for i in range(0, 144, 8))  # mixed, not group order


def test_row_group_sampler_splits_ranks_and_loader_workers_by_row_group(shards):
    ds = ParquetShards(shards)
    world, batch, workers = 2, 10, 2
    per_rank = [
        RowGroupSampler(ds, world, rank, seed=1, drop_last=True, batch_size=batch, loader_workers=workers)
        for rank in range(world)
    ]
    orders = [list(s) for s in per_rank]
    assert [len(o) for o in orders] == [75, 75] == [len(s) for s in per_rank]
    assert not set(orders[0]) & set(orders[1]) and len(set(orders[0]) | set(orders[1])) == 150
    rank_groups = [set(_groups_of(ds, o).tolist()) for o in orders]
    assert len(rank_groups[0] & rank_groups[1]) <= 1  # only the group at the slice boundary is shared
    for order in orders:
        # DataLoader worker k takes batches k, k + workers, ...: their row groups must not overlap
        batches = [order[i : i + batch] for i in range(0, len(order), batch)]
        by_worker = [set(_groups_of(ds, [i for b in batches[k::workers] for i in b]).tolist()) for k in range(workers)]
        assert len(by_worker[0] & by_worker[1]) <= 1
    padded = RowGroupSampler(ds, 4, 3, seed=1, drop_last=False)
    assert len(list(padded)) == len(padded) == 38  # ceil(150 / 4), padded by repeating as DistributedSampler


def test_row_group_sampler_checks_its_window_and_picks_itself_for_parquet(shards):
    ds = ParquetShards(shards, cache_row_groups=2)
    with pytest.raises(ValueError, match="window must be in 1..cache_row_groups"):
        RowGroupSampler(ds, window=3)
    assert isinstance(training_sampler(ds, batch_size=4), RowGroupSampler)
    other = training_sampler(SyntheticObjects(10, image_size=16, object_size=4))
    assert type(other) is torch.utils.data.DistributedSampler
    with pytest.raises(TypeError, match="ParquetShards"):
        RowGroupSampler(SyntheticObjects(10, image_size=16, object_size=4))


def test_row_group_sampler_with_a_corrupt_shard_skips_it(shards, tmp_path, caplog):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    bad = copy / "shard-00001.parquet"
    bad.write_bytes(bad.read_bytes()[:100])  # truncated: no footer
    ds = ParquetShards(str(copy))
    assert ds.skipped_files == [str(bad)] and len(ds) == 100
    loader = DataLoader(ds, batch_size=10, sampler=training_sampler(ds, seed=0, batch_size=10))
    labels = torch.cat([b[1] for b in loader])
    assert len(labels) == 100


def test_loader_workers_read_each_row_group_once(shards):
    """Two DataLoader worker processes with their own caches still read ~1x (counted in
    shared memory across the forked workers)."""
    ds = ParquetShards(shards)
    counter = CountingFileSystem(filesystem_for(shards)[0])
    ds.filesystem = counter.filesystem()
    sampler = training_sampler(ds, seed=2, batch_size=5, loader_workers=2)
    loader = DataLoader(ds, batch_size=5, sampler=sampler, num_workers=2, drop_last=True)
    assert sum(len(b[0]) for b in loader) == 150
    dataset_bytes = sum(s.bytes for s in ds.manifest.shards)
    assert counter.bytes_read / dataset_bytes <= AMPLIFICATION_TARGET
    # one read per row group, plus the group at the boundary of the two workers' runs
    assert counter.reads <= ds.num_row_groups + 1


def test_data_benchmark_reads_s3_about_once_per_epoch(s3_endpoint, tmp_path):
    """Many row groups (48 of 8 rows): the row-group shuffle reads each about once; the old
    global shuffle over the same S3 data would miss the target by far."""
    settings = DataBenchSettings(
        samples=384, image_size=32, rows_per_shard=96, row_group_size=8, batch_size=16, global_shuffle=True
    )
    result = run_data_benchmark(settings)
    s3 = result.path("s3 parquet")
    assert result.row_groups == 48 and s3.images == 384
    assert s3.amplification <= AMPLIFICATION_TARGET and result.passed
    assert result.path("local parquet").amplification <= AMPLIFICATION_TARGET
    assert result.path("s3 parquet, global shuffle (old)").amplification > 3 * AMPLIFICATION_TARGET
    assert result.path("local imagefolder").images == 384
    assert all(p.images_per_s > 0 for p in result.paths)


def test_bench_data_command_prints_ratios_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "data",
            "--samples",
            "96",
            "--image-size",
            "16",
            "--rows-per-shard",
            "48",
            "--row-group-size",
            "8",
            "--no-imagefolder",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "bytes read per epoch / dataset bytes" in text and "(target <= 1.5): ok" in text
    assert "s3 parquet / local parquet images/s" in text
    figures = json.loads(out.read_text())
    assert figures["passed"] is True and [p["name"] for p in figures["paths"]] == ["s3 parquet", "local parquet"]
    with pytest.raises(SystemExit) as stopped:  # a model option is an error, not ignored
        main(["bench", "data", "--depth", "2"])
    assert stopped.value.code == 2 and "unrecognized arguments: --depth 2" in capsys.readouterr().err


def test_ray_run_config_gets_the_projects_s3_filesystem(s3_bucket, s3_endpoint, tmp_path):
    import boto3

    from splitvit.config import ExperimentConfig
    from splitvit.train.ray_trainer import _torch_trainer

    assert ray_storage(str(tmp_path)) == (str(tmp_path), None)
    config = ExperimentConfig.from_dict({"storage": {"path": f"s3://{s3_bucket}/experiments", "name": "run"}}, [])
    run_config = _torch_trainer(config, config.storage.resolved_path(), None, None, None).run_config
    assert run_config.storage_path == f"{s3_bucket}/experiments"  # Ray wants it without the scheme
    # the filesystem reaches the local endpoint with the project's settings: what it writes lands there
    with run_config.storage_filesystem.open_output_stream(f"{s3_bucket}/experiments/probe.txt") as f:
        f.write(b"from ray's filesystem")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    assert client.get_object(Bucket=s3_bucket, Key="experiments/probe.txt")["Body"].read() == b"from ray's filesystem"


def test_parallel_upload_lands_every_file_and_reports_progress(s3_bucket, s3_endpoint, tmp_path, caplog):
    import boto3

    src = tmp_path / "src"
    for i in range(25):
        (src / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 3}" / f"f{i:02d}.bin").write_bytes(bytes([i]) * (100 + i))
    stream = io.StringIO()  # not a terminal: a log line every 10 files and one at the end
    with caplog.at_level(logging.INFO, logger="splitvit.storage"):
        result = upload_dir(src, f"s3://{s3_bucket}/up", workers=4, progress=True, progress_every=10, stream=stream)
    assert result.files == 25 and result.bytes == sum(100 + i for i in range(25))
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for i in range(25):
        key = f"up/d{i % 3}/f{i:02d}.bin"
        assert client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == bytes([i]) * (100 + i)
    lines = [m for m in (r.getMessage() for r in caplog.records) if re.match(r"uploaded \d+/\d+ files", m)]
    assert [line.split()[1] for line in lines] == ["10/25", "20/25", "25/25"] and stream.getvalue() == ""
    terminal = _Terminal()  # a terminal: one updating bar (carriage returns), up to every byte
    upload_dir(src, f"s3://{s3_bucket}/again", workers=4, progress=True, stream=terminal)
    assert f"push -> s3://{s3_bucket}/again" in terminal.getvalue() and "\r" in terminal.getvalue()
    assert "100%" in terminal.getvalue()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _FailsOn:
    """A boto3 client whose upload of one file fails (the others go through)."""

    def __init__(self, client, name: str) -> None:
        self.client, self.name = client, name

    def __getattr__(self, attr):
        return getattr(self.client, attr)

    def upload_file(self, filename, bucket, key, **kwargs):
        if filename.endswith(self.name):
            from botocore.exceptions import ClientError

            raise ClientError({"Error": {"Code": "InternalError", "Message": "boom"}}, "PutObject")
        return self.client.upload_file(filename, bucket, key, **kwargs)


def test_failed_upload_names_its_file(s3_bucket, s3_endpoint, tmp_path, capsys):
    import boto3

    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.bin", "bad.bin", "c.bin"):
        (src / name).write_bytes(b"x")
    client = _FailsOn(boto3.client("s3", endpoint_url=s3_endpoint), "bad.bin")
    with pytest.raises(StorageError, match=f"s3://{s3_bucket}/p/bad.bin: upload of {src / 'bad.bin'} failed"):
        upload_dir(src, f"s3://{s3_bucket}/p", client=client, workers=2)
    # the command: the parallel push with its final line; a missing folder is one clear error
    assert main(["data", "push", str(src), f"s3://{s3_bucket}/q", "--workers", "2", "--no-progress"]) == 0
    assert "pushed 3 files" in capsys.readouterr().out


def test_local_training_reads_each_row_group_once_per_epoch(shards):
    """fit_local (the study's single-machine trainer) shuffles parquet by row group too."""
    from splitvit.config import SplitLossConfig
    from splitvit.model import SplitViT
    from splitvit.train.local import fit_local

    ds = ParquetShards(shards)
    counter = CountingFileSystem(filesystem_for(shards)[0])
    ds.filesystem = counter.filesystem()
    model = SplitViT.from_timm(
        "vit_tiny_patch16_224",
        policy=PolicyConfig(depth=1),
        levels=2,
        image_size=16,
        num_classes=10,
        timm_kwargs={"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
    )
    fit_local(model, ds, SplitLossConfig(), epochs=2, batch_size=10, lr=1e-3, weight_decay=0.0, seed=0)
    # two epochs, each reading every row group once (a plain shuffle reads ~one per batch item)
    assert counter.reads <= 2 * ds.num_row_groups
