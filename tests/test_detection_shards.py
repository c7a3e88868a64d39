"""Detection data as parquet shards (issue 34): ``splitvit data prepare coco|fashion-det``
writes the targets in typed columns and the COCO ground truth beside them; the shards
read back as their source's items, tensor for tensor, locally and from ``s3://``; a
detector evaluates to the same COCO figures on them as on their source; the preflight
refuses shards of another task; the Ray workers' data batch them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from splitvit.cli import main
from splitvit.cluster import preflight as pf
from splitvit.cluster.preflight import PreflightError
from splitvit.config import ExperimentConfig
from splitvit.data import ParquetShards, SyntheticObjects, build_dataset, write_shards
from splitvit.data.fashion_det import coco_document as items_document
from splitvit.data.fashion_mnist import CLASSES
from splitvit.data.parquet import RowGroupSampler
from splitvit.train.coco_eval import coco_evaluate, detection_records
from splitvit.train.detection import detection_ground_truth, to_original_pixels
from splitvit.train.experiment import build_model, experiment_from_dict

from .helpers import write_fake_fashion_mnist
from .test_coco_data import coco_document as small_coco_document
from .test_coco_data import compressed_rle, write_folder
from .test_detection_model import SMALL_HEADS

CANVAS = 64
#: a tiny detector on 64-px canvases that keeps its best 6 detections per image, however low they score
#: (few proposals at test time: a fast evaluation)
DETECTOR = {
    "name": "vit_tiny_patch16_224",
    "timm_kwargs": {"patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2},
    "image_size": CANVAS,
    "levels": 2,
    "policy": {"kind": "full", "depth": 1},
    "task": "detection",
    "detector": {
        **{k: list(v) if isinstance(v, tuple) else v for k, v in SMALL_HEADS.items()},
        "pyramid_channels": 32,
        "rpn_pre_nms_top_n": [200, 50],
        "rpn_post_nms_top_n": [100, 20],
        "box_score_thresh": 0.0,
        "box_detections_per_img": 6,
    },
}


@pytest.fixture(scope="module")
def fmnist_root(tmp_path_factory) -> Path:
    """A tiny Fashion-MNIST in its file format (20 of its 60 train items are val)."""
    return write_fake_fashion_mnist(tmp_path_factory.mktemp("fmnist"), train=60, test=20)


@pytest.fixture(scope="module")
def coco_files(tmp_path_factory) -> dict[str, str]:
    """The COCO folder of test_coco_data (a polygon, an uncompressed crowd RLE, a
    compressed RLE, an image without annotations; 10x8, 6x5 and 7x7 images, all
    letterboxed onto the canvas) plus a canvas-sized image whose two masks overlap."""
    root = tmp_path_factory.mktemp("coco")
    document = small_coco_document()
    document["images"].append({"id": 4, "file_name": "d.png", "width": CANVAS, "height": CANVAS})
    overlap = np.zeros((CANVAS, CANVAS), np.uint8)
    overlap[20:50, 30:60] = 1  # over the polygon's square 10..40
    document["annotations"] += [
        {
            "id": 20,
            "image_id": 4,
            "category_id": 3,
            "bbox": [10, 10, 30, 30],
            "area": 900.0,
            "segmentation": [[10, 10, 40, 10, 40, 40, 10, 40]],
            "iscrowd": 0,
        },
        {
            "id": 21,
            "image_id": 4,
            "category_id": 7,
            "bbox": [30, 20, 30, 30],
            "area": 900.0,
            "segmentation": compressed_rle(overlap),
            "iscrowd": 0,
        },
    ]
    annotations, images = write_folder(root, document)
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (CANVAS, CANVAS, 3), dtype=np.uint8)).save(
        images / "d.png"
    )
    return {"val_annotations": str(annotations), "val_images": str(images)}


def prepare(*argv: str) -> int:
    return main(["data", "prepare", *argv, "--image-size", str(CANVAS)])


def prepare_coco(coco_files: dict[str, str], split: str, out: str | Path) -> int:
    """`splitvit data prepare coco` of the test folder as ``split``, to ``out``."""
    options = [f"--option={key.replace('val', split)}={value}" for key, value in coco_files.items()]
    return prepare("coco", "--split", split, *options, "--out", str(out))


def assert_same_items(shards, source) -> None:
    """Every item of ``shards`` is ``source``'s: the same image, keys, dtypes, shapes and values."""
    assert len(shards) == len(source)
    for i in range(len(source)):
        (image, target), (want_image, want) = shards[i], source[i]
        assert torch.equal(image, want_image) and list(target) == list(want), i
        for key, value in want.items():
            got = target[key]
            assert (got.dtype, got.shape) == (value.dtype, value.shape) and torch.equal(got, value), (i, key)


