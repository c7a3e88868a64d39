"""The checks of a config's names (dataset, policy, task, input normalisation) against
what the data and the model define, without torch: the command line runs them before
torch, Ray and MLflow load (a misspelt name is one line in a second), and
:func:`~splitvit.train.experiment.validate_experiment` runs them with the rest."""

from __future__ import annotations

from ..config import ExperimentConfig, require
from ..data.names import DATASET_NAMES
from ..model.names import INPUT_NORMALIZATIONS, POLICY_NAMES, TASKS


def check_names(config: ExperimentConfig) -> None:
    """Raise :class:`~splitvit.config.ConfigError` naming the key whose name is unknown."""
    d, m = config.data, config.model
    require(
        d.name in DATASET_NAMES, "data.name", f"unknown dataset {d.name!r}; expected one of {', '.join(DATASET_NAMES)}"
    )
    require(
        m.policy in POLICY_NAMES,
        "model.policy",
        f"unknown policy {m.policy!r}; expected one of {', '.join(POLICY_NAMES)}",
    )
    require(m.task in TASKS, "model.task", f"must be one of {', '.join(TASKS)}, got {m.task!r}")
    require(
        m.normalize in INPUT_NORMALIZATIONS,
        "model.normalize",
        f"must be one of {', '.join(INPUT_NORMALIZATIONS)}, got {m.normalize!r}",
    )
