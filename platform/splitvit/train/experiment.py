"""From an experiment's settings to what runs it: the one way to get a runnable config,
and the model a :class:`~splitvit.config.ModelConfig` describes.

**Every caller that builds a config to run uses** :func:`load_experiment` (a YAML
file plus ``key=value`` overrides) or :func:`experiment_from_dict` (a dict): the
schema loading of :mod:`splitvit.config` (types and ranges:
:func:`~splitvit.config.load_config`, :meth:`~splitvit.config.ExperimentConfig.from_dict`)
followed by :func:`validate_experiment`, the checks that need timm, the model or the
dataset registry. Both raise :class:`~splitvit.config.ConfigError` naming the key,
in seconds and before any Ray work. :func:`validate_experiment` alone fully checks a
config built any other way (the preflight and ``run_training`` call it).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import typing
from pathlib import Path
from typing import Any

import timm
import torch

from ..config import (
    AUTO_THRESHOLD_START,
    AUTO_THRESHOLDS,
    ConfigError,
    ExperimentConfig,
    Layer,
    ModelConfig,
    blame_recipe,
    coerce,
    field_error,
    load_config,
    require,
    resolve_config,
    validate,
)
from ..jsontypes import JsonObject
from ..model import QuadtreeGeometry, SplitDetector, SplitViT, validate_thresholds
from ..model.names import DETECTION_TASK
from .names import check_names


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """The experiment YAML at ``path`` with ``key=value`` overrides applied, fully
    validated (:func:`~splitvit.config.load_config`, then :func:`validate_experiment`).

    Raises :class:`~splitvit.config.ConfigError` naming the bad key, or
    ``FileNotFoundError`` when ``path`` does not exist.
    """
    config = load_config(path, overrides)
    validate_experiment(config)
    return config


def experiment_from_dict(
    raw: JsonObject | None, overrides: list[str] | None = None, *, default_name: str = "experiment"
) -> ExperimentConfig:
    """A fully validated config from a plain dict plus ``key=value`` overrides
    (:meth:`~splitvit.config.ExperimentConfig.from_dict`, then :func:`validate_experiment`).

    ``default_name`` starts the run's name when ``storage.name`` is unset. Raises
    :class:`~splitvit.config.ConfigError` naming the first bad key.
    """
    config = ExperimentConfig.from_dict(raw, overrides, default_name=default_name)
    validate_experiment(config)
    return config


def experiment_from_layers(layers: list[Layer], *, default_name: str = "experiment") -> ExperimentConfig:
    """A fully validated config from its layers (:func:`~splitvit.config.resolve_config`:
    a study's run, its recipe under them), then :func:`validate_experiment`."""
    config = resolve_config(layers, default_name=default_name)
    validate_experiment(config)
    return config


def validate_experiment(config: ExperimentConfig) -> None:
    """Every check of ``config``: its settings' own (:func:`splitvit.config.validate`),
    then the dataset's name against the registry and the model against timm and
    :class:`~splitvit.model.SplitViT`'s own validators.

    Builds the model on PyTorch's ``meta`` device (no memory, no weights, no
    download), so every check the model makes runs here. Raises
    :class:`~splitvit.config.ConfigError` naming the key.
    """
    try:
        validate(config)
        check_names(config)
        _validate_model(config.model)
    except ConfigError as exc:
        raise blame_recipe(exc, config) from None


def _validate_model(m: ModelConfig) -> None:
    """The model's checks (its names: :func:`~splitvit.train.names.check_names`): timm
    knows the name and takes ``timm_kwargs``, the thresholds fit the levels, the image fits
    the quadtree, the policy's depth and width fit the ViT, and SplitViT builds."""
    require(timm.is_model(m.name), "model.name", f"unknown timm model {m.name!r}")
    if m.thresholds != AUTO_THRESHOLDS:
        try:
            validate_thresholds(m.thresholds, m.levels)
        except ValueError as exc:
            raise field_error(exc, ["thresholds"], "model.", "model.thresholds") from None
    # The ViT alone, on the meta device: its patch size decides the quadtree geometry.
    create = dict(m.timm_kwargs, img_size=m.image_size, num_classes=m.num_classes)
    try:
        with torch.device("meta"):
            vit = timm.create_model(m.name, pretrained=False, **create)
    except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        key = f"model.timm_kwargs.{bad.group(1)}" if bad else "model.timm_kwargs"
        raise ConfigError(key, f"timm.create_model({m.name!r}) rejected it: {exc}") from None
    patch = vit.patch_embed.patch_size[0] if hasattr(vit, "patch_embed") else None
    if patch is not None:
        try:
            QuadtreeGeometry(m.image_size, patch, m.levels)
        except ValueError as exc:
            raise ConfigError("model.image_size", str(exc)) from None
    if m.task == DETECTION_TASK:
        detector_options(m)  # unknown options and wrong types, each named
        # the pyramid's strides p/4 .. 2p are whole pixels, and torchvision's RoI pooler infers powers of two
        require(
            patch is not None and patch >= 4 and patch & (patch - 1) == 0,
            "model.timm_kwargs.patch_size",
            f"a detector needs a finest patch that is a power of two >= 4, got {patch}",
        )
    depth, p = len(getattr(vit, "blocks", [])), m.policy
    if p.width is None:
        require(
            0 <= p.depth <= depth,
            "model.policy.depth",
            f"must be in [0, {depth}] (the ViT's depth), got {p.depth}",
        )
    else:
        require(p.depth >= 0, "model.policy.depth", f"must be >= 0, got {p.depth}")
        heads = max(1, p.width // 64)
        require(
            p.width >= 1 and p.width % heads == 0,
            "model.policy.width",
            f"must be a positive multiple of its {heads} attention head(s) (width // 64), got {p.width}",
        )
    require(
        not p.level_context or m.levels >= 3,
        "model.policy.level_context",
        f"needs model.levels >= 3 (with {m.levels} levels only the coarsest is scored)",
    )
    try:
        # whatever else SplitViT (and SplitDetector) check; weights are loaded on the workers, not here
        with torch.device("meta"):
            build_model(dataclasses.replace(m, checkpoint_path=None), pretrained=False)
    except (TypeError, ValueError) as exc:
        if m.task == DETECTION_TASK:  # "anchor_sizes: one per pyramid level..." names its option
            raise field_error(exc, _detector_option_names(), "model.detector.", "model") from None
        raise ConfigError("model", str(exc)) from None


def _detector_option_names() -> list[str]:
    """:class:`~splitvit.model.SplitDetector`'s options: its keyword arguments but the
    backbone and ``num_classes`` (``model.num_classes``)."""
    names = list(inspect.signature(SplitDetector.__init__).parameters)
    return [n for n in names if n not in ("self", "backbone", "num_classes")]


def detector_options(model: ModelConfig) -> dict[str, Any]:
    """``model.detector`` as :class:`~splitvit.model.SplitDetector` keyword arguments,
    each value checked against (and converted to) its type: YAML lists become the
    tuples SplitDetector takes.

    Raises :class:`~splitvit.config.ConfigError` naming ``model.detector.<key>`` for a
    key that is not an option (with the closest name) or a value of the wrong type.
    """
    names = _detector_option_names()
    hints = typing.get_type_hints(SplitDetector.__init__)
    options = {}
    for key, value in model.detector.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean model.detector.{close[0]}?" if close else f"expected one of {', '.join(names)}"
            raise ConfigError(f"model.detector.{key}", f"not a SplitDetector option; {hint}")
        options[key] = coerce(value, hints[key], f"model.detector.{key}")
    return options


def experiment_datasets(config: ExperimentConfig, interpolation: str) -> tuple[Any, Any]:
    """The experiment's training and validation sets (``data.val_split``) at the model's
    input size, resized with its ``interpolation``: what the Ray loop, the local trainer
    and ``bench train`` all train and validate on."""
    from ..data import build_dataset

    mc, dc = config.model, config.data
    sizing = dict(image_size=mc.image_size, interpolation=interpolation)
    train_set = build_dataset(dc.name, "train", seed=dc.seed, **sizing, **dc.options)
    return train_set, build_dataset(dc.name, dc.val_split, seed=dc.seed, **sizing, **dc.options)


def build_model(model: ModelConfig, pretrained: bool | None = None) -> SplitViT | SplitDetector:
    """Build the model the ``model`` section describes: a :class:`~splitvit.model.SplitViT`,
    or for ``task: detection`` a :class:`~splitvit.model.SplitDetector` on one
    (``model.num_classes`` object classes, the ``model.detector`` options).

    ``pretrained`` overrides ``model.pretrained`` (the validation builds on the meta
    device without weights). ``auto`` thresholds start at
    :data:`~splitvit.config.AUTO_THRESHOLD_START` until calibrated.
    """
    backbone: dict[str, Any] = dict(
        levels=model.levels,
        policy=model.policy,
        pretrained=model.pretrained if pretrained is None else pretrained,
        checkpoint_path=model.checkpoint_path,
        image_size=model.image_size,
        timm_kwargs=dict(model.timm_kwargs),
        normalize=model.normalize,
        thresholds=AUTO_THRESHOLD_START if model.thresholds == AUTO_THRESHOLDS else model.thresholds,
        fine_aggregation=model.fine_aggregation,
        task=model.task,
        length_buckets=model.length_buckets,
    )
    if model.task == DETECTION_TASK:
        # the backbone runs no head: a classification SplitViT (whose head the detector drops), given no num_classes
        backbone["task"] = "classification"
        options = detector_options(model)
        pyramid = {"pyramid_channels": options.pop("pyramid_channels")} if "pyramid_channels" in options else {}
        return SplitDetector.from_timm(
            model.name, num_classes=model.num_classes, **pyramid, detector_options=options, **backbone
        )
    return SplitViT.from_timm(model.name, num_classes=model.num_classes, **backbone)
