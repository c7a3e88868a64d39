"""The study in MLflow: a child run per method and seed (its points, one step per
evaluated token ratio; its timed speed-ups), and on the parent run the table, the
figures, the goals, the reference's curves and the speed figures (:func:`record_study`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .report import study_figure, study_speed_figure
from .spec import StudySpec
from .speed import timed_points

if TYPE_CHECKING:
    from .execute import StudyResult


def record_study(result: StudyResult, spec: StudySpec, parent, runs: list[dict[str, Any]], tracking_uri: str) -> None:
    """MLflow: a child run per method and seed; the table, plot, goals and speed on the parent."""
    import tempfile

    import matplotlib.pyplot as plt
    import mlflow
    from mlflow.entities import Metric

    from ..tracking import RunTracker
    from ..tune.mlflow_records import KIND_TAG, METRIC_TAG, PARENT_TAG

    metric = result.metric
    client = mlflow.MlflowClient(tracking_uri)
    timed = timed_points(result.point_speed)
    for run in runs:
        child, _ = RunTracker.open(
            tracking_uri,
            spec.experiment,
            run["run_uri"],
            f"{run['method']}-s{run['seed']}",
            params=run.get("config") or {},
            tags={
                PARENT_TAG: parent.run_id,
                KIND_TAG: "study-run",
                METRIC_TAG: metric,
                "splitvit.method": run["method"],
                "splitvit.seed": str(run["seed"]),
            },
        )
        recorded = client.get_run(child.run_id).data.metrics
        timed_before = "speedup_vs_full" in recorded and not run.get("reevaluated")
        if result.point_speed and int(run["seed"]) == result.point_speed["seed"] and not timed_before:
            # the measured speed-up at the step of the evaluated point it timed (full resolution: 1.0)
            now = int(time.time() * 1000)
            speed_batch = [
                Metric(key, float(row[src]), now, step)
                for step, point in enumerate(run["points"])
                for row in [timed.get((run["method"], point["target_ratio"]))]
                if row
                for key, src in (
                    ("speedup_vs_full", "speedup_vs_full"),
                    ("timed_images_per_s", "images_per_s"),
                    ("timed_token_ratio", "token_ratio"),
                )
            ]
            if speed_batch:
                client.log_batch(child.run_id, metrics=speed_batch)
        if recorded and not run.get("reevaluated"):
            child.close("completed")
            continue  # recorded by an earlier run of this study
        # (a run evaluated again logs its new points at the same steps: the latest value is the current one)
        # one step per evaluated token ratio: MLflow's metric charts draw the threshold sweep
        now = int(time.time() * 1000)
        batch = [
            Metric(key, float(point[src]), now, step)
            for step, point in enumerate(run["points"])
            for key, src in (
                (metric, "quality"),
                ("tokens_per_image", "tokens_per_image"),
                ("token_ratio", "token_ratio"),
                ("images_per_s", "images_per_s"),
            )
        ]
        client.log_batch(child.run_id, metrics=batch)
        child.log_dict({"points": run["points"], "checkpoint": run["checkpoint"]}, "study_points.json")
        child.close("completed")
    flat_rows = [{k: v for k, v in r.items() if k != "per_seed"} for r in result.rows]
    if timed:  # measured on one seed: the columns say which
        for row in flat_rows:
            found = timed.get((row["method"], row["target_ratio"]))
            row.update(
                {
                    "speedup_vs_full": found["speedup_vs_full"] if found else None,
                    "timed_images_per_s": found["images_per_s"] if found else None,
                    "speed_seed": result.point_speed["seed"] if found else None,
                }
            )
    client.log_table(parent.run_id, data=_columns(flat_rows), artifact_file="study_table.json")
    metrics = {f"goal_{k}_met": float(v["met"]) for k, v in result.goals.items() if isinstance(v, dict) and "met" in v}
    matches = [("", result.goals["match"])] if "match" in result.goals else []
    matches += [(f".r{g['max_token_ratio']:g}", g) for g in result.goals.get("match_also", [])]
    for suffix, g in matches:
        metrics[f"match_gap_points{suffix}"] = g["gap_points"]
        if g.get("gap_std_points") is not None:  # the gap's spread over seeds, seed by seed
            metrics[f"match_gap_std_points{suffix}"] = g["gap_std_points"]
    if "study_time" in result.goals:
        metrics["study_minutes"] = result.goals["study_time"]["minutes"]
    reference = result.goals.get("reference_converged")
    if reference:
        # the reference's validation curve per seed, one step per epoch (MLflow's chart view draws it)
        now = int(time.time() * 1000)
        curves = [
            Metric(f"reference_{metric}.s{seed}", value, now, epoch)
            for seed, record in reference["seeds"].items()
            for epoch, value in enumerate(record["curve"])
        ]
        if (
            curves
            and f"reference_{metric}.s{next(iter(reference['seeds']))}"
            not in client.get_run(parent.run_id).data.metrics
        ):
            client.log_batch(parent.run_id, metrics=curves)
    if result.speed:
        metrics.update({"speed_ratio": result.speed["ratio"], "speed_ideal_ratio": result.speed["ideal_ratio"]})
    if result.point_speed:
        from ..tune.mlflow_records import SPEED_DEVICE_TAG, SPEED_TIMING_TAG

        ps = result.point_speed
        metrics["speed_full_images_per_s"] = ps["full"][0]["images_per_s"]
        for (method, ratio), row in timed.items():
            if method != ps["full"][0]["method"]:
                metrics[f"speedup_vs_full.{method}" + (f".r{ratio:g}" if ratio is not None else "")] = row[
                    "speedup_vs_full"
                ]
        client.set_tag(parent.run_id, SPEED_DEVICE_TAG, ps["device"])
        client.set_tag(
            parent.run_id,
            SPEED_TIMING_TAG,
            f"seed {ps['seed']}, batch {ps['batch_size']}, {ps['rounds']} "
            f"interleaved rounds after {ps['warmup']} warm-up, {ps['precision']}",
        )
        client.log_dict(parent.run_id, json.loads(json.dumps(ps, default=str)), "point_speed.json")
    for key, value in metrics.items():
        client.log_metric(parent.run_id, key, float(value))
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "study.json").write_text(json.dumps(result.to_dict(), indent=2, default=float) + "\n")
        fig = study_figure(result.rows, metric, title=f"{result.name}: {metric} vs tokens ({len(result.seeds)} seeds)")
        fig.savefig(Path(folder) / "study.png")
        plt.close(fig)
        client.log_artifact(parent.run_id, str(Path(folder) / "study.json"))
        client.log_artifact(parent.run_id, str(Path(folder) / "study.png"))
        if timed:
            fig = study_speed_figure(
                result.rows,
                timed,
                metric,
                title=f"{result.name}: {metric} vs measured speed-up ({result.point_speed['device']})",
            )
            fig.savefig(Path(folder) / "study_speed.png")
            plt.close(fig)
            client.log_artifact(parent.run_id, str(Path(folder) / "study_speed.png"))


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: [r.get(k) for r in rows] for k in keys}
