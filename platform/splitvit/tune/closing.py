"""The end of a sweep: its result, the summary metrics and the description on the MLflow
parent run, ``sweep.json`` there and beside the artifacts, and the parent run closed
(completed with its best point's run, or failed when no trial completed).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

from .mlflow_records import PLOT_ARTIFACT, sweep_note
from .pareto import Baseline, Point
from .reference import convergence_verdict
from .state import Sweep, SweepResult, TrialSummary

log = logging.getLogger(__name__)


SWEEP_RESULT_FILE = "sweep.json"


def sweep_result(
    sweep: Sweep, trials: list[TrialSummary], points: list[Point], baselines: list[Baseline], hypervolume: float
) -> SweepResult:
    """The sweep's result, before its artifacts (plot, tables, split map) are written."""
    setup, recorder = sweep.setup, sweep.recorder
    return SweepResult(
        name=setup.name,
        space=setup.space.source,
        sweep_dir=setup.sweep_dir,
        metric=sweep.metric,
        points=points,
        baselines=baselines,
        hypervolume=hypervolume,
        reference_point={"quality": sweep.reference[0], "token_ratio": sweep.reference[1]},
        trials=trials,
        tracking_uri=recorder.tracking_uri,
        experiment=recorder.experiment,
        experiment_id=recorder.experiment_id,
        parent_run_id=recorder.parent_run_id,
        resumed=sweep.resumed,
        status="completed" if points else "failed",
        reference=sweep.setup.reference,
        held_out_split=sweep.space.evaluation.split,
        validation_images=validation_images(points),
        # a point's whole configuration is this plus its searched ``params``
        base_config=setup.base.flat(redact=True),
    )


def validation_images(points: list[Point]) -> int | None:
    """The validation images every point of the sweep was measured on, as the trials
    reported it; ``None`` where a point did not say (older sweeps) or where points were
    measured on different counts (their noise differs: no one standard error)."""
    counts = {p.extras.get("images") for p in points if p.finite}
    if len(counts) != 1 or None in counts:
        if len(counts) > 1:
            found = sorted(map(str, counts))
            log.warning("the sweep's points were measured on different validation image counts: %s", found)
        return None
    return int(next(iter(counts)))


def close_sweep_run(
    sweep: Sweep,
    result: SweepResult,
    *,
    front: list[Point],
    best: Point | None,
    speed_metrics: dict[str, float],
    local_dir: Path,
) -> None:
    """The summary metrics and ``sweep.json`` on the parent run (and in ``local_dir``);
    then end the parent run: completed with the best point's run, or failed when no
    trial completed."""
    recorder, trials = sweep.recorder, result.trials
    completed = sum(t.status in ("completed", "stopped") for t in trials)
    failed = sum(t.status in ("failed", "diverged") for t in trials)
    result.wall_time_s = time.time() - sweep.started
    recorder.log_parent_metrics(
        {
            "hypervolume": result.hypervolume,
            "frontier_size": len(front),
            "points": len(result.points),
            "trials_completed": completed,
            "trials_failed": failed,
            "wall_time_s": result.wall_time_s,
            **speed_metrics,
        }
    )
    try:
        recorder.describe(
            sweep_note(
                name=result.name,
                metric=result.metric,
                hypervolume=result.hypervolume,
                reference=sweep.reference,
                points=result.points,
                best=best,
                baselines=result.baselines,
                trial_status=dict(Counter(t.status for t in trials)),
                experiment_id=recorder.experiment_id,
                parent_run_id=recorder.parent_run_id,
                plot=PLOT_ARTIFACT if result.plot else None,
                best_uris=sweep.registered.by_run.get(best.run_id or "") if sweep.registered and best else None,
                reference_note=_reference_note(sweep),
            )
        )
        recorder.describe_experiment(
            result.name, result.hypervolume, len(front), len(result.points), best, sweep.registered
        )
    except Exception as exc:  # noqa: BLE001 - a description that will not save must not lose the sweep
        log.warning("could not write the sweep's description: %s", exc)
    payload = result.to_dict()
    (local_dir / SWEEP_RESULT_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    recorder.parent.log_dict(json.loads(json.dumps(payload, default=str)), SWEEP_RESULT_FILE)
    if result.points:
        recorder.close("completed", tags={"splitvit.best_run": (best.run_id or "") if best else ""})
    else:
        recorder.close("failed", tags={"splitvit.error": "no trial completed"})


def _reference_note(sweep: Sweep) -> str | None:
    """The parent description's line on the reference: where it came from, a link to its
    MLflow run (in whichever experiment holds it), its convergence."""
    from ..tracking.runs import mlflow_client
    from .mlflow_records import run_link

    reference = sweep.setup.reference
    if reference is None:
        return None
    where = f"`{reference.source}`"
    if reference.run_id:
        try:
            experiment_id = mlflow_client(sweep.recorder.tracking_uri).get_run(reference.run_id).info.experiment_id
            where = f"[{reference.source}]({run_link(experiment_id, reference.run_id)})"
        except Exception as exc:  # noqa: BLE001 - a run the store lost: name it without a link
            log.warning("the reference's MLflow run %s: %s", reference.run_id, exc)
    return (
        f"**Every trial fine-tuned from the reference** {where} (`{reference.checkpoint}`): "
        f"{convergence_verdict(sweep.space, reference)}."
    )
