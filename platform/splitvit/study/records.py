"""The study in MLflow: a parent run for the study (:func:`open_study_run`) and, once it
has its figures (:func:`record_study`), a child run per method and seed (its points, one
step per evaluated token ratio; its timed speed-ups), and on the parent the table, the
figures, the goals, the reference's curves and the speed figures.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..bench.speed import FullTiming
from ..config import config_layers
from ..jsontypes import JsonObject
from .goals import GoalVerdicts, ReferenceConvergence
from .report import study_figure, study_speed_figure
from .runs import MethodRun
from .spec import StudySpec
from .speed import PointSpeed, StudyTimedPoint, timed_points

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from ..tracking import RunTracker
    from .execute import StudyResult

#: (method, target ratio) -> its timed point (:func:`~splitvit.study.speed.timed_points`)
Timed = dict[tuple[str, float | None], FullTiming | StudyTimedPoint]
#: a child run's speed metrics, from the timed point's fields
_RUN_SPEED_METRICS = (
    ("speedup_vs_full", "speedup_vs_full"),
    ("timed_images_per_s", "images_per_s"),
    ("timed_token_ratio", "token_ratio"),
    ("backbone_speedup_vs_full", "backbone_speedup_vs_full"),  # a detector's backbone alone (else unset)
)


def open_study_run(
    spec: StudySpec, tracking_uri: str, study_dir: str, name: str, references_dir: str | None
) -> RunTracker:
    """The study's parent run (the one of an earlier invocation under the same folder,
    reopened): the study's settings as params; runs a driver that died left RUNNING end
    KILLED."""
    from ..tracking import RunTracker
    from ..tracking.runs import KIND_TAG, METRIC_TAG, close_stale_runs, flat_params

    params = {
        **flat_params(
            {
                "seeds": spec.seeds,
                "ratios": spec.ratios,
                "scale": spec.scale or "cpu",
                "methods": {name: entry.settings for name, entry in spec.methods.items()},
                "backbone": spec.backbone,
                "method": spec.method,
                **({"references": references_dir} if references_dir is not None else {}),
            }
        ),
        **{f"config.{k}": v for k, v in flat_params({**spec.config, **spec.overrides}).items()},
    }
    parent, _ = RunTracker.open(
        tracking_uri,
        spec.experiment,
        study_dir,
        name,
        params=params,
        tags={KIND_TAG: "study", METRIC_TAG: spec.metric, "splitvit.study": spec.source},
    )
    close_stale_runs(parent)
    # the files as they were read: the study file and its base experiment config
    parent.log_text(Path(spec.source).read_text(), "study_file.yaml")
    parent.log_text(Path(spec.base).read_text(), "base_config.yaml")
    _describe_experiment(spec, tracking_uri, parent, name)
    return parent


def _describe_experiment(spec: StudySpec, tracking_uri: str, parent: RunTracker, name: str) -> None:
    """The experiment's description and tags: what a study is, its latest, how to read it."""
    from ..tracking.runs import describe_experiment

    link = f"#/experiments/{parent.experiment_id}/runs/{parent.run_id}"
    describe_experiment(
        tracking_uri,
        parent.experiment_id,
        "\n".join(
            [
                f"**SPLIT evidence studies** (`splitvit study {spec.source}`): every method trained alike from "
                f"a converged full-resolution reference and compared at matched token budgets over seeds, "
                f"{spec.metric} against tokens.",
                "",
                f"**Latest study:** [{name}]({link}).",
                "",
                "**How to read it**",
                "- The study's run (`tags.splitvit.kind = 'study'`): the table (`study_table.json`), `study.png`, "
                "the goal lines in `study.json`, the speed figures; `study_file.yaml` and `base_config.yaml` "
                "are the files it ran.",
                "- Under it, one run per method and seed: one step per evaluated token ratio "
                f"(`metrics.{spec.metric}`, `metrics.token_ratio`).",
            ]
        ),
        {"splitvit.latest_study": name, "splitvit.latest_study_run": parent.run_id},
    )


