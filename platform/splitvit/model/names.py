"""The names a config picks the model's parts by, without torch: read by the checks
that run before torch loads (:mod:`splitvit.train.names`) and by the model itself."""

#: The split policies (:mod:`splitvit.model.policies`), by ``model.policy``.
POLICY_NAMES = ("learned", "entropy", "random", "full", "coarse")
#: :class:`~splitvit.model.splitvit.SplitViT`'s tasks: a class per image, or a class per pixel.
TASKS = ("classification", "dense")
#: ``model.task`` of a detector: boxes, classes and masks of objects (a
#: :class:`~splitvit.model.detection.SplitDetector` on a classification-task SplitViT).
DETECTION_TASK = "detection"
#: ``model.task``: SplitViT's tasks, or detection.
MODEL_TASKS = (*TASKS, DETECTION_TASK)
#: How the learned policy's fine evidence pools a node's patches (``model.policy_evidence_pooling``).
EVIDENCE_POOLINGS = ("max", "soft")
#: ``normalize`` values of :func:`~splitvit.model.splitvit.input_data_config` (``model.normalize``).
INPUT_NORMALIZATIONS = ("auto", "timm", "none")
