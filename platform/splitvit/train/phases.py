"""A run's phases, the same on Ray Train and in one process: which step each epoch
takes (:class:`SplitStep`: the policy's lead epochs, the fine-tune, the policy's
epochs after it) and the learning-rate schedule over them (:func:`lr_schedule`,
:func:`phase_schedule`, :func:`warmup_cosine`).

Ray-free: :mod:`.ray_trainer`'s workers and :mod:`.local`'s loop import both, so a
recipe trains alike on the platform and on one machine.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import TrainConfig
from ..model.detection import SplitDetector
from .detection import detection_policy_step, detection_training_step
from .steps import SplitLossConfig, policy_training_step, training_step


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


def warmup_steps(train: TrainConfig, steps_per_epoch: int) -> int:
    """The fine-tune's linear warm-up in steps: ``train.lr_warmup_steps``, else
    ``train.lr_warmup_epochs`` of ``steps_per_epoch``."""
    if train.lr_warmup_steps is not None:
        return train.lr_warmup_steps
    return round(train.lr_warmup_epochs * steps_per_epoch)


def phase_schedule(
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    *,
    epochs: int,
    warmup_steps: int,
    lead_epochs: int = 0,
    policy_epochs: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of a run's phases, stepped once per batch: ``lead_epochs`` of the
    policy alone on a cosine from the peak, then the fine-tune's ``epochs`` (linear
    warm-up over ``warmup_steps``, at most all of them, then cosine decay), then
    ``policy_epochs`` of the policy alone on a cosine of their own."""
    total_steps = epochs * steps_per_epoch
    return warmup_cosine(
        optimizer,
        min(warmup_steps, total_steps),
        total_steps,
        policy_epochs * steps_per_epoch,
        lead_steps=lead_epochs * steps_per_epoch,
    )


def lr_schedule(
    optimizer: torch.optim.Optimizer, train: TrainConfig, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``train``'s :func:`phase_schedule`: the fine-tune's ``train.epochs`` with
    :func:`warmup_steps`, the policy's own ``train.policy.lead_epochs`` before them and
    ``train.policy.epochs`` after them."""
    return phase_schedule(
        optimizer,
        steps_per_epoch,
        epochs=train.epochs,
        warmup_steps=warmup_steps(train, steps_per_epoch),
        lead_epochs=train.policy.lead_epochs,
        policy_epochs=train.policy.epochs,
    )


class SplitStep(nn.Module):
    """The SPLIT training step as a module, for DDP.

    ``training_step`` needs the plain SplitViT (``.policy``, ``.relevance``) and, on
    teacher steps, runs a full-resolution relevance pass beside the model's forward.
    Running the whole step inside this module's ``forward`` lets DDP wrap it: every
    pass happens within DDP's forward, so its reducer sees every parameter that
    receives a gradient. A :class:`SplitDetector` takes
    :func:`~.detection.detection_training_step` (targets: one dict per image). In the
    first ``lead_epochs`` (``train.policy.lead_epochs``) and from ``policy_from_epoch`` on
    (the ``train.policy.epochs`` after the fine-tune), the step is the policy's alone
    (:func:`~.steps.policy_training_step`, :func:`~.detection.detection_policy_step`);
    the fine-tune's steps count their epochs from the end of the lead.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: SplitLossConfig,
        policy_from_epoch: int | None = None,
        lead_epochs: int = 0,
    ) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.policy_from_epoch = policy_from_epoch
        self.lead_epochs = lead_epochs

    @classmethod
    def for_config(cls, model: nn.Module, train: TrainConfig) -> SplitStep:
        """The step of ``train``'s phases: policy lead, fine-tune, policy epochs."""
        return cls(
            model,
            train.loss_config(),
            policy_from_epoch=train.policy.lead_epochs + train.epochs,
            lead_epochs=train.policy.lead_epochs,
        )

    def policy_only(self, epoch: int) -> bool:
        """Whether ``epoch`` (counted from the run's first) trains the policy alone."""
        tail = self.policy_from_epoch is not None and epoch >= self.policy_from_epoch
        return epoch < self.lead_epochs or tail

    def forward(
        self,
        images: torch.Tensor,
        target: torch.Tensor,
        epoch: int,
        generator: torch.Generator | None = None,
        step: int = 0,
    ):
        policy_only = self.policy_only(epoch)
        epoch -= self.lead_epochs  # the fine-tune's own epoch (its warm-up phases count from 0)
        if isinstance(self.model, SplitDetector):
            targets = [{k: v.to(images.device) for k, v in t.items()} for t in target]
            if policy_only:
                return detection_policy_step(self.model, images, targets, self.loss, generator)
            return detection_training_step(self.model, images, targets, self.loss, epoch, generator, step)
        if policy_only:
            return policy_training_step(self.model, images, target, self.loss, generator)
        return training_step(self.model, images, target, self.loss, epoch, generator, step)
