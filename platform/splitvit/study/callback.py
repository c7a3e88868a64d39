"""A study's Tune grid as it runs: :class:`GridProgress`, the Ray Tune callback that
prints a line when a run starts and ends (with its objectives) and a bar over the runs.

This module imports Ray (the callback is a ``ray.tune.Callback``): the study loads it
only when it builds a grid's ``Tuner``, so a study file's mistakes are reported before
Ray loads.
"""

from __future__ import annotations

import json
import logging

from ray import tune

from ..train.console import Progress
from .runs import BackboneRun, MethodRun, RunOutcome, RunRequest, outcome_from_dict

log = logging.getLogger(__name__)


class GridProgress(tune.Callback):
    """The study's console for one Tune grid of ``total`` runs of ``stage``
    (``"backbones"`` or ``"methods"``); each trial's run is in its config under
    ``run_key``, its outcome the JSON it reported as ``"result"``."""

    def __init__(self, total: int, stage: str, metric: str, run_key: str) -> None:
        self.total = total
        self.stage = stage
        self.metric = metric
        self.run_key = run_key
        self.ended = 0
        self.progress = Progress(f"{stage} runs", total)

    def _label(self, trial) -> str:
        return RunRequest.from_dict(trial.config[self.run_key]).label

    def on_trial_start(self, iteration, trials, trial, **info):
        self.progress.log(log, logging.INFO, "%s run %s started", self.stage, self._label(trial))

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.ended += 1
        raw = (trial.last_result or {}).get("result")
        try:
            outcome = run_outcome(outcome_from_dict(json.loads(raw)), self.metric) if raw else "no result"
        except (TypeError, ValueError, KeyError):  # not a run's JSON
            outcome = "no result"
        self.progress.log(
            log,
            logging.INFO,
            "%s run %s finished (%d/%d): %s",
            self.stage,
            self._label(trial),
            self.ended,
            self.total,
            outcome,
        )
        self.progress.update(self.ended)

    def on_trial_error(self, iteration, trials, trial, **info):
        self.ended += 1
        self.progress.log(
            log, logging.WARNING, "%s run %s failed (%d/%d)", self.stage, self._label(trial), self.ended, self.total
        )
        self.progress.update(self.ended)


def run_outcome(run: RunOutcome, metric: str) -> str:
    """A finished run's objectives in a few words: quality and tokens per point."""
    if isinstance(run, MethodRun) and run.points:
        return "; ".join(
            f"{p.target_ratio if p.target_ratio is not None else 'full'}: "
            f"{metric} {p.quality:.4f} at {p.tokens_per_image:.1f} tokens/image"
            for p in run.points
        )
    metrics = run.metrics if isinstance(run, BackboneRun) else {}
    return f"{metric} {metrics[metric]:.4f}" if metric in metrics else "trained"