def record_study(
    result: StudyResult, spec: StudySpec, parent: RunTracker, runs: list[MethodRun], tracking_uri: str
) -> None:
    """MLflow: a child run per method and seed (``runs``: their stored results); the table,
    plot, goals and speed on the parent."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    timed = timed_points(result.point_speed)
    for run in runs:
        _record_run(client, spec, parent, run, result.metric, result.point_speed, timed, tracking_uri)
    client.log_table(parent.run_id, data=_columns(_table_rows(result, timed)), artifact_file="study_table.json")
    metrics = _goal_metrics(result.goals)
    if result.goals.reference_converged is not None:
        _record_reference_curves(client, parent.run_id, result.goals.reference_converged, result.metric)
    if result.speed:
        metrics.update({"speed_ratio": result.speed.ratio, "speed_ideal_ratio": result.speed.ideal_ratio})
    if result.point_speed:
        metrics.update(_record_point_speed(client, parent.run_id, result.point_speed, timed))
    for key, value in metrics.items():
        client.log_metric(parent.run_id, key, float(value))
    _record_artifacts(client, parent.run_id, result, timed)


def _record_run(
    client: MlflowClient,
    spec: StudySpec,
    parent: RunTracker,
    run: MethodRun,
    metric: str,
    point_speed: PointSpeed | None,
    timed: Timed,
    tracking_uri: str,
) -> None:
    """One method run's child: its timed speed-ups and, unless an earlier invocation
    recorded them (and the run was not evaluated again), its points."""
    from ..tracking import RunTracker
    from ..tracking.runs import KIND_TAG, METRIC_TAG, PARENT_TAG

    child, _ = RunTracker.open(
        tracking_uri,
        spec.experiment,
        run.run_uri,
        f"{run.method}-s{run.seed}",
        params=run.config or {},
        tags={
            PARENT_TAG: parent.run_id,
            KIND_TAG: "study-run",
            METRIC_TAG: metric,
            "splitvit.method": run.method,
            "splitvit.seed": str(run.seed),
        },
    )
    recorded = client.get_run(child.run_id).data.metrics
    timed_before = "speedup_vs_full" in recorded and not run.reevaluated
    if point_speed and int(run.seed) == point_speed.seed and not timed_before:
        _record_run_speed(client, child.run_id, run, timed)
    if recorded and not run.reevaluated:
        child.close("completed")
        return  # recorded by an earlier run of this study
    # (a run evaluated again logs its new points at the same steps: the latest value is the current one)
    _record_run_points(client, child.run_id, run, (metric, *spec.companions))
    child.log_dict({"points": [p.to_dict() for p in run.points], "checkpoint": run.checkpoint}, "study_points.json")
    # the run's config with the layer of each key (recipe, base file, study sections, method entry)
    config = spec.run_config(int(run.seed), run.method, Path(run.run_uri).name, settings_only=True)
    child.log_dict(config_layers(config), "config_layers.json")
    child.close("completed")


def _record_run_speed(client: MlflowClient, run_id: str, run: MethodRun, timed: Timed) -> None:
    """The measured speed-up at the step of the evaluated point it timed (full resolution: 1.0)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [
        Metric(key, float(getattr(row, field)), now, step)
        for step, point in enumerate(run.points)
        for row in [timed.get((run.method, point.target_ratio))]
        if row
        for key, field in _RUN_SPEED_METRICS
        if getattr(row, field, None) is not None
    ]
    if batch:
        client.log_batch(run_id, metrics=batch)


