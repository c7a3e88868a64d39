"""The trials' outcomes once Tune returns: read from its ``ResultGrid`` (completed,
stopped, failed, diverged or unfinished), and each trial's MLflow run made whole
(completed with its stage-two threshold points, stopped early, or failed), giving
the points the frontier is drawn from and the fine-tuned baselines' figures. Also
what a trial's run records of its config (params, data), during the sweep too.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..jsontypes import JsonObject
from ..storage import is_s3
from .pareto import Baseline, Point
from .space import ConfigValue, SearchSpace
from .state import Sweep, TrialSummary
from .trial import (
    BASELINE_KEY,
    FINAL_KEY,
    SweepPlan,
    ThresholdPoint,
    TrialDiverged,
    TrialFinal,
    trained_thresholds,
)

if TYPE_CHECKING:
    from ..config import DataConfig

log = logging.getLogger(__name__)

REUSED_TAG = "splitvit.reused_from"  # a baseline taken from an earlier sweep: that sweep and trial


def trial_data(plan: SweepPlan, sampled: dict[str, ConfigValue], trial_id: str) -> DataConfig | None:
    """The trial's data config (its runs' MLflow dataset inputs); ``None`` when its
    config does not build (the trial fails the same way and says why)."""
    try:
        return plan.trial_config(sampled, trial_id).data
    except ValueError:
        return None


def trial_config_params(plan: SweepPlan, sampled: dict[str, ConfigValue], trial_id: str) -> dict[str, ConfigValue]:
    """A trial run's params: its experiment config, flattened. Without
    ``tracking.enabled``: the trial's own Train run logs nothing (``False`` in its
    config), its MLflow run is the sweep driver's record of it, which a ``False``
    there would contradict."""
    try:
        params = plan.trial_config(sampled, trial_id).flat(redact=True)
    except ValueError as exc:  # the trial will fail the same way; record what it was
        log.warning("trial %s: %s", trial_id, exc)
        return {}
    params.pop("tracking.enabled", None)
    return params


def collect(grid, space: SearchSpace, sweep_dir: str) -> tuple[list[TrialSummary], dict[str, TrialFinal]]:
    """Trial outcomes from Tune's ResultGrid, and the figures of each completed or
    stopped trial by trial id: a completed one's final report, a stopped one's last
    epoch (its thresholds still unknown: :func:`record_trials` reads them from its
    checkpoint)."""
    metric = space.quality_metric
    trials, finals = [], {}
    for i in range(len(grid)):
        result = grid[i]
        trial_id = Path(str(result.path)).name
        metrics = dict(result.metrics or {})
        sampled = _sampled_config(result)
        params = space.decode({k: v for k, v in sampled.items() if k in space.parameters})
        baseline = str(sampled.get(BASELINE_KEY) or "")
        if result.error is not None:
            text = str(result.error)
            status = "diverged" if ("diverged:" in text or isinstance(result.error, TrialDiverged)) else "failed"
            trials.append(TrialSummary(trial_id, status, params, error=text[-2000:], baseline=baseline))
        elif metrics.get(FINAL_KEY):
            trials.append(
                TrialSummary(trial_id, "completed", params, checkpoint=metrics.get("checkpoint"), baseline=baseline)
            )
            finals[trial_id] = TrialFinal.from_report(metrics, metric, space.companion_metrics)
        elif metric in metrics and metrics.get("checkpoint_path"):
            checkpoint = _full_uri(metrics["checkpoint_path"], sweep_dir)
            trials.append(TrialSummary(trial_id, "stopped", params, checkpoint=checkpoint))
            # its last reported epoch; its thresholds are its checkpoint's (read when it is recorded)
            finals[trial_id] = TrialFinal(
                quality=metrics[metric],
                tokens_per_image=metrics["tokens_per_image"],
                token_ratio=metrics.get("token_ratio"),
                thresholds=None,
                checkpoint=checkpoint,
                epochs=int(metrics.get("epoch", 0)) + 1,
                images=None if metrics.get("val_images") is None else int(metrics["val_images"]),
            )
        else:
            trials.append(TrialSummary(trial_id, "unfinished", params, baseline=baseline))
    return sorted(trials, key=lambda t: t.trial_id), finals


def _sampled_config(result) -> JsonObject:
    """A trial's sampled values: Tune's Result has them only with a reported result,
    so a trial that failed before reporting is read from its ``params.json``."""
    if result.config:
        return dict(result.config)
    try:
        with result.filesystem.open_input_stream(f"{result.path}/params.json") as stream:
            return json.loads(stream.readall())
    except (OSError, ValueError):
        return {}


def _full_uri(path: str, sweep_dir: str) -> str:
    if is_s3(sweep_dir) and "://" not in path:
        return f"s3://{path.lstrip('/')}"
    return path


def record_trials(
    sweep: Sweep, trials: list[TrialSummary], finals: dict[str, TrialFinal]
) -> tuple[list[Point], list[Baseline]]:
    """Make each trial's MLflow run whole (completed with its stage-two points, stopped
    early, or failed) and set its ``run_id``; returns the points of the completed and
    stopped trials, and the fine-tuned baselines' figures. ``finals``: the completed and
    stopped trials' figures (:func:`collect`)."""
    points: list[Point] = []
    baselines: list[Baseline] = []
    for trial in trials:
        sampled = {BASELINE_KEY: trial.baseline} if trial.baseline else trial.params
        config_params = trial_config_params(sweep.plan, sampled, trial.trial_id)
        if trial.status == "completed":
            final = finals[trial.trial_id]
            if trial.baseline:
                baselines += _baseline_trial_rows(sweep, trial, final, config_params)
            else:
                points += _completed_trial_points(sweep, trial, final, config_params)
        elif trial.status == "stopped":
            points.append(_stopped_trial_point(sweep, trial, finals[trial.trial_id], config_params))
        else:
            _record_failed_trial(sweep, trial, config_params)
    return points, baselines


