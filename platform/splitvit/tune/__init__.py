"""Multi-objective sweeps: search spaces, the Tune + Optuna sweep, the Pareto frontier.

* :func:`load_space` — read and validate a YAML search space (``search_spaces/``).
* :func:`run_sweep` — the sweep: Ray Tune + Optuna over SPLIT training, threshold
  sweeps on every checkpoint, baselines, the frontier and its hypervolume in MLflow.
* :func:`frontier_from_mlflow` — an experiment's frontier, read back from MLflow
  (a :class:`FrontierReadBack`).
* :func:`pareto_indices`, :func:`hypervolume`, :func:`annotate` — the frontier math
  (on Optuna's own multi-objective code).

The evidence study is :mod:`splitvit.study`: the study and the sweep never import
each other; what both use lies below them (:mod:`splitvit.bench.speed`,
:mod:`splitvit.train.trial`, :mod:`splitvit.train.console`).

:mod:`.sweep` holds :func:`run_sweep`, the driver; its docstring lists the modules that
hold each stage.
"""

from .pareto import Baseline, Point, annotate, best_point, dominates, frontier, hypervolume, pareto_indices
from .space import Parameter, SearchSpace, SearchSpaceError, load_space, space_from_dict

# The sweep driver imports Ray, torch and MLflow; the space and the frontier math do
# not. It loads on first use, so a search space's mistakes are reported in a second.
# Each name, by the module of the sweep that holds it.
_SWEEP = {
    "FrontierReadBack": "read_back",
    "FrontierRow": "artifacts",
    "frontier_rows": "artifacts",
    "SweepError": "state",
    "SweepNotFound": "state",
    "SweepResult": "state",
    "TrialSummary": "state",
    "frontier_from_mlflow": "read_back",
    "run_sweep": "sweep",
}


def __getattr__(name: str):
    if name in _SWEEP:
        import importlib

        return getattr(importlib.import_module(f".{_SWEEP[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Baseline",
    "FrontierReadBack",
    "FrontierRow",
    "Parameter",
    "Point",
    "SearchSpace",
    "SearchSpaceError",
    "SweepError",
    "SweepNotFound",
    "SweepResult",
    "TrialSummary",
    "annotate",
    "best_point",
    "dominates",
    "frontier",
    "frontier_from_mlflow",
    "frontier_rows",
    "hypervolume",
    "load_space",
    "pareto_indices",
    "run_sweep",
    "space_from_dict",
]