def _record_run_points(client: MlflowClient, run_id: str, run: MethodRun, metrics: tuple[str, ...]) -> None:
    """One step per evaluated token ratio: MLflow's metric charts draw the threshold sweep
    (``metrics``: the quality, then its companions, e.g. a detector's ``mask_ap``)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    quality, *companions = metrics
    batch = [
        Metric(key, point.figure(src), now, step)
        for step, point in enumerate(run.points)
        for key, src in (
            (quality, "quality"),
            *((c, c) for c in companions),
            ("tokens_per_image", "tokens_per_image"),
            ("token_ratio", "token_ratio"),
            ("images_per_s", "images_per_s"),
        )
    ]
    client.log_batch(run_id, metrics=batch)


def _table_rows(result: StudyResult, timed: Timed) -> list[JsonObject]:
    """The parent's table: the study's rows without the per-seed figures and, where the
    points were timed (on one seed: the columns say which), their speed-ups."""
    flat_rows = [{k: v for k, v in r.to_dict().items() if not k.startswith("per_seed")} for r in result.rows]
    if timed and result.point_speed:
        for row in flat_rows:
            found = timed.get((row["method"], row["target_ratio"]))
            row.update(
                {
                    "speedup_vs_full": found.speedup_vs_full if found else None,
                    "timed_images_per_s": found.images_per_s if found else None,
                    "speed_seed": result.point_speed.seed if found else None,
                }
            )
    return flat_rows


def _goal_metrics(goals: GoalVerdicts) -> dict[str, float]:
    """``goal_<goal>_met`` per verdict, the parity gaps (and their spreads over seeds) per
    share, and the study's minutes."""
    metrics = {f"goal_{key}_met": float(met) for key, met in goals.verdicts().items()}
    matches = [("", goals.match)] if goals.match is not None else []
    matches += [(f".r{g.max_token_ratio:g}", g) for g in goals.match_also]
    for suffix, g in matches:
        metrics[f"match_gap_points{suffix}"] = g.gap_points
        if g.gap_std_points is not None:  # the gap's spread over seeds, seed by seed
            metrics[f"match_gap_std_points{suffix}"] = g.gap_std_points
        for c in g.companions:  # e.g. a detector's mask AP on the same point
            metrics[f"match_{c.metric}_gap_points{suffix}"] = c.gap_points
    if goals.study_time is not None:
        metrics["study_minutes"] = goals.study_time.minutes
    return metrics


def _record_reference_curves(client: MlflowClient, run_id: str, reference: ReferenceConvergence, metric: str) -> None:
    """The reference's validation curve per seed, one step per epoch (MLflow's chart view
    draws it), once: a later invocation finds them there."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    curves = [
        Metric(f"reference_{metric}.s{seed}", value, now, epoch)
        for seed, record in reference.seeds.items()
        for epoch, value in enumerate(record.curve)
    ]
    if curves and f"reference_{metric}.s{next(iter(reference.seeds))}" not in client.get_run(run_id).data.metrics:
        client.log_batch(run_id, metrics=curves)


def _record_point_speed(client: MlflowClient, run_id: str, ps: PointSpeed, timed: Timed) -> dict[str, float]:
    """The timing's device and setting as tags, its record as ``point_speed.json``; returns
    the speed-up metrics (one per method and ratio, and full resolution's images/s)."""
    from ..tracking.runs import SPEED_DEVICE_TAG, SPEED_TIMING_TAG

    metrics = {"speed_full_images_per_s": ps.full_timing.images_per_s}
    for (method, ratio), row in timed.items():
        if method != ps.full_method:
            metrics[f"speedup_vs_full.{method}" + (f".r{ratio:g}" if ratio is not None else "")] = row.speedup_vs_full
    client.set_tag(run_id, SPEED_DEVICE_TAG, ps.device)
    client.set_tag(
        run_id,
        SPEED_TIMING_TAG,
        f"seed {ps.seed}, batch {ps.batch_size}, {ps.rounds} "
        f"interleaved rounds after {ps.warmup} warm-up, {ps.precision}",
    )
    client.log_dict(run_id, json.loads(json.dumps(ps.to_dict(), default=str)), "point_speed.json")
    return metrics


def _record_artifacts(client: MlflowClient, run_id: str, result: StudyResult, timed: Timed) -> None:
    """``study.json`` (the result), ``study.png`` and, with timed points, ``study_speed.png``."""
    import tempfile

    import matplotlib.pyplot as plt

    metric = result.metric
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "study.json").write_text(json.dumps(result.to_dict(), indent=2, default=float) + "\n")
        fig = study_figure(result.rows, metric, title=f"{result.name}: {metric} vs tokens ({len(result.seeds)} seeds)")
        fig.savefig(Path(folder) / "study.png")
        plt.close(fig)
        client.log_artifact(run_id, str(Path(folder) / "study.json"))
        client.log_artifact(run_id, str(Path(folder) / "study.png"))
        if timed and result.point_speed:
            fig = study_speed_figure(
                result.rows,
                timed,
                metric,
                title=f"{result.name}: {metric} vs measured speed-up ({result.point_speed.device})",
            )
            fig.savefig(Path(folder) / "study_speed.png")
            plt.close(fig)
            client.log_artifact(run_id, str(Path(folder) / "study_speed.png"))


def _columns(rows: list[JsonObject]) -> dict[str, list[Any]]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: [r.get(k) for r in rows] for k in keys}
