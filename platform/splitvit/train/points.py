"""An evaluated operating point: a checkpoint's figures at one token budget
(:func:`~splitvit.train.evaluation.evaluate_points`), as a study's method runs and a
sweep's baselines carry it. Torch-free: a study reads its stored points without torch."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ..jsontypes import JsonObject

#: the figures every point has, each a field of its own
_COMMON = ("tokens_per_image", "token_ratio", "images_per_s")


@dataclass(frozen=True)
class EvaluatedPoint:
    """Quality, tokens and speed of one evaluation at ``target_ratio`` (``None``: the
    policy's own budget, full or coarse). ``metrics`` holds the task's own figures, in
    the evaluation's order: ``accuracy`` or ``miou``; a detector's ``box_*``/``mask_*``
    AP, ``per_class`` and ``area_ranges``; ``fine_on_object`` and ``object_coverage``
    where objects were counted. :meth:`to_dict` writes the evaluation's JSON, key for
    key and in its order."""

    target_ratio: float | None
    quality: float  # accuracy, mIoU or box AP: the task's quality metric
    tokens_per_image: float
    token_ratio: float
    images_per_s: float
    images: int
    thresholds: list[float] | None  # the per-level thresholds evaluated (None: the annotations' splits)
    metrics: JsonObject  # the task's own figures (see above), as its JSON writes them

    @property
    def detector(self) -> bool:
        """A detector's point (box AP first in its JSON)."""
        return "box_ap" in self.metrics

    def figure(self, name: str) -> float:
        """A figure by its JSON name (a field or one of ``metrics``), e.g. a study's
        companion metric ``mask_ap``; ``KeyError`` where the point has none."""
        if name in self.metrics:
            return float(self.metrics[name])
        if name in {"quality", "images", *_COMMON}:
            return float(getattr(self, name))
        raise KeyError(name)

    def to_dict(self) -> JsonObject:
        """The evaluation's JSON: ``target_ratio``; a classifier's tokens, speed and
        images then its figures, a detector's AP, tokens and speed, its other figures
        and its images; then ``quality`` and ``thresholds``."""
        common = {k: getattr(self, k) for k in _COMMON}
        metrics = copy.deepcopy(self.metrics)
        if self.detector:
            ap = {k: v for k, v in metrics.items() if k.startswith(("box_", "mask_"))}
            rest = {k: v for k, v in metrics.items() if k not in ap}
            body = {**ap, **common, **rest, "images": self.images}
        else:
            body = {**common, "images": self.images, **metrics}
        thresholds = None if self.thresholds is None else list(self.thresholds)
        return {"target_ratio": self.target_ratio, **body, "quality": self.quality, "thresholds": thresholds}

    @classmethod
    def from_dict(cls, data: JsonObject) -> EvaluatedPoint:
        """The inverse of :meth:`to_dict` (an evaluation's figures, ``target_ratio``
        added); a missing common figure raises ``KeyError``."""
        own = {"target_ratio", "quality", "images", "thresholds", *_COMMON}
        thresholds = data["thresholds"]
        return cls(
            target_ratio=data["target_ratio"],
            quality=data["quality"],
            tokens_per_image=data["tokens_per_image"],
            token_ratio=data["token_ratio"],
            images_per_s=data["images_per_s"],
            images=data["images"],
            thresholds=None if thresholds is None else list(thresholds),
            metrics={k: copy.deepcopy(v) for k, v in data.items() if k not in own},
        )
