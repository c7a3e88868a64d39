"""The names a config picks the model's parts by, without torch: read by the checks
that run before torch loads (:mod:`splitvit.train.names`) and by the model itself."""

#: The split policies (:mod:`splitvit.model.policies`), by ``model.policy``.
POLICY_NAMES = ("learned", "entropy", "random", "full", "coarse")
#: ``model.task``: a class per image, or a class per pixel.
TASKS = ("classification", "dense")
#: ``normalize`` values of :func:`~splitvit.model.splitvit.input_data_config` (``model.normalize``).
INPUT_NORMALIZATIONS = ("auto", "timm", "none")
