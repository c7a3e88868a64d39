"""The preflight: mistakes that would only show once Ray runs end in seconds, one line, exit 2.

One row per mistake of issue #14: too many workers, GPUs that are not there, a Ray
address that does not answer, an MLflow server that does not answer, S3 (endpoint
down, bucket missing, credentials rejected), an empty image folder, labels beyond
``model.num_classes``, a Fashion-MNIST ``root`` that names an empty folder. Each
check has a unit test (no Ray) and the command line a test per row: exit status 2,
one ``splitvit <command>: error:`` line, no traceback, within the time goal.
"""

from __future__ import annotations

import contextlib
import gzip
import http.server
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from splitvit.cli import main
from splitvit.cluster import preflight as pf
from splitvit.cluster.preflight import PreflightError
from splitvit.cluster.stack import free_port
from splitvit.config import ExperimentConfig, load_config
from splitvit.data import fashion_mnist as fm

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "jobs" / "configs" / "smoke.yaml"
#: a tiny model and data, two workers of one CPU each (two levels: the library's plain settings)
TINY = [
    "recipe=none",
    "model.timm_kwargs={patch_size: 4, embed_dim: 16, depth: 1, num_heads: 1}",
    "model.image_size=16",
    "model.levels=2",
    "model.policy.depth=1",
    "data.options={train_samples: 32, val_samples: 16, object_size: 4}",
]


# ---------------------------------------------------------------------- helpers
def tiny(tmp_path: Path, *overrides: str) -> ExperimentConfig:
    return load_config(
        SMOKE,
        [
            *TINY,
            f"storage.path={tmp_path / 'runs'}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}",
            *overrides,
        ],
    )


def cli(capsys, argv: list[str]) -> tuple[int, str, float]:
    """``splitvit ARGV`` in this process: (exit status, stderr, seconds). The logging
    handler main() installs on pytest's captured stream is removed afterwards."""
    root = logging.getLogger()
    before = list(root.handlers)
    start = time.monotonic()
    try:
        code = main(argv)
    finally:
        root.handlers[:] = before
    return code, capsys.readouterr().err, time.monotonic() - start


def assert_one_error_line(err: str, command: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"splitvit {command}: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def train_argv(tmp_path: Path, *overrides: str) -> list[str]:
    return [
        "train",
        str(SMOKE),
        *TINY,
        f"storage.path={tmp_path / 'runs'}",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}",
        *overrides,
    ]


def assert_nothing_started(tmp_path: Path) -> None:
    """No storage folder, no MLflow store (so no MLflow run left RUNNING)."""
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "mlflow").exists()


