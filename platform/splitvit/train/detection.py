"""The SPLIT objective and evaluation for detection (:class:`~splitvit.model.detection.SplitDetector`).

:func:`detection_training_step` is :func:`~splitvit.train.steps.training_step` for a
detector: the same warm-up (random splits, full resolution first), the same budget
penalty on the expected tokens, and the relevance teacher, whose relevance here is the
detection loss's: gradient x input of the Mask R-CNN losses with respect to the
backbone's fine map (each finest cell's feature), from a full-resolution pass, summed
into every quadtree node. A node matters when the boxes and masks depend on it.

:func:`evaluate_detection_totals` runs the detector over batches and keeps what COCO's
evaluation needs as plain records (:class:`DetectionTotals`): the shards of several
workers are gathered and :meth:`DetectionTotals.figures` evaluates them once, so the
figures are those of one process evaluating everything.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Required, TypedDict

import torch

from ..config import ConfigError, SplitLossConfig
from ..model.detection import SplitDetector
from ..model.quadtree import QuadtreeGeometry, nodes_mass
from .coco_eval import COCO_REFERENCE_SIDE, CocoRecord, area_ranges_for, coco_evaluate, detection_records
from .losses import budget_penalty, feature_distillation_loss, teacher_loss_at_ratio
from .steps import batch_target_ratio, object_counts, object_figures, policy_teacher_loss, warmup_decisions

Targets = list[dict[str, torch.Tensor]]


def detection_ground_truth(dataset: Any) -> Any:
    """COCO's ground truth of a detection dataset (a ``pycocotools`` ``COCO``): the
    document a dataset keeps (``ground_truth_document()``: a COCO file's own annotations,
    :class:`~splitvit.data.coco.CocoDetection`; the one stored with detection shards,
    :class:`~splitvit.data.parquet.ParquetShards`), else the document of its items
    (:func:`~splitvit.data.fashion_det.coco_document`: one pass over the set)."""
    from ..data.fashion_det import coco_document
    from .coco_eval import load_ground_truth

    own = getattr(dataset, "ground_truth_document", None)
    return load_ground_truth(own() if own is not None else coco_document(dataset))


def detection_area_ranges(image_size: int) -> dict[str, tuple[float, float]] | None:
    """The object-size ranges AP is reported by: COCO's own on canvases of a COCO
    image's size or more (comparable with the literature), scaled to the canvas
    below it (:func:`~.coco_eval.area_ranges_for`: on a 128-px canvas every object
    would be "large" by COCO's)."""
    return None if image_size >= COCO_REFERENCE_SIDE else area_ranges_for(image_size)


def check_detection_labels(targets: Targets, num_classes: int) -> None:
    """A ``ConfigError`` on ``model.num_classes`` for a label outside ``1..num_classes``
    (the detector's object classes; 0 is the background, never a target)."""
    labels = torch.cat([t["labels"].reshape(-1) for t in targets]) if targets else torch.zeros(0)
    bad = sorted({int(v) for v in labels[(labels < 1) | (labels > num_classes)].tolist()})
    if bad:
        raise ConfigError(
            "model.num_classes",
            f"the training data hold object label{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:8]))}, "
            f"outside 1..{num_classes} for model.num_classes = {num_classes} (object classes, background "
            "not counted): set it to the dataset's number of categories",
        )


def detection_relevance(detector: SplitDetector, images: torch.Tensor, targets: Targets) -> list[torch.Tensor]:
    """Every non-finest node's relevance to the detection loss: ``|grad . feature|`` of
    each finest cell's feature in a full-resolution pass (the detector in training mode,
    so the losses exist), summed over the node's area (:func:`nodes_mass`)."""
    backbone = detector.backbone
    geometry = backbone.geometry_for(tuple(images.shape[-2:]))
    with torch.enable_grad():
        fine, _ = backbone.fine_features(images, decisions=backbone.full_decisions(images))
        fine = fine.detach().requires_grad_(True)
        losses, _ = detector.heads(fine, images, targets)
        (grad,) = torch.autograd.grad(sum(losses.values()), fine)
    per_cell = (grad * fine.detach()).sum(1).abs()  # (B, H_fine, W_fine)
    return nodes_mass(per_cell, geometry)


def object_relevance(
    targets: Targets, geometry: QuadtreeGeometry, generator: torch.Generator | None = None, context: int = 0
) -> list[torch.Tensor]:
    """Every non-finest node's relevance by the annotations (``train.teacher.kind: objects``),
    summed over the node's area (:func:`nodes_mass`): per finest cell, the share of it
    under an instance mask, plus a tenth of the share under a box (the box regressor's
    context; a target without masks has its boxes alone), plus noise below 1e-4, so
    that the empty cells a budget still marks are drawn at random rather than always
    the same corner. No forward pass: the policy learns to find what the detector is
    asked to find.

    ``context`` (``train.teacher.context``): a ring of that many pixels around the
    masks (or boxes) counts too, half as much as an object at its edge and falling
    linearly with the distance (Chebyshev, as the oracle's ``--oracle-context`` grows
    masks), so that past the items' own cells the budget goes to their surroundings,
    nearest first."""
    height, width = geometry.image_size
    objects, boxes = [], []
    for target in targets:
        box = torch.zeros((height, width), device=target["boxes"].device)
        for x1, y1, x2, y2 in target["boxes"].floor().long().clamp(min=0).tolist():
            box[y1 : y2 + 1, x1 : x2 + 1] = 1.0
        objects.append((target["masks"] > 0).any(dim=0).float() if "masks" in target else box)
        boxes.append(box)
    masks = torch.stack(objects).unsqueeze(1)
    cover = masks + 0.1 * torch.stack(boxes).unsqueeze(1)
    if context:
        cover = cover + 0.5 * context_ring(masks, context)
    per_cell = torch.nn.functional.avg_pool2d(cover, geometry.patch_size).squeeze(1)  # (B, H_fine, W_fine)
    per_cell = per_cell + 1e-4 * torch.rand(per_cell.shape, generator=generator).to(per_cell.device)
    return nodes_mass(per_cell, geometry)


def context_ring(masks: torch.Tensor, context: int) -> torch.Tensor:
    """``(C - d + 1) / C`` at Chebyshev distance ``d`` in ``1..C`` from ``masks``
    (``(B, 1, H, W)``, 0/1; ``C = context``), 1 on the masks and 0 farther out: the mean
    of the masks grown by 1 to ``C`` pixels, one 3x3 dilation at a time."""
    grown, ring = masks, torch.zeros_like(masks)
    for _ in range(context):
        grown = torch.nn.functional.max_pool2d(grown, 3, stride=1, padding=1)
        ring = ring + grown
    return ring / context


def detection_training_step(
    detector: SplitDetector,
    images: torch.Tensor,
    targets: Targets,
    cfg: SplitLossConfig,
    epoch: int,
    generator: torch.Generator | None = None,
    step: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one detection batch (call ``backward`` on it) and its statistics.

    The detection losses (torchvision's five, summed: ``task_loss``), plus for a learned
    policy past warm-up the budget penalty and, on every ``cfg.teacher.every``-th step,
    the relevance teacher: ``cfg.teacher.kind`` ``gradient``, the detection loss's gradient
    (:func:`detection_relevance`, a full-resolution pass), or ``objects``, the
    annotations (:func:`object_relevance`, no pass); a detector has no class token to
    attend from. Self-distillation (``cfg.distill.weight``) is on the features here: the
    split path's fine map (what the pyramid and the heads read) learns the same
    backbone's full-resolution fine map (:func:`~.losses.feature_distillation_loss`, a
    gradient-free full-resolution pass of the backbone alone), so that the heads, trained
    on full-resolution features, see features like them on the mixed token grid;
    ``cfg.distill.temperature`` has no part in it.

    Raises ``ConfigError`` (key ``model.num_classes``) for a label the detector cannot
    predict, ``ValueError`` for a teacher a detector has not, ``FloatingPointError`` for
    a non-finite loss (a divergence, as in :func:`~splitvit.train.steps.training_step`).
    """
    if cfg.teacher.kind not in ("gradient", "objects"):
        raise ValueError(
            f"train.teacher.kind: a detector's teachers are gradient and objects, got {cfg.teacher.kind!r}"
        )
    check_detection_labels(targets, detector.num_classes)
    backbone = detector.backbone
    learned = backbone.policy.learned
    warmup = learned and epoch < cfg.policy.warmup_epochs
    stats: dict[str, float] = {}
    target_ratio = batch_target_ratio(cfg, learned and not warmup, generator, stats)
    if warmup:  # the classifier's curriculum
        out = detector(images, targets, decisions=warmup_decisions(backbone, images, cfg, epoch, generator))
    else:
        out = detector(images, targets, budget=target_ratio)
    main = out.loss
    loss = main
    stats["task_loss"] = float(main.detach())
    stats.update({name: float(value.detach()) for name, value in out.losses.items()})
    if learned and not warmup and cfg.teacher.weight > 0 and step % cfg.teacher.every == 0:
        geometry = backbone.geometry_for(tuple(images.shape[-2:]))
        relevance = _teacher_relevance(detector, images, targets, geometry, cfg, generator)
        taught = teacher_loss_at_ratio(
            out.split.split_probs, relevance, target_ratio, geometry, cfg.teacher.targets, cfg.teacher.scope
        )
        loss = loss + cfg.teacher.weight * taught
        stats["teacher_loss"] = float(taught.detach())
    if cfg.distill.weight > 0 and not warmup and backbone.policy.name != "full":
        with torch.no_grad():
            full_fine, _ = backbone.fine_features(images, decisions=backbone.full_decisions(images))
        distill = feature_distillation_loss(out.split.logits, full_fine)
        loss = loss + cfg.distill.weight * distill
        stats["distill_loss"] = float(distill.detach())
    if learned and not warmup:
        penalty = budget_penalty(out.split.expected_tokens / out.split.full_tokens, target_ratio, cfg.budget.penalty)
        loss = loss + cfg.budget.weight * penalty
        stats["budget_penalty"] = float(penalty.detach())
    stats["loss"] = float(loss.detach())
    stats["token_ratio"] = float(out.split.token_ratio.mean())
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {float(loss)} at epoch {epoch}: {stats}")
    return loss, stats


def detection_policy_step(
    detector: SplitDetector,
    images: torch.Tensor,
    targets: Targets,
    cfg: SplitLossConfig,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`~splitvit.train.steps.policy_training_step` for a detector: the teacher
    alone on the backbone's policy, its relevance the annotations' (``objects``: the
    policy's forward is the whole step) or the detection loss's gradient (a
    full-resolution pass of the detector, no weight of it trained)."""
    check_detection_labels(targets, detector.num_classes)
    backbone = detector.backbone
    stats: dict[str, float] = {}
    target_ratio = batch_target_ratio(cfg, True, generator, stats)
    geometry = backbone.geometry_for(tuple(images.shape[-2:]))
    relevance = _teacher_relevance(detector, images, targets, geometry, cfg, generator)
    return policy_teacher_loss(backbone, images, relevance, target_ratio, cfg, stats)


def _teacher_relevance(
    detector: SplitDetector,
    images: torch.Tensor,
    targets: Targets,
    geometry: QuadtreeGeometry,
    cfg: SplitLossConfig,
    generator: torch.Generator | None,
) -> list[torch.Tensor]:
    """The relevance ``cfg.teacher.kind`` marks: the annotations' (``objects``, no pass) or the
    detection loss's gradient (``gradient``, a full-resolution pass)."""
    if cfg.teacher.kind == "objects":
        return object_relevance(targets, geometry, generator, cfg.teacher.context)
    return detection_relevance(detector, images, targets)


class DetectionFigures(TypedDict, total=False):
    """:meth:`DetectionTotals.figures`: COCO's box and mask AP (0-1; -1 where there is
    nothing to score), tokens per image, token ratio and images/s, the object figures
    where the targets had instance masks, each class's box and mask AP by class name, and
    the object-size ranges used. Callers add their own counts: ``val_images`` (training's
    validation), ``images`` and ``quality`` (a checkpoint's evaluation)."""

    box_ap: Required[float]
    box_ap50: Required[float]
    box_ap75: Required[float]
    box_aps: Required[float]
    box_apm: Required[float]
    box_apl: Required[float]
    mask_ap: Required[float]
    mask_ap50: Required[float]
    mask_ap75: Required[float]
    mask_aps: Required[float]
    mask_apm: Required[float]
    mask_apl: Required[float]
    tokens_per_image: Required[float]
    token_ratio: Required[float]
    images_per_s: Required[float]
    fine_on_object: float
    object_coverage: float
    per_class: Required[dict[str, dict[str, float]]]  # class name -> box_ap, mask_ap
    area_ranges: Required[dict[str, list[float | None]]]  # pixels of area; large has no upper bound
    val_images: float
    images: int
    quality: float


@dataclass
class DetectionTotals:
    """What a detection evaluation keeps, before any figure: sums over images and the
    detections as COCO records. Shards of disjoint images merge (:meth:`merge`) into
    the totals of one evaluation of them all; ``elapsed`` is the slowest shard's."""

    images: int = 0
    tokens: int = 0
    full_tokens: int = 0
    elapsed: float = 0.0
    image_ids: list[int] = field(default_factory=list)
    records: list[CocoRecord] = field(default_factory=list)
    # the backbone's finest cells: chosen, chosen on an object (an instance mask), on an object
    fine_total: float = 0.0
    fine_on_object: float = 0.0
    object_cells: float = 0.0

    @classmethod
    def merge(cls, shards: Iterable[DetectionTotals]) -> DetectionTotals:
        """One evaluation's totals from its shards' (e.g. gathered from Ray Train's workers)."""
        total = cls()
        for shard in shards:
            total.images += shard.images
            total.tokens += shard.tokens
            total.full_tokens += shard.full_tokens
            total.elapsed = max(total.elapsed, shard.elapsed)
            total.image_ids += shard.image_ids
            total.records += shard.records
            total.fine_total += shard.fine_total
            total.fine_on_object += shard.fine_on_object
            total.object_cells += shard.object_cells
        if len(set(total.image_ids)) != len(total.image_ids):
            raise ValueError("the shards overlap: an image was evaluated twice")
        return total

    def figures(
        self, ground_truth: Any, *, area_ranges: dict[str, tuple[float, float]] | None = None
    ) -> DetectionFigures:
        """Box and mask AP (COCO's, 0-1: ``box_ap``, ``box_ap50``, ``box_ap75``,
        ``box_aps``/``m``/``l``, the same ``mask_*``), tokens per image, token ratio and
        images/s, ``fine_on_object`` and ``object_coverage`` where the targets had
        instance masks; ``per_class`` holds each class's box and mask AP and
        ``area_ranges`` the size ranges used."""
        coco = coco_evaluate(ground_truth, self.records, image_ids=self.image_ids, area_ranges=area_ranges)
        result = DetectionFigures()
        for prefix, iou_type in (("box", "bbox"), ("mask", "segm")):
            for key, value in coco[iou_type].items():
                if key != "per_class":
                    result[f"{prefix}_{key.lower()}"] = value
        images = max(self.images, 1)
        result["tokens_per_image"] = self.tokens / images
        result["token_ratio"] = self.tokens / max(self.full_tokens, 1)
        result["images_per_s"] = self.images / self.elapsed if self.elapsed > 0 else 0.0
        result.update(object_figures(self.fine_total, self.fine_on_object, self.object_cells))
        result["per_class"] = {
            name: {"box_ap": ap, "mask_ap": coco["segm"]["per_class"][name]}
            for name, ap in coco["bbox"]["per_class"].items()
        }
        result["area_ranges"] = coco["area_ranges"]
        return result


def to_original_pixels(found: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detections on a letterboxed canvas (the target has ``scale`` and ``original_size``:
    :func:`splitvit.data.coco.letterbox`) in the file's own pixels, where COCO's
    evaluation compares them with its annotations: boxes divided by the scale, masks cut
    from the padding and resized back. Other detections are returned as they are."""
    if "scale" not in target:
        return found
    scale = float(target["scale"])
    height, width = (int(v) for v in target["original_size"].tolist())
    inner = (max(1, round(height * scale)), max(1, round(width * scale)))
    boxes = found["boxes"] / scale
    boxes = torch.minimum(boxes.clamp(min=0), boxes.new_tensor([width, height, width, height]))
    mapped = {**found, "boxes": boxes}
    if "masks" in found:
        masks = found["masks"][..., : inner[0], : inner[1]]
        if masks.dim() == 3:
            masks = masks[:, None]
        mapped["masks"] = (
            torch.nn.functional.interpolate(masks.float(), size=(height, width), mode="bilinear", align_corners=False)
            if len(masks)
            else masks.new_zeros((0, 1, height, width))
        )
    return mapped


def annotation_decisions(targets: Targets, geometry: QuadtreeGeometry, context: int = 0) -> list[torch.Tensor]:
    """The oracle's split decisions (``splitvit eval --oracle``): a node splits when its
    area holds pixels of an instance mask, so exactly the finest cells the instances
    touch are fine tokens and the rest of the canvas is as coarse as the quadtree allows.
    Its box AP at the tokens it takes tells what a perfect policy would give this
    backbone; the tokens are those of ``scripts/oracle_item_coverage.py``. ``context``:
    the masks grown by this many pixels first (``--oracle-context``), so that the fine
    tokens also cover the items' surroundings.

    Raises:
        ValueError: a target without instance masks (boxes alone do not say which cells
            an object covers), or a negative ``context``.
    """
    if not all("masks" in t for t in targets):
        raise ValueError("the oracle splits where the instance masks are: this data's targets have boxes only")
    if context < 0:
        raise ValueError(f"--oracle-context must be >= 0 pixels, got {context}")
    covers = torch.stack([(t["masks"] > 0).any(dim=0).float() for t in targets])  # no instances: background
    if context:
        covers = torch.nn.functional.max_pool2d(covers.unsqueeze(1), 2 * context + 1, stride=1, padding=context)
        covers = covers.squeeze(1)
    per_cell = torch.nn.functional.avg_pool2d(covers.unsqueeze(1), geometry.patch_size).squeeze(1)
    return [mass > 0 for mass in nodes_mass(per_cell, geometry)]


@torch.no_grad()
def evaluate_detection_totals(
    detector: SplitDetector,
    batches: Iterable[tuple[torch.Tensor, Targets]],
    label_to_category: Sequence[int],
    *,
    thresholds: float | list[float] | None = None,
    device: torch.device | str | None = None,
    oracle: bool = False,
    oracle_context: int = 0,
) -> DetectionTotals:
    """Detect on every batch (the detector in evaluation mode, restored afterwards) and
    keep the totals: tokens, time in forward passes, each detection as a COCO record in
    the image file's pixels (:func:`to_original_pixels`; ``label_to_category[k]``:
    label ``k``'s COCO category id; image ids from the targets' ``image_id``), and where
    the targets carry instance masks (on the canvas) the backbone's fine cells on them.
    ``oracle``: the splits are :func:`annotation_decisions` (masks grown by
    ``oracle_context`` pixels), not the policy's."""
    was_training = detector.training
    detector.eval()
    totals = DetectionTotals()
    try:
        for images, targets in batches:
            if device is not None:
                images = images.to(device)
            decisions = None
            if oracle:
                geometry = detector.backbone.geometry_for(tuple(images.shape[-2:]))
                decisions = [d.to(images.device) for d in annotation_decisions(targets, geometry, oracle_context)]
            start = time.perf_counter()
            out = detector(images, thresholds=thresholds, decisions=decisions)
            totals.elapsed += time.perf_counter() - start
            ids = [int(t["image_id"]) for t in targets]
            found = [to_original_pixels(d, t) for d, t in zip(out.detections, targets)]
            totals.records += detection_records(ids, found, label_to_category)
            totals.image_ids += ids
            totals.images += images.shape[0]
            totals.tokens += int(out.split.tokens.sum())
            totals.full_tokens += out.split.full_tokens * images.shape[0]
            if all("masks" in t for t in targets):
                backbone = detector.backbone
                objects = torch.stack([(t["masks"] > 0).any(dim=0) for t in targets])  # zero masks: background
                chosen, on_object, cells = object_counts(
                    out.split.fine_cell_level(), backbone.levels - 1, backbone.patch_size, objects
                )
                totals.fine_total += chosen
                totals.fine_on_object += on_object
                totals.object_cells += cells
    finally:
        detector.train(was_training)
    return totals