def detections_from_targets(dataset) -> dict:
    """COCO's figures for detections made from ``dataset``'s own targets, mapped to the
    files' pixels as evaluation maps them, against ``detection_ground_truth(dataset)``."""
    records, ids = [], []
    for i in range(len(dataset)):
        _, target = dataset[i]
        found = {
            "boxes": target["boxes"],
            "labels": target["labels"],
            "scores": torch.linspace(0.9, 0.5, len(target["labels"])),
            "masks": target["masks"][:, None].float(),
        }
        ids.append(int(target["image_id"]))
        records += detection_records([ids[-1]], [to_original_pixels(found, target)], [0, *dataset.category_ids])
    return coco_evaluate(detection_ground_truth(dataset), records, image_ids=ids)


def detector_config(tmp_path: Path, data: dict, num_classes: int) -> ExperimentConfig:
    raw = {
        "model": {**DETECTOR, "num_classes": num_classes},
        "data": {"batch_size": 2, **data},
        "storage": {"path": str(tmp_path / "runs"), "name": "det-shards"},
    }
    return experiment_from_dict(raw)


def save_checkpoint(model, config: ExperimentConfig, path: Path) -> str:
    model.save(path, extra={"config": config.to_dict(redact=True)})
    return str(path)


# ----------------------------------------------------------------- prepared, read back


def test_fashion_det_shards_read_back_as_the_procedural_items(fmnist_root, tmp_path):
    out = tmp_path / "det" / "val"
    options = ["--option", "val_size=20", "--option", "download=false"]
    argv = ["fashion-det", "--split", "val", "--root", str(fmnist_root), *options, "--out", str(out)]
    assert prepare(*argv, "--limit", "6", "--rows-per-shard", "4", "--json", str(tmp_path / "prep.json")) == 0
    prepared = json.loads((tmp_path / "prep.json").read_text())
    assert prepared["task"] == "detection" and prepared["rows"] == 6 and len(prepared["shards"]) == 2
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["categories"] == list(CLASSES) and manifest["category_ids"] == list(range(1, 11))
    assert manifest["num_classes"] == 11 and manifest["image_size"] == [CANVAS, CANVAS]

    source = build_dataset(
        "fashion-det", "val", image_size=CANVAS, root=str(fmnist_root), val_size=20, download=False, num_samples=6
    )
    shards = build_dataset("parquet", "val", image_size=CANVAS, uri=str(tmp_path / "det"))
    assert isinstance(shards, ParquetShards) and shards.task == "detection"
    assert (shards.categories, shards.category_ids, shards.num_classes) == (CLASSES, tuple(range(1, 11)), 11)
    assert_same_items(shards, source)
    # the ground truth is the procedural set's own COCO document, and scores the same
    assert shards.ground_truth_document() == json.loads(json.dumps(items_document(source)))
    figures = detections_from_targets(shards)
    assert figures == detections_from_targets(source) and figures["bbox"]["AP"] == pytest.approx(1.0)


def test_coco_shards_keep_letterboxing_crowds_overlaps_and_the_files_annotations(coco_files, tmp_path):
    options = [f"--option={k}={v}" for k, v in coco_files.items()]
    assert prepare("coco", "--split", "val", *options, "--out", str(tmp_path), "--rows-per-shard", "3") == 0
    source = build_dataset("coco", "val", image_size=CANVAS, **coco_files)
    shards = ParquetShards(str(tmp_path), "val", image_size=CANVAS)
    assert_same_items(shards, source)
    assert [("scale" in shards[i][1]) for i in range(4)] == [True, True, True, False]  # d.png is the canvas
    assert shards[0][1]["iscrowd"].tolist() == [0, 1] and shards[2][1]["masks"].shape == (0, CANVAS, CANVAS)
    assert (shards[3][1]["masks"][0] & shards[3][1]["masks"][1]).any()  # overlapping masks stay apart
    assert (shards.categories, shards.category_ids) == (("three", "seven"), (3, 7))
    # COCO's ground truth is the file's own annotations, in its pixels
    document = json.loads(Path(coco_files["val_annotations"]).read_text())
    assert shards.ground_truth_document() == document
    figures = detections_from_targets(shards)
    assert figures == detections_from_targets(source) and figures["bbox"]["AP"] == pytest.approx(1.0)


