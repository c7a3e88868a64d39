"""Stage one as it runs: :class:`SweepCallback`, the Ray Tune callback that records each
trial in MLflow from the driver as it starts, reports and ends, and prints a line (and
a bar over the trials) for each event.

This module imports Ray (the callback is a ``ray.tune.Callback``): the sweep loads it
only when it builds its ``Tuner``, so a search space's mistakes are reported before
Ray loads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ray import tune

from ..config import config_layers
from ..jsontypes import JsonObject
from ..train.console import Progress
from .mlflow_records import SweepRecorder
from .outcomes import trial_config_params, trial_data
from .space import ConfigValue
from .trial import FINAL_KEY, SweepPlan, TrialFinal, threshold_points

log = logging.getLogger(__name__)


class SweepCallback(tune.Callback):
    """Records trials in MLflow from the Tune driver as they start, report and end.

    MLflow trouble never stops the sweep: it is logged, and the records are made
    whole again after ``Tuner.fit`` returns.
    """

    def __init__(self, recorder: SweepRecorder, plan: SweepPlan, total: int) -> None:
        self.recorder = recorder
        self.plan = plan
        self.total = total  # the trials Tune runs (baselines reused from earlier sweeps are not)
        self._params: dict[str, dict[str, ConfigValue]] = {}
        # a bar over the trials on a terminal; the lines below are the record elsewhere
        self.progress = Progress("trials", total)

    def _config_params(self, trial) -> dict[str, ConfigValue]:
        if trial.trial_id not in self._params:
            self._params[trial.trial_id] = trial_config_params(self.plan, trial.config, trial.trial_id)
        return self._params[trial.trial_id]

    def _safe(self, what: str, fn, *args) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - MLflow trouble must not end the sweep
            log.warning("could not record %s in MLflow: %s", what, exc)
            return None

    def on_trial_start(self, iteration, trials, trial, **info):
        sampled = self.plan.space.decode(trial.config)
        self.progress.log(log, logging.INFO, "trial %s started: %s", trial.trial_id, _short(sampled))
        run_id = self._safe(
            f"trial {trial.trial_id}",
            self.recorder.trial_started,
            trial.trial_id,
            self.plan.run_uri(trial.trial_id),
            sampled,
            self._config_params(trial),
            {t.trial_id for t in trials},
            trial_data(self.plan, sampled, trial.trial_id),
        )
        if run_id:
            self._safe(f"trial {trial.trial_id}'s config layers", self._log_layers, run_id, sampled, trial)

    def _log_layers(self, run_id: str, sampled: dict[str, ConfigValue], trial) -> None:
        """The trial's config with each key's layer (recipe, base file, the space's
        fixed values, sampled): ``config_layers.json``, as a training run has it."""
        from ..tracking import RunTracker

        try:
            config = self.plan.trial_config(sampled, trial.trial_id)
        except ValueError:  # the trial fails the same way and says why
            return
        tracker = RunTracker(self.recorder.tracking_uri, self.recorder.experiment_id, run_id)
        tracker.log_dict(config_layers(config), "config_layers.json")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get(FINAL_KEY):
            return
        metric = self.plan.space.quality_metric
        if "epoch" in result:
            self.progress.log(
                log,
                logging.INFO,
                "trial %s epoch %d: %s %.4f, %.1f tokens/image",
                trial.trial_id,
                int(result["epoch"]),
                metric,
                float(result.get(metric, float("nan"))),
                float(result.get("tokens_per_image", float("nan"))),
            )
        self._safe(
            f"an epoch of trial {trial.trial_id}",
            self.recorder.trial_epoch,
            trial.trial_id,
            self.plan.run_uri(trial.trial_id),
            result,
        )

    def on_trial_complete(self, iteration, trials, trial, **info):
        final = trial.last_result or {}
        done = sum(t.status in ("TERMINATED", "ERROR") for t in trials) + 1
        total = self.total
        if not final.get(FINAL_KEY):
            self.progress.log(log, logging.INFO, "trial %s stopped early (%d/%d)", trial.trial_id, done, total)
            self.progress.update(done)
            return  # recorded after the Tuner returns, from its last epoch
        metric = self.plan.space.quality_metric
        self.progress.log(
            log,
            logging.INFO,
            "trial %s finished (%d/%d): %s %.4f at %.1f tokens/image, %d threshold points",
            trial.trial_id,
            done,
            total,
            metric,
            final.get(metric, float("nan")),
            final.get("tokens_per_image", float("nan")),
            len(threshold_points(final, metric)),
        )
        self.progress.update(done)
        self._safe(f"trial {trial.trial_id}", self._record_completed, trial, final)

    def _record_completed(self, trial, report: JsonObject) -> None:
        """The finished trial's run, from its final report."""
        space = self.plan.space
        self.recorder.trial_completed(
            trial.trial_id,
            self.plan.run_uri(trial.trial_id),
            space.decode(trial.config),
            self._config_params(trial),
            TrialFinal.from_report(report, space.quality_metric, space.companion_metrics),
            trial_data(self.plan, space.decode(trial.config), trial.trial_id),
        )

    def on_trial_error(self, iteration, trials, trial, **info):
        message = _trial_error(trial)
        self.progress.log(
            log,
            logging.WARNING,
            "trial %s failed: %s",
            trial.trial_id,
            message.strip().splitlines()[-1] if message.strip() else "?",
        )
        self.progress.update(sum(t.status in ("TERMINATED", "ERROR") for t in trials) + 1)
        self._safe(
            f"trial {trial.trial_id}",
            self.recorder.trial_failed,
            trial.trial_id,
            self.plan.run_uri(trial.trial_id),
            self.plan.space.decode(trial.config),
            self._config_params(trial),
            message,
        )


def _trial_error(trial) -> str:
    """The trial's error text: Tune writes it next to the trial on the driver first
    (its copy in storage follows at the next sync)."""
    try:
        local = trial.error_file
        if local and Path(local).is_file():
            return Path(local).read_text()
        return str(trial.get_error() or "trial failed")
    except Exception:  # noqa: BLE001 - an unreadable error file must not hide the failure
        return "trial failed"


def _short(params: dict[str, ConfigValue]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
