"""One experiment fitted inside a Ray Tune trial, and evaluated where it trained.

A sweep's trial (:func:`splitvit.tune.trial.sweep_trial`) and a study's run on the
platform (:class:`splitvit.study.runs.RayTrainer`) both train this way: a Tune trial is
a light driver function that launches its own ``TorchTrainer`` through
:func:`~splitvit.train.ray_trainer.run_training` (the same fit as ``splitvit train``),
its epochs reported to Tune (``TuneReportCallback``); never ``Tuner(trainer)``.
Evaluations of the checkpoint run on the kind of resources the training had
(:func:`run_evaluation`). Ray is imported only when these run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..config import ExperimentConfig


class TrialFailed(RuntimeError):
    """Training failed (an exception on the workers, after Ray Train's retries)."""


@dataclass(frozen=True)
class TrainedRun:
    """One experiment's training as a sweep's trial or a study's run sees it
    (:func:`fit_trial`; a study's local trainer makes it too)."""

    status: str  # ``completed``, or why not (``diverged``, ``interrupted``)
    metrics: dict[str, float]  # the last epoch's
    checkpoint: str | None  # None: training left none
    message: str = ""  # what went wrong, for a run that did not complete
    history: list[dict[str, float]] | None = None  # every epoch's figures (None: not read)
    train_seconds: float | None = None  # the trainer's own training time (None: the caller times it)
    steps: int | None = None  # optimiser steps (None: not counted)


def fit_trial(config: ExperimentConfig) -> TrainedRun:
    """Train ``config`` with :func:`~splitvit.train.ray_trainer.run_training`, its
    epochs reported to Tune (``TuneReportCallback``).

    Returns the :class:`TrainedRun` (its ``history``: every epoch's figures, from the
    last checkpoint). Raises :class:`TrialFailed` when Ray Train gives up.
    """
    from ray.tune.integration.ray_train import TuneReportCallback

    from .checkpoints import read_history
    from .ray_trainer import TrainingError, run_training

    # trials never write to MLflow (docs/design.md §3.4: only the Tune driver does), whatever the
    # config says; Ray is up already (this runs inside Tune), so run_training joins it
    if config.tracking.enabled:
        config = replace(config, tracking=replace(config.tracking, enabled=False))
    try:
        result = run_training(config, callbacks=[TuneReportCallback()])
    except TrainingError as exc:
        # Ray Train's own error, as before: the sweep records this message
        raise TrialFailed(f"training failed: {exc.__cause__ or exc}") from exc
    return TrainedRun(
        status=result.status,
        metrics=result.metrics,
        checkpoint=result.checkpoint_uri,
        message=result.message,
        history=read_history(result.checkpoint_uri) if result.checkpoint_uri else [],
    )


def eval_resources(config: ExperimentConfig) -> tuple[dict[str, float | dict[str, float]], str]:
    """Ray task options (and the torch device) for evaluation on one training worker's
    kind of resources: its CPUs, and one GPU where training uses GPUs."""
    per_worker = dict(config.scaling.resources_per_worker)
    gpus = float(per_worker.pop("GPU", 1.0 if config.scaling.use_gpu else 0.0))
    cpus = float(per_worker.pop("CPU", 1.0))
    options: dict[str, float | dict[str, float]] = {"num_cpus": cpus, "num_gpus": min(gpus, 1.0)}
    if per_worker:
        options["resources"] = per_worker
    return options, ("cuda" if gpus > 0 else "cpu")


def run_evaluation(config: ExperimentConfig, fn, *args: Any, **kwargs: Any) -> Any:
    """Run an evaluation function where the training ran: GPU training evaluates in a
    Ray task with one GPU (outside the caller's placement group, which Tune sized for
    the trial's driver function); CPU training evaluates in this process, which has
    torch loaded already and saves starting a worker process per evaluation."""
    if not config.scaling.use_gpu:
        return fn(*args, device="cpu", **kwargs)
    import ray

    options, device = eval_resources(config)
    task = ray.remote(fn).options(scheduling_strategy="DEFAULT", **options)
    return ray.get(task.remote(*args, device=device, **kwargs))
