"""Framework-free pieces of SPLIT training: one step, evaluation, threshold calibration.

Ray Train's per-worker loop and the local demo both call these, so a model trains
the same way on a laptop and on 64 GPUs.

Training has two phases (docs/design.md §3.2):

* warm-up (``epoch < warmup_epochs``): splits are drawn at random, at a per-image
  split rate, so the backbone learns every scale; the rate's lower bound anneals
  from 1 (full resolution: learn the task first) to ``train.policy.warmup_min_split``;
* policy: the learned policy decides (sampled hard decisions, straight-through
  gradients to its probabilities), under the budget penalty.

With ``train.budget.ratio_range``, every policy-phase batch draws its target ratio from
that range (budget-conditioned training); a budget-conditioned policy is told it.

After warm-up the learned policy is also taught by the model's own relevance at
full resolution, pooled per node (gradient x input saliency of the true class by
default; see ``SplitViT.relevance``): the policy learns to rank nodes as the model
does (``train.teacher.weight``). Measured on the synthetic task, gradient saliency put its
top node on the object 88% of the time, last-block class attention 59%.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..config import SplitLossConfig  # declared with the config's train section; imported from here too
from ..model.quadtree import token_counts, top_down_decisions
from ..model.splitvit import SplitViT
from .losses import (
    IGNORE_INDEX,
    budget_penalty,
    distillation_loss,
    task_loss,
    teacher_loss_at_ratio,
)


def random_decisions(
    model: SplitViT, images: torch.Tensor, min_rate: float, generator: torch.Generator | None = None
) -> list[torch.Tensor]:
    """Random hierarchical splits; each image draws its own split rate in ``[min_rate, 1]``."""
    geometry = model.geometry_for(tuple(images.shape[-2:]))
    b = images.shape[0]
    rate = min_rate + (1 - min_rate) * torch.rand(b, 1, 1, generator=generator)
    wishes = [torch.rand(b, *geometry.grid(level), generator=generator) < rate for level in range(geometry.levels - 1)]
    return top_down_decisions([w.to(images.device) for w in wishes])


def batch_target_ratio(
    cfg: SplitLossConfig, policy_phase: bool, generator: torch.Generator | None, stats: dict[str, float]
) -> float:
    """This batch's target token ratio: ``cfg.budget.target_ratio``, or in the policy phase with
    ``cfg.budget.ratio_range`` one drawn uniformly from it (noted in ``stats``)."""
    if not policy_phase or cfg.budget.ratio_range is None:
        return cfg.budget.target_ratio
    low, high = cfg.budget.ratio_range
    stats["target_ratio"] = low + (high - low) * float(torch.rand((), generator=generator))
    return stats["target_ratio"]


def warmup_decisions(
    model: SplitViT, images: torch.Tensor, cfg: SplitLossConfig, epoch: int, generator: torch.Generator | None
) -> list[torch.Tensor]:
    """The warm-up curriculum's random splits: the first warm-up epoch is full resolution
    (the backbone learns the task), later ones draw lower split rates down to
    ``cfg.policy.warmup_min_split``."""
    progress = epoch / max(cfg.policy.warmup_epochs - 1, 1)
    min_rate = 1.0 - (1.0 - cfg.policy.warmup_min_split) * progress
    return random_decisions(model, images, min_rate, generator)


def model_classes(model: SplitViT) -> int:
    """The number of classes ``model`` predicts (its classifier's, or its dense head's)."""
    if model.task == "dense" and model.dense_head is not None:
        return int(model.dense_head.decoder[-1].out_channels)
    return int(model.vit.num_classes)


def check_labels(target: torch.Tensor, num_classes: int) -> None:
    """A ``ConfigError`` on ``model.num_classes`` when a label lies outside
    ``[0, num_classes)`` (``255``, ignored, allowed in masks): better than
    cross-entropy's ``IndexError`` on the CPU or a device-side assert on CUDA."""
    from ..config import ConfigError

    if target.is_floating_point() or target.numel() == 0:
        return
    valid = (target >= 0) & (target < num_classes)
    if target.dim() > 1:
        valid |= target == IGNORE_INDEX
    if bool(valid.all()):
        return
    bad = sorted({int(v) for v in target[~valid].unique()[:8].tolist()})
    raise ConfigError(
        "model.num_classes",
        f"the training data hold label{'s' if len(bad) > 1 else ''} "
        f"{', '.join(map(str, bad))}, outside 0..{num_classes - 1} for "
        f"model.num_classes = {num_classes}: set model.num_classes to the "
        "dataset's number of classes, or check its labels",
    )


