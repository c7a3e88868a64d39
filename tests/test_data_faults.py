"""Data faults are said, not swallowed (issue #61, item 4).

* a corrupt item the file-backed datasets pass over is counted, across the
  DataLoader's worker processes, and each epoch's count goes to the epoch's metrics
  (``train_skipped_items``, ``val_skipped_items``: MLflow) and its console line;
* a COCO annotation file without a single annotation is refused before training
  (one line, exit 2), not trained on to exit 0.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from splitvit.data import build_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def image_folder(root: Path, corrupt: int = 1) -> Path:
    """An imagefolder dataset, 4 classes x 4 PNGs per split; the first ``corrupt`` of
    the training PNGs of class ``c0`` hold bytes no decoder reads (16 items in all, so a
    batch of 4 reads every one of them)."""
    from PIL import Image

    for split in ("train", "val"):
        for c in range(4):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(4):
                path = folder / f"{i}.png"
                if split == "train" and c == 0 and i < corrupt:
                    path.write_bytes(b"not a png")
                else:
                    Image.new("RGB", (16, 16), (40 * c, 10 * i, 0)).save(path)
    return root


@pytest.mark.parametrize("loader_workers", [0, 2])
def test_skipped_items_are_counted_every_epoch_across_loader_processes(tmp_path, loader_workers):
    data = build_dataset("imagefolder", "train", seed=0, image_size=16, root=str(image_folder(tmp_path, 2)))
    counts = []
    for _ in range(2):  # an epoch: every item once, in DataLoader processes started anew
        before = data.skips.value
        seen = sum(len(labels) for _, labels in DataLoader(data, batch_size=4, num_workers=loader_workers))
        counts.append(data.skips.value - before)
        assert seen == 16  # the corrupt items' places are taken by the next readable ones
    assert counts == [2, 2]
    # a plain pickle (not a process being started) carries a count of its own
    copy = pickle.loads(pickle.dumps(data))
    assert copy.skips.value == 0 and data.skips.value == 4


def test_the_epoch_line_says_how_many_corrupt_items_were_skipped(capsys):
    from splitvit.cli.train import print_epoch

    print_epoch(0, {"train_loss": 1.0, "accuracy": 0.5, "train_skipped_items": 2.0, "val_skipped_items": 1.0})
    print_epoch(1, {"train_loss": 1.0, "accuracy": 0.5, "train_skipped_items": 0.0, "val_skipped_items": 0.0})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(", 3 corrupt items skipped") and "skipped" not in lines[1]


def test_skipped_items_reach_each_epochs_metrics_in_mlflow(ray_local, mlflow_uri, tmp_path):
    from mlflow import MlflowClient

    from splitvit.config import ExperimentConfig
    from splitvit.train.ray_trainer import run_training
    from tests.test_train_ray import TINY

    raw = json.loads(json.dumps(TINY))
    raw["data"] = {"name": "imagefolder", "options": {"root": str(image_folder(tmp_path / "images"))}, "batch_size": 4}
    raw["storage"] = {"path": str(tmp_path / "runs"), "name": "skipcount"}
    raw["tracking"].update(tracking_uri=mlflow_uri, split_map_images=0, log_model=False)
    raw["train"].update(epochs=2, max_failures=0)
    raw["scaling"] = {"num_workers": 1, "resources_per_worker": {"CPU": 1}}
    epochs = []
    result = run_training(ExperimentConfig.from_dict(raw), on_epoch=lambda e, m: epochs.append(m))
    assert result.status == "completed"
    assert result.metrics["train_skipped_items"] == 1 and result.metrics["val_skipped_items"] == 0
    assert [m["train_skipped_items"] for m in epochs] == [1, 1]  # what the console's lines read
    history = MlflowClient(mlflow_uri).get_metric_history(result.mlflow_run_id, "train_skipped_items")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 1.0)]


# ---------------------------------------------------------------------- COCO without annotations
def _coco_without_annotations(tmp_path: Path) -> tuple[Path, Path]:
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (32, 32)).save(images / "a.png")
    document = {
        "images": [{"id": 1, "file_name": "a.png", "width": 32, "height": 32}],
        "annotations": [],
        "categories": [{"id": 1, "name": "thing"}],
    }
    annotations = tmp_path / "instances_train.json"
    annotations.write_text(json.dumps(document))
    return annotations, images


def test_a_coco_file_without_annotations_is_refused_naming_it(tmp_path):
    from splitvit.data.coco import CocoFormatError

    annotations, images = _coco_without_annotations(tmp_path)
    with pytest.raises(CocoFormatError) as err:
        build_dataset("coco", "train", image_size=32, train_annotations=str(annotations), train_images=str(images))
    assert str(err.value).startswith(f"{annotations}: has no annotations (its 1 images have no objects)")


def test_training_on_a_coco_file_without_annotations_stops_before_it_starts(tmp_path, capsys):
    """`splitvit train`: one line naming the file, exit 2, before training starts."""
    from splitvit.cli import main

    annotations, images = _coco_without_annotations(tmp_path)
    options = {
        "train_annotations": str(annotations),
        "train_images": str(images),
        "val_annotations": str(annotations),
        "val_images": str(images),
    }
    config = ROOT / "jobs" / "configs" / "fashion_det.yaml"
    code = main(
        [
            "train",
            str(config),
            "--set",
            "data.name=coco",
            "--set",
            f"data.options={json.dumps(options)}",
            "--set",
            f"storage.path={tmp_path / 'runs'}",
            "--set",
            "tracking.enabled=false",
        ]
    )
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("splitvit train")]
    assert code == 2, err
    assert len(lines) == 1 and f"{annotations}: has no annotations" in lines[0], err
    assert not list((tmp_path / "runs").glob("**/checkpoint_*"))  # stopped before training
