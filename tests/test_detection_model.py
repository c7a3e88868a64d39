"""SPLIT as a detector (issue 34): the fine map, the pyramid, torchvision's Mask R-CNN heads."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from torchvision.ops import box_iou

from splitvit.config import PolicyConfig
from splitvit.model import SplitViT
from splitvit.model.detection import SimpleFeaturePyramid, SplitDetector, training_targets
from splitvit.model.roi_align import MultiScaleRoIAlign

POLICIES = ["learned", "entropy", "random", "full", "coarse"]
CANVAS, PATCH, LEVELS, CLASSES = 64, 4, 2, 3
LOSSES = {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg", "loss_mask"}
#: small heads: the whole file runs in seconds on a shared CPU
SMALL_HEADS = dict(
    representation_size=64,
    mask_head_layers=(32, 32),
    rpn_pre_nms_top_n=(200, 100),
    rpn_post_nms_top_n=(100, 50),
    rpn_batch_size_per_image=64,
    box_batch_size_per_image=32,
)


def tiny_vit(**kwargs) -> timm.models.VisionTransformer:
    torch.manual_seed(0)
    args = dict(img_size=CANVAS, patch_size=PATCH, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    args.update(kwargs)
    return timm.create_model("vit_tiny_patch16_224", **args)


def tiny_detector(policy: str = "full", **backbone_options) -> SplitDetector:
    return SplitDetector.from_timm(
        tiny_vit(),
        policy=PolicyConfig(kind=policy, depth=1),
        num_classes=CLASSES,
        pyramid_channels=32,
        detector_options=SMALL_HEADS,
        levels=LEVELS,
        image_size=CANVAS,
        **backbone_options,
    )


def instance(box: tuple[int, int, int, int], label: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A box, its label and its (box-filling) mask."""
    x1, y1, x2, y2 = box
    mask = torch.zeros(CANVAS, CANVAS, dtype=torch.uint8)
    mask[y1:y2, x1:x2] = 1
    return torch.tensor(box, dtype=torch.float32), torch.tensor(label), mask


def target(*instances, iscrowd: list[int] | None = None) -> dict[str, torch.Tensor]:
    """A data-format target (boxes xyxy float, labels int64, masks uint8, iscrowd uint8)."""
    if not instances:
        return dict(
            boxes=torch.zeros(0, 4),
            labels=torch.zeros(0, dtype=torch.int64),
            masks=torch.zeros(0, CANVAS, CANVAS, dtype=torch.uint8),
            iscrowd=torch.zeros(0, dtype=torch.uint8),
        )
    boxes, labels, masks = zip(*instances)
    crowd = iscrowd if iscrowd is not None else [0] * len(instances)
    return dict(
        boxes=torch.stack(boxes),
        labels=torch.stack(labels),
        masks=torch.stack(masks),
        iscrowd=torch.tensor(crowd, dtype=torch.uint8),
    )


def scene() -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Two fixed images: bright rectangles (the objects) on dim noise, 1 and 2 boxes."""
    g = torch.Generator().manual_seed(3)
    images = torch.rand(2, 3, CANVAS, CANVAS, generator=g) * 0.3
    objects = [[((8, 10, 36, 30), 1)], [((30, 6, 58, 22), 2), ((6, 34, 22, 60), 3)]]
    colours = {1: (1.0, 0.2, 0.2), 2: (0.2, 1.0, 0.2), 3: (0.2, 0.2, 1.0)}
    for i, found in enumerate(objects):
        for (x1, y1, x2, y2), label in found:
            images[i, :, y1:y2, x1:x2] = torch.tensor(colours[label]).view(3, 1, 1)
    return images, [target(*(instance(box, label) for box, label in found)) for found in objects]


def grad_norm(module: torch.nn.Module) -> float:
    return sum(p.grad.abs().sum().item() for p in module.parameters() if p.grad is not None)


# 1. the backbone's fine map -------------------------------------------------------------------
@pytest.mark.parametrize(
    "timm_kwargs",
    [{}, dict(global_pool="avg", class_token=False), dict(reg_tokens=2, no_embed_class=True)],
    ids=["class-token", "no-prefix", "registers"],
)
def test_full_policy_fine_map_is_the_plain_vit_patch_tokens(timm_kwargs):
    vit = tiny_vit(**timm_kwargs).eval()
    detector = SplitDetector.from_timm(
        vit, num_classes=CLASSES, levels=LEVELS, policy="full", image_size=CANVAS, detector_options=SMALL_HEADS
    ).eval()
    backbone = detector.backbone
    images = torch.rand(2, 3, CANVAS, CANVAS)
    with torch.no_grad():
        fine, split = backbone.fine_features(images)
        tokens = vit.forward_features(backbone.normalize(images))[:, vit.num_prefix_tokens :]
    side = CANVAS // PATCH
    expected = tokens.reshape(2, side, side, -1).permute(0, 3, 1, 2)
    assert fine.shape == expected.shape == (2, vit.embed_dim, side, side)
    assert (fine - expected).abs().max().item() <= 1e-5
    assert split.tokens.tolist() == [side * side] * 2


def test_fine_features_are_what_the_dense_head_reads():
    """One code path: the dense task's logits are its head on :meth:`fine_features`."""
    model = SplitViT.from_timm(tiny_vit(), levels=3, image_size=CANVAS, task="dense", num_classes=4).eval()
    images = torch.rand(2, 3, CANVAS, CANVAS)
    g = torch.Generator().manual_seed(0)
    decisions = [torch.rand(2, *model.geometry.grid(level), generator=g) < 0.5 for level in range(2)]
    with torch.no_grad():
        out = model(images, decisions=decisions)
        fine, split = model.fine_features(images, decisions=decisions)
    assert torch.equal(model.dense_head(fine, (CANVAS, CANVAS)), out.logits)
    assert torch.equal(split.tokens, out.tokens)
    assert split.tokens.max() < split.full_tokens  # mixed leaves, not a one-level fast path


