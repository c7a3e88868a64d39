"""Detection in the experiment config and the dataset registry (issue 34): ``model.task:
detection`` and its options, the detector build_model gives, the ``fashion-det`` and
``coco`` datasets, their batches, and every error a detection config can meet, each one
line naming its key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from splitvit.cluster import preflight as pf
from splitvit.cluster.preflight import PreflightError
from splitvit.config import ConfigError, ModelConfig, PolicyConfig, load_config, quality_metric
from splitvit.data import build_dataset, detection_collate
from splitvit.data.fashion_det import FashionDetection, write_coco
from splitvit.model import SplitDetector, SplitViT
from splitvit.train.experiment import build_model, experiment_from_dict, load_experiment

from .helpers import write_fake_fashion_mnist

ROOT = Path(__file__).resolve().parents[1]
FASHION_DET = ROOT / "jobs" / "configs" / "fashion_det.yaml"
#: a tiny detector on 64-px canvases: 8-px finest patches, two levels (the library's plain
#: settings: the detection recipe's level context needs three)
DETECTION = {
    "recipe": "none",
    "model": {
        "name": "vit_tiny_patch16_224",
        "timm_kwargs": {"patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2},
        "image_size": 64,
        "levels": 2,
        "task": "detection",
        "num_classes": 10,
        "policy": {"depth": 1},
    },
    "data": {"name": "fashion-det"},
    "storage": {"name": "detection-test"},
}


@pytest.fixture(scope="module")
def fmnist_root(tmp_path_factory) -> Path:
    """A tiny Fashion-MNIST in its file format: 60 train items (20 of them val), 20 test items."""
    return write_fake_fashion_mnist(tmp_path_factory.mktemp("fmnist"), train=60, test=20)


def fashion_det(root: Path, split: str, **options) -> FashionDetection:
    return build_dataset("fashion-det", split, image_size=64, root=str(root), val_size=20, download=False, **options)


@pytest.fixture(scope="module")
def coco_folder(tmp_path_factory, fmnist_root) -> Path:
    """train and val splits of fashion-det (64-px canvases) written in COCO's format."""
    folder = tmp_path_factory.mktemp("coco")
    for split in ("train", "val"):
        write_coco(fashion_det(fmnist_root, split, num_samples=4), folder, split)
    return folder


def coco_options(folder: Path, *splits: str) -> dict[str, str]:
    options = {}
    for split in splits:
        options[f"{split}_annotations"] = str(folder / f"instances_{split}.json")
        options[f"{split}_images"] = str(folder / split)
    return options


