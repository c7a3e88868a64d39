"""From an experiment's settings to the objects that run it: the model a
:class:`~splitvit.config.ModelConfig` describes."""

from __future__ import annotations

from ..config import AUTO_THRESHOLDS, ModelConfig
from ..model import SplitViT


def build_model(model: ModelConfig, pretrained: bool | None = None) -> SplitViT:
    """Build the :class:`~splitvit.model.SplitViT` the ``model`` section describes.

    ``pretrained`` overrides ``model.pretrained`` (the validation builds on the meta
    device without weights). ``auto`` thresholds start at 0.5 until calibrated.
    """
    return SplitViT.from_timm(
        model.name,
        levels=model.levels,
        policy=model.policy,
        pretrained=model.pretrained if pretrained is None else pretrained,
        checkpoint_path=model.checkpoint_path,
        image_size=model.image_size,
        num_classes=model.num_classes,
        timm_kwargs=dict(model.timm_kwargs),
        thresholds=0.5 if model.thresholds == AUTO_THRESHOLDS else model.thresholds,
        policy_depth=model.policy_depth,
        policy_width=model.policy_width,
        task=model.task,
        length_buckets=model.length_buckets,
    )
