"""The names a config picks the model's parts by, without torch: read by the checks
that run before torch loads (:mod:`splitvit.train.names`) and by the model itself.
Each list is its config field's ``Literal`` (:mod:`splitvit.config`), the one place
the names are written."""

import typing

from ..config import EvidencePooling, InputNormalization, ModelTask, PolicyKind

#: The split policies (:mod:`splitvit.model.policies`), by ``model.policy.kind``.
POLICY_NAMES: tuple[str, ...] = typing.get_args(PolicyKind)
#: ``model.task`` of a detector: boxes, classes and masks of objects (a
#: :class:`~splitvit.model.detection.SplitDetector` on a classification-task SplitViT).
DETECTION_TASK = "detection"
#: ``model.task``: SplitViT's tasks, or detection.
MODEL_TASKS: tuple[str, ...] = typing.get_args(ModelTask)
#: :class:`~splitvit.model.splitvit.SplitViT`'s tasks: a class per image, or a class per pixel.
TASKS: tuple[str, ...] = tuple(task for task in MODEL_TASKS if task != DETECTION_TASK)
#: How the learned policy's fine evidence pools a node's patches (``model.policy.evidence_pooling``).
EVIDENCE_POOLINGS: tuple[str, ...] = typing.get_args(EvidencePooling)
#: ``normalize`` values of :func:`~splitvit.model.splitvit.input_data_config` (``model.normalize``).
INPUT_NORMALIZATIONS: tuple[str, ...] = typing.get_args(InputNormalization)
