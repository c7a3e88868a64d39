"""The checks of a config's names (dataset, policy, task, input normalisation, evidence
pooling) against what the data and the model define, and of the task against the
dataset's targets, without torch: the command line runs them before torch, Ray and
MLflow load (a misspelt name is one line in a second), and
:func:`~splitvit.train.experiment.validate_experiment` runs them with the rest."""

from __future__ import annotations

from ..config import ConfigError, ExperimentConfig, require
from ..data.names import ANY_TASK_DATASETS, DATASET_NAMES, DETECTION_DATASETS
from ..model.names import DETECTION_TASK, EVIDENCE_POOLINGS, INPUT_NORMALIZATIONS, MODEL_TASKS, POLICY_NAMES


def check_names(config: ExperimentConfig) -> None:
    """Raise :class:`~splitvit.config.ConfigError` naming the key whose name is unknown,
    or ``data.name`` where the dataset's targets are not the task's (detection data
    serves ``model.task: detection`` only, and that task no other data)."""
    d, m = config.data, config.model
    require(
        d.name in DATASET_NAMES, "data.name", f"unknown dataset {d.name!r}; expected one of {', '.join(DATASET_NAMES)}"
    )
    require(
        m.policy in POLICY_NAMES,
        "model.policy",
        f"unknown policy {m.policy!r}; expected one of {', '.join(POLICY_NAMES)}",
    )
    require(m.task in MODEL_TASKS, "model.task", f"must be one of {', '.join(MODEL_TASKS)}, got {m.task!r}")
    check_task_data(d.name, m.task)
    require(
        m.normalize in INPUT_NORMALIZATIONS,
        "model.normalize",
        f"must be one of {', '.join(INPUT_NORMALIZATIONS)}, got {m.normalize!r}",
    )
    require(
        m.policy_evidence_pooling in EVIDENCE_POOLINGS,
        "model.policy_evidence_pooling",
        f"must be one of {', '.join(EVIDENCE_POOLINGS)}, got {m.policy_evidence_pooling!r}",
    )


def check_task_data(dataset: str, task: str) -> None:
    """Raise :class:`~splitvit.config.ConfigError` on ``data.name`` unless ``dataset``
    has the targets ``task`` learns: objects for ``detection``, classes otherwise.
    Parquet shards may hold either: the preflight reads which."""
    if dataset in ANY_TASK_DATASETS:
        return
    detection_data = dataset in DETECTION_DATASETS
    if task == DETECTION_TASK and not detection_data:
        raise ConfigError(
            "data.name",
            f"model.task=detection needs a detection dataset ({', '.join(DETECTION_DATASETS)}, or parquet shards "
            f"of one): {dataset!r} has no object boxes",
        )
    require(
        task == DETECTION_TASK or not detection_data,
        "data.name",
        f"{dataset!r} is a detection dataset (boxes and masks of objects): it needs model.task=detection, "
        f"got model.task={task!r}",
    )