def same_item(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


# ----------------------------------------------------------------- the config


def test_detection_is_a_task_judged_by_box_ap():
    cfg = experiment_from_dict(DETECTION)
    assert cfg.model.task == "detection" and cfg.model.detector == {}
    assert cfg.model.metric == quality_metric("detection") == "box_ap"
    # the other tasks keep their metrics
    assert (quality_metric("classification"), quality_metric("dense")) == ("accuracy", "miou")


def test_build_model_gives_a_detector_of_k_object_classes():
    cfg = experiment_from_dict(DETECTION, ["model.detector={pyramid_channels: 16, representation_size: 32}"])
    model = build_model(cfg.model)
    assert isinstance(model, SplitDetector) and isinstance(model.backbone, SplitViT)
    assert model.num_classes == 10
    # the predictors add the background: K + 1 classes
    assert model.roi_heads.box_predictor.cls_score.out_features == 11
    assert model.roi_heads.mask_predictor.mask_fcn_logits.out_channels == 11
    assert model.pyramid.out_channels == 16 and model.pyramid.strides == [2, 4, 8, 16, 32]
    assert model.roi_heads.box_head.fc7.out_features == 32
    assert model.backbone.task == "classification" and model.backbone.vit.num_classes == 0  # no head runs
    assert model.backbone.geometry.image_size == (64, 64) and model.backbone.policy.name == "learned"
    # unset options keep SplitDetector's defaults (pyramid_channels 256); YAML lists become its tuples
    default = build_model(experiment_from_dict(DETECTION, ["model.detector={rpn_post_nms_top_n: [20, 10]}"]).model)
    assert default.pyramid.out_channels == 256
    assert default.rpn._post_nms_top_n == {"training": 20, "testing": 10}
    # the other tasks still build a SplitViT
    tiny_vit = {"embed_dim": 32, "depth": 1, "num_heads": 2}
    assert (
        type(build_model(ModelConfig(policy=PolicyConfig(depth=1), image_size=64, levels=2, timm_kwargs=tiny_vit)))
        is SplitViT
    )


def test_the_detector_builds_on_the_meta_device():
    """validate_experiment builds the model there: the detector must too (no memory, no weights)."""
    cfg = experiment_from_dict(DETECTION)
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_the_shipped_detection_config_validates():
    cfg = load_experiment(FASHION_DET)
    assert (cfg.model.task, cfg.data.name, cfg.model.num_classes, cfg.model.image_size) == (
        "detection",
        "fashion-det",
        10,
        128,
    )
    assert cfg.model.detector["pyramid_channels"] == 64 and cfg.model.policy.kind == "learned"


@pytest.mark.parametrize(
    "overrides, key, text",
    [
        (
            ["model.detector={pyramid_channel: 64}"],
            "model.detector.pyramid_channel",
            "not a SplitDetector option; did you mean model.detector.pyramid_channels?",
        ),
        (["model.detector={backbone: 1}"], "model.detector.backbone", "not a SplitDetector option; expected one of"),
        (
            ["model.detector={rpn_post_nms_top_n: [10]}"],
            "model.detector.rpn_post_nms_top_n",
            "expected tuple[int, int], got list [10]",
        ),
        (["model.detector={anchor_sizes: [8, 16]}"], "model.detector.anchor_sizes", "one per pyramid level (5), got 2"),
        (
            ["model.task=classification", "data.name=synthetic", "model.detector={pyramid_channels: 64}"],
            "model.detector",
            "sets a detector's options, but model.task is 'classification'",
        ),
        (
            ["model.timm_kwargs.patch_size=2", "model.levels=3"],
            "model.timm_kwargs.patch_size",
            "a detector needs a finest patch that is a power of two >= 4, got 2",
        ),
        (["model.num_classes=0"], "model.num_classes", "must be >= 1, got 0"),
        (
            ["train.teacher.kind=attention"],
            "train.teacher.kind",
            "attention is not a teacher of a detection model: a detector has no class token to attend from; "
            "its teachers are gradient and objects",
        ),
        (
            ["model.task=classification", "data.name=synthetic", "train.teacher.kind=objects"],
            "train.teacher.kind",
            "objects is not a teacher of a classification model: objects reads instance annotations",
        ),
        (
            ["train.teacher.kind=boxes"],
            "train.teacher.kind",
            "must be one of gradient, attention, objects, got 'boxes'",
        ),
        (["model.task=segmentation"], "model.task", "must be one of classification, dense, detection"),
        # the dataset's targets and the task, both ways
        (
            ["data.name=synthetic"],
            "data.name",
            "model.task=detection needs a detection dataset (fashion-det, coco, or parquet shards of one): "
            "'synthetic' has no object boxes",
        ),
        (
            ["model.task=classification"],
            "data.name",
            "'fashion-det' is a detection dataset (boxes and masks of objects): it needs model.task=detection, "
            "got model.task='classification'",
        ),
        (["model.task=dense", "data.name=coco"], "data.name", "'coco' is a detection dataset"),
    ],
)
def test_every_detection_config_error_is_one_line_naming_its_key(overrides, key, text):
    with pytest.raises(ConfigError) as err:
        experiment_from_dict(DETECTION, overrides)
    assert err.value.key == key
    assert text in err.value.reason
    assert "\n" not in str(err.value) and str(err.value).startswith(f"config error: {key}: ")


def test_a_task_and_data_mismatch_is_found_before_torch_loads():
    code = (
        "import sys; from splitvit.cli import main\n"
        f"code = main(['train', {str(FASHION_DET)!r}, 'data.name=cluttered-fashion-mnist'])\n"
        "print(code, sorted(m for m in ('torch', 'timm') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "2 []", done.stdout + done.stderr
    assert "error: config error: data.name: model.task=detection needs a detection dataset" in done.stderr


# ----------------------------------------------------------------- the datasets


def test_fashion_det_splits_have_their_own_seeds_and_are_deterministic(fmnist_root):
    splits = {
        split: fashion_det(fmnist_root, split, train_samples=3, val_samples=3, test_samples=3)
        for split in ("train", "val", "test")
    }
    assert [ds.seed for ds in splits.values()] == [0, 1, 2]  # seed 0's splits: distinct canvases
    assert {len(ds) for ds in splits.values()} == {3}
    assert len(splits["train"].images) == 40 and len(splits["val"].images) == 20 and len(splits["test"].images) == 20
    again = fashion_det(fmnist_root, "val", val_samples=3)
    image, target = again[0]
    assert same_item(again[0], splits["val"][0])
    assert not torch.equal(splits["train"][0][0], image)
    assert image.shape == (3, 64, 64) and target["masks"].shape[-2:] == (64, 64)
    assert int(target["labels"].min()) >= 1 and int(target["labels"].max()) <= 10
    # a seed moves every split; FashionDetection's options pass through
    seeded = build_dataset("fashion-det", "val", image_size=64, seed=1, root=str(fmnist_root), val_size=20)
    assert seeded.seed == 1001
    plain = fashion_det(fmnist_root, "train", num_samples=2, clutter=False, min_items=1, max_items=1)
    assert not plain.clutter and all(len(plain[i][1]["labels"]) == 1 for i in range(2))


def test_fashion_det_refuses_an_unknown_option(fmnist_root):
    with pytest.raises(
        ValueError, match=r"^dataset 'fashion-det': unknown option\(s\) clutter_fractoin; known: "
    ) as err:
        fashion_det(fmnist_root, "train", clutter_fractoin=0.5)
    assert "clutter_fraction" in str(err.value) and "val_size" in str(err.value)


def test_coco_reads_the_split_asked_for(coco_folder, fmnist_root):
    options = coco_options(coco_folder, "train", "val")
    val = build_dataset("coco", "val", image_size=64, **options)
    assert len(val) == 4 and val.categories[0] == "T-shirt/top" and val.num_classes == 11
    source = fashion_det(fmnist_root, "val", num_samples=4)
    assert all(same_item(val[i], source[i]) for i in range(4))  # bit for bit through the PNGs
    assert len(build_dataset("coco", "train", image_size=64, train_samples=2, verify=True, **options)) == 2


@pytest.mark.parametrize(
    "split, given, text",
    [
        ("val", ["train_annotations", "train_images"], "needs option val_annotations=FILE for the val split"),
        ("test", ["val_annotations", "val_images"], "needs option test_annotations=FILE for the test split"),
        ("train", ["train_images"], "needs option train_annotations=FILE for the train split"),
        ("train", ["train_annotations"], "needs option train_images=FOLDER for the train split"),
    ],
)
def test_coco_names_the_option_the_split_lacks(coco_folder, split, given, text):
    options = coco_options(coco_folder, "train", "val")
    with pytest.raises(ValueError) as err:
        build_dataset("coco", split, image_size=64, **{key: options[key] for key in given})
    assert str(err.value) == f"dataset 'coco' {text}"


def test_coco_refuses_unknown_options_and_letterboxes_other_image_sizes(coco_folder):
    options = coco_options(coco_folder, "train")
    with pytest.raises(ValueError, match=r"dataset 'coco': unknown option\(s\) root; known: strict, test_annotations"):
        build_dataset("coco", "train", image_size=64, root=str(coco_folder), **options)
    # 64-px images on a 32-px canvas: scaled by 0.5, boxes and masks with them
    same = build_dataset("coco", "train", image_size=64, **options)
    half = build_dataset("coco", "train", image_size=32, **options)
    (image, target), (big, original) = half[0], same[0]
    assert image.shape == (3, 32, 32) and float(target["scale"]) == 0.5 and "scale" not in original
    assert target["original_size"].tolist() == [64, 64] and big.shape == (3, 64, 64)
    assert torch.equal(target["boxes"], original["boxes"] * 0.5) and target["masks"].shape[-2:] == (32, 32)
    assert torch.equal(target["masks"], original["masks"][:, ::2, ::2])  # nearest: every other pixel
    assert torch.equal(target["area"], original["area"])  # the file's: COCO's evaluation runs in its pixels


def test_detection_collate_stacks_images_and_keeps_targets(fmnist_root):
    dataset = fashion_det(fmnist_root, "train", num_samples=5)
    images, targets = next(iter(DataLoader(dataset, batch_size=3, collate_fn=detection_collate)))
    assert images.shape == (3, 3, 64, 64) and isinstance(targets, list) and len(targets) == 3
    for i in range(3):
        assert same_item((images[i], targets[i]), dataset[i])
    small = (torch.zeros(3, 32, 32), targets[0])
    with pytest.raises(ValueError, match=r"one size, got \(3, 32, 32\), \(3, 64, 64\)"):
        detection_collate([dataset[0], small])


# ----------------------------------------------------------------- the preflight


def detection_config(tmp_path: Path, *overrides: str):
    return load_config(FASHION_DET, [f"storage.path={tmp_path / 'runs'}", *overrides])


def test_preflight_wants_k_object_classes(tmp_path, fmnist_root):
    data = f"data.options={{root: {fmnist_root}, val_size: 20, train_samples: 4, val_samples: 2}}"
    with pytest.raises(PreflightError) as err:
        pf.check_data(detection_config(tmp_path, data, "model.num_classes=11"))  # the background counted
    assert err.value.key == "model.num_classes"
    assert "is 11, but the fashion-det data in" in str(err.value)
    assert "have 10 object classes (labels 1..10; the background is not counted): set model.num_classes=10" in str(
        err.value
    )
    line, source = pf.check_data(detection_config(tmp_path, data))
    assert source == str(fmnist_root) and line.endswith(": 4 train, 2 val items, 10 object classes")


def test_preflight_wants_one_category_list_across_splits(tmp_path, coco_folder):
    renamed = tmp_path / "instances_val.json"
    document = json.loads((coco_folder / "instances_val.json").read_text())
    document["categories"][0]["name"] = "Tee"
    renamed.write_text(json.dumps(document))
    options = coco_options(coco_folder, "train", "val") | {"val_annotations": str(renamed)}
    overrides = ["data.name=coco", "model.image_size=64", "model.timm_kwargs.patch_size=8", "model.levels=2"]
    with pytest.raises(PreflightError) as err:
        pf.check_data(detection_config(tmp_path, *overrides, f"data.options={json.dumps(options)}"))
    assert err.value.key == "data"
    assert "the train and val splits name different categories (10 and 10: T-shirt/top, Tee in one only)" in str(
        err.value
    )
    del options["val_annotations"]
    with pytest.raises(PreflightError) as err:
        pf.check_data(detection_config(tmp_path, *overrides, f"data.options={json.dumps(options)}"))
    assert (err.value.key, str(err.value)) == (
        "data",
        "data: dataset 'coco' needs option val_annotations=FILE for the val split",
    )
    options["val_annotations"] = str(coco_folder / "instances_val.json")
    line, _ = pf.check_data(detection_config(tmp_path, *overrides, f"data.options={json.dumps(options)}"))
    assert "from " + str(coco_folder / "instances_train.json") in line and line.endswith("10 object classes")
