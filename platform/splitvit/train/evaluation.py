"""Evaluate a training checkpoint (local or ``s3://``) on its experiment's data.

One evaluator serves every evaluation-only caller: ``splitvit eval``, a study's
operating points and speed timing, and a sweep's stage two and baselines
(``tune/stage_two.py``). It loads the checkpoint once and its data when first asked.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..jsontypes import JsonObject
from ..model import SplitViT, validate_thresholds
from ..model.detection import SplitDetector, split_backbone
from .checkpoints import load_payload, model_from_payload
from .points import EvaluatedPoint
from .steps import calibrate_thresholds, evaluate

if TYPE_CHECKING:
    from .detection import DetectionFigures

log = logging.getLogger(__name__)

#: Evaluation sets up to this many images are kept in memory between evaluations.
CACHE_LIMIT = 4096


class CheckpointEvaluator:
    """A checkpoint's model and its experiment's evaluation data.

    The model is a SplitViT or a :class:`SplitDetector` (evaluated with COCO's box
    and mask AP; thresholds, calibration and split maps are its backbone's). It loads
    on construction (a checkpoint that does not fit its spec fails
    here, naming the checkpoint); the data load when first used, so bad thresholds
    fail before any image is read.

    Args:
        checkpoint: a checkpoint folder or its ``model.pt`` (local or ``s3://``).
        split: the data split to evaluate on (default: the experiment's validation split).
        samples: evaluate on this many images (default: the experiment's split size).
        batch_size: evaluation batch size (default: the experiment's).
        policy: evaluate with another split policy (``entropy``, ``full``...) on the
            checkpoint's backbone.
        device: torch device.
        cache: keep the evaluation batches in memory (sets up to ``CACHE_LIMIT`` images).
    """

    def __init__(
        self,
        checkpoint: str,
        *,
        split: str | None = None,
        samples: int | None = None,
        batch_size: int | None = None,
        policy: str | None = None,
        device: str = "cpu",
        cache: bool = True,
    ) -> None:
        self.checkpoint = str(checkpoint)
        self.device = torch.device(device)
        self.payload = load_payload(self.checkpoint)
        self.model = self.build(policy)
        config = self.payload.get("config") or {}
        self.data = config.get("data") or {}
        if not self.data.get("name"):
            raise ValueError(
                f"checkpoint {checkpoint} holds no experiment config; it was not written by splitvit train"
            )
        self.num_classes = (config.get("model") or {}).get("num_classes")
        self.backbone = split_backbone(self.model)
        self.levels = self.backbone.levels
        self.split = split or self.data.get("val_split") or "val"
        self.samples = samples
        self.batch_size = int(batch_size or self.data.get("eval_batch_size") or self.data.get("batch_size") or 64)
        self.num_workers = int(self.data.get("num_workers") or 0)
        self._cache: list | None = None
        self._ground_truth: Any = None  # a detector's: COCO's ground truth of the evaluated split
        self._use_cache = cache

    def build(self, policy: str | None) -> SplitViT | SplitDetector:
        """The checkpoint's model, under ``policy`` instead of its own when given."""
        overrides = {"policy": policy} if policy else {}
        return model_from_payload(self.payload, self.checkpoint, **overrides).to(self.device).eval()

    @functools.cached_property
    def dataset(self) -> Dataset:
        """The evaluation split (``samples`` images), built on first use."""
        return self.split_dataset(self.split, self.samples)

    def batches(self):
        """The evaluation batches (kept in memory after the first pass for small sets)."""
        if self._cache is not None:
            return self._cache
        from ..data import detection_collate

        collate = detection_collate if isinstance(self.model, SplitDetector) else None
        loader = DataLoader(
            self.dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers, collate_fn=collate
        )
        if self._use_cache and len(self.dataset) <= CACHE_LIMIT:
            self._cache = list(loader)
            return self._cache
        return loader

    def autocast(self):
        """The precision every evaluation runs in: bf16 autocast on CUDA, float32 elsewhere."""
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def calibrate(self, images: torch.Tensor, target_ratio: float, model: SplitViT | None = None) -> list[float]:
        """Thresholds that meet ``target_ratio`` on ``images``, scored in the precision
        :meth:`evaluate` runs in (so the evaluated budget is the calibrated one)."""
        with self.autocast():
            return calibrate_thresholds(split_backbone(model or self.model), images, target_ratio)

    def evaluate(
        self,
        thresholds: list[float] | None = None,
        model: SplitViT | None = None,
        *,
        oracle: bool = False,
        oracle_context: int = 0,
    ) -> EvaluatedPoint:
        """Quality (accuracy, mIoU or box AP), tokens per image, token ratio and images/s
        at ``thresholds`` (validated before any data are read); on data with object
        masks also ``fine_on_object`` and ``object_coverage``; a detector's mask AP and
        AP per class too. ``oracle`` (detectors): split where the annotations' instances
        are (:func:`~splitvit.train.detection.annotation_decisions`, the masks grown by
        ``oracle_context`` pixels), not by the policy; its ``thresholds`` are ``None``."""
        model = model or self.model
        if thresholds is not None:
            validate_thresholds(thresholds, split_backbone(model).levels)
        if oracle and not isinstance(model, SplitDetector):
            raise ValueError(
                f"--oracle splits where a detection dataset's instance masks are; {self.checkpoint} "
                "is not a detector (model.task=detection)"
            )
        if isinstance(model, SplitDetector):
            result = self._evaluate_detector(model, thresholds, oracle, oracle_context)
        else:
            result = self._evaluate_classifier(model, thresholds)
        used = thresholds if thresholds is not None else split_backbone(model).thresholds.tolist()
        return EvaluatedPoint.from_dict(
            {"target_ratio": None, **result, "thresholds": None if oracle else [float(t) for t in used]}
        )

    def _evaluate_classifier(self, model: SplitViT, thresholds: list[float] | None) -> dict[str, float]:
        with self.autocast():
            result = evaluate(
                model, self.batches(), thresholds=thresholds, num_classes=self.num_classes, object_masks=True
            )
        result["quality"] = result.get("miou", result.get("accuracy"))
        return result

    def _evaluate_detector(
        self, model: SplitDetector, thresholds: list[float] | None, oracle: bool = False, oracle_context: int = 0
    ) -> DetectionFigures:
        from .detection import detection_area_ranges, detection_ground_truth, evaluate_detection_totals

        with self.autocast():
            totals = evaluate_detection_totals(
                model,
                self.batches(),
                [0, *self.dataset.category_ids],
                thresholds=thresholds,
                device=self.device,
                oracle=oracle,
                oracle_context=oracle_context,
            )
        if self._ground_truth is None:
            self._ground_truth = detection_ground_truth(self.dataset)
        result = totals.figures(
            self._ground_truth, area_ranges=detection_area_ranges(self.backbone.geometry.image_size[0])
        )
        result["images"] = totals.images
        result["quality"] = result["box_ap"]
        return result

    def split_dataset(self, split: str, samples: int | None = None) -> Dataset:
        """The checkpoint's experiment data, split ``split`` (``samples`` images; ``None``:
        the split's own count), built as the evaluation builds its own."""
        from ..data import build_dataset

        options = dict(self.data.get("options") or {})
        if samples is not None:
            options.pop("num_samples", None)  # it would win over the split's own count
            options[f"{split}_samples"] = samples
        return build_dataset(
            self.data["name"],
            split,
            image_size=self.backbone.geometry.image_size[0],
            interpolation=self.backbone.data_config["interpolation"],
            seed=int(self.data.get("seed", 0)),
            **options,
        )

    def first_images(self, count: int, split: str | None = None) -> torch.Tensor:
        """The first ``count`` images of the evaluation split, or of ``split`` (e.g.
        validation images to calibrate thresholds on, never the evaluated ones)."""
        from ..data import first_images

        dataset = self.dataset if split in (None, self.split) else self.split_dataset(split, count)
        return first_images(dataset, count).to(self.device)

    @torch.no_grad()
    def split_map(self, thresholds: list[float] | None, count: int = 8):
        """A PIL grid of the quadtree the model chooses on the first ``count`` images."""
        from ..tracking.split_maps import split_map_grid

        images = self.first_images(count)
        out = self.backbone(images, thresholds=thresholds)
        captions = [f"{int(t)}/{out.full_tokens} tok" for t in out.tokens]
        return split_map_grid(images.cpu(), [d.cpu() for d in out.decisions], self.backbone.geometry, captions)


def evaluate_checkpoint(
    checkpoint: str,
    *,
    thresholds: list[float] | None = None,
    policy: str | None = None,
    split: str = "val",
    batch_size: int | None = None,
    samples: int | None = None,
    device: str = "cpu",
    oracle: bool = False,
    oracle_context: int = 0,
) -> JsonObject:
    """One evaluation of a checkpoint (``splitvit eval``): :meth:`CheckpointEvaluator.evaluate`
    plus the checkpoint, its epoch, the policy (``oracle`` for the annotations' splits)
    and the split. The arguments are :class:`CheckpointEvaluator`'s; ``thresholds`` are
    per-level split thresholds; ``oracle`` and ``oracle_context`` as in
    :meth:`CheckpointEvaluator.evaluate`."""
    evaluator = CheckpointEvaluator(
        checkpoint, split=split, samples=samples, batch_size=batch_size, policy=policy, device=device, cache=False
    )
    point = evaluator.evaluate(thresholds, oracle=oracle, oracle_context=oracle_context)
    return {
        **{k: v for k, v in point.to_dict().items() if k != "target_ratio"},
        "checkpoint": str(checkpoint),
        "epoch": evaluator.payload.get("epoch"),
        "policy": "oracle" if oracle else evaluator.backbone.policy.name,
        "split": split,
    }


def evaluate_points(
    checkpoint: str,
    *,
    policy: str,
    ratios: list[float],
    split: str,
    samples: int | None,
    calibration_samples: int,
    seed: int,
    device: str = "cpu",
) -> list[EvaluatedPoint]:
    """Quality, tokens per image and images/s of ``checkpoint`` on ``split``: one point
    for ``full``/``coarse``, else one per token ratio, its thresholds calibrated on the
    first ``calibration_samples`` validation images (never on the evaluated ones, unless
    ``split`` is ``val`` itself: a sweep's baselines are chosen on validation like its points).
    A study's method runs and a sweep's fine-tuned baselines are evaluated with it."""
    evaluator = CheckpointEvaluator(checkpoint, samples=samples, device=device, split=split)
    if not ratios:
        return [evaluator.evaluate(None)]
    return calibrated_points(evaluator, ratios, calibration_samples, seed=seed, label=policy)


def calibrated_points(
    evaluator: CheckpointEvaluator, ratios: list[float], calibration_samples: int, *, seed: int = 0, label: str = ""
) -> list[EvaluatedPoint]:
    """One point per token ratio: ``evaluator``'s model with its thresholds calibrated to
    the ratio on the first ``calibration_samples`` validation images, evaluated on its
    split; each point keeps the ratio it was calibrated to (``target_ratio``). How a
    study's methods, a sweep's baselines and stage two's calibrated points are made."""
    calibration = evaluator.first_images(calibration_samples, split="val")
    points: list[EvaluatedPoint] = []
    for ratio in ratios:
        # the random policy draws fresh scores on every call: seeded, so a rerun repeats it
        torch.manual_seed(seed * 1009 + round(ratio * 1000))
        thresholds = evaluator.calibrate(calibration, ratio)
        points.append(dataclasses.replace(evaluator.evaluate(thresholds), target_ratio=float(ratio)))
        log.info(
            "%s @ %.2f: thresholds %s -> quality %.4f at %.1f tokens/image",
            label or "calibrated point",
            ratio,
            [round(t, 3) for t in thresholds],
            points[-1].quality,
            points[-1].tokens_per_image,
        )
    return points
