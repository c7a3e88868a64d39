"""A plain single-process training loop on the shared SPLIT steps.

Used by ``splitvit demo``, as the plain-PyTorch reference that Ray Train's
overhead is measured against, and by the single-machine study runner
(``splitvit.study.local``, ``infra/gpu-check``). Its epochs are the Ray loop's
phases (the policy's lead epochs, the fine-tune, the policy's epochs), routed and
scheduled by the same code (:mod:`.phases`), for classifiers, dense models and
detectors alike.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..data.common import detection_collate
from ..data.parquet import ParquetShards, RowGroupSampler
from ..model.detection import SplitDetector, split_backbone
from .detection import detection_area_ranges, detection_ground_truth, evaluate_detection_totals
from .phases import SplitStep, phase_schedule, warmup_steps
from .steps import SplitLossConfig, calibrate_thresholds, evaluate

if TYPE_CHECKING:
    from ..config import ExperimentConfig

log = logging.getLogger(__name__)


class ParamGroup(TypedDict):
    """One of torch's optimizer parameter groups: its parameters and learning rate."""

    params: list[nn.Parameter]
    lr: float


def param_groups(model: nn.Module, lr: float, policy_lr_scale: float = 1.0) -> list[ParamGroup]:
    """The optimizer's parameter groups: SplitViT's own modules (the policy, fine
    aggregation and level embeddings of ``model``'s SplitViT) at ``lr * policy_lr_scale``,
    the rest at ``lr``; one group at a scale of 1, so that an optimizer's saved state
    keeps the layout it always had."""
    params = [p for p in model.parameters() if p.requires_grad]
    if policy_lr_scale == 1.0:
        return [{"params": params, "lr": lr}]
    backbone = split_backbone(model)
    own = [backbone.level_embed, *backbone.policy.parameters()]
    if backbone.fine_aggregation is not None:
        own += list(backbone.fine_aggregation.parameters())
    own_ids = {id(p) for p in own}
    return [
        {"params": [p for p in params if id(p) not in own_ids], "lr": lr},
        {"params": [p for p in params if id(p) in own_ids], "lr": lr * policy_lr_scale},
    ]