def training_step(
    model: SplitViT,
    images: torch.Tensor,
    target: torch.Tensor,
    cfg: SplitLossConfig,
    epoch: int,
    generator: torch.Generator | None = None,
    step: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one batch (call ``backward`` on it) and its scalar statistics.

    ``step`` (the batch's index in its epoch) picks the steps that compute the
    relevance teacher: those with ``step % cfg.teacher.every == 0``.

    With ``cfg.budget.ratio_range``, a learned policy past warm-up trains at a target
    ratio drawn uniformly from the range for this batch (from ``generator`` when
    given): the budget penalty and the teacher's targets use it, a budget-conditioned
    policy is told it, and ``stats["target_ratio"]`` reports it.

    Raises ``ConfigError`` (key ``model.num_classes``) for a label the model cannot predict.
    """
    check_labels(target, model_classes(model))
    learned = model.policy.learned
    warmup = learned and epoch < cfg.policy.warmup_epochs
    stats: dict[str, float] = {}
    loss = images.new_zeros(())
    target_ratio = batch_target_ratio(cfg, learned and not warmup, generator, stats)
    if warmup:
        out = model(images, decisions=warmup_decisions(model, images, cfg, epoch, generator))
    else:
        out = model(images, budget=target_ratio)
    main = task_loss(out.logits, target)
    loss = loss + main
    stats["task_loss"] = float(main.detach())
    full_logits = None  # the full-resolution pass's, where one ran
    if learned and not warmup and cfg.teacher.weight > 0 and step % cfg.teacher.every == 0:
        # the teacher grades the split probabilities the forward pass just computed
        label = target if model.task == "classification" else None
        relevance, full_logits = model.relevance_and_logits(images, cfg.teacher.kind, target=label)
        geometry = model.geometry_for(tuple(images.shape[-2:]))
        # (decide() has checked the probabilities are finite: NaN is a divergence, not a BCE error)
        taught = teacher_loss_at_ratio(
            out.split_probs, relevance, target_ratio, geometry, cfg.teacher.targets, cfg.teacher.scope
        )
        loss = loss + cfg.teacher.weight * taught
        stats["teacher_loss"] = float(taught.detach())
    if cfg.distill.weight > 0 and not warmup and model.policy.name != "full":
        if full_logits is None:
            with torch.no_grad():
                full_logits = model(images, decisions=model.full_decisions(images)).logits
        distill = distillation_loss(out.logits, full_logits, cfg.distill.temperature, target)
        loss = loss + cfg.distill.weight * distill
        stats["distill_loss"] = float(distill.detach())
    if learned and not warmup:
        penalty = budget_penalty(out.expected_tokens / out.full_tokens, target_ratio, cfg.budget.penalty)
        loss = loss + cfg.budget.weight * penalty
        stats["budget_penalty"] = float(penalty.detach())
    stats["loss"] = float(loss.detach())
    stats["token_ratio"] = float(out.token_ratio.mean())
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {float(loss)} at epoch {epoch}: {stats}")
    return loss, stats


def policy_training_step(
    model: SplitViT,
    images: torch.Tensor,
    target: torch.Tensor,
    cfg: SplitLossConfig,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one batch of the policy's own epochs (``train.policy.epochs``): the
    relevance teacher alone, on the policy's scores (:meth:`SplitViT.split_scores`,
    which read the backbone's features detached), so that only the policy learns. No
    task loss and no budget penalty: the teacher's targets carry the budget."""
    check_labels(target, model_classes(model))
    stats: dict[str, float] = {}
    target_ratio = batch_target_ratio(cfg, True, generator, stats)
    label = target if model.task == "classification" else None
    relevance, _ = model.relevance_and_logits(images, cfg.teacher.kind, target=label)
    return policy_teacher_loss(model, images, relevance, target_ratio, cfg, stats)


def policy_teacher_loss(
    model: SplitViT,
    images: torch.Tensor,
    relevance: list[torch.Tensor],
    target_ratio: float,
    cfg: SplitLossConfig,
    stats: dict[str, float],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The teacher's loss on ``model``'s split scores at ``target_ratio`` (weighted by
    ``cfg.teacher.weight``), and ``stats`` with ``teacher_loss`` and ``loss`` added."""
    scores = model.split_scores(images, budget=target_ratio)  # told only to a budget-conditioned policy
    geometry = model.geometry_for(tuple(images.shape[-2:]))
    taught = teacher_loss_at_ratio(scores, relevance, target_ratio, geometry, cfg.teacher.targets, cfg.teacher.scope)
    loss = cfg.teacher.weight * taught
    stats["teacher_loss"] = float(taught.detach())
    stats["loss"] = float(loss.detach())
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {float(loss)} in the policy's epochs: {stats}")
    return loss, stats


@dataclass
class EvalTotals:
    """What an evaluation counts, before any figure is computed from it.

    Every field is a sum over images (``elapsed`` excepted), so the totals of disjoint
    shards summed (``elapsed``: their maximum, the shards run in parallel) are the
    totals of one evaluation of all of them, and :meth:`figures` gives exactly what one
    process evaluating everything would: what ``train.ray_trainer._combine_eval``
    all-reduces.

    Attributes:
        task: the model's task (``dense`` reports mIoU, others accuracy).
        images: images evaluated.
        correct: correctly classified images (classification).
        tokens: tokens attended to, over all images.
        full_tokens: full-resolution tokens, over all images (``N_full`` per image).
        elapsed: seconds spent in forward passes.
        confusion: dense task: ``(C, C)`` int64 pixel counts, row = true class,
            column = predicted; pixels labelled ``IGNORE_INDEX`` are not counted.
        fine_total: finest-level cells chosen.
        fine_on_object: those of them on the object.
        object_cells: finest-level cells the object touches (what full resolution sees of
            it), chosen or not. The object counts are kept by ``evaluate_totals(...,
            object_masks=True)`` on batches that carry masks; none counted: no object figures.
    """

    task: str
    images: int = 0
    correct: int = 0
    tokens: int = 0
    full_tokens: int = 0
    elapsed: float = 0.0
    confusion: torch.Tensor | None = None
    fine_total: float = 0.0
    fine_on_object: float = 0.0
    object_cells: float = 0.0

    def figures(self) -> dict[str, float]:
        """Accuracy or mIoU, tokens per image, token ratio, images/s, and where objects
        were counted ``fine_on_object`` (the share of fine tokens on the object: where
        the budget went) and ``object_coverage`` (the share of the object's fine cells
        kept fine: how much of it the model sees at full resolution) of these totals."""
        result = {
            "tokens_per_image": self.tokens / max(self.images, 1),
            "token_ratio": self.tokens / max(self.full_tokens, 1),
            "images_per_s": self.images / max(self.elapsed, 1e-9) if self.images else 0.0,
            "images": self.images,
        }
        if self.task == "dense":
            result["miou"] = mean_iou(self.confusion)
        else:
            result["accuracy"] = self.correct / max(self.images, 1)
        result.update(object_figures(self.fine_total, self.fine_on_object, self.object_cells))
        return result


def object_counts(
    level: torch.Tensor, fine_level: int, patch_size: int, object_mask: torch.Tensor
) -> tuple[float, float, float]:
    """Of a batch: the finest-level cells chosen, those of them on an object, and the
    finest cells the objects touch, chosen or not. ``level``: ``(B, h, w)`` the level of
    the leaf over each finest cell (``SplitOutput.fine_cell_level``); ``object_mask``:
    ``(B, H, W)``, nonzero on the objects."""
    fine = level == fine_level
    on_object = torch.nn.functional.avg_pool2d(object_mask.float().unsqueeze(1), patch_size).squeeze(1) > 0
    on_object = on_object.to(fine.device)
    return float(fine.sum()), float((fine & on_object).sum()), float(on_object.sum())


def object_figures(fine_total: float, fine_on_object: float, object_cells: float) -> dict[str, float]:
    """``fine_on_object`` (the share of fine tokens on an object: where the budget went)
    and ``object_coverage`` (the share of the objects' fine cells kept fine: how much of
    them the model sees at full resolution); nothing where no object cell was counted."""
    if object_cells <= 0:
        return {}
    return {"fine_on_object": fine_on_object / max(fine_total, 1.0), "object_coverage": fine_on_object / object_cells}


def mean_iou(confusion: torch.Tensor | None) -> float:
    """Mean intersection over union of a ``(C, C)`` confusion matrix (row = true class,
    column = predicted) over the classes present, in the labels or the predictions;
    0.0 when no pixel was counted. Float64: float32 counts are inexact above 2**24 pixels."""
    if confusion is None:
        return 0.0
    counts = confusion.double()
    inter = counts.diag()
    union = counts.sum(0) + counts.sum(1) - inter
    present = union > 0
    return float((inter[present] / union[present]).mean()) if bool(present.any()) else 0.0


@torch.no_grad()
def evaluate_totals(
    model: SplitViT,
    batches: Iterable,
    thresholds: list[float] | None = None,
    num_classes: int | None = None,
    object_masks: bool = False,
) -> EvalTotals:
    """Evaluate ``model`` on ``batches`` and return the counts (:class:`EvalTotals`);
    :func:`evaluate` returns their figures.

    ``batches`` yields ``(images, target)`` or ``(images, target, object_mask)``;
    with ``object_masks`` the fine tokens on the object are counted too. The dense
    task's confusion matrix has ``num_classes`` rows (default: the logits' channels).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    totals = EvalTotals(task=model.task)
    if model.task == "dense" and num_classes is not None:
        # sized up front, so that a shard with no batches sums with the others
        totals.confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for batch in batches:
        images, target = batch[0].to(device), batch[1].to(device)
        start = time.perf_counter()
        out = model(images, thresholds=thresholds)
        if images.is_cuda:
            torch.cuda.synchronize(device)  # CUDA runs asynchronously: time the work, not its launch
        totals.elapsed += time.perf_counter() - start
        totals.full_tokens += out.full_tokens * images.shape[0]
        totals.tokens += int(out.tokens.sum())
        totals.images += images.shape[0]
        if model.task == "dense":
            classes = num_classes or out.logits.shape[1]
            pred = out.logits.argmax(1)
            keep = target != IGNORE_INDEX
            idx = target[keep] * classes + pred[keep]
            counts = torch.bincount(idx, minlength=classes * classes).reshape(classes, classes)
            totals.confusion = counts if totals.confusion is None else totals.confusion + counts
        else:
            totals.correct += int((out.logits.argmax(1) == target).sum())
        if object_masks and len(batch) > 2:
            chosen, on_object, cells = object_counts(
                out.fine_cell_level(), model.levels - 1, model.patch_size, batch[2].to(device)
            )
            totals.fine_total += chosen
            totals.fine_on_object += on_object
            totals.object_cells += cells
    model.train(was_training)
    if totals.confusion is not None:
        totals.confusion = totals.confusion.cpu()
    return totals


def evaluate(
    model: SplitViT,
    batches: Iterable,
    thresholds: list[float] | None = None,
    num_classes: int | None = None,
    object_masks: bool = False,
) -> dict[str, float]:
    """Accuracy (or mIoU for the dense task), tokens per image, token ratio, images/s.

    ``batches`` yields ``(images, target)`` or ``(images, target, object_mask)``;
    with ``object_masks`` the share of fine tokens that fall on the object is
    reported too (``fine_on_object``). See :func:`evaluate_totals`.
    """
    return evaluate_totals(model, batches, thresholds, num_classes, object_masks).figures()


@torch.no_grad()
def calibrate_thresholds(
    model: SplitViT, images: torch.Tensor, target_ratio: float, iterations: int = 30
) -> list[float]:
    """One threshold for every level such that the mean token ratio on ``images`` is
    at or under ``target_ratio``, as close to it as the policy's scores allow
    (bisection: a higher threshold never adds tokens). Never over: a point quoted at
    a budget spends no more than that budget on the images it was calibrated on (the
    nearest ratio may lie just over it: 50.52% for a 50% target would miss a "<= 50%"
    goal). Only when even the highest threshold (every region coarse) spends more is
    the result over the target: the fewest tokens the model can spend.

    Side effect: a budget-conditioned model is first told this budget
    (``model.set_budget(target_ratio)``), so that its scores, and so its evaluation
    at the returned thresholds, are those of the budget it is calibrated to. Other
    models are left unchanged.
    """
    if not 0.0 < target_ratio <= 1.0:
        raise ValueError(f"target_ratio must be in (0, 1], got {target_ratio}")
    if model.uses_budget:
        model.set_budget(target_ratio)
    was_training = model.training
    model.eval()
    geometry = model.geometry_for(tuple(images.shape[-2:]))
    scores = model.split_scores(images)

    def ratio(t: float) -> float:
        decisions = top_down_decisions([s > t for s in scores])
        return float(token_counts(decisions).float().mean()) / geometry.full_tokens

    lo, hi = 0.0, 1.0  # ratio(lo) > target_ratio >= ratio(hi), once either has moved
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if ratio(mid) > target_ratio:
            lo = mid
        else:
            hi = mid
    # hi is the lowest threshold found at or under the target: the most tokens within it
    model.train(was_training)
    return [hi] * (model.levels - 1)
