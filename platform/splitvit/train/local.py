"""A plain single-process training loop on the shared SPLIT steps.

Used by ``splitvit demo`` and as the plain-PyTorch reference that Ray Train's
overhead is measured against.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch
from torch.utils.data import DataLoader, Dataset

from ..model.splitvit import SplitViT
from .steps import SplitLossConfig, training_step

log = logging.getLogger(__name__)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to zero, stepped once per batch."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(warmup_steps, 1)
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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
) -> list[dict[str, float]]:
    """Train ``model`` in this process; returns per-epoch mean statistics."""
    torch.manual_seed(seed)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * len(loader)
    scheduler = warmup_cosine(optimizer, min(len(loader), steps // 10), steps)
    generator = torch.Generator().manual_seed(seed + 1)
    history = []
    model.train()
    for epoch in range(epochs):
        start = time.perf_counter()
        totals: dict[str, float] = {}
        seen = 0
        for batch in loader:
            images, target = batch[0], batch[1]
            loss, stats = training_step(model, images, target, cfg, epoch, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            scheduler.step()
            seen += images.shape[0]
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
        stats = {key: value / len(loader) for key, value in totals.items()}
        stats["epoch"] = epoch
        stats["images_per_s"] = seen / (time.perf_counter() - start)
        history.append(stats)
        log.info("epoch %d: %s", epoch, stats)
        if on_epoch is not None:
            on_epoch(epoch, stats)
    return history
