"""A plain single-process training loop on the shared SPLIT steps.

Used by ``splitvit demo``, as the plain-PyTorch reference that Ray Train's
overhead is measured against, and by the single-GPU study runner
(``infra/gpu-check``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..data.parquet import ParquetShards, RowGroupSampler
from ..model.detection import split_backbone
from ..model.splitvit import SplitViT
from .steps import SplitLossConfig, calibrate_thresholds, evaluate, training_step

log = logging.getLogger(__name__)


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    tail_steps: int = 0,
    lead_steps: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to zero over ``total_steps``, stepped once per
    batch; for ``tail_steps`` more after them, and ``lead_steps`` before the warm-up
    (the policy's own epochs), a cosine of their own from the peak."""

    def cosine(done: int, steps: int) -> float:
        return 0.5 * (1 + math.cos(math.pi * min(done / max(steps, 1), 1.0)))

    def factor(step: int) -> float:
        if step < lead_steps:
            return cosine(step, lead_steps)
        step -= lead_steps
        if step < warmup_steps:
            return (step + 1) / max(warmup_steps, 1)
        if tail_steps and step >= total_steps:
            return cosine(step - total_steps, tail_steps)
        return cosine(step - warmup_steps, total_steps - warmup_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def param_groups(model: nn.Module, lr: float, policy_lr_scale: float = 1.0) -> list[dict[str, Any]]:
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
    model: SplitViT,
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
    policy_lr_scale: float = 1.0,
) -> list[dict[str, float]]:
    """Train ``model`` in this process, on the device it is on; returns per-epoch
    mean statistics.

    ``on_epoch(epoch, stats)``: called after each epoch; the caller then reports
    the epoch (without one, this function logs it). ``amp``: bf16 autocast on CUDA
    (as the Ray loop with ``train.amp``).
    ``warmup_steps``: linear learning-rate warm-up (default: an epoch, at most a
    tenth of the run). ``num_workers``: data-loading processes. ``policy_lr_scale``:
    see :func:`param_groups`.
    """
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    # parquet shards shuffle by row group (each group read once per epoch, not once per
    # item); other datasets read any item cheaply and keep the plain shuffle
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
    )
    optimizer = torch.optim.AdamW(param_groups(model, lr, policy_lr_scale), lr=lr, weight_decay=weight_decay)
    steps = epochs * len(loader)
    warmup = min(len(loader), steps // 10) if warmup_steps is None else min(warmup_steps, steps)
    scheduler = warmup_cosine(optimizer, warmup, steps)
    use_amp = amp and device.type == "cuda"
    generator = torch.Generator().manual_seed(seed + 1)
    history = []
    model.train()
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        start = time.perf_counter()
        totals: dict[str, float] = {}
        counts: dict[str, int] = {}
        seen = 0
        for index, batch in enumerate(loader):
            images, target = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
                loss, stats = training_step(model, images, target, cfg, epoch, generator, index)
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
        history.append(stats)
        if on_epoch is not None:
            on_epoch(epoch, stats)  # the caller reports the epoch, with its own validation figures
        else:
            log.info("epoch %d: %s", epoch, stats)
    return history


def validate(
    model: SplitViT,
    val_set: Dataset,
    val_loader,
    *,
    num_classes: int | None,
    calibrate_to: float | None = None,
    calibration_images: int = 64,
    amp: bool = False,
) -> dict[str, float]:
    """End-of-epoch validation of a single-process run: thresholds calibrated to
    ``calibrate_to`` on the first ``calibration_images`` of ``val_set`` (``None``: kept),
    then :func:`~splitvit.train.steps.evaluate` on ``val_loader``, both in the
    precision training ran in (the Ray loop does the same across its workers)."""
    from ..data import first_images

    device = next(model.parameters()).device
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp and device.type == "cuda"):
        if calibrate_to is not None:
            images = first_images(val_set, calibration_images).to(device)
            model.set_thresholds(calibrate_thresholds(model, images, calibrate_to))
        return evaluate(model, val_loader, num_classes=num_classes)