def _baseline_trial_rows(
    sweep: Sweep, trial: TrialSummary, final: TrialFinal, config_params: dict[str, ConfigValue]
) -> list[Baseline]:
    """A fine-tuned baseline's MLflow run (tagged ``splitvit.baseline``) and its figures:
    full resolution's last validation, or entropy's and random's at each ratio."""
    record = replace(final, threshold_points=[])  # its ratio points are the parent's baselines, not point runs
    run_id, _ = sweep.recorder.trial_completed(
        trial.trial_id,
        sweep.plan.run_uri(trial.trial_id),
        {BASELINE_KEY: trial.baseline},
        config_params,
        record,
        trial_data(sweep.plan, {BASELINE_KEY: trial.baseline}, trial.trial_id),
    )
    trial.run_id = run_id
    tags = {"splitvit.baseline": trial.baseline}
    if trial.reused_from:
        tags[REUSED_TAG] = trial.reused_from
    sweep.recorder.tag_run(run_id, tags)
    if trial.baseline == "full":
        rows = [ThresholdPoint(final.quality, final.tokens_per_image, final.token_ratio, final.thresholds)]
        labels = ["full resolution (fine-tuned)"]
    else:
        rows = final.threshold_points
        labels = [
            f"{trial.baseline} @ {row.token_ratio if row.target_ratio is None else row.target_ratio:.2f} (fine-tuned)"
            for row in rows
        ]
    return [
        Baseline(
            baseline=trial.baseline,
            label=label,
            quality=float(row.quality),
            tokens_per_image=float(row.tokens_per_image),
            token_ratio=float(row.token_ratio),
            thresholds=list(row.thresholds or []),
            trial_id=trial.trial_id,
            images_per_s=row.images_per_s,
            target_ratio=row.target_ratio,
        )
        for row, label in zip(rows, labels)
    ]


def _completed_trial_points(
    sweep: Sweep, trial: TrialSummary, final: TrialFinal, config_params: dict[str, ConfigValue]
) -> list[Point]:
    """A finished trial's point and its stage-two threshold points, each with its MLflow run."""
    run_id, point_ids = sweep.recorder.trial_completed(
        trial.trial_id,
        sweep.plan.run_uri(trial.trial_id),
        trial.params,
        config_params,
        final,
        trial_data(sweep.plan, trial.params, trial.trial_id),
    )
    trial.run_id = run_id
    points = [
        Point(
            final.quality,
            final.tokens_per_image,
            final.token_ratio,
            "trial",
            trial.trial_id,
            list(final.thresholds or []),
            trial.params,
            final.checkpoint,
            run_id,
            extras={
                "images_per_s": 0.0 if final.images_per_s is None else final.images_per_s,
                **_companions(sweep, final.companions),
                **_images(final.images),
            },
        )
    ]
    for row, point_id in zip(final.threshold_points, point_ids):
        points.append(
            Point(
                row.quality,
                row.tokens_per_image,
                row.token_ratio,
                "threshold",
                trial.trial_id,
                list(row.thresholds),
                trial.params,
                final.checkpoint,
                point_id,
                extras={
                    "images_per_s": 0.0 if row.images_per_s is None else row.images_per_s,
                    **_companions(sweep, row.companions),
                    # a point calibrated to a ratio (stage_two.ratios) says which
                    **({"target_ratio": row.target_ratio} if row.target_ratio is not None else {}),
                    **_images(row.images),
                },
            )
        )
    return points


def _companions(sweep: Sweep, figures: dict[str, float]) -> dict[str, float]:
    """The companion qualities (a detector's ``mask_ap``) among a point's ``figures``."""
    return {c: float(figures[c]) for c in sweep.space.companion_metrics if c in figures}


def _images(count: int | None) -> dict[str, float]:
    """``images``, the validation images a point was measured on, where recorded."""
    return {} if count is None else {"images": float(count)}


def _stopped_trial_point(
    sweep: Sweep, trial: TrialSummary, last: TrialFinal, config_params: dict[str, ConfigValue]
) -> Point:
    """An early-stopped trial's point: its ``last`` reported epoch, with the thresholds of
    its checkpoint (no stage two), recorded as a completed run."""
    plan = sweep.plan
    thresholds = trained_thresholds(plan.trial_config(trial.params, trial.trial_id), trial.checkpoint)
    final = replace(last, thresholds=thresholds)
    run_id, _ = sweep.recorder.trial_completed(
        trial.trial_id,
        plan.run_uri(trial.trial_id),
        trial.params,
        config_params,
        final,
        trial_data(plan, trial.params, trial.trial_id),
    )
    trial.run_id = run_id
    return Point(
        final.quality,
        final.tokens_per_image,
        float("nan") if final.token_ratio is None else final.token_ratio,
        "trial",
        trial.trial_id,
        thresholds,
        trial.params,
        trial.checkpoint,
        run_id,
        extras={"stopped_early": 1.0, **_images(final.images)},
    )


def _record_failed_trial(sweep: Sweep, trial: TrialSummary, config_params: dict[str, ConfigValue]) -> None:
    """A failed, diverged or unfinished trial's run, marked so (a run already marked
    failed or diverged is kept as it is)."""
    run_uri = sweep.plan.run_uri(trial.trial_id)
    existing = sweep.recorder.find_run(run_uri)
    if existing is None or existing.data.tags.get("splitvit.status") not in ("failed", "diverged"):
        trial.run_id = sweep.recorder.trial_failed(
            trial.trial_id, run_uri, trial.params, config_params, trial.error or trial.status
        )
    else:
        trial.run_id = existing.info.run_id
