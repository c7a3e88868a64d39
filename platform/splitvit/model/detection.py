"""SPLIT as a detector: SplitViT's leaf features on the finest grid, a simple feature
pyramid (ViTDet's), and torchvision's Mask R-CNN parts.

The backbone is a :class:`~splitvit.model.splitvit.SplitViT`: its policy picks each
image's quadtree, the encoder runs on the leaves, and :meth:`SplitViT.fine_features`
lays every leaf's feature on the finest grid (stride ``p``, the ViT's patch size). With
the ``full`` policy that map is the plain ViT's patch tokens, so SPLIT-``full`` is the
plain ViT detector. :class:`SimpleFeaturePyramid` builds strides ``p/4 .. 2p`` (and a
``4p`` level for the proposals) from that one map, as ViTDet does; torchvision's region
proposal network and RoI heads (boxes, classes, masks) run on the pyramid.

Inputs are the SplitViT's: ``[0, 1]`` images of one canvas size, normalised by the
backbone itself. Nothing is resized or normalised again: torchvision's
``GeneralizedRCNNTransform`` is not used; the :class:`ImageList` is the batch as it is,
every image its full canvas, and the detections come back in its pixels.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from timm.layers import LayerNorm2d
from timm.models.vision_transformer import VisionTransformer
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.roi_heads import RoIHeads, paste_masks_in_image
from torchvision.models.detection.rpn import RegionProposalNetwork, RPNHead
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from .roi_align import MultiScaleRoIAlign
from .spec import CheckpointPayload, TrainingFacts, checkpoint_spec
from .splitvit import SplitOutput, SplitViT, load_checkpoint_state

#: ViTDet's pyramid: the fine map upsampled 4x and 2x, as it is, and pooled 2x.
PYRAMID_SCALES = (4.0, 2.0, 1.0, 0.5)
#: torchvision's (and ViTDet's) RoI level mapping: an object of 224 px pools from the
#: stride-16 level, on canvases of about 1024 px; scaled here to the canvas.
FIELD_CANONICAL_SCALE, FIELD_CANVAS = 224, 1024
#: Each level's anchor side, in strides of that level: the smallest objects of a
#: 128-px canvas (8 px) get stride-4 anchors of 8 px, the largest a 128-px one.
ANCHOR_STRIDES = 2
#: The target fields a training image needs (``iscrowd`` optional).
TARGET_KEYS = ("boxes", "labels", "masks")


@dataclass
class DetectorOutput:
    """What :meth:`SplitDetector.forward` returns.

    Attributes:
        losses: in training, torchvision's ``loss_objectness``, ``loss_rpn_box_reg``,
            ``loss_classifier``, ``loss_box_reg`` and ``loss_mask``; empty in evaluation.
        detections: in evaluation, one dict per image: ``boxes`` float ``(N, 4)`` xyxy
            pixels, ``labels`` int64 ``(N,)`` in ``1..K``, ``scores`` ``(N,)``, ``masks``
            float ``(N, 1, H, W)`` probabilities at image size (torchvision's format);
            empty in training.
        split: the backbone's :class:`SplitOutput` (tokens per image, decisions, split
            probabilities, expected tokens for the budget penalty); its ``logits`` is
            the fine map.
    """

    losses: dict[str, torch.Tensor]
    detections: list[dict[str, torch.Tensor]]
    split: SplitOutput

    @property
    def loss(self) -> torch.Tensor:
        """The sum of :attr:`losses` (training)."""
        if not self.losses:
            raise ValueError("no losses: the detector was in evaluation mode")
        return sum(self.losses.values())


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's simple feature pyramid: maps at several strides from one map.

    Each scale of :data:`PYRAMID_SCALES` is a 2x deconvolution twice (4x), once
    (2x), the map itself (1x) or a 2x max-pool (0.5x), then a 1x1 and a 3x3
    convolution to ``out_channels``, each followed by a channels-first LayerNorm
    (batch-independent, so batches of 1-2 images train as well as large ones).
    A stride-``2 * max`` level is added by subsampling the coarsest map (torchvision's
    ``LastLevelMaxPool``, ``'pool'``), for the proposals only.

    Args:
        in_channels: the input map's channels (the ViT's width).
        out_channels: every level's channels (torchvision's ``out_channels``).
        input_stride: the input map's stride in pixels (the finest patch ``p``).
        scales: the levels' scales relative to the input (ViTDet's by default).
        top_block: add the ``'pool'`` level.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int = 256,
        *,
        input_stride: int = 16,
        scales: tuple[float, ...] = PYRAMID_SCALES,
        top_block: bool = True,
    ) -> None:
        super().__init__()
        strides = [input_stride / scale for scale in scales]
        if any(s != int(s) for s in strides):
            raise ValueError(f"input_stride {input_stride} at scales {scales} gives non-integer strides {strides}")
        self.strides = [int(s) for s in strides] + ([int(strides[-1]) * 2] if top_block else [])
        self.out_channels = out_channels
        self.stages = nn.ModuleList(self._stage(in_channels, out_channels, scale) for scale in scales)
        self.top_block = LastLevelMaxPool() if top_block else None

    @staticmethod
    def _stage(dim: int, out_channels: int, scale: float) -> nn.Sequential:
        """One level: the rescaling, then the 1x1 and 3x3 convolutions with their norms."""
        if scale == 4.0:
            layers: list[nn.Module] = [
                nn.ConvTranspose2d(dim, dim // 2, 2, stride=2),
                LayerNorm2d(dim // 2),
                nn.GELU(),
                nn.ConvTranspose2d(dim // 2, dim // 4, 2, stride=2),
            ]
            width = dim // 4
        elif scale == 2.0:
            layers, width = [nn.ConvTranspose2d(dim, dim // 2, 2, stride=2)], dim // 2
        elif scale == 1.0:
            layers, width = [], dim
        elif scale == 0.5:
            layers, width = [nn.MaxPool2d(2, stride=2)], dim
        else:
            raise ValueError(f"pyramid scale {scale} is not one of 4, 2, 1, 0.5")
        # no bias before a norm, which has its own (ViTDet's choice)
        layers += [
            nn.Conv2d(width, out_channels, 1, bias=False),
            LayerNorm2d(out_channels),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            LayerNorm2d(out_channels),
        ]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        """``(B, in_channels, h, w)`` -> levels ``'0'..'3'`` finest first (and ``'pool'``)."""
        maps = [stage(x) for stage in self.stages]
        names = [str(i) for i in range(len(maps))]
        if self.top_block is not None:
            maps, names = self.top_block(maps, [], names)
        return OrderedDict(zip(names, maps))


class SplitDetector(nn.Module):
    """Mask R-CNN on a SplitViT: the backbone's fine map, a simple feature pyramid,
    torchvision's region proposal network and RoI heads (boxes, classes, masks).

    Configured for the backbone's canvas: no resize, no second normalisation;
    anchors and the RoI level mapping follow the canvas and the pyramid's strides.

    Args:
        backbone: the SplitViT (its classification head, never used, is dropped;
            a ``dense`` task's head is refused). Its finest patch ``p`` must be a power
            of two and at least 4: the pyramid's strides ``p/4 .. 2p`` are whole pixels,
            and torchvision's RoI pooler infers each level's scale as a power of two.
        num_classes: object classes ``K``; targets' labels are ``1..K``, and the
            predictors add the background class 0.
        pyramid_channels: every pyramid level's channels (and the RPN's, the RoI heads' input).
        anchor_sizes: one anchor side per pyramid level (``'pool'`` included); default
            :data:`ANCHOR_STRIDES` strides of each level: ``p/2, p, 2p, 4p, 8p``.
        aspect_ratios: the anchors' height/width ratios, the same at every level.
        roi_canonical_scale: the object side that pools from the stride-``p`` level
            (each halving or doubling moves one level); default torchvision's 224 px
            scaled from its 1024-px canvas to this canvas (28 px at 128).
        representation_size: the box head's MLP width.
        mask_head_layers: the mask head's convolution widths; default four of ``pyramid_channels``.
        rpn_pre_nms_top_n: proposals kept per level before NMS, ``(training, testing)``.
        rpn_post_nms_top_n: proposals kept per image after NMS, ``(training, testing)``.
        rpn_batch_size_per_image: anchors sampled per image for the RPN's loss.
        box_batch_size_per_image: proposals sampled per image for the box and mask losses.
        box_score_thresh, box_nms_thresh, box_detections_per_img: torchvision's inference settings.
    """

    def __init__(
        self,
        backbone: SplitViT,
        num_classes: int,
        *,
        pyramid_channels: int = 256,
        anchor_sizes: tuple[int, ...] | None = None,
        aspect_ratios: tuple[float, ...] = (0.5, 1.0, 2.0),
        roi_canonical_scale: int | None = None,
        representation_size: int = 1024,
        mask_head_layers: tuple[int, ...] | None = None,
        rpn_pre_nms_top_n: tuple[int, int] = (1000, 500),
        rpn_post_nms_top_n: tuple[int, int] = (500, 250),
        rpn_batch_size_per_image: int = 256,
        box_batch_size_per_image: int = 128,
        box_score_thresh: float = 0.05,
        box_nms_thresh: float = 0.5,
        box_detections_per_img: int = 100,
    ) -> None:
        super().__init__()
        # what rebuilds this detector on a rebuilt backbone (save/load)
        self.options = {
            "num_classes": num_classes,
            "pyramid_channels": pyramid_channels,
            "anchor_sizes": anchor_sizes,
            "aspect_ratios": tuple(aspect_ratios),
            "roi_canonical_scale": roi_canonical_scale,
            "representation_size": representation_size,
            "mask_head_layers": mask_head_layers,
            "rpn_pre_nms_top_n": tuple(rpn_pre_nms_top_n),
            "rpn_post_nms_top_n": tuple(rpn_post_nms_top_n),
            "rpn_batch_size_per_image": rpn_batch_size_per_image,
            "box_batch_size_per_image": box_batch_size_per_image,
            "box_score_thresh": box_score_thresh,
            "box_nms_thresh": box_nms_thresh,
            "box_detections_per_img": box_detections_per_img,
        }
        if backbone.task != "classification":
            raise ValueError(
                f"the detector's backbone runs no head: its task must be 'classification', not {backbone.task!r}"
            )
        if num_classes < 1:
            raise ValueError(f"num_classes (object classes, background excluded) must be >= 1, got {num_classes}")
        p = backbone.patch_size
        if p < 4 or p & (p - 1):
            raise ValueError(f"the detector needs a finest patch that is a power of two >= 4, got {p}")
        if backbone.vit.num_classes:
            backbone.vit.reset_classifier(0)  # parameters the detector never uses would still train (and DDP wait)
        self.backbone = backbone
        self.num_classes = num_classes
        self.pyramid = SimpleFeaturePyramid(backbone.embed_dim, pyramid_channels, input_stride=p)
        strides = self.pyramid.strides
        if anchor_sizes is None:
            anchor_sizes = tuple(ANCHOR_STRIDES * s for s in strides)
        if len(anchor_sizes) != len(strides):
            raise ValueError(f"anchor_sizes: one per pyramid level ({len(strides)}), got {len(anchor_sizes)}")
        anchors = AnchorGenerator(tuple((int(s),) for s in anchor_sizes), (tuple(aspect_ratios),) * len(strides))
        self.rpn = RegionProposalNetwork(
            anchors,
            RPNHead(pyramid_channels, anchors.num_anchors_per_location()[0]),
            fg_iou_thresh=0.7,
            bg_iou_thresh=0.3,
            batch_size_per_image=rpn_batch_size_per_image,
            positive_fraction=0.5,
            pre_nms_top_n=dict(training=rpn_pre_nms_top_n[0], testing=rpn_pre_nms_top_n[1]),
            post_nms_top_n=dict(training=rpn_post_nms_top_n[0], testing=rpn_post_nms_top_n[1]),
            nms_thresh=0.7,
        )
        canvas = max(backbone.geometry.image_size)
        if roi_canonical_scale is None:
            roi_canonical_scale = max(1, round(FIELD_CANONICAL_SCALE * canvas / FIELD_CANVAS))
        self.roi_canonical_scale = roi_canonical_scale
        # the RoI heads pool from the strides p/4 .. 2p ('pool' is the proposals' only)
        levels = [str(i) for i in range(len(PYRAMID_SCALES))]
        mapping = dict(canonical_scale=roi_canonical_scale, canonical_level=int(math.log2(p)))
        box_pool = MultiScaleRoIAlign(levels, output_size=7, sampling_ratio=2, **mapping)
        mask_pool = MultiScaleRoIAlign(levels, output_size=14, sampling_ratio=2, **mapping)
        mask_layers = tuple(mask_head_layers) if mask_head_layers is not None else (pyramid_channels,) * 4
        self.roi_heads = RoIHeads(
            box_pool,
            TwoMLPHead(pyramid_channels * 7 * 7, representation_size),
            FastRCNNPredictor(representation_size, num_classes + 1),
            fg_iou_thresh=0.5,
            bg_iou_thresh=0.5,
            batch_size_per_image=box_batch_size_per_image,
            positive_fraction=0.25,
            bbox_reg_weights=None,
            score_thresh=box_score_thresh,
            nms_thresh=box_nms_thresh,
            detections_per_img=box_detections_per_img,
            mask_roi_pool=mask_pool,
            mask_head=MaskRCNNHeads(pyramid_channels, mask_layers, dilation=1),
            mask_predictor=MaskRCNNPredictor(mask_layers[-1], mask_layers[-1], num_classes + 1),
        )

    @classmethod
    def from_timm(
        cls,
        model_or_name: VisionTransformer | str,
        *,
        num_classes: int,
        pyramid_channels: int = 256,
        detector_options: dict[str, Any] | None = None,
        **backbone_options: Any,
    ) -> SplitDetector:
        """Build the backbone with :meth:`SplitViT.from_timm` (``backbone_options``:
        its arguments, ``levels``, ``policy``, ``pretrained``, ``image_size``...; its
        ``num_classes`` is not passed, so a checkpoint with a head loads as it is) and
        the detector on it: ``num_classes`` object classes, ``pyramid_channels``, and
        the other :class:`SplitDetector` options in ``detector_options``."""
        backbone = SplitViT.from_timm(model_or_name, **backbone_options)
        return cls(backbone, num_classes, pyramid_channels=pyramid_channels, **(detector_options or {}))

    def forward(
        self,
        images: torch.Tensor,
        targets: list[dict[str, torch.Tensor]] | None = None,
        *,
        thresholds: float | list[float] | torch.Tensor | None = None,
        decisions: list[torch.Tensor] | None = None,
        budget: float | torch.Tensor | None = None,
    ) -> DetectorOutput:
        """Detect, or (training) compute the detection losses.

        Args:
            images: ``(B, C, H, W)`` in ``[0, 1]``, one canvas (``H``, ``W`` multiples of
                the coarsest patch); the backbone normalises them.
            targets: training only (ignored in evaluation), one dict per image:
                ``boxes`` float ``(N, 4)`` xyxy pixels, ``labels`` int64 ``(N,)`` in
                ``1..K``, ``masks`` uint8 ``(N, H, W)``, optional ``iscrowd`` ``(N,)``:
                crowd instances are left out of the targets. ``N`` may be 0 (background).
            thresholds, decisions, budget: the backbone's (:meth:`SplitViT.forward`).
        """
        if self.training and targets is None:
            raise ValueError("a detector in training mode needs targets")
        fine, split = self.backbone.fine_features(images, thresholds=thresholds, decisions=decisions, budget=budget)
        losses, detections = self.heads(fine, images, targets)
        return DetectorOutput(losses=losses, detections=detections, split=split)

    def heads(
        self, fine: torch.Tensor, images: torch.Tensor, targets: list[dict[str, torch.Tensor]] | None = None
    ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        """The pyramid, the proposals and the RoI heads on a fine map (the backbone's
        :meth:`SplitViT.fine_features`): ``(losses, [])`` in training, ``({}, detections)``
        in evaluation. The relevance teacher differentiates the losses with respect to
        the fine map itself, so this is a method of its own."""
        stage = self.backbone.stage  # marks for a clock on the backbone (splitvit bench parts)
        with stage("pyramid"):
            features = self.pyramid(fine)
        size = (int(images.shape[-2]), int(images.shape[-1]))
        # the batch as it is: every image its whole canvas, nothing resized
        image_list = ImageList(images, [size] * images.shape[0])
        train_targets = training_targets(targets, size) if self.training else None
        with stage("proposals"):
            proposals, rpn_losses = self.rpn(image_list, features, train_targets)
        with stage("roi_heads"):
            detections, roi_losses = self.roi_heads(features, proposals, image_list.image_sizes, train_targets)
        if self.training:
            return {**rpn_losses, **roi_losses}, []
        with stage("paste"):
            for found in detections:
                # the mask head's 28 x 28 masks pasted into their boxes at image size (no resize to undo)
                found["masks"] = paste_masks_in_image(found["masks"], found["boxes"], size)
        return {}, detections

    def save(self, path: str | Path, extra: TrainingFacts | None = None) -> None:
        """Save weights with what rebuilds the detector (:meth:`load`): the backbone's
        spec and data config, and the detector's own arguments."""
        if self.backbone.spec is None:
            raise ValueError("only a detector on a SplitViT built from a timm model name can be saved with its spec")
        payload: CheckpointPayload = {
            "kind": "detector",
            "spec": self.backbone.spec.to_dict(),
            "detector": dict(self.options),
            "state_dict": self.state_dict(),
            "data_config": self.backbone.data_config,
        }
        torch.save({**payload, **(extra or {})}, path)

    @classmethod
    def from_checkpoint(cls, payload: CheckpointPayload, **overrides: Any) -> SplitDetector:
        """Rebuild from a payload :meth:`save` wrote (``overrides`` change the backbone's
        spec, e.g. its ``policy``; the saved thresholds and weights load over it, as
        :meth:`SplitViT.from_checkpoint` does)."""
        if payload.get("kind") != "detector":
            raise ValueError("not a detector checkpoint (a SplitViT's? load it with SplitViT.load)")
        # the backbone has no head: the detector's classes are its own
        spec = dataclasses.replace(checkpoint_spec(payload, overrides), num_classes=None)
        options = dict(payload["detector"])
        num_classes, channels = options.pop("num_classes"), options.pop("pyramid_channels")
        backbone = SplitViT.from_spec(spec, payload.get("data_config"))
        model = cls(backbone, num_classes, pyramid_channels=channels, **options)
        load_checkpoint_state(model, payload, spec, prefix="backbone.")
        return model

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> SplitDetector:
        """Load a detector :meth:`save` wrote (local path)."""
        return cls.from_checkpoint(torch.load(path, map_location="cpu", weights_only=False), **overrides)


def split_backbone(model: nn.Module) -> SplitViT:
    """The SplitViT of a model: a detector's backbone, or the model itself. Thresholds,
    the data config, the geometry and split maps are the backbone's."""
    return model.backbone if isinstance(model, SplitDetector) else model


def training_targets(targets: list[dict[str, torch.Tensor]], size: tuple[int, int]) -> list[dict[str, torch.Tensor]]:
    """The targets the heads train on: crowd instances (``iscrowd == 1``) left out
    (COCO's rule: they are neither positives nor negatives to learn), types as
    torchvision's heads expect. The callers' dicts are not changed.

    Raises ``ValueError`` naming the image for a missing field, masks not of the
    image's size, or a box without area.
    """
    kept = []
    for i, target in enumerate(targets):
        missing = [k for k in TARGET_KEYS if k not in target]
        if missing:
            raise ValueError(f"target {i}: missing {', '.join(missing)} (needs {', '.join(TARGET_KEYS)})")
        boxes, labels, masks = target["boxes"], target["labels"], target["masks"]
        if tuple(masks.shape[-2:]) != size or masks.dim() != 3:
            raise ValueError(f"target {i}: masks must be (N, {size[0]}, {size[1]}), got {tuple(masks.shape)}")
        crowd = target.get("iscrowd")
        counts = {len(boxes), len(labels), len(masks), *([len(crowd)] if crowd is not None else [])}
        if len(counts) > 1:
            raise ValueError(
                f"target {i}: boxes, labels, masks (and iscrowd) must count the same instances, got "
                f"{len(boxes)}, {len(labels)}, {len(masks)}" + (f", {len(crowd)}" if crowd is not None else "")
            )
        if crowd is not None:
            keep = crowd == 0
            boxes, labels, masks = boxes[keep], labels[keep], masks[keep]
        boxes = boxes.float().reshape(-1, 4)
        if bool((boxes[:, 2:] <= boxes[:, :2]).any()):
            raise ValueError(f"target {i}: boxes must be xyxy with positive width and height, got {boxes.tolist()}")
        kept.append({"boxes": boxes, "labels": labels.long(), "masks": masks})
    return kept