def fit_local(
    model: nn.Module,
    dataset: Dataset,
    cfg: SplitLossConfig,
    *,
    epochs: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    grad_clip: float = 1.0,
    seed: int = 0,
    on_epoch: Callable[[int, dict[str, float]], None] | None = None,
    amp: bool = False,
    warmup_steps: int | None = None,
    num_workers: int = 0,
    epoch_hook: Callable[[int, nn.Module], None] | None = None,
) -> list[dict[str, float]]:
    """Train ``model`` (a SplitViT or a :class:`~splitvit.model.detection.SplitDetector`)
    in this process, on the device it is on; returns per-epoch mean statistics, with the
    learning rate after the epoch (``lr``; ``lr_policy`` for the policy's own group).

    The epochs are the Ray loop's phases, routed by the same :class:`~.phases.SplitStep`
    on the same schedule (:func:`~.phases.phase_schedule`), as ``cfg.policy`` (``train.policy``)
    sets them: its ``lead_epochs`` of the policy alone, the ``epochs`` of the fine-tune,
    then its ``epochs`` of the policy alone; SplitViT's own modules learn at ``lr`` times its
    ``lr_scale`` (:func:`param_groups`).
    ``on_epoch(epoch, stats)``: called after each epoch; the caller then reports
    the epoch (without one, this function logs it). ``epoch_hook(epoch, model)``: called
    before each epoch (as the Ray loop's ``epoch_hook``). ``amp``: bf16 autocast on CUDA
    (as the Ray loop with ``train.amp``).
    ``warmup_steps``: the fine-tune's linear learning-rate warm-up (default: an epoch, at
    most a tenth of the fine-tune). ``num_workers``: data-loading processes.
    """
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    # the policy's own phases and learning rate: the loss config's, as the Ray loop reads them
    lead_epochs, policy_epochs, policy_lr_scale = cfg.policy.lead_epochs, cfg.policy.epochs, cfg.policy.lr_scale
    loader, sampler = _train_loader(model, dataset, batch_size, seed, num_workers, device)
    optimizer = torch.optim.AdamW(param_groups(model, lr, policy_lr_scale), lr=lr, weight_decay=weight_decay)
    warmup = min(len(loader), epochs * len(loader) // 10) if warmup_steps is None else warmup_steps
    scheduler = phase_schedule(
        optimizer, len(loader), epochs=epochs, warmup_steps=warmup, lead_epochs=lead_epochs, policy_epochs=policy_epochs
    )
    step = SplitStep(model, cfg, policy_from_epoch=lead_epochs + epochs, lead_epochs=lead_epochs)
    use_amp = amp and device.type == "cuda"
    generator = torch.Generator().manual_seed(seed + 1)
    history = []
    model.train()
    for epoch in range(lead_epochs + epochs + policy_epochs):
        if epoch_hook is not None:
            epoch_hook(epoch, model)
        if sampler is not None:
            sampler.set_epoch(epoch)
        start = time.perf_counter()
        totals: dict[str, float] = {}
        counts: dict[str, int] = {}
        seen = 0
        for index, batch in enumerate(loader):
            images, target = batch[0].to(device, non_blocking=True), batch[1]
            if isinstance(target, torch.Tensor):  # a detector's targets (dicts) are moved by the step
                target = target.to(device, non_blocking=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
                loss, stats = step(images, target, epoch, generator, index)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            scheduler.step()
            seen += images.shape[0]
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1  # teacher_loss: teacher steps only
        stats = {key: value / counts[key] for key, value in totals.items()}
        stats["epoch"] = epoch
        stats["images_per_s"] = seen / (time.perf_counter() - start)
        rates = scheduler.get_last_lr()  # as the Ray loop reports them
        stats["lr"] = rates[0]
        if len(rates) > 1:  # policy_lr_scale: SplitViT's own modules in a group of their own
            stats["lr_policy"] = rates[1]
        history.append(stats)
        if on_epoch is not None:
            on_epoch(epoch, stats)  # the caller reports the epoch, with its own validation figures
        else:
            log.info("epoch %d: %s", epoch, stats)
    return history


def fit_config(
    model: nn.Module,
    dataset: Dataset,
    config: ExperimentConfig,
    *,
    on_epoch: Callable[[int, dict[str, float]], None] | None = None,
    epoch_hook: Callable[[int, nn.Module], None] | None = None,
) -> list[dict[str, float]]:
    """:func:`fit_local` with an experiment's own training settings, read as the Ray
    loop reads them: its loss, epochs, batch, learning rate, weight decay, clipping (0:
    none), seed, bf16, the fine-tune's warm-up (:func:`~.phases.warmup_steps`) and the
    loader's workers. The one way a config trains in one process (local studies, ``bench
    train``'s plain loop and its allocator runs).

    Raises:
        ValueError: ``dataset`` holds fewer images than one batch.
    """
    dc, tc = config.data, config.train
    steps_per_epoch = len(dataset) // dc.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"data: {len(dataset)} training images give no batch of {dc.batch_size}")
    return fit_local(
        model,
        dataset,
        tc.loss_config(),
        epochs=tc.epochs,
        batch_size=dc.batch_size,
        lr=tc.lr,
        weight_decay=tc.weight_decay,
        grad_clip=tc.grad_clip if tc.grad_clip > 0 else math.inf,
        seed=dc.seed,
        on_epoch=on_epoch,
        amp=tc.amp,
        warmup_steps=warmup_steps(tc, steps_per_epoch),  # the Ray loop's (train.phases.lr_schedule)
        num_workers=dc.num_workers,
        epoch_hook=epoch_hook,
    )


def _train_loader(
    model: nn.Module, dataset: Dataset, batch_size: int, seed: int, num_workers: int, device: torch.device
) -> tuple[DataLoader, RowGroupSampler | None]:
    """:func:`fit_local`'s shuffled training batches, and the sampler to set each epoch on
    (parquet shards shuffle by row group, each group read once per epoch, not once per
    item; other datasets read any item cheaply and keep the plain shuffle: ``None``)."""
    sampler = (
        RowGroupSampler(dataset, 1, 0, seed=seed, drop_last=True, batch_size=batch_size, loader_workers=num_workers)
        if isinstance(dataset, ParquetShards)
        else None
    )
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        drop_last=True,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
        # detection targets are one dict per image: the batch keeps them a list
        collate_fn=detection_collate if isinstance(model, SplitDetector) else None,
    )
    return loader, sampler


def validate(
    model: nn.Module,
    val_set: Dataset,
    val_loader,
    *,
    num_classes: int | None,
    calibrate_to: float | None = None,
    calibration_images: int = 64,
    amp: bool = False,
    ground_truth: Any = None,
) -> dict[str, float]:
    """End-of-epoch validation of a single-process run: thresholds calibrated to
    ``calibrate_to`` on the first ``calibration_images`` of ``val_set`` (``None``: kept),
    then :func:`~splitvit.train.steps.evaluate` on ``val_loader``, both in the
    precision training ran in (the Ray loop does the same across its workers).

    A :class:`~splitvit.model.detection.SplitDetector` is evaluated as the Ray loop
    evaluates it: its detections on ``val_loader`` (batches of
    :func:`~splitvit.data.common.detection_collate`) scored by COCO's evaluation against
    ``ground_truth`` (default: :func:`~.detection.detection_ground_truth` of ``val_set``,
    one pass over it: pass it in to validate every epoch), box and mask AP among the
    figures, with ``val_images``.
    """
    from ..data import first_images

    device = next(model.parameters()).device
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp and device.type == "cuda"):
        if calibrate_to is not None:
            backbone = split_backbone(model)
            images = first_images(val_set, calibration_images).to(device)
            backbone.set_thresholds(calibrate_thresholds(backbone, images, calibrate_to))
        if not isinstance(model, SplitDetector):
            return evaluate(model, val_loader, num_classes=num_classes)
        totals = evaluate_detection_totals(model, val_loader, [0, *val_set.category_ids], device=device)
    truth = detection_ground_truth(val_set) if ground_truth is None else ground_truth
    side = max(model.backbone.geometry.image_size)  # model.image_size: the canvas's side
    figures = totals.figures(truth, area_ranges=detection_area_ranges(side))
    figures["val_images"] = float(totals.images)
    return {k: float(v) for k, v in figures.items() if isinstance(v, (int, float))}  # per class: the Ray loop's MLflow