# 2. the pyramid ---------------------------------------------------------------------------------
def test_pyramid_levels_and_strides():
    pyramid = SimpleFeaturePyramid(32, 16, input_stride=16)
    maps = pyramid(torch.rand(1, 32, 8, 8))  # a 128-px canvas at patch 16
    assert list(maps) == ["0", "1", "2", "3", "pool"]
    assert pyramid.strides == [4, 8, 16, 32, 64]
    assert [tuple(m.shape) for m in maps.values()] == [(1, 16, 128 // s, 128 // s) for s in pyramid.strides]
    assert pyramid.out_channels == 16
    with pytest.raises(ValueError, match="non-integer strides"):
        SimpleFeaturePyramid(32, 16, input_stride=6)


def test_detector_settings_follow_the_canvas():
    detector = tiny_detector()
    # anchors: two strides of each level, strides p/4 .. 2p and the 'pool' level
    assert detector.rpn.anchor_generator.sizes == ((2,), (4,), (8,), (16,), (32,))
    # RoI levels: torchvision's 224 px at 1024 scaled to the 64-px canvas, at the stride-p level
    assert detector.roi_canonical_scale == 14
    mapper_level = detector.roi_heads.box_roi_pool.canonical_level
    assert mapper_level == int(math.log2(PATCH))
    # both pools take the vectorised RoIAlign backward (tests/test_roi_align.py)
    assert isinstance(detector.roi_heads.box_roi_pool, MultiScaleRoIAlign)
    assert isinstance(detector.roi_heads.mask_roi_pool, MultiScaleRoIAlign)
    # no classification head left to train
    assert isinstance(detector.backbone.vit.head, torch.nn.Identity)


def test_detector_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="power of two"):
        SplitDetector(SplitViT.from_timm(tiny_vit(patch_size=2), levels=2, image_size=CANVAS), CLASSES)
    with pytest.raises(ValueError, match="task"):
        SplitDetector(SplitViT.from_timm(tiny_vit(), levels=2, image_size=CANVAS, task="dense"), CLASSES)
    detector = tiny_detector().train()
    images, targets = scene()
    del targets[0]["masks"]
    with pytest.raises(ValueError, match="target 0: missing masks"):
        detector(images, targets)
    with pytest.raises(ValueError, match="needs targets"):
        detector(images)
    images, targets = scene()
    targets[1]["labels"] = targets[1]["labels"][:0]  # a label dropped: the instances no longer line up
    with pytest.raises(ValueError, match=r"target 1: boxes, labels, masks \(and iscrowd\) must count the same"):
        detector(images, targets)


# 3. every policy trains and detects -----------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_trains_and_detects(policy):
    detector = tiny_detector(policy).train()
    images, targets = scene()
    geometry = detector.backbone.geometry
    out = detector(images, targets)
    assert set(out.losses) == LOSSES
    assert all(torch.isfinite(v) for v in out.losses.values())
    probs = out.split.split_probs
    if policy == "learned":
        for p in probs:
            p.retain_grad()
    out.loss.backward()
    backbone = detector.backbone
    for part in (backbone.vit.blocks, backbone.vit.patch_embed, detector.pyramid, detector.rpn, detector.roi_heads):
        assert grad_norm(part) > 0
    for head in (detector.roi_heads.box_predictor, detector.roi_heads.mask_predictor):
        assert grad_norm(head) > 0
    if policy == "learned":  # the straight-through gates carry the detection loss to the split probabilities
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in probs)
        assert grad_norm(backbone.policy) > 0
    else:
        assert probs is None
    coarse_tokens = math.prod(geometry.grid(0))
    if policy == "full":
        assert out.split.tokens.tolist() == [geometry.full_tokens] * 2
    elif policy == "coarse":
        assert out.split.tokens.tolist() == [coarse_tokens] * 2
    else:
        assert all(coarse_tokens <= t <= geometry.full_tokens for t in out.split.tokens.tolist())

    detector.eval()
    with torch.no_grad():
        found = detector(images, targets)
    assert found.losses == {} and len(found.detections) == 2
    for d in found.detections:
        assert set(d) == {"boxes", "labels", "scores", "masks"}
        n = d["boxes"].shape[0]
        assert d["boxes"].shape == (n, 4) and d["labels"].shape == (n,) and d["scores"].shape == (n,)
        assert d["masks"].shape == (n, 1, CANVAS, CANVAS)  # at image size
        assert d["labels"].dtype == torch.int64 and all(v.device == images.device for v in d.values())
        if n:
            assert 1 <= d["labels"].min() and d["labels"].max() <= CLASSES
            assert 0 <= d["masks"].min() and d["masks"].max() <= 1
    if policy in ("full", "coarse"):
        assert found.split.tokens.tolist() == out.split.tokens.tolist()


