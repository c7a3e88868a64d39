"""SPLIT's objective and COCO evaluation for detection (issue 34): the training step
(warm-up, budget penalty, the detection loss's relevance teacher), evaluation through
the COCO files the procedural set writes, shards that merge into one evaluation, and
a detector checkpoint that loads back to the same detections."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from splitvit.config import ConfigError, SplitLossConfig
from splitvit.data.coco import CocoDetection
from splitvit.data.fashion_det import FashionDetection, write_coco
from splitvit.model.detection import SplitDetector
from splitvit.train.coco_eval import load_ground_truth
from splitvit.train.detection import (
    DetectionTotals,
    detection_relevance,
    detection_training_step,
    evaluate_detection_totals,
)

from .helpers import fake_items

CANVAS, LEVELS = 64, 2
SMALL_HEADS = dict(
    representation_size=64,
    mask_head_layers=(32, 32),
    rpn_pre_nms_top_n=(200, 100),
    rpn_post_nms_top_n=(100, 50),
    rpn_batch_size_per_image=64,
    box_batch_size_per_image=32,
)


def detector(policy: str = "learned", seed: int = 0) -> SplitDetector:
    """A tiny detector built from a timm name (so it can be saved): 64-px canvas, 8-px
    finest patches (16-px coarse), 10 Fashion-MNIST classes."""
    torch.manual_seed(seed)
    return SplitDetector.from_timm(
        "vit_tiny_patch16_224",
        num_classes=10,
        pyramid_channels=32,
        detector_options=SMALL_HEADS,
        timm_kwargs=dict(patch_size=8, embed_dim=48, depth=2, num_heads=2),
        levels=LEVELS,
        policy=policy,
        image_size=CANVAS,
        policy_depth=1,
        thresholds=0.5,
    )


def collate(batch):
    return torch.stack([image for image, _ in batch]), [target for _, target in batch]


@pytest.fixture(scope="module")
def coco_set(tmp_path_factory):
    """Eight procedural canvases (2-3 items of 16-28 px, no clutter) written as COCO files
    and read back with the COCO loader: the path real COCO data takes."""
    images, labels = fake_items(64, seed=3)
    procedural = FashionDetection(
        images,
        labels,
        image_size=CANVAS,
        num_samples=8,
        min_items=2,
        max_items=3,
        min_item_size=16,
        max_item_size=28,
        clutter=False,
        seed=1,
    )
    files = write_coco(procedural, tmp_path_factory.mktemp("coco"), "train")
    return CocoDetection(files.annotation_file, files.image_root)


def test_warm_up_trains_at_full_resolution_first_then_the_policy_with_budget_and_teacher(coco_set):
    model = detector("learned").train()
    images, targets = collate([coco_set[i] for i in range(2)])
    cfg = SplitLossConfig(warmup_epochs=2, target_ratio=0.5, lambda_budget=1.0, teacher_weight=1.0)
    _, stats = detection_training_step(model, images, targets, cfg, epoch=0)
    assert stats["token_ratio"] == 1.0 and "budget_penalty" not in stats and "teacher_loss" not in stats
    assert {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg", "loss_mask"} <= set(stats)
    model.zero_grad()
    loss, stats = detection_training_step(model, images, targets, cfg, epoch=2, step=0)
    assert {"budget_penalty", "teacher_loss"} <= set(stats) and 0 < stats["token_ratio"] < 1
    assert stats["loss"] == pytest.approx(
        stats["task_loss"] + stats["teacher_loss"] + stats["budget_penalty"], rel=1e-5
    )
    loss.backward()
    policy_grads = [p.grad for p in model.backbone.policy.parameters() if p.requires_grad]
    assert policy_grads and all(g is not None for g in policy_grads)
    assert sum(float(g.abs().sum()) for g in policy_grads) > 0  # the policy learns from budget and teacher
    # the teacher runs on every teacher_every-th step only
    _, stats = detection_training_step(model, images, targets, SplitLossConfig(teacher_every=2), epoch=5, step=1)
    assert "teacher_loss" not in stats and "budget_penalty" in stats


def test_the_teacher_relevance_is_the_detection_losss_gradient_on_each_node(coco_set):
    model = detector("learned").train()
    images, targets = collate([coco_set[i] for i in range(2)])
    relevance = detection_relevance(model, images, targets)
    geometry = model.backbone.geometry_for((CANVAS, CANVAS))
    assert [tuple(r.shape) for r in relevance] == [(2, *geometry.grid(level)) for level in range(LEVELS - 1)]
    assert all(bool(torch.isfinite(r).all()) and bool((r >= 0).all()) for r in relevance)
    assert all(float(r.sum()) > 0 for r in relevance)
    # no boxes: the box and mask losses vanish, and the relevance with them (up to the RPN's background)
    empty = [{**t, **{k: t[k][:0] for k in ("boxes", "labels", "masks", "iscrowd", "area")}} for t in targets]
    torch.manual_seed(0)
    background = detection_relevance(model, images, empty)
    assert all(float(b.sum()) < float(r.sum()) for b, r in zip(background, relevance))


def test_self_distillation_and_labels_the_detector_cannot_predict_are_refused(coco_set):
    images, targets = collate([coco_set[0]])
    with pytest.raises(ValueError, match="train.distill_weight"):
        detection_training_step(detector(), images, targets, SplitLossConfig(distill_weight=1.0), epoch=3)
    targets[0]["labels"] = targets[0]["labels"].clone()
    targets[0]["labels"][0] = 11  # 10 object classes: labels 1..10
    with pytest.raises(ConfigError, match=r"object label 11, outside 1..10 for model.num_classes = 10") as info:
        detection_training_step(detector(), images, targets, SplitLossConfig(), epoch=0)
    assert info.value.key == "model.num_classes"


def test_a_trained_detector_finds_the_items_and_shards_evaluate_as_one(coco_set, tmp_path):
    """Full resolution, trained on the eight canvases until it has learned them: COCO's
    box and mask AP on those canvases are high; two shards merged give the figures of
    one evaluation; the saved detector detects the same."""
    torch.manual_seed(0)
    model = detector("full").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = DataLoader(coco_set, batch_size=4, shuffle=True, collate_fn=collate)
    cfg = SplitLossConfig()
    first = None
    for epoch in range(40):
        for images, targets in loader:
            loss, stats = detection_training_step(model, images, targets, cfg, epoch=epoch)
            first = stats["loss"] if first is None else first
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert stats["loss"] < 0.4 * first, (first, stats["loss"])

    ground_truth = load_ground_truth(coco_set.index.dataset)
    label_to_category = [0, *coco_set.category_ids]
    ordered = DataLoader(coco_set, batch_size=4, collate_fn=collate)
    untrained = evaluate_detection_totals(detector("full"), ordered, label_to_category).figures(ground_truth)
    totals = evaluate_detection_totals(model, ordered, label_to_category)
    figures = totals.figures(ground_truth)
    # measured: box AP50 0.84 (AP 0.41), mask AP50 0.84; untrained: about 0
    assert figures["box_ap50"] > 0.6 and figures["mask_ap50"] > 0.6 and figures["box_ap"] > 0.25, figures
    assert untrained["box_ap50"] < 0.1 and untrained["mask_ap50"] < 0.1, untrained
    assert figures["token_ratio"] == 1.0 and figures["tokens_per_image"] == (CANVAS // 8) ** 2
    assert set(figures["per_class"]) == set(coco_set.categories)
    assert model.training  # evaluation restores the mode

    halves = [
        evaluate_detection_totals(
            model, DataLoader(Subset(coco_set, part), batch_size=3, collate_fn=collate), label_to_category
        )
        for part in (range(5, 8), range(0, 5))
    ]
    merged = DetectionTotals.merge(halves)
    same = {k: v for k, v in merged.figures(ground_truth).items() if k != "images_per_s"}
    assert same == {k: v for k, v in figures.items() if k != "images_per_s"}
    with pytest.raises(ValueError, match="overlap"):
        DetectionTotals.merge([halves[0], halves[0]])

    model.save(tmp_path / "detector.pt")
    loaded = SplitDetector.load(tmp_path / "detector.pt")
    again = evaluate_detection_totals(loaded, ordered, label_to_category)
    assert again.records == totals.records
    assert loaded.options == model.options