def test_a_detector_scores_the_same_on_shards_as_on_their_source_and_previews_from_them(
    coco_files, fmnist_root, tmp_path
):
    """`splitvit eval`'s evaluator: a random detector on COCO and on fashion-det, and on
    the shards prepared from each, detects on the same batches and gets the same COCO
    figures (a random detector's AP is 0: the figures of detections that score are
    compared above, from the targets)."""
    from splitvit.train.evaluation import CheckpointEvaluator

    fashion = {"root": str(fmnist_root), "val_size": 20, "download": False, "val_samples": 4}
    sources = {"coco": (coco_files, 2), "fashion-det": (fashion, 10)}
    for name, (options, classes) in sources.items():
        out = tmp_path / name
        given = [f"--option={k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in options.items()]
        assert prepare(name, "--split", "val", *given, "--out", str(out / "val")) == 0
        source_config = detector_config(tmp_path, {"name": name, "options": options}, classes)
        shard_config = detector_config(tmp_path, {"name": "parquet", "options": {"uri": str(out)}}, classes)
        torch.manual_seed(0)
        model = build_model(source_config.model)
        figures, batches = [], []
        for config in (source_config, shard_config):
            checkpoint = save_checkpoint(model, config, tmp_path / f"{name}-{config.data.name}.pt")
            evaluator = CheckpointEvaluator(checkpoint)
            result = evaluator.evaluate().to_dict()
            figures.append({k: v for k, v in result.items() if k != "images_per_s"})
            batches.append(evaluator.batches())  # kept from the evaluation
        assert figures[0] == figures[1], name
        assert figures[0]["images"] == 4 and figures[0]["tokens_per_image"] == (CANVAS // 8) ** 2
        assert set(figures[0]["per_class"]) == set(evaluator.dataset.categories)
        for (images, targets), (same_images, same_targets) in zip(*batches, strict=True):  # what was detected on
            assert torch.equal(images, same_images)
            assert all(torch.equal(a[k], b[k]) for a, b in zip(targets, same_targets, strict=True) for k in a)
    # a preview of the detector's detections, drawn from the shards
    drawn = tmp_path / "viz.json"
    argv = ["viz", "--checkpoint", checkpoint, "--dataset", "parquet", "--root", str(tmp_path / "fashion-det")]
    assert main([*argv, "--count", "2", "--out", str(tmp_path / "viz.png"), "--json", str(drawn)]) == 0
    assert len(json.loads(drawn.read_text())["detections"]) == 2 and (tmp_path / "viz.png").stat().st_size > 0


def test_detection_shards_on_s3(coco_files, tmp_path, s3_bucket):
    uri = f"s3://{s3_bucket}/coco"
    assert prepare_coco(coco_files, "val", f"{uri}/val") == 0
    assert prepare_coco(coco_files, "val", tmp_path / "val") == 0
    remote = build_dataset("parquet", "val", image_size=CANVAS, uri=uri)
    assert_same_items(remote, build_dataset("parquet", "val", image_size=CANVAS, uri=str(tmp_path)))
    assert remote.ground_truth_document() == json.loads(Path(coco_files["val_annotations"]).read_text())
    config = detector_config(tmp_path, {"name": "parquet", "options": {"uri": uri}, "val_split": "val"}, 2)
    line, source = pf.check_data(config, ["val"])
    assert source == uri and line.endswith(": 4 val items, 2 object classes")


# ----------------------------------------------------------------- refused, in one line


def test_the_preflight_refuses_shards_of_another_task_naming_them(coco_files, tmp_path):
    detection = tmp_path / "det"
    assert prepare_coco(coco_files, "val", detection / "val") == 0
    write_shards(SyntheticObjects(4, image_size=16, object_size=4), str(tmp_path / "cls" / "val"))
    # the config check lets parquet through for a detector: what shards hold is read by the preflight
    shards = {"name": "parquet", "val_split": "val"}
    config = detector_config(tmp_path, {**shards, "options": {"uri": str(tmp_path / "cls")}}, 2)
    with pytest.raises(PreflightError) as err:
        pf.check_data(config, ["val"])
    assert err.value.key == "data.options.uri" and "\n" not in str(err.value)
    assert str(err.value.reason).startswith(
        f"{tmp_path / 'cls' / 'val'} holds classification shards (no object boxes), but model.task is 'detection'"
    )
    classifier = experiment_from_dict(
        {
            "model": {**{k: v for k, v in DETECTOR.items() if k != "detector"}, "task": "classification"},
            "data": {**shards, "options": {"uri": str(detection)}},
            "storage": {"path": str(tmp_path / "runs"), "name": "cls"},
        }
    )
    with pytest.raises(PreflightError) as err:
        pf.check_data(classifier, ["val"])
    assert err.value.key == "data.options.uri"
    assert str(err.value.reason).startswith(
        f"{detection / 'val'} holds detection shards (boxes and masks of objects), but model.task is 'classification'"
    )
    # the category count, as for COCO
    with pytest.raises(PreflightError) as err:
        pf.check_data(detector_config(tmp_path, {**shards, "options": {"uri": str(detection)}}, 3), ["val"])
    assert err.value.key == "model.num_classes" and "have 2 object classes" in str(err.value)


def test_detection_shards_are_read_at_their_canvas_with_their_manifest(coco_files, tmp_path):
    assert prepare_coco(coco_files, "val", tmp_path / "val") == 0
    with pytest.raises(ValueError) as err:
        build_dataset("parquet", "val", image_size=32, uri=str(tmp_path))
    assert str(err.value) == (
        f"{tmp_path / 'val'}: detection shards of 64x64 canvases read at 32 px; their boxes and masks are the "
        "stored canvas's: prepare them with --image-size 32, or set model.image_size=64"
    )
    (tmp_path / "val" / "_manifest.json").unlink()
    with pytest.raises(ValueError, match="detection shards without their _manifest.json categories and ground truth"):
        ParquetShards(str(tmp_path / "val"))
    write_shards(SyntheticObjects(2, image_size=16, object_size=4), str(tmp_path / "cls"))
    with pytest.raises(ValueError, match="classification shards have no COCO ground truth"):
        ParquetShards(str(tmp_path / "cls")).ground_truth_document()


class Items(list):
    """Detection items in a list, with a detection set's categories."""

    categories, category_ids = ("thing",), (1,)


def target(n: int = 1, size: int = 8, **fields) -> dict[str, torch.Tensor]:
    masks = torch.zeros((n, size, size), dtype=torch.uint8)
    masks[:, 2:5, 2:5] = 1
    return {
        "boxes": torch.tensor([[2.0, 2, 5, 5]] * n),
        "labels": torch.ones(n, dtype=torch.int64),
        "masks": masks,
        "iscrowd": torch.zeros(n, dtype=torch.uint8),
        "area": torch.full((n,), 9.0),
        "image_id": torch.tensor(0),
        **fields,
    }


@pytest.mark.parametrize(
    "items, text",
    [
        ([(torch.zeros(3, 8, 8), target(depth=torch.zeros(1)))], "item 0: a detection target has boxes, labels"),
        ([(torch.zeros(3, 8, 8), {k: v for k, v in target().items() if k != "area"})], "missing area"),
        ([(torch.zeros(3, 8, 8), target(masks=torch.full((1, 8, 8), 3, dtype=torch.uint8)))], "masks are 0/1"),
        ([(torch.zeros(3, 8, 8), target(size=6))], "item 0: 1 labels need boxes (1, 4) and masks (1, 8, 8)"),
        (
            [(torch.zeros(3, 8, 8), target()), (torch.zeros(3, 6, 6), target(size=6))],
            "item 1: image is 6x6, the first item's 8x8; detection shards hold one canvas size",
        ),
        ([(torch.zeros(3, 8, 8), target(), torch.zeros(8, 8))], "a detection item is (image, target dict)"),
    ],
)
def test_what_the_writer_cannot_store_exactly_is_named(items, text, tmp_path):
    with pytest.raises(ValueError) as err:
        write_shards(Items(items), str(tmp_path))
    assert text in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------- the Ray workers' data


def test_ray_workers_batch_detection_shards_by_row_group(coco_files, tmp_path, monkeypatch):
    """The worker data builder (no Ray Train session: its loader wrapper is the identity
    here) gives a row-group sampler and detection batches: images stacked, targets a list."""
    import ray.train.torch

    from splitvit.train.ray_trainer import _worker_data

    for split in ("train", "val"):
        assert prepare_coco(coco_files, split, tmp_path / split) == 0
    monkeypatch.setattr(ray.train.torch, "prepare_data_loader", lambda loader: loader)
    config = detector_config(tmp_path, {"name": "parquet", "options": {"uri": str(tmp_path)}}, 2)
    data = _worker_data(config, 0, 1, torch.device("cpu"), "bicubic")
    assert isinstance(data.sampler, RowGroupSampler)
    order = list(data.sampler)
    train_set = data.loader.dataset
    for b, (images, targets) in enumerate(data.loader):
        assert images.shape == (2, 3, CANVAS, CANVAS) and isinstance(targets, list)
        for k, found in enumerate(targets):
            want = train_set[order[2 * b + k]][1]
            assert all(torch.equal(found[key], want[key]) for key in want) and found.keys() == want.keys()
    assert b == 1  # 4 images, 2 batches of 2
    images, targets = next(iter(data.val_loader))
    assert images.shape[1:] == (3, CANVAS, CANVAS) and int(targets[0]["image_id"]) == 1