# 4. targets --------------------------------------------------------------------------------------
def test_background_only_images_train():
    detector = tiny_detector("entropy").train()
    images, _ = scene()
    out = detector(images, [target(), target()])
    assert all(torch.isfinite(v) for v in out.losses.values())
    assert out.losses["loss_box_reg"].item() == 0 and out.losses["loss_mask"].item() == 0
    out.loss.backward()
    assert grad_norm(detector.rpn) > 0 and grad_norm(detector.roi_heads.box_predictor) > 0


def test_crowd_instances_are_not_trained_on():
    images, targets = scene()
    crowd = instance((40, 40, 60, 60), 1)
    with_crowd = [target(*[instance((8, 10, 36, 30), 1), crowd], iscrowd=[0, 1]), targets[1]]
    kept = training_targets(with_crowd, (CANVAS, CANVAS))
    assert kept[0]["boxes"].tolist() == [[8.0, 10.0, 36.0, 30.0]] and kept[0]["masks"].shape == (1, CANVAS, CANVAS)
    assert with_crowd[0]["boxes"].shape == (2, 4)  # the caller's targets unchanged

    detector = tiny_detector("full").train()
    losses = []
    for batch in (with_crowd, targets):  # the same, but for the crowd instance
        torch.manual_seed(0)  # the same anchor and proposal samples
        losses.append({k: v.item() for k, v in detector(images, batch).losses.items()})
    assert losses[0] == losses[1]
    torch.manual_seed(0)
    only_crowd = detector(images, [target(crowd, iscrowd=[1]), targets[1]]).losses
    torch.manual_seed(0)
    background = detector(images, [target(), targets[1]]).losses
    assert {k: v.item() for k, v in only_crowd.items()} == {k: v.item() for k, v in background.items()}


def test_the_detector_overfits_two_images():
    """A few dozen steps on two fixed images: the losses fall and the objects are found.
    (60 steps: at 40 a gradient changed at float rounding, 4e-7, flipped one detection;
    at 60 torchvision's and our RoIAlign backward pass on 7 random streams.)"""
    torch.manual_seed(0)
    detector = tiny_detector("full").train()
    images, targets = scene()
    optimizer = torch.optim.AdamW(detector.parameters(), lr=5e-3)
    history = []
    for _ in range(60):
        losses = detector(images, targets).losses
        loss = sum(losses.values())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append({k: v.item() for k, v in losses.items()} | {"total": loss.item()})

    def mean(key: str, steps: slice) -> float:
        return sum(h[key] for h in history[steps]) / len(history[steps])

    first, last = slice(0, 3), slice(-3, None)
    assert mean("total", last) < 0.25 * mean("total", first), history
    for key in ("loss_objectness", "loss_classifier", "loss_mask"):
        assert mean(key, last) < 0.3 * mean(key, first), (key, history)
    detector.eval()
    with torch.no_grad():
        detections = detector(images).detections
    for found, expected in zip(detections, targets):
        iou = box_iou(expected["boxes"], found["boxes"])  # (objects, detections)
        right = (found["labels"][None] == expected["labels"][:, None]) & (found["scores"][None] > 0.5)
        assert ((iou > 0.5) & right).any(1).all(), (found, expected)
