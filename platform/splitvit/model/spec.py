"""What a checkpoint records to rebuild its SplitViT: :class:`ModelSpec`, in the
payload :class:`CheckpointPayload` describes.

:meth:`~splitvit.model.splitvit.SplitViT.save` writes it as a mapping (``payload["spec"]``,
:meth:`ModelSpec.to_dict`); loading reads it back with :meth:`ModelSpec.from_dict`, which
also takes the specs old checkpoints hold (the policy's settings as flat keys).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Required, TypedDict

from ..config import LEGACY_KEYS, ConfigError, PolicyConfig, build_dataclass
from ..jsontypes import JsonObject

if TYPE_CHECKING:
    import torch

#: The :class:`~splitvit.model.splitvit.SplitViT` options a spec keeps when they were given,
#: in the order it writes them (``splitvit train``'s order: its checkpoints' keys stay as they were).
SPEC_OPTIONS = ("thresholds", "fine_aggregation", "task", "length_buckets", "attention", "token_buckets")
#: The types of option value a spec keeps: plain values a checkpoint (or a JSON report) holds as they are.
PLAIN_TYPES = (int, float, str, list, tuple, type(None))
#: A kept option's value.
OptionValue = float | int | bool | str | list[float] | tuple[float, ...]


class DataConfig(TypedDict, total=False):
    """timm's data config of a model (``timm.data.resolve_model_data_config``): its
    ``input_size`` (channels, height, width), the normalisation ``mean`` and ``std`` per
    channel, the resize ``interpolation`` and the evaluation crop (``crop_pct``, ``crop_mode``)."""

    input_size: tuple[int, int, int]
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_pct: float
    crop_mode: str


class TrainingFacts(TypedDict, total=False):
    """What a training run adds to a saved model (``save``'s ``extra``): the epoch, its
    figures and the (redacted) experiment config."""

    epoch: int
    metrics: dict[str, float]
    config: JsonObject  # ExperimentConfig.to_dict: the config file's own shape


class CheckpointPayload(TrainingFacts, total=False):
    """What :meth:`~splitvit.model.splitvit.SplitViT.save` (or a detector's ``save``)
    hands ``torch.save``: the ``spec`` and ``state_dict`` every checkpoint has, the
    ``data_config`` (older checkpoints lack it); a detector's also ``kind``
    (``"detector"``) and its constructor's arguments (``detector``)."""

    spec: Required[JsonObject]  # ModelSpec.to_dict, as written (old checkpoints: older keys)
    state_dict: Required[dict[str, torch.Tensor]]
    data_config: DataConfig
    kind: str
    detector: dict[str, Any]  # SplitDetector's keyword arguments


@dataclass(frozen=True)
class ModelSpec:
    """How to rebuild a SplitViT built from a timm model name: the arguments of
    :meth:`~splitvit.model.splitvit.SplitViT.from_timm` other than the weights' source
    (``pretrained``, ``checkpoint_path``: a checkpoint brings its own weights).

    Attributes:
        name: timm model name.
        levels: quadtree levels.
        policy: the split policy's settings.
        image_size: input side (``None``: the ViT's).
        num_classes: classifier size (``None``: the ViT's).
        timm_kwargs: further ``timm.create_model`` arguments, as given.
        normalize: ``timm``, ``none`` or ``auto`` (:func:`~splitvit.model.splitvit.input_data_config`).
        thresholds, fine_aggregation, task, length_buckets, attention, token_buckets:
            the SplitViT options given to ``from_timm`` (:data:`SPEC_OPTIONS`); ``None``:
            not given (the SplitViT default), and not written.
    """

    name: str
    levels: int
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    image_size: int | None = None
    num_classes: int | None = None
    timm_kwargs: dict[str, Any] = field(default_factory=dict)  # timm.create_model's keyword arguments
    normalize: str = "auto"
    thresholds: float | list[float] | tuple[float, ...] | None = None
    fine_aggregation: bool | None = None
    task: str | None = None
    length_buckets: int | None = None
    attention: str | None = None
    token_buckets: int | None = None

    def options(self) -> dict[str, OptionValue]:
        """The SplitViT options given (:data:`SPEC_OPTIONS` not ``None``), by name."""
        given = {name: getattr(self, name) for name in SPEC_OPTIONS}
        return {name: value for name, value in given.items() if value is not None}

    def to_dict(self) -> JsonObject:
        """The mapping a checkpoint holds (``payload["spec"]``): the keys and their order as ever."""
        return {
            "name": self.name,
            "levels": self.levels,
            "policy": dataclasses.asdict(self.policy),
            "image_size": self.image_size,
            "num_classes": self.num_classes,
            "timm_kwargs": dict(self.timm_kwargs),
            "normalize": self.normalize,
            **self.options(),
        }

    @classmethod
    def from_dict(cls, raw: JsonObject) -> ModelSpec:
        """A checkpoint's spec (an old one's flat policy keys too, :func:`upgrade_spec`).
        ``TypeError`` for a key no SplitViT takes (or a missing ``name`` or ``levels``),
        ``ValueError`` for a bad policy setting."""
        spec = upgrade_spec(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [key for key in spec if key not in names]
        if unknown:
            raise TypeError(f"a SplitViT spec has no {', '.join(map(repr, unknown))}")
        return cls(**{**spec, "policy": policy_settings(spec["policy"])})


def policy_settings(policy: PolicyConfig | JsonObject | str) -> PolicyConfig:
    """The policy's settings from a :class:`~splitvit.config.PolicyConfig`, a mapping of
    its fields (a spec's), or a policy's name (the rest at their defaults); ``ValueError``
    for an unknown name, field or value."""
    if isinstance(policy, PolicyConfig):
        return policy
    if isinstance(policy, str):
        policy = {"kind": policy}
    if not isinstance(policy, dict):
        raise TypeError(f"policy must be a PolicyConfig, a mapping or a name, got {type(policy).__name__}")
    try:
        return build_dataclass(PolicyConfig, policy, "policy.")
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix("config error: ")) from None


#: a spec's keys before the policy's settings were one mapping (:data:`splitvit.config.LEGACY_KEYS`'
#: ``model.policy_*`` and ``model.budget_conditioned``, without ``model.``)
_LEGACY_SPEC_KEYS = {
    old.removeprefix("model."): new.removeprefix("model.policy.")
    for old, new in LEGACY_KEYS.items()
    if old.startswith("model.") and new.startswith("model.policy.") and old != "model.policy"
}


def upgrade_spec(spec: JsonObject) -> JsonObject:
    """A saved spec with its policy's settings as one mapping (``policy: {kind, depth,
    ...}``): an old checkpoint's spec had a name (``policy: learned``) and flat keys
    (``policy_depth: 1``, ``budget_conditioned: true``...), mapped here by the config's
    legacy table. A copy; a current spec comes back as it is."""
    spec = dict(spec)
    policy = spec.get("policy", "learned")
    settings = dict(policy) if isinstance(policy, dict) else {"kind": policy}
    for old, new in _LEGACY_SPEC_KEYS.items():
        if old in spec:
            settings[new] = spec.pop(old)
    spec["policy"] = settings
    return spec


def checkpoint_spec(payload: CheckpointPayload, overrides: dict[str, Any]) -> ModelSpec:
    """The spec a :meth:`~splitvit.model.splitvit.SplitViT.save` payload (or a detector's)
    rebuilds its SplitViT from: the saved spec with ``overrides`` (spec fields by name)
    over it. A policy's name changes the kind alone (the saved settings stay); settings
    replace the saved ones."""
    spec = ModelSpec.from_dict(payload["spec"])
    if "policy" in overrides:
        given = overrides["policy"]
        saved = dataclasses.asdict(spec.policy)
        policy = policy_settings({**saved, "kind": given} if isinstance(given, str) else given)
        overrides = {**overrides, "policy": dataclasses.replace(policy)}  # a copy: the caller's may change
    return dataclasses.replace(spec, **overrides)
