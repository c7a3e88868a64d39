"""Losses of SPLIT training: task loss, token-budget penalty, relevance teacher."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import PENALTIES, TEACHER_SCOPES, TEACHER_TARGETS
from ..model.quadtree import QuadtreeGeometry

IGNORE_INDEX = 255


def task_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for labels ``(B,)`` or per-pixel masks ``(B, H, W)`` (255 ignored)."""
    return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


def distillation_loss(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0, target: torch.Tensor | None = None
) -> torch.Tensor:
    """KL divergence of the student's class distribution from the teacher's, at
    ``temperature`` and scaled by its square (gradients keep their size as it
    changes); over dim 1, so per image ``(B, C)`` or per pixel ``(B, C, H, W)``,
    averaged over images and pixels. With a dense ``target`` mask ``(B, H, W)`` the
    mean is over the pixels the task loss counts (255 is unlabelled: no class for the
    teacher to know either). The teacher is detached."""
    with torch.autocast(device_type=student.device.type, enabled=False):
        log_student = F.log_softmax(student.float() / temperature, dim=1)
        log_teacher = F.log_softmax(teacher.detach().float() / temperature, dim=1)
        per_item = (log_teacher.exp() * (log_teacher - log_student)).sum(1)
    if target is not None and target.shape == per_item.shape and per_item.dim() > 1:
        labelled = (target != IGNORE_INDEX).to(per_item.dtype)
        return (per_item * labelled).sum() / labelled.sum().clamp_min(1.0) * temperature**2
    return per_item.mean() * temperature**2


def feature_distillation_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Squared error of the student's feature map from the teacher's (``(B, D, H, W)``
    or any shape alike), relative to the teacher's variance: 0 when they agree, 1 for a
    student that outputs the teacher's mean everywhere, whatever the features' scale.
    The teacher is detached."""
    with torch.autocast(device_type=student.device.type, enabled=False):
        target = teacher.detach().float()
        return F.mse_loss(student.float(), target) / target.var().clamp_min(1e-12)


def budget_penalty(expected_ratio: torch.Tensor, target_ratio: float, kind: str = "squared") -> torch.Tensor:
    """Penalty on the batch's mean expected token ratio (``E[n] / N_full``).

    ``squared`` pulls toward ``target_ratio`` from both sides (DynamicViT's keep-ratio
    loss); ``hinge`` only penalises going over it. A plain linear penalty is not
    offered: it drives a young policy to all-coarse before the backbone can use
    fine tokens.
    """
    mean = expected_ratio.mean()
    if kind == "squared":
        return (mean - target_ratio) ** 2
    if kind == "hinge":
        return F.relu(mean - target_ratio) ** 2
    raise ValueError(f"budget penalty must be one of {PENALTIES}, got {kind!r}")


def split_fraction_for_ratio(target_ratio: float, geometry: QuadtreeGeometry) -> float:
    """Share of nodes per level to split so that nested top-down splits meet
    ``target_ratio``: tokens = ``N_min + f * (N_full - N_min)``."""
    r_min = geometry.min_tokens / geometry.full_tokens
    return min(max((target_ratio - r_min) / (1 - r_min), 0.0), 1.0)


def _mark_top(flat: torch.Tensor, fraction: float, scope: str = "image") -> torch.Tensor:
    """1.0 at the ``fraction`` of each row's entries with the largest values, else 0.0;
    ``scope`` ``batch``: of all rows' entries together (the rows are the images)."""
    if scope == "batch":
        return _mark_top(flat.reshape(1, -1), fraction).view_as(flat)
    k = min(max(int(math.ceil(fraction * flat.shape[1])), 0), flat.shape[1])
    marks = torch.zeros_like(flat)
    if k > 0:
        marks.scatter_(1, flat.topk(k, dim=1).indices, 1.0)
    return marks


def relevance_targets(
    relevance: list[torch.Tensor], fraction: float, kind: str = "per_level", scope: str = "image"
) -> list[torch.Tensor]:
    """The teacher's split targets at a split ``fraction``, one tensor per level, shaped
    like ``relevance``; ``scope`` is ``train.teacher.scope`` (``image``: the fraction of
    each image's nodes; ``batch``: of the batch's, its images ranked together) and
    ``kind`` is ``train.teacher.targets``:

    * ``per_level``: 1.0 at the ``fraction`` of each level's nodes with the most
      relevance, each level ranked on its own. Every level's scores learn a ranking, but
      a finer node may be marked under a coarse one that is not, so the tree the marks
      describe misses the target ratio, by an amount that varies from image to image.
    * ``nested``: 1.0 at the ``fraction`` of all levels' nodes together with the most
      relevance. The marks form a tree, because a node's relevance is the mass summed
      over its area, so never less than a child's (ties aside); splitting them gives
      ``N_min + fraction * (N_full - N_min)`` tokens, the target ratio of
      :func:`split_fraction_for_ratio`, on every image. At a high target every node of
      the coarsest level is marked, so that level's scores learn no ranking.
    * ``mixed``: the mean of the two (0, 0.5 or 1.0), so the binary cross-entropy is the
      mean of both losses: nested's budget and tree, per-level's ranking of every level.
    """
    if kind not in TEACHER_TARGETS:
        raise ValueError(f"teacher.targets must be one of {TEACHER_TARGETS}, got {kind!r}")
    if scope not in TEACHER_SCOPES:
        raise ValueError(f"teacher.scope must be one of {TEACHER_SCOPES}, got {scope!r}")
    if kind == "per_level":
        return _per_level_marks(relevance, fraction, scope)
    flats = [rel.flatten(1) for rel in relevance]
    marks = _mark_top(torch.cat(flats, dim=1), fraction, scope)
    nested = [m.view_as(rel) for m, rel in zip(marks.split([f.shape[1] for f in flats], dim=1), relevance)]
    if kind == "nested":
        return nested
    return [(a + b) / 2 for a, b in zip(nested, _per_level_marks(relevance, fraction, scope))]


def _per_level_marks(relevance: list[torch.Tensor], fraction: float, scope: str) -> list[torch.Tensor]:
    """1.0 at the ``fraction`` of each level's nodes with the most relevance."""
    return [_mark_top(rel.flatten(1), fraction, scope).view_as(rel) for rel in relevance]


def teacher_loss(split_probs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    """Binary cross-entropy of the policy's split probabilities against relevance targets.

    Computed in float32 with autocast off: CUDA autocast refuses ``binary_cross_entropy``
    (unsafe in half precision), and the probabilities are float32 already (the policy's
    heads run in float32)."""
    with torch.autocast(device_type=split_probs[0].device.type, enabled=False):
        losses = [
            F.binary_cross_entropy(p.float().clamp(1e-6, 1 - 1e-6), t.float()) for p, t in zip(split_probs, targets)
        ]
    return torch.stack(losses).mean()


def teacher_loss_at_ratio(
    split_probs: list[torch.Tensor],
    relevance: list[torch.Tensor],
    target_ratio: float,
    geometry: QuadtreeGeometry,
    kind: str = "per_level",
    scope: str = "image",
) -> torch.Tensor:
    """:func:`teacher_loss` against the teacher's marks (:func:`relevance_targets`, of
    ``kind`` and ``scope``) at the split fraction that meets ``target_ratio`` on ``geometry``."""
    fraction = split_fraction_for_ratio(target_ratio, geometry)
    return teacher_loss(split_probs, relevance_targets(relevance, fraction, kind, scope))
