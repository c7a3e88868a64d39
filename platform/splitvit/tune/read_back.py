"""A sweep's frontier read back from MLflow (``splitvit pareto``): recomputed from the
recorded trial and threshold-point runs, with the sweep's baselines where one sweep
is read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ExperimentConfig, redact_uri
from ..jsontypes import JsonObject
from .pareto import Baseline, Point, annotate, frontier
from .state import SweepError, SweepNotFound

if TYPE_CHECKING:
    from .mlflow_records import RecordedTiming

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontierReadBack:
    """An experiment's frontier as :func:`frontier_from_mlflow` reads it back: every
    completed point (each marked on or off the frontier), the hypervolume they span, the
    baselines of the one sweep read, and how each sweep timed its frontier.
    :meth:`to_dict` is ``splitvit pareto --json``.

    Attributes:
        experiment: the MLflow experiment's name; ``experiment_id`` its id.
        tracking_uri: the store, its password redacted.
        sweeps: the sweeps read, by parent run id (sorted); ``sweep_names`` their run names.
        metric: the quality metric (the latest sweep's).
        reference_point: the hypervolume's reference ``(quality, token_ratio)``.
        baselines: the sweep's ``baselines.json`` when one sweep is read, else none
            (baselines of different backbones do not share axes).
    """

    experiment: str
    experiment_id: str
    tracking_uri: str
    sweeps: list[str]
    sweep_names: dict[str, str]
    metric: str
    hypervolume: float
    reference_point: tuple[float, float]
    points: list[Point]
    baselines: list[Baseline]
    speed: list[RecordedTiming]

    @property
    def frontier(self) -> list[Point]:
        """The points no other point dominates, by token ratio."""
        return frontier(self.points)

    def to_dict(self) -> JsonObject:
        """The JSON ``splitvit pareto --json`` writes (points as dicts; a timed point's
        ``extras`` hold ``speedup_vs_full``)."""
        return {
            "experiment": self.experiment,
            "experiment_id": self.experiment_id,
            "tracking_uri": self.tracking_uri,
            "sweeps": self.sweeps,
            "sweep_names": self.sweep_names,
            "metric": self.metric,
            "hypervolume": self.hypervolume,
            "reference_point": {"quality": self.reference_point[0], "token_ratio": self.reference_point[1]},
            "points": [p.to_dict(self.metric) for p in self.points],
            "frontier": [p.to_dict(self.metric) for p in self.frontier],
            "baselines": [b.to_dict(self.metric) for b in self.baselines],
            "speed": [s.to_dict() for s in self.speed],
        }


def frontier_from_mlflow(
    experiment: str, tracking_uri: str | None = None, sweep_run_id: str | None = None, *, all_sweeps: bool = False
) -> FrontierReadBack:
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

    Returns the points, the frontier's hypervolume, the baselines of the one sweep read
    and each sweep's timing settings (:class:`FrontierReadBack`).

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
    hypervolume = annotate(data.points, data.reference)
    return FrontierReadBack(
        experiment=experiment,
        experiment_id=data.experiment_id,
        tracking_uri=redact_uri(uri),
        sweeps=data.sweeps,
        sweep_names=data.sweep_names,
        metric=data.metric,
        hypervolume=hypervolume,
        reference_point=data.reference,
        points=data.points,
        baselines=_read_baselines(uri, data.sweeps[0]) if len(data.sweeps) == 1 else [],
        speed=data.speed,
    )


def _read_baselines(tracking_uri: str, sweep_run_id: str) -> list[Baseline]:
    """A sweep's ``baselines.json`` (empty when it has none: baselines off, or a sweep
    that did not finish, or when it cannot be read)."""
    import tempfile

    from ..tracking.runs import mlflow_client
    from ..train.console import environment

    # MLflow draws a download bar, three lines for one small JSON in the frontier's
    # printout: off, unless the user set it
    quiet = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    try:
        with tempfile.TemporaryDirectory() as tmp, environment(quiet, override=False):
            path = mlflow_client(tracking_uri).download_artifacts(sweep_run_id, "baselines.json", tmp)
            rows = json.loads(Path(path).read_text())
        return [Baseline.from_dict(row) for row in rows] if isinstance(rows, list) else []
    except Exception as exc:  # noqa: BLE001 - the frontier stands without its baselines
        log.debug("no baselines for sweep %s: %s", sweep_run_id, exc)
        return []
