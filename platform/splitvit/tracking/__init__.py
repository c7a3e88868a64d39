"""MLflow tracking: runs, params, per-epoch metrics, split-map images, logged models."""

from .runs import RunTracker, ensure_experiment, prepare_store, safe_params

__all__ = ["RunTracker", "ensure_experiment", "prepare_store", "safe_params"]