@contextlib.contextmanager
def http_answering(status: int, body: str = ""):
    """A server on 127.0.0.1 answering every GET with ``status`` and ``body``; its URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.with_name(path.name + ".gz").write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


@pytest.fixture(scope="module")
def fmnist_root(tmp_path_factory) -> Path:
    """A tiny Fashion-MNIST in its file format (labels 0..9)."""
    root = tmp_path_factory.mktemp("fmnist")
    rng = np.random.default_rng(0)
    for part, n in (("train", 40), ("t10k", 20)):
        write_idx(root / f"{part}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(root / f"{part}-labels-idx1-ubyte", np.arange(n) % 10)
    return root


def image_folder(root: Path, classes: tuple[str, ...], per_class: int = 1) -> Path:
    for split in ("train", "val"):
        for name in classes:
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.fromarray(np.full((20, 20, 3), 40 * i, np.uint8)).save(root / split / name / f"{i}.png")
    return root


def scaling(num_workers=1, use_gpu=False, resources=None, strategy="PACK"):
    return SimpleNamespace(
        num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources or {}, placement_strategy=strategy
    )


# ---------------------------------------------------------------------- capacity (no Ray)
def test_worker_resources_follow_ray_trains_rule():
    assert pf.worker_resources(scaling()) == {"CPU": 1.0}
    assert pf.worker_resources(scaling(use_gpu=True)) == {"GPU": 1.0}
    assert pf.worker_resources(scaling(use_gpu=True, resources={"CPU": 2})) == {"CPU": 2.0, "GPU": 1.0}
    assert pf.worker_resources(scaling(resources={"CPU": 0.5, "GPU": 0})) == {"CPU": 0.5}


def test_too_many_workers_for_the_cpus():
    with pytest.raises(PreflightError) as info:
        pf.check_capacity(scaling(16, resources={"CPU": 1}), [{"CPU": 2.0, "GPU": 0.0}], where="this machine")
    assert info.value.key == "scaling.num_workers"
    assert "16 workers x 1 CPU = 16 CPUs, but this machine has 2 CPUs" in str(info.value)
    assert "fit this machine" in pf.check_capacity(
        scaling(2, resources={"CPU": 1}), [{"CPU": 2.0}], where="this machine"
    )


def test_gpus_that_are_not_there():
    with pytest.raises(PreflightError) as info:
        pf.check_capacity(scaling(1, use_gpu=True), [{"CPU": 8.0, "GPU": 0.0}], where="this machine")
    assert info.value.key == "scaling.use_gpu" and "1 worker x 1 GPU = 1 GPU, but this machine has 0 GPUs" in str(
        info.value
    )
    with pytest.raises(PreflightError) as info:
        pf.check_capacity(scaling(2, resources={"GPU": 4}), [{"CPU": 8.0, "GPU": 2.0}], where="the cluster")
    assert info.value.key == "scaling.resources_per_worker.GPU"


def test_workers_must_fit_node_by_node():
    four_gpus = scaling(2, resources={"CPU": 1, "GPU": 4})
    pf.check_capacity(four_gpus, [{"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 4.0}], where="the cluster")
    # 8 GPUs in total, but no node holds a 4-GPU worker
    with pytest.raises(PreflightError, match="no node of the cluster has that much"):
        pf.check_capacity(four_gpus, [{"CPU": 8.0, "GPU": 2.0}] * 4, where="the cluster")
    # 6 GPUs, 6 asked for, but only one 2-GPU worker fits on each 3-GPU node
    with pytest.raises(PreflightError, match="at most 2 at once"):
        pf.check_capacity(scaling(3, resources={"GPU": 2}), [{"CPU": 4.0, "GPU": 3.0}] * 2, where="the cluster")
    with pytest.raises(PreflightError, match="STRICT_PACK") as info:
        pf.check_capacity(scaling(2, strategy="STRICT_PACK"), [{"CPU": 1.0}] * 2, where="the cluster")
    assert info.value.key == "scaling.placement_strategy"
    with pytest.raises(PreflightError, match="STRICT_SPREAD"):
        pf.check_capacity(scaling(3, strategy="STRICT_SPREAD"), [{"CPU": 4.0}] * 2, where="the cluster")
    pf.check_capacity(scaling(2, strategy="STRICT_SPREAD"), [{"CPU": 1.0}] * 2, where="the cluster")


def test_a_trials_driver_counts_too():
    with pytest.raises(PreflightError, match=r"0.5 CPUs for the trial's driver \(search.trial_resources\) = 2.5 CPUs"):
        pf.check_capacity(scaling(2), [{"CPU": 2.0}], where="this machine", extra={"CPU": 0.5})
    with pytest.raises(PreflightError) as info:
        pf.check_capacity(
            scaling(1), [{"CPU": 2.0}], where="this machine", extra={"CPU": 4}, extra_key="run.trial_resources"
        )
    assert info.value.key == "run.trial_resources"


def test_autoscaler_node_groups_are_the_limit(monkeypatch):
    """A cluster whose autoscaler declares node groups is checked against them (what
    it can scale to), not against the nodes up now."""
    from ray._private import state as ray_state

    config = SimpleNamespace(
        node_group_configs=[
            SimpleNamespace(resources={"CPU": 4, "GPU": 1}, max_count=3),
            SimpleNamespace(resources={"CPU": 2}, max_count=1),
        ]
    )
    monkeypatch.setattr(ray_state.state, "get_cluster_config", lambda: config)
    nodes, declared = pf.ray_nodes()
    assert declared and sorted(n.get("GPU", 0) for n in nodes) == [0, 1, 1, 1]
    pf.check_capacity(scaling(3, use_gpu=True), nodes, where="the cluster")
    with pytest.raises(PreflightError, match="4 GPUs, but the cluster has 3 GPUs"):
        pf.check_capacity(scaling(4, use_gpu=True), nodes, where="the cluster")


# ---------------------------------------------------------------------- Ray address (no Ray)
def test_ray_address_that_does_not_answer():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(PreflightError, match=f"no Ray cluster answers at 127.0.0.1:{port}") as info:
        pf.check_ray_address(f"127.0.0.1:{port}", "RAY_ADDRESS")
    assert (
        info.value.key == "RAY_ADDRESS" and time.monotonic() - start < 15
    )  # the bound for an unreachable service
    with pytest.raises(PreflightError, match="dashboard"):
        pf.check_ray_address("http://127.0.0.1:8265", "--address")
    with pytest.raises(PreflightError, match="not a Ray address"):
        pf.check_ray_address("nonsense", "--address")


def test_ray_address_auto_without_a_cluster(monkeypatch):
    import ray._private.utils

    monkeypatch.setattr(ray._private.utils, "read_ray_address", lambda temp_dir=None: None)
    with pytest.raises(PreflightError, match="no Ray cluster was started on this machine"):
        pf.check_ray_address("auto", "RAY_ADDRESS")


# ---------------------------------------------------------------------- MLflow (no Ray)
def test_mlflow_server_that_does_not_answer():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(PreflightError, match=f"no MLflow server answers at {url}") as info:
        pf.check_tracking(url, "MLFLOW_TRACKING_URI")
    assert (
        info.value.key == "MLFLOW_TRACKING_URI" and time.monotonic() - start < 15
    )  # the bound for an unreachable service


def test_mlflow_server_answers_or_is_not_mlflow():
    with http_answering(404, '{"error_code": "RESOURCE_DOES_NOT_EXIST"}') as url:
        assert "answers" in pf.check_tracking(url, "tracking.tracking_uri")
    with http_answering(404, "<html>nope</html>") as url, pytest.raises(PreflightError, match="not as an MLflow"):
        pf.check_tracking(url, "tracking.tracking_uri")
    with http_answering(401) as url, pytest.raises(PreflightError, match="MLFLOW_TRACKING_USERNAME"):
        pf.check_tracking(url, "tracking.tracking_uri")


def test_mlflow_sqlite_store_must_be_writable(tmp_path):
    assert "writable" in pf.check_tracking(f"sqlite:///{tmp_path}/new/deeper/mlflow.db", "storage.path")
    assert not (tmp_path / "new").exists()  # checked, not created
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(PreflightError, match="is not a folder"):
        pf.check_tracking(f"sqlite:///{blocker}/mlflow.db", "tracking.tracking_uri")


def test_tracking_key_names_where_the_uri_came_from(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert pf._tracking_key(tiny(tmp_path)) == "tracking.tracking_uri"
    raw = tiny(tmp_path).to_dict(redact=False)
    raw["tracking"]["tracking_uri"] = None
    assert pf._tracking_key(ExperimentConfig.from_dict(raw)) == "storage.path"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://x")
    assert pf._tracking_key(ExperimentConfig.from_dict(raw)) == "MLFLOW_TRACKING_URI"


# ---------------------------------------------------------------------- storage (no Ray)
def test_local_storage_must_be_writable(tmp_path):
    assert "writable" in pf.check_storage(str(tmp_path / "runs"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(PreflightError, match="cannot write to") as info:
        pf.check_storage(str(blocker / "runs"))
    assert info.value.key == "storage.path"


def test_s3_bucket_present_missing_and_written(s3_bucket):
    import boto3

    assert "writable" in pf.check_storage(f"s3://{s3_bucket}/runs")
    # the probe object is gone again
    assert boto3.client("s3").list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0
    with pytest.raises(PreflightError, match="bucket 'no-such-bucket-pf' is missing .* does not exist") as info:
        pf.check_storage("s3://no-such-bucket-pf/runs")
    assert info.value.key == "storage.path"


def test_s3_endpoint_down(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    start = time.monotonic()
    with pytest.raises(PreflightError, match="the endpoint does not answer"):
        pf.check_storage("s3://bucket/runs")
    assert time.monotonic() - start < 15  # the bound for an unreachable service


def test_s3_errors_say_what_they_mean():
    from botocore.exceptions import ClientError, NoCredentialsError

    from splitvit.storage import s3_error_reason

    def client_error(code, status):
        return ClientError(
            {"Error": {"Code": code, "Message": ""}, "ResponseMetadata": {"HTTPStatusCode": status}}, "HeadBucket"
        )

    assert "credentials were rejected" in s3_error_reason(client_error("403", 403))
    assert "credentials were rejected" in s3_error_reason(client_error("InvalidAccessKeyId", 403))
    assert "does not exist" in s3_error_reason(client_error("404", 404))
    assert "no S3 credentials" in s3_error_reason(NoCredentialsError())


def test_s3_credentials_rejected(monkeypatch):
    """The server refuses the credentials: one line that says so (a client that answers 403)."""
    from botocore.exceptions import ClientError

    class Refusing:
        def head_bucket(self, Bucket):
            raise ClientError(
                {"Error": {"Code": "403", "Message": "Forbidden"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
                "HeadBucket",
            )

    import splitvit.storage

    monkeypatch.setattr(splitvit.storage, "s3_client", lambda timeout=None: Refusing())
    with pytest.raises(PreflightError, match="credentials were rejected"):
        pf.check_storage("s3://bucket/runs")


# ---------------------------------------------------------------------- data (no Ray)
def test_empty_image_folder(tmp_path):
    (tmp_path / "images" / "train" / "cat").mkdir(parents=True)
    config = tiny(tmp_path, "data.name=imagefolder", f"data.options={{root: {tmp_path / 'images'}}}")
    with pytest.raises(PreflightError, match="no images") as info:
        pf.check_data(config)
    assert info.value.key == "data.options.root"


def test_labels_beyond_num_classes_from_the_file_list(tmp_path):
    root = image_folder(tmp_path / "images", ("a", "b", "c"))
    config = tiny(tmp_path, "data.name=imagefolder", f"data.options={{root: {root}}}", "model.num_classes=2")
    with pytest.raises(PreflightError, match="is 2, but .* have labels up to 2 .* set model.num_classes=3") as info:
        pf.check_data(config)
    assert info.value.key == "model.num_classes"
    line, source = pf.check_data(
        tiny(tmp_path, "data.name=imagefolder", f"data.options={{root: {root}}}", "model.num_classes=3")
    )
    assert source == str(root) and "3 train, 3 val items, 3 classes" in line


def test_labels_of_synthetic_and_fashion_mnist(tmp_path, fmnist_root):
    with pytest.raises(PreflightError, match="set model.num_classes=4"):
        pf.check_data(tiny(tmp_path, "model.num_classes=3"))
    fashion = [
        "data.name=cluttered-fashion-mnist",
        "model.image_size=64",
        f"data.options={{root: {fmnist_root}, val_size: 10}}",
    ]
    with pytest.raises(PreflightError, match="set model.num_classes=10"):
        pf.check_data(tiny(tmp_path, *fashion, "model.num_classes=5"))
    line, source = pf.check_data(tiny(tmp_path, *fashion, "model.num_classes=10"))
    assert source == str(fmnist_root) and "30 train, 10 val items, 10 classes" in line
    # the dense variant paints class k as k + 1 (0: background)
    seg = [
        "data.name=cluttered-fashion-mnist-seg",
        "model.image_size=64",
        f"data.options={{root: {fmnist_root}, val_size: 10}}",
        "model.task=dense",
    ]
    with pytest.raises(PreflightError, match="set model.num_classes=11"):
        pf.check_data(tiny(tmp_path, *seg, "model.num_classes=10"))


def test_labels_of_parquet_shards_without_class_count(tmp_path):
    from splitvit.data import build_dataset, write_shards

    class NoClassCount(torch_dataset_base()):
        def __init__(self):
            self.inner = build_dataset("synthetic", "train", image_size=16, num_samples=12, object_size=4)

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            image, label = self.inner[i][:2]
            return image, label + 5  # labels 5..8

    write_shards(NoClassCount(), str(tmp_path / "shards" / "train"), rows_per_shard=5)
    write_shards(NoClassCount(), str(tmp_path / "shards" / "val"), rows_per_shard=5)
    config = tiny(tmp_path, "data.name=parquet", f"data.options={{uri: {tmp_path / 'shards'}}}", "model.num_classes=4")
    with pytest.raises(PreflightError, match="from the label column of 3 shard"):
        pf.check_data(config)


def torch_dataset_base():
    from torch.utils.data import Dataset

    return Dataset


def test_parquet_data_on_a_missing_bucket(tmp_path, s3_endpoint):
    config = tiny(tmp_path, "data.name=parquet", "data.options={uri: s3://no-such-bucket-pq/shards}")
    start = time.monotonic()
    with pytest.raises(PreflightError, match="no-such-bucket-pq.*does not exist") as info:
        pf.check_data(config)
    assert info.value.key == "data.options.uri" and time.monotonic() - start < 15


def test_canvas_cache_is_not_rendered(tmp_path, fmnist_root):
    cache = tmp_path / "canvas-cache"
    pf.check_data(
        tiny(
            tmp_path,
            "data.name=cluttered-fashion-mnist",
            "model.num_classes=10",
            "model.image_size=64",
            f"data.options={{root: {fmnist_root}, val_size: 10, cache_dir: {cache}}}",
        )
    )
    assert not cache.exists()


# ---------------------------------------------------------------------- no silent fallback (Fashion-MNIST root)
def test_fashion_mnist_root_naming_an_empty_folder_is_an_error(tmp_path, fmnist_root, monkeypatch):
    """Even with a good copy elsewhere (here: $SPLITVIT_DATA_DIR), a root without the
    files is an error, not a reason to read that copy."""
    from splitvit.data import build_dataset

    monkeypatch.setenv(fm.DATA_DIR_ENV, str(fmnist_root))
    assert fm.find_fashion_mnist() == fmnist_root  # no root: the search order
    empty = tmp_path / "empty"
    empty.mkdir()
    for root, state in ((empty, "does not hold all four idx files"), (tmp_path / "missing", "does not exist")):
        with pytest.raises(fm.FashionMNISTNotFound, match=f"root={root} {state}"):
            build_dataset("cluttered-fashion-mnist", "train", image_size=32, root=str(root))
    # download=true fills the named folder, and only it
    asked = []
    monkeypatch.setattr(
        fm, "download_fashion_mnist", lambda dest: asked.append(dest) or (_ for _ in ()).throw(OSError("offline"))
    )
    with pytest.raises(fm.FashionMNISTNotFound, match="offline"):
        fm.find_fashion_mnist(empty, download=True)
    assert asked == [empty]


def test_the_log_says_which_folder_was_used(fmnist_root, tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="splitvit.data.fashion_mnist"):
        fm.find_fashion_mnist(fmnist_root)
    assert f"Fashion-MNIST: using the files in {fmnist_root}" in caplog.text
    # $SPLITVIT_DATA_DIR without the files: the copy used instead is a warning, not silent
    monkeypatch.setattr(fm, "DEBIAN_DIR", fmnist_root)
    monkeypatch.setenv(fm.DATA_DIR_ENV, str(tmp_path))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="splitvit.data.fashion_mnist"):
        assert fm.find_fashion_mnist(download=False) == fmnist_root
    assert f"${fm.DATA_DIR_ENV}={tmp_path} does not hold the idx files; using the files in {fmnist_root}" in caplog.text


# ---------------------------------------------------------------------- eval (no Ray)
def test_eval_device_that_is_not_there(capsys, tmp_path):
    import torch

    checkpoint = tmp_path / "ck"  # there (a missing one is its own error, found first)
    checkpoint.mkdir()
    code, err, seconds = cli(capsys, ["eval", str(checkpoint), "--device", f"cuda:{torch.cuda.device_count()}"])
    assert code == 2
    assert_one_error_line(err, "eval", "--device", "CUDA GPU")


def test_eval_checkpoint_on_a_missing_bucket(capsys, s3_endpoint):
    code, err, seconds = cli(capsys, ["eval", "s3://no-such-bucket-ev/run/checkpoint_epoch0001"])
    assert code == 2 and seconds < 15
    assert_one_error_line(err, "eval", "checkpoint:", "does not exist")


# ---------------------------------------------------------------------- the command line, one row each
@pytest.fixture
def machine(monkeypatch):
    """The machine (and any Ray this test session runs) as 2 CPUs and no GPU; Ray
    must not be started (or joined) by a command whose input is bad."""
    import splitvit.train.ray_trainer as ray_trainer

    def no_ray(*args, **kwargs):  # pragma: no cover - reached only if the preflight comes too late
        raise AssertionError("Ray was started before the preflight failed")

    nodes = [{"CPU": 2.0, "GPU": 0.0}]
    monkeypatch.setattr(pf, "local_nodes", lambda: nodes)
    monkeypatch.setattr(pf, "ray_nodes", lambda: (nodes, False))
    monkeypatch.setattr(ray_trainer, "init_ray", no_ray)
    return nodes


@pytest.mark.parametrize(
    "override,needles",
    [
        ("scaling.num_workers=16", ("scaling.num_workers", "16 workers x 1 CPU = 16 CPUs", "has 2 CPUs")),
        ("scaling.use_gpu=true", ("scaling.use_gpu", "2 workers x 1 GPU = 2 GPUs", "has 0 GPUs")),
    ],
)
def test_cli_capacity(tmp_path, capsys, machine, override, needles):
    code, err, seconds = cli(capsys, train_argv(tmp_path, override))
    assert code == 2 and seconds < 30
    assert_one_error_line(err, "train", *needles)
    assert_nothing_started(tmp_path)


def test_cli_mlflow_unreachable(tmp_path, capsys, machine):
    url = f"http://127.0.0.1:{free_port()}"
    code, err, seconds = cli(capsys, train_argv(tmp_path, f"tracking.tracking_uri={url}"))
    assert code == 2 and seconds < 15
    assert_one_error_line(err, "train", "tracking.tracking_uri", f"no MLflow server answers at {url}")
    assert not (tmp_path / "runs").exists()


def test_cli_s3_bucket_missing(tmp_path, capsys, machine, s3_endpoint):
    code, err, seconds = cli(capsys, train_argv(tmp_path, "storage.path=s3://no-such-bucket-tr/runs"))
    assert code == 2 and seconds < 15
    assert_one_error_line(err, "train", "storage.path", "no-such-bucket-tr", "does not exist")
    assert "allow_bucket_creation" not in err
    assert_nothing_started(tmp_path)


def test_cli_s3_endpoint_down(tmp_path, capsys, machine, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    code, err, seconds = cli(capsys, train_argv(tmp_path, "storage.path=s3://bucket/runs"))
    assert code == 2 and seconds < 15
    assert_one_error_line(err, "train", "storage.path", "the endpoint does not answer")
    assert_nothing_started(tmp_path)


def test_cli_empty_image_folder(tmp_path, capsys, machine):
    (tmp_path / "images" / "train" / "cat").mkdir(parents=True)
    code, err, seconds = cli(
        capsys, train_argv(tmp_path, "data.name=imagefolder", f"data.options={{root: {tmp_path / 'images'}}}")
    )
    assert code == 2 and seconds < 30
    assert_one_error_line(err, "train", "data.options.root", "no images")
    assert_nothing_started(tmp_path)


def test_cli_labels_beyond_num_classes(tmp_path, capsys, machine):
    root = image_folder(tmp_path / "images", tuple("abcdefgh"))
    code, err, seconds = cli(capsys, train_argv(tmp_path, "data.name=imagefolder", f"data.options={{root: {root}}}"))
    assert code == 2 and seconds < 30
    assert_one_error_line(err, "train", "model.num_classes: is 4", "labels up to 7", "set model.num_classes=8")
    assert_nothing_started(tmp_path)


def test_cli_fashion_mnist_root_empty(tmp_path, capsys, machine):
    (tmp_path / "empty").mkdir()
    code, err, seconds = cli(
        capsys,
        train_argv(
            tmp_path,
            "data.name=cluttered-fashion-mnist",
            "model.num_classes=10",
            f"data.options={{root: {tmp_path / 'empty'}}}",
        ),
    )
    assert code == 2 and seconds < 30
    assert_one_error_line(err, "train", "data.options.root", f"root={tmp_path / 'empty'} does not hold")
    assert_nothing_started(tmp_path)


def test_cli_sweep_and_study_run_the_preflight(tmp_path, capsys, machine):
    code, err, seconds = cli(
        capsys,
        [
            "sweep",
            str(ROOT / "search_spaces" / "smoke.yaml"),
            "--set",
            f"storage.path={tmp_path / 'runs'}",
            "--set",
            "scaling.num_workers=8",
        ],
    )
    assert code == 2 and seconds < 30
    assert_one_error_line(err, "sweep", "scaling.num_workers", "search.trial_resources", "has 2 CPUs")
    assert not (tmp_path / "runs").exists()
    code, err, seconds = cli(
        capsys,
        [
            "study",
            str(ROOT / "studies" / "study_fashion.yaml"),
            "--set",
            f"storage.path={tmp_path / 'runs'}",
            "--set",
            "scaling.num_workers=8",
        ],
    )
    assert code == 2 and seconds < 30
    assert_one_error_line(err, "study", "scaling.num_workers", "run.trial_resources", "has 2 CPUs")
    assert not (tmp_path / "runs").exists()


def _run_splitvit(args: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "splitvit.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )
    return done, time.monotonic() - start


def test_cli_process_end_to_end(tmp_path):
    """As a user runs it, a fresh process each: too many workers for this machine,
    then a RAY_ADDRESS where nothing listens. Seconds, one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    done, seconds = _run_splitvit(train_argv(tmp_path, "scaling.num_workers=4096"), env, tmp_path)
    assert done.returncode == 2 and seconds < 30, done.stderr
    assert_one_error_line(done.stderr, "train", "scaling.num_workers", "4096 workers x 1 CPU")
    port = free_port()
    done, seconds = _run_splitvit(train_argv(tmp_path), {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, tmp_path)
    assert done.returncode == 2 and seconds < 15 + 10, done.stderr  # 15 s goal + the interpreter's start-up
    assert_one_error_line(done.stderr, "train", "RAY_ADDRESS", f"no Ray cluster answers at 127.0.0.1:{port}")
    assert_nothing_started(tmp_path)


# ---------------------------------------------------------------------- with the session's Ray
def test_capacity_of_a_running_ray(tmp_path, ray_local):
    """A Ray already running (the session's, 4 CPUs) is checked as it is."""
    import ray

    from tests.fixtures_ray import RAY_CPUS

    with pytest.raises(PreflightError, match=f"but the cluster has {RAY_CPUS} CPUs") as info:
        pf.preflight(tiny(tmp_path, f"scaling.num_workers={RAY_CPUS + 1}"))
    assert info.value.key == "scaling.num_workers"
    report = pf.preflight(tiny(tmp_path))
    assert any(line.startswith("capacity: 2 worker(s)") and "fit the cluster" in line for line in report.lines)
    assert report.data_line == "data: synthetic (generated): 32 train, 16 val items, 4 classes"
    # the address of a cluster that is up answers
    gcs = ray.get_runtime_context().gcs_address
    assert pf.check_ray_address(gcs, "--address") == gcs
