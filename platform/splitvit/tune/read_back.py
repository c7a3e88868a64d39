"""A sweep's frontier read back from MLflow (``splitvit pareto``): recomputed from the
recorded trial and threshold-point runs, with the sweep's baselines where one sweep
is read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..config import ExperimentConfig, redact_uri
from .pareto import Baseline, annotate, frontier
from .state import SweepError, SweepNotFound

log = logging.getLogger(__name__)


def frontier_from_mlflow(
    experiment: str, tracking_uri: str | None = None, sweep_run_id: str | None = None, *, all_sweeps: bool = False
) -> dict[str, Any]:
    """The frontier of an MLflow experiment's latest sweep (or of one sweep, or of all
    of them), recomputed from the recorded trial and threshold-point runs (failed runs
    excluded).

    Args:
        experiment: the MLflow experiment.
        tracking_uri: the store (default: the default config's, ``$MLFLOW_TRACKING_URI``
            or the local SQLite store).
        sweep_run_id: one sweep, by its parent run id.
        all_sweeps: merge every sweep of the experiment (the latest one's reference
            point and metric apply); default: the latest started sweep only.

    Returns ``{"experiment", "experiment_id", "tracking_uri", "sweeps", "sweep_names",
    "metric", "hypervolume", "reference_point", "points", "frontier", "baselines",
    "speed"}`` (points as dicts; a timed point's ``extras`` hold ``speedup_vs_full``;
    ``baselines`` are the sweep's ``baselines.json`` when one sweep is read, else
    empty: baselines of different backbones do not share axes; ``speed`` lists, per
    sweep that timed its frontier, the device and timing settings).

    Raises:
        SweepError: the store is missing (a local store is never created), or the
            experiment or the sweep is not in it.
    """
    from mlflow.exceptions import MlflowException

    from .mlflow_records import points_from_mlflow

    uri = tracking_uri or ExperimentConfig().tracking_uri()
    try:
        data = points_from_mlflow(uri, experiment, sweep_run_id, all_sweeps=all_sweeps)
    except ValueError as exc:  # missing store, experiment or sweep: one line for the command line
        raise SweepNotFound(str(exc)) from None
    except (MlflowException, OSError) as exc:  # a server that does not answer (requests' errors are OSErrors)
        raise SweepError(f"could not read MLflow store {redact_uri(uri)}: {type(exc).__name__}: {exc}") from None
    hv = annotate(data.points, data.reference)
    metric = data.metric
    baselines = _read_baselines(uri, data.sweeps[0]) if len(data.sweeps) == 1 else []
    return {
        "experiment": experiment,
        "experiment_id": data.experiment_id,
        "tracking_uri": redact_uri(uri),
        "sweeps": data.sweeps,
        "sweep_names": data.sweep_names,
        "metric": metric,
        "hypervolume": hv,
        "reference_point": {"quality": data.reference[0], "token_ratio": data.reference[1]},
        "points": [p.to_dict(metric) for p in data.points],
        "frontier": [p.to_dict(metric) for p in frontier(data.points)],
        "baselines": [b.to_dict(metric) for b in baselines],
        "speed": [s.to_dict() for s in data.speed],
    }


def _read_baselines(tracking_uri: str, sweep_run_id: str) -> list[Baseline]:
    """A sweep's ``baselines.json`` (empty when it has none: baselines off, or a sweep
    that did not finish, or when it cannot be read)."""
    import tempfile

    from ..tracking.runs import mlflow_client

    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = mlflow_client(tracking_uri).download_artifacts(sweep_run_id, "baselines.json", tmp)
            rows = json.loads(Path(path).read_text())
        return [Baseline.from_dict(row) for row in rows] if isinstance(rows, list) else []
    except Exception as exc:  # noqa: BLE001 - the frontier stands without its baselines
        log.debug("no baselines for sweep %s: %s", sweep_run_id, exc)
        return []
