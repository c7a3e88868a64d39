"""Experiment configuration: one YAML file per experiment, ``key=value`` overrides.

A config has six sections (docs/design.md §3.1): ``model``, ``data``, ``train``, ``scaling``,
``storage`` and ``tracking``. :func:`load_config` reads the YAML, applies dotted
overrides (``train.epochs=3``, ``model.timm_kwargs.embed_dim=64``,
``model.thresholds[0]=0.4``) and checks every value's type and range: all that the
settings alone can tell. Any problem raises :class:`ConfigError`, whose message
names the key::

    config error: train.budget.weight: must be >= 0, got -1.0

This module imports neither torch nor timm, the model nor the data. The checks that
need them (the timm model, the policy, the quadtree geometry, the thresholds, a build
on the meta device, the dataset's name) are
:func:`splitvit.train.experiment.validate_experiment`'s. **To get a config to run,
use** :func:`splitvit.train.experiment.load_experiment` (a YAML file) or
:func:`~splitvit.train.experiment.experiment_from_dict` (a dict): the loading here
plus those checks, before any Ray work starts.

The dict-to-dataclass loader (:func:`build_dataclass`, :func:`coerce`) and the
dotted-key setter (:func:`set_dotted`) are the ones search spaces use too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
import re
import time
import types
import typing
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .jsontypes import JsonObject
from .recipes import NO_RECIPE, RecipeError, current_recipes, load_recipe, resolve_name

SECTIONS = ("model", "data", "train", "scaling", "storage", "tracking")
#: the top-level key beside the sections that names a recipe (:mod:`splitvit.recipes`)
RECIPE_KEY = "recipe"
DEFAULT_RUNS_DIR = "runs"
# Keys whose values are never logged, stored in checkpoints or printed. "token" only
# ends a credential's name (GITHUB_TOKEN, auth_token, accessToken): elsewhere it is a
# figure of the model (token_ratio, tokens_per_image), which must stay readable.
SECRET_KEY_PATTERN = re.compile(r"key|secret|token$|password|passwd|credential|auth", re.IGNORECASE)
REDACTED = "***"


class ConfigError(ValueError):
    """A bad experiment setting. ``key`` is the dotted key, ``reason`` what is wrong."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"config error: {key}: {reason}")

    def __reduce__(self):  # Ray pickles a worker's exception: rebuild from key and reason
        return (type(self), (self.key, self.reason), dict(self.__dict__))


# ---------------------------------------------------------------------- sections
#: ``model.thresholds`` value that calibrates thresholds to ``train.budget.target_ratio``.
AUTO_THRESHOLDS = "auto"
#: Where ``auto`` thresholds stand until the first calibration.
AUTO_THRESHOLD_START = 0.5
#: The split policies (:mod:`splitvit.model.policies`), by ``model.policy.kind``.
PolicyKind = Literal["learned", "entropy", "random", "full", "coarse"]
#: How the learned policy's fine evidence pools a node's patches (``model.policy.evidence_pooling``).
EvidencePooling = Literal["max", "soft"]
#: ``model.task``: :class:`~splitvit.model.splitvit.SplitViT`'s tasks (a class per image,
#: or a class per pixel), or ``detection`` (a :class:`~splitvit.model.detection.SplitDetector`).
ModelTask = Literal["classification", "dense", "detection"]
#: How the model normalises its inputs (``model.normalize``; ``input_data_config``'s ``normalize``).
InputNormalization = Literal["auto", "timm", "none"]
#: Budget penalties of the SPLIT objective (:func:`splitvit.train.losses.budget_penalty`).
Penalty = Literal["squared", "hinge"]
#: The model's relevance signals that can teach the policy (``SplitViT.relevance``).
TeacherKind = Literal["gradient", "attention", "objects"]
#: Which nodes the relevance teacher marks (:func:`splitvit.train.losses.relevance_targets`).
TeacherTargets = Literal["per_level", "nested", "mixed"]
#: What the teacher's marks meet the target ratio over (:func:`splitvit.train.losses.relevance_targets`).
TeacherScope = Literal["image", "batch"]
#: The split each epoch validates on (``data.val_split``).
ValSplit = Literal["val", "test"]
#: How Ray places a run's workers (``scaling.placement_strategy``; Ray's placement group strategies).
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]

PENALTIES = typing.get_args(Penalty)
TEACHERS = typing.get_args(TeacherKind)
TEACHER_TARGETS = typing.get_args(TeacherTargets)
TEACHER_SCOPES = typing.get_args(TeacherScope)


#: What each task is judged by; a task not named here (``classification``) by ``accuracy``.
#: ``box_ap``: COCO's box AP (``COCOeval``'s, on a 0-1 scale; :mod:`splitvit.train.coco_eval`).
TASK_METRICS = {"dense": "miou", "detection": "box_ap"}


def quality_metric(task: str) -> str:
    """The quality a task is judged by: ``miou`` for ``dense``, ``box_ap`` for
    ``detection``, ``accuracy`` otherwise. The one place the metric's name is derived."""
    return TASK_METRICS.get(task, "accuracy")


#: Qualities a task is also judged by, beside :func:`quality_metric` (which ranks the
#: points): a detector's mask AP (COCO's ``segm``), whose parity with full resolution a
#: study checks on the same operating point as its box AP's.
COMPANION_METRICS = {"detection": ("mask_ap",)}


def companion_metrics(task: str) -> tuple[str, ...]:
    """The qualities ``task`` is also judged by (:data:`COMPANION_METRICS`; none for most)."""
    return COMPANION_METRICS.get(task, ())


@dataclass
class PolicyConfig:
    """The split policy (``model.policy``): which one, and the learned policy's shape.

    Attributes:
        kind: ``learned``, ``entropy``, ``random``, ``full`` or ``coarse``.
        depth: ViT blocks the learned policy runs on the coarse tokens (with
            ``width``: blocks of its own).
        width: give the learned policy its own blocks of this width instead of
            the ViT's first ones (``null``: share the ViT's): a policy that costs
            little beside a wide ViT (see ``splitvit bench forward``).
        level_context: the learned policy judges each finer level's nodes
            after its blocks (``depth``) ran on all of that level's nodes
            together, not from their patch embeddings alone (needs ``model.levels`` >= 3).
        feature_grad: every gradient that reaches the learned policy's scores
            in the training step (the relevance teacher's, the budget penalty's, the
            task loss's through the split gates) also trains what its features come
            from: the ViT's first ``depth`` blocks and the embeddings. Default
            ``false``: its features are detached and only its own modules learn from
            them. The policy's own epochs (``train.policy.epochs``) detach them either way.
        fine_evidence: the learned policy also scores every node from the most
            telling of the finest patches under it (a small MLP on the finest level's
            embeddings, max-pooled to each level's grid, zero at initialisation): a
            node with one patch on an item splits, as the oracle's rule has it.
        evidence_pooling: how the fine evidence of the patches under a node
            becomes the node's: ``max`` (the most telling patch's), or ``soft``, their
            log-mean-exp (zero at initialisation as ``max`` is, tending to the max as the
            scores part, but passing the gradient to every patch rather than to the
            first of tied ones).
        budget_conditioned: the learned policy is told the target token ratio (an
            embedding of it joins its features), so one model serves every budget;
            trained with ``train.budget.ratio_range``, evaluated at the ratio its
            thresholds are calibrated to.

    Raises ``ValueError`` for a value out of range (its message starts with the
    field's name, which :func:`field_error` turns into the key).
    """

    kind: PolicyKind = "learned"
    depth: int = 2
    width: int | None = None
    level_context: bool = False
    feature_grad: bool = False
    fine_evidence: bool = False
    evidence_pooling: EvidencePooling = "max"
    budget_conditioned: bool = False

    def __post_init__(self) -> None:
        if self.evidence_pooling == "soft" and not self.fine_evidence:
            raise ValueError(
                "evidence_pooling pools the learned policy's fine evidence, but model.policy.fine_evidence "
                "is false: set it true"
            )


@dataclass
class ModelConfig:
    """The SplitViT to train (see :meth:`splitvit.model.SplitViT.from_timm`).

    Attributes:
        name: timm model name (a ``VisionTransformer``), e.g. ``vit_tiny_patch16_224``.
        timm_kwargs: further ``timm.create_model`` arguments (``embed_dim``, ``depth``,
            ``num_heads``, ``patch_size``...); the ViT's patch size is the finest patch.
        levels: quadtree levels ``L``.
        policy: the split policy and the learned policy's shape (:class:`PolicyConfig`).
        thresholds: per-level split thresholds in ``[0, 1]`` (one number: every level),
            or ``auto``: after every epoch the thresholds are calibrated on validation
            images so the model meets ``train.budget.target_ratio`` (the checkpoint keeps them).
        task: ``classification``, ``dense`` or ``detection`` (a
            :class:`~splitvit.model.detection.SplitDetector`: Mask R-CNN on the SplitViT,
            trained on a detection dataset, ``fashion-det`` or ``coco``).
        num_classes: classifier (or per-pixel) classes; for ``detection`` the object
            classes ``K``, the background not counted (labels are ``1..K``).
        detector: ``detection`` only: :class:`~splitvit.model.detection.SplitDetector`
            options by name (``pyramid_channels``, default 256; ``representation_size``,
            ``anchor_sizes``, ``rpn_post_nms_top_n``...), each checked against its type;
            unset ones keep SplitDetector's defaults.
        image_size: input side in pixels; a multiple of the coarsest patch.
        pretrained: load timm's pretrained weights (needs the hub).
        checkpoint_path: local pretrained weights for ``name`` (no hub needed).
        normalize: how the model normalises its ``[0, 1]`` inputs: ``timm`` (timm's
            data config's mean and std, what pretrained weights saw), ``none`` (the
            pixels as they are), or ``auto``: ``timm`` for weights from timm
            (``pretrained`` or ``checkpoint_path``), ``none`` for a model trained from
            scratch. Saved with the checkpoint; ``init_from`` weights bring their own.
        fine_aggregation: every coarse token also gets a zero-initialised aggregation
            of the finest patch embeddings it covers (APT's; see
            :class:`splitvit.model.aggregation.FineAggregation`): a model fine-tuned
            from a full-resolution reference keeps the reference's view of fine detail.
        length_buckets: the padded attention path only (``attention='padded'`` or
            ``return_attention``): encode variable-length batches in this many length groups.
        init_from: start training from the weights of this splitvit checkpoint (a
            folder or ``model.pt``, local or ``s3://``): every tensor whose name and
            shape match is copied, so a policy-free backbone (``full``, ``entropy``...)
            can start from a learned-policy checkpoint and the other way round. A run
            that resumes from its own checkpoint ignores it.
    """

    name: str = "vit_tiny_patch16_224"
    timm_kwargs: dict[str, Any] = field(default_factory=dict)
    levels: int = 3
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    thresholds: float | list[float] | str = "auto"
    task: ModelTask = "classification"
    num_classes: int = 10
    detector: dict[str, Any] = field(default_factory=dict)
    image_size: int = 64
    pretrained: bool = False
    checkpoint_path: str | None = None
    normalize: InputNormalization = "auto"
    fine_aggregation: bool = False
    length_buckets: int = 1
    init_from: str | None = None

    @property
    def metric(self) -> str:
        """The metric this model's task is judged by (:func:`quality_metric`)."""
        return quality_metric(self.task)


@dataclass
class DataConfig:
    """Dataset and loader settings (see :func:`splitvit.data.build_dataset`).

    Attributes:
        name: dataset name (``synthetic``, ...).
        options: dataset keyword arguments (e.g. ``train_samples``, ``object_size``).
        batch_size: training batch size *per worker*.
        eval_batch_size: evaluation batch size per worker (default: ``batch_size``).
        num_workers: DataLoader worker processes per training worker.
        seed: dataset and shuffling seed.
        val_split: split evaluated every epoch (``val`` or ``test``).
    """

    name: str = "synthetic"
    options: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    eval_batch_size: int | None = None
    num_workers: int = 0
    seed: int = 0
    val_split: ValSplit = "val"


@dataclass
class BudgetConfig:
    """The token budget the learned policy trains to (``train.budget``).

    Attributes:
        target_ratio: target tokens as a fraction of full resolution, in (0, 1].
        weight: weight of the token-budget penalty (>= 0).
        penalty: ``squared`` (both sides) or ``hinge`` (over budget only).
        ratio_range: budget-conditioned training: ``[low, high]`` in (0, 1]; each
            batch draws its target ratio uniformly from it (the budget penalty and the
            teacher's targets use it), and a budget-conditioned policy
            (``model.policy.budget_conditioned``) is told it, so that one model serves every
            budget. ``null``: every batch trains at ``target_ratio``.

    Raises ``ValueError`` for a value out of range; its message starts with the
    field's name, which :func:`field_error` turns into the key (``train.budget.weight``).
    """

    target_ratio: float = 0.5
    weight: float = 1.0
    penalty: Penalty = "squared"
    ratio_range: list[float] | None = None

    def __post_init__(self) -> None:
        if not self.weight >= 0:  # "not >=": NaN fails too
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if not 0.0 < self.target_ratio <= 1.0:
            raise ValueError(f"target_ratio must be in (0, 1], got {self.target_ratio}")
        if self.ratio_range is not None:
            bounds = list(self.ratio_range)
            if len(bounds) != 2 or not 0.0 < bounds[0] <= bounds[1] <= 1.0:
                raise ValueError(f"ratio_range must be [low, high] with 0 < low <= high <= 1, got {bounds}")
            self.ratio_range = [float(bounds[0]), float(bounds[1])]


@dataclass
class TeacherConfig:
    """The relevance teacher of the learned policy (``train.teacher``).

    Attributes:
        kind: the relevance signal, ``gradient`` (the model's: gradient x input
            saliency of the true class, or of a detector's loss), ``attention`` (the
            model's last block's class-token attention; classifiers and dense models,
            see ``SplitViT.relevance``) or ``objects`` (a detector's: the annotated
            instance masks' share of each finest cell; no extra pass).
        weight: weight of the relevance-teacher loss on the policy (>= 0).
        targets: which nodes the teacher marks to split at the target ratio.
            ``per_level`` (default): the same share of every level's nodes, each level
            ranked on its own, so a finer node may be marked under a coarse node that
            is not, and the marked tree misses the target ratio (39.5% of the tokens
            at a 50% target on the study's canvases); every level's scores learn a
            ranking. ``nested``: the nodes of all levels ranked together by relevance
            mass, which gives a tree (a node's mass is its children's sum) that meets
            it, but marks every coarsest node at a high target, so that level learns
            no ranking: better near the budget trained for, worse far below it.
            ``mixed``: the mean of the two marks (the mean of both losses), nested's
            tree with every level ranked. Measured in docs/results.md (dense study,
            mixed targets): both beat per-level at 70% of the tokens there (trained
            at a 50% target, full resolution too) and lose the smoke sweep's low
            budgets.
        every: compute the relevance teacher (a full-resolution forward and
            backward pass, about half of a policy-phase step) on every k-th step only;
            the other steps train the policy through the task loss and budget penalty.
        scope: what the teacher's marks meet the target ratio over. ``image``
            (default): every image, each image's nodes ranked on their own, so an empty
            canvas gets as many split marks as a crowded one. ``batch``: the batch as
            a whole (each worker's, under Ray Train), its images' nodes ranked
            together, so a crowded image gets more marks and an empty one fewer, as
            the thresholds that every image shares give at evaluation. Meant for the
            ``objects`` teacher, whose relevance (the share of a node under an
            instance) means the same in every image; the gradient and attention
            teachers' scale varies from image to image.
        context: the ``objects`` teacher's context ring, in pixels (>= 0; 0:
            off): the cells within this distance of an instance mask rank next after
            the masks' own, nearer ones first, so that a budget above the items' share
            keeps their surroundings fine, as ``splitvit eval --oracle-context`` does.
    """

    kind: TeacherKind = "gradient"
    weight: float = 1.0
    targets: TeacherTargets = "per_level"
    every: int = 1
    scope: TeacherScope = "image"
    context: int = 0

    def __post_init__(self) -> None:
        if not self.weight >= 0:  # "not >=": NaN fails too
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if self.context < 0:
            raise ValueError(f"context must be >= 0 pixels, got {self.context}")


@dataclass
class DistillConfig:
    """Self-distillation (``train.distill``).

    Attributes:
        weight: self-distillation (>= 0; 0: off): the split path's logits
            learn from the same model's full-resolution logits (KL divergence,
            teacher detached). The gradient teacher's full-resolution pass gives them
            where it runs; other steps make a gradient-free full-resolution pass.
            Applies wherever the model does not run at full resolution (the learned
            policy after warm-up, and the fixed policies other than ``full``). A
            detector distils features instead: the split path's fine map learns the
            full-resolution one (relative squared error, a gradient-free pass of the
            backbone alone; ``temperature`` unused), so that its heads see
            features like those they were trained on.
        temperature: softmax temperature of the self-distillation (> 0); the
            loss is scaled by its square, as in Hinton et al.
    """

    weight: float = 0.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight >= 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclass
class PolicyTrainingConfig:
    """How the learned policy trains (``train.policy``): its warm-up, learning rate and own epochs.

    Attributes:
        warmup_epochs: epochs of random splits before the policy decides.
        warmup_min_split: lowest per-image random split rate in warm-up.
        lr_scale: the learning rate of SplitViT's own modules (the policy, fine
            aggregation, level embeddings) is ``train.lr`` times this (> 0): a fine-tune from a
            full-resolution reference starts them from scratch, with few steps to learn.
        epochs: after the ``train.epochs``, this many more that train the learned
            policy alone (>= 0; 0: none): every other weight frozen, the relevance
            teacher on every step, its own cosine schedule from the policy's learning
            rate (``train.lr * lr_scale``). The policy reads the backbone's features
            detached, so nothing else changes; with the objects teacher a step is the
            policy's forward alone (docs/results.md, the detection study: in 564
            fine-tune steps the policy learns less than the detector lets it).
        lead_epochs: before the ``train.epochs``, this many that train the learned
            policy alone, as ``epochs`` do (>= 0; 0: none): the fine-tune's
            task loss then meets the policy's splits, not an untrained policy's, from its
            first step. The fine-tune's schedule (learning-rate warm-up, ``warmup_epochs``)
            starts after them.
    """

    warmup_epochs: int = 1
    warmup_min_split: float = 0.3
    lr_scale: float = 1.0
    epochs: int = 0
    lead_epochs: int = 0

    def __post_init__(self) -> None:
        if self.warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        if not 0.0 <= self.warmup_min_split <= 1.0:
            raise ValueError(f"warmup_min_split must be in [0, 1], got {self.warmup_min_split}")
        if not self.lr_scale > 0:
            raise ValueError(f"lr_scale must be > 0, got {self.lr_scale}")
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        if self.lead_epochs < 0:
            raise ValueError(f"lead_epochs must be >= 0, got {self.lead_epochs}")


@dataclass
class SplitLossConfig:
    """Hyper-parameters of the SPLIT objective (:func:`splitvit.train.steps.training_step`),
    grouped by what they steer; :class:`TrainConfig` holds them as its sections
    (``train.budget.weight``).

    Attributes:
        budget: the token budget and its penalty (:class:`BudgetConfig`).
        teacher: the relevance teacher (:class:`TeacherConfig`).
        distill: self-distillation (:class:`DistillConfig`).
        policy: the learned policy's warm-up, learning rate and own epochs
            (:class:`PolicyTrainingConfig`).
    """

    budget: BudgetConfig = field(default_factory=BudgetConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    policy: PolicyTrainingConfig = field(default_factory=PolicyTrainingConfig)


@dataclass
class TrainConfig(SplitLossConfig):
    """Optimisation settings and the SPLIT objective's (its sections are
    :class:`SplitLossConfig`'s: ``train.budget``, ``train.teacher``, ``train.distill``,
    ``train.policy``).

    Attributes:
        epochs: training epochs.
        lr: AdamW peak learning rate.
        weight_decay: AdamW weight decay.
        lr_warmup_steps: linear learning-rate warm-up in optimizer steps; when unset,
            ``lr_warmup_epochs`` epochs' worth of steps.
        lr_warmup_epochs: learning-rate warm-up in epochs (fractions allowed).
        grad_clip: max gradient norm (0 disables clipping).
        amp: bf16 autocast on CUDA (ignored on CPU).
        max_failures: worker-group failures Ray Train recovers from (resuming from
            the latest checkpoint); -1 for no limit.
        budget, teacher, distill, policy: the SPLIT objective (:class:`SplitLossConfig`).
    """

    epochs: int = 10
    lr: float = 1e-3
    weight_decay: float = 0.05
    lr_warmup_steps: int | None = None
    lr_warmup_epochs: float = 1.0
    grad_clip: float = 1.0
    amp: bool = True
    max_failures: int = 2

    @property
    def total_epochs(self) -> int:
        """Every epoch a run trains: the policy's own before and after the fine-tune's ``epochs``."""
        return self.policy.lead_epochs + self.epochs + self.policy.epochs

    def loss_config(self) -> SplitLossConfig:
        """The SPLIT objective's settings alone, as a plain :class:`SplitLossConfig`
        (what the training step gets; ``dataclasses.replace`` works on it and its sections)."""
        return SplitLossConfig(
            **{f.name: dataclasses.replace(getattr(self, f.name)) for f in dataclasses.fields(SplitLossConfig)}
        )


@dataclass
class ScalingConfig:
    """How many Ray Train workers, on what.

    Attributes:
        num_workers: training workers (one DDP rank each).
        use_gpu: one GPU per worker (NCCL); CPU training uses gloo.
        resources_per_worker: Ray resources per worker, e.g. ``{CPU: 4, GPU: 1}``.
        placement_strategy: Ray placement group strategy (``PACK``, ``SPREAD``...).
        allocator: the memory allocator of the training workers, set through their Ray
            runtime environment: ``glibc`` (the default: nothing set), ``glibc-keep``
            (glibc keeping freed memory), ``jemalloc`` or ``tcmalloc`` (preloaded: every
            node needs the library, as the Docker image has). The names and what each
            sets: ``splitvit.train.allocator``; ``splitvit bench train --parts
            allocators`` measures them.
    """

    num_workers: int = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    placement_strategy: PlacementStrategy = "PACK"
    allocator: str = "glibc"


@dataclass
class StorageConfig:
    """Where Ray Train persists checkpoints and results.

    Attributes:
        path: a local folder (default ``./runs``) or ``s3://bucket/prefix``. A
            multi-node cluster needs storage every node reaches (S3, NFS).
        name: the run's name; re-running with the same name and path resumes from
            its latest checkpoint. Default: the config file's stem, a timestamp and
            a random tail (a new run each time).
        num_to_keep: checkpoints kept (newest first); ``None`` keeps all.
    """

    path: str = DEFAULT_RUNS_DIR
    name: str | None = None
    num_to_keep: int | None = None

    @property
    def is_remote(self) -> bool:
        """True for a URI storage path (``s3://...``)."""
        return "://" in self.path and not self.path.startswith("file://")

    def resolved_path(self) -> str:
        """The storage path as Ray gets it: an absolute local path or the URI."""
        if self.is_remote:
            return self.path.rstrip("/")
        path = self.path[len("file://") :] if self.path.startswith("file://") else self.path
        return str(Path(path).expanduser().resolve())

    def run_uri(self) -> str:
        """The run's folder: ``<path>/<name>``."""
        return f"{self.resolved_path()}/{self.name}"


@dataclass
class TrackingConfig:
    """MLflow tracking.

    Attributes:
        enabled: log to MLflow.
        tracking_uri: MLflow tracking URI. Default: ``$MLFLOW_TRACKING_URI`` when set,
            else a local SQLite store ``sqlite:///<runs dir>/mlflow.db`` with
            artifacts under ``<runs dir>/mlartifacts``.
        experiment: MLflow experiment name.
        split_map_images: validation images drawn in the per-epoch split map (0: none).
        log_model: log the final model with ``mlflow.pytorch.log_model``.
    """

    enabled: bool = True
    tracking_uri: str | None = None
    experiment: str = "splitvit"
    split_map_images: int = 8
    log_model: bool = True


@dataclass
class ExperimentConfig:
    """A whole experiment. Load it with :func:`load_config` or :meth:`from_dict`; to
    run it, with :func:`splitvit.train.experiment.load_experiment` (see the module
    docstring)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    #: the recipe whose settings lie under this config's (:mod:`splitvit.recipes`), or
    #: ``none``: the library's defaults (a policy other than ``learned`` never has one)
    recipe: str = NO_RECIPE
    #: dotted key -> the layer that set it (:class:`Layer`'s names; ``default`` for none):
    #: what ``splitvit config`` prints; filled by :func:`resolve_config`
    layers: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(
        cls,
        raw: JsonObject | None,
        overrides: list[str] | None = None,
        *,
        default_name: str = "experiment",
        source: str = "config",
    ) -> ExperimentConfig:
        """A config from a plain dict plus ``key=value`` overrides, its types and ranges
        checked (:func:`validate`); not the checks that need the model or the data
        (:func:`splitvit.train.experiment.experiment_from_dict` adds them). The dict
        may name a recipe (``recipe:``); a learned policy that names none gets its
        task's current one, under the dict's settings (:func:`resolve_config`).
        ``source`` names the dict's layer (``file jobs/configs/smoke.yaml``).

        Raises :class:`ConfigError` naming the first bad key.
        """
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError("<root>", f"expected a mapping of sections, got {type(raw).__name__}")
        with legacy_warnings(source):
            layers = [Layer(source, raw or {}, nested=True)]
            if overrides:
                layers.append(Layer("--set", [parse_override(item) for item in overrides]))
        return resolve_config(layers, default_name=default_name)

    def to_dict(self, redact: bool = True) -> JsonObject:
        """Nested plain dict (the recipe's name, then the six sections); secret-looking
        values replaced by ``***`` unless ``redact=False``. :meth:`from_dict` reads it
        back to the same config."""
        data = {RECIPE_KEY: self.recipe, **{name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}}
        return redact_secrets(data) if redact else data

    def flat(self, redact: bool = True) -> dict[str, Any]:
        """Dotted-key view (``train.lr``), for MLflow params."""
        return flatten(self.to_dict(redact=redact))

    def tracking_uri(self) -> str:
        """The MLflow tracking URI this experiment logs to (see :class:`TrackingConfig`)."""
        if self.tracking.tracking_uri:
            return self.tracking.tracking_uri
        env = os.environ.get("MLFLOW_TRACKING_URI")
        if env:
            return env
        return f"sqlite:///{self.local_runs_dir()}/mlflow.db"

    def local_runs_dir(self) -> str:
        """Local folder for the embedded MLflow store: the storage folder, or ``./runs``
        when checkpoints go to S3."""
        if self.storage.is_remote:
            return str(Path(DEFAULT_RUNS_DIR).resolve())
        return self.storage.resolved_path()


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read an experiment YAML, apply ``key=value`` overrides, check types and ranges
    (:meth:`ExperimentConfig.from_dict`). To run it, use
    :func:`splitvit.train.experiment.load_experiment`, which checks the rest.

    Raises :class:`ConfigError` (a ``ValueError``) naming the bad key, or
    ``FileNotFoundError`` when ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"not valid YAML: {exc}") from None
    if raw is None:  # empty or comments only: not an experiment (it would train the defaults)
        raise ConfigError(str(path), "the file is empty (or only comments): it configures no experiment")
    if not isinstance(raw, dict):
        raise ConfigError(str(path), f"expected a mapping of sections, got {type(raw).__name__}")
    return ExperimentConfig.from_dict(raw, overrides, default_name=path.stem, source=f"file {path}")


# ---------------------------------------------------------------------- legacy keys
#: Every setting's key before the settings were grouped by what they steer -> its key
#: now: the one table old configs, studies, search spaces, recipes, ``--set`` items,
#: checkpoints' specs and committed results' settings are read through
#: (:func:`upgrade_dotted`, :func:`upgrade_sections`, :func:`upgrade_flat`).
#: ``model.policy`` and ``train.teacher`` were names; a mapping there is the new section.
LEGACY_KEYS: dict[str, str] = {
    "model.policy": "model.policy.kind",
    "model.policy_depth": "model.policy.depth",
    "model.policy_width": "model.policy.width",
    "model.policy_level_context": "model.policy.level_context",
    "model.policy_feature_grad": "model.policy.feature_grad",
    "model.policy_fine_evidence": "model.policy.fine_evidence",
    "model.policy_evidence_pooling": "model.policy.evidence_pooling",
    "model.budget_conditioned": "model.policy.budget_conditioned",
    "train.target_ratio": "train.budget.target_ratio",
    "train.lambda_budget": "train.budget.weight",
    "train.penalty": "train.budget.penalty",
    "train.target_ratio_range": "train.budget.ratio_range",
    "train.teacher": "train.teacher.kind",
    "train.teacher_weight": "train.teacher.weight",
    "train.teacher_targets": "train.teacher.targets",
    "train.teacher_every": "train.teacher.every",
    "train.teacher_scope": "train.teacher.scope",
    "train.teacher_context": "train.teacher.context",
    "train.distill_weight": "train.distill.weight",
    "train.distill_temperature": "train.distill.temperature",
    "train.warmup_epochs": "train.policy.warmup_epochs",
    "train.warmup_min_split": "train.policy.warmup_min_split",
    "train.policy_lr_scale": "train.policy.lr_scale",
    "train.policy_epochs": "train.policy.epochs",
    "train.policy_lead_epochs": "train.policy.lead_epochs",
}
#: The sections inside a section (``model.policy``, ``train.budget``...): a file's
#: mapping there merges key by key, as a section does, rather than replacing the whole.
SUBSECTIONS = ("model.policy", "train.budget", "train.teacher", "train.distill", "train.policy")

log = logging.getLogger(__name__)
#: the (source, renames) groups already warned of: a study resolves the same layers for every run
_WARNED: set[tuple[tuple[str, tuple[tuple[str, str], ...]], ...]] = set()
#: the (source, rename) pairs :func:`legacy_warnings` gathers into one line (None: each
#: source warns itself)
_GATHERED: list[tuple[str, tuple[str, str]]] | None = None


def _legacy_target(key: str, value: Any) -> str | None:
    """The new key of the old dotted ``key`` (no index), or None: ``model.policy`` and
    ``train.teacher`` are old only where their value is not a mapping (the new section)."""
    new = LEGACY_KEYS.get(key)
    # a mapping there is the section, unless it is a search space's distribution
    if new is None or (new.endswith(".kind") and isinstance(value, dict) and "distribution" not in value):
        return None
    return new


def warn_legacy(source: str, renames: list[tuple[str, str]]) -> None:
    """One deprecation line for ``source``'s old keys (``old -> new`` each), once per
    source and keys; none for the library's own recipes (versioned records, never edited)."""
    if not renames or source.startswith("recipe "):
        return
    if _GATHERED is not None:
        _GATHERED.extend((source, r) for r in renames)  # legacy_warnings drops repeats
        return
    _warn_once({source: renames})


def _warn_once(groups: dict[str, list[tuple[str, str]]]) -> None:
    """One line for the old keys of each source in ``groups`` (where -> renames)."""
    marker = tuple((where, tuple(renames)) for where, renames in groups.items())
    if marker in _WARNED:
        return
    _WARNED.add(marker)
    listed = {where: ", ".join(f"{old} -> {new}" for old, new in renames) for where, renames in groups.items()}
    if len(listed) == 1:
        ((where, text),) = listed.items()
        log.warning("%s uses old setting names (read as the new ones; rename them): %s", where, text)
    else:
        text = "; ".join(f"in {where}: {renames}" for where, renames in listed.items())
        log.warning("old setting names (read as the new ones; rename them) %s", text)


@contextlib.contextmanager
def legacy_warnings(source: str) -> Iterator[None]:
    """The old keys of everything read inside (a file and its ``--set`` items, a study's
    sections and methods) warned of in one line naming where each was: ``source`` (its
    own sections count as it) or another layer, e.g. ``--set``."""
    global _GATHERED
    if _GATHERED is not None:  # already gathering: the outer one warns
        yield
        return
    _GATHERED = []
    try:
        yield
        gathered = _GATHERED
    finally:
        _GATHERED = None
    groups: dict[str, list[tuple[str, str]]] = {}
    for where, rename in gathered:
        renames = groups.setdefault(source if where.startswith(source) else where, [])
        if rename not in renames:
            renames.append(rename)
    if groups:
        _warn_once(groups)


def _both_spellings(old: str, new: str, source: str) -> ConfigError:
    return ConfigError(new, f"set twice in {source}, as {new} and by its old name {old}: keep {new} alone")


def upgrade_dotted(items: Any, source: str = "settings", *, warn: bool = True) -> Any:
    """Dotted settings (a mapping, or ``(key, value)`` pairs) with every old key
    (:data:`LEGACY_KEYS`; an index kept: ``train.target_ratio_range[0]``) under its new
    name, in the same form and order. Logs one deprecation line naming them
    (:func:`warn_legacy`; not with ``warn=False``). Raises :class:`ConfigError` where an
    old key and its new one are both set."""
    pairs = list(items.items()) if isinstance(items, dict) else list(items)
    renames: list[tuple[str, str]] = []
    out: list[tuple[str, Any]] = []
    given: set[str] = set()  # the new keys given as such
    for key, value in pairs:
        parts, index = split_key(str(key))
        new = _legacy_target(".".join(parts), value)
        if new is None:
            out.append((key, value))
            given.add(".".join(parts))
            continue
        renames.append((".".join(parts), new))
        out.append((new if index is None else f"{new}[{index}]", value))
    for old, new in renames:
        if new in given or (new.endswith(".kind") and new.rsplit(".", 1)[0] in given):
            raise _both_spellings(old, new, source)
    if warn:
        warn_legacy(source, list(dict.fromkeys(renames)))
    return dict(out) if isinstance(items, dict) else out


def upgrade_keys(keys: Iterable[str]) -> list[str]:
    """Dotted keys (a lever's ``without:``, a list of settings) under their new names."""
    return [key if _legacy_target(key, None) is None else LEGACY_KEYS[key] for key in keys]


def upgrade_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat settings dict read back from a record (a study's or a sweep's committed
    JSON, MLflow params, a recipe, a checkpoint's spec) with every old key under its
    new name; silent (the record is history, not something to edit)."""
    return upgrade_dotted(flat, "record", warn=False)


def legacy_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat settings dict under the old key names (:data:`LEGACY_KEYS` backwards): for
    a digest of settings that must stay what it was (a sweep's reference folder is
    named by one, and a trained reference is found again by it)."""
    old_names = {new: old for old, new in LEGACY_KEYS.items()}
    return {old_names.get(key, key): value for key, value in flat.items()}


def upgrade_sections(raw: JsonObject, source: str = "config", *, warn: bool = True) -> JsonObject:
    """A config file's sections (``{model: {policy: learned, policy_depth: 3}}``) with
    every old key moved to its new section (``{model: {policy: {kind: learned, depth:
    3}}}``); a copy. Logs one deprecation line naming them, and raises
    :class:`ConfigError` where an old key and its new one are both set."""
    if not isinstance(raw, dict):
        return raw
    out = _deep_copy(raw)
    renames: list[tuple[str, str]] = []
    for section, values in raw.items():
        if not isinstance(values, dict):
            continue
        # the names first (model.policy: learned), so that the others find their section
        ordered = sorted(values, key=lambda k: f"{section}.{k}" not in ("model.policy", "train.teacher"))
        for key in ordered:
            new = _legacy_target(f"{section}.{key}", values[key])
            if new is None:
                continue
            old = f"{section}.{key}"
            renames.append((old, new))
            value = out[section].pop(key)
            sub, leaf = new.split(".")[1:]
            target = out[section].setdefault(sub, {})
            if not isinstance(target, dict):
                raise _both_spellings(old, f"{section}.{sub}", source)
            if leaf in target:
                raise _both_spellings(old, new, source)
            target[leaf] = value
    if warn:
        warn_legacy(source, renames)
    return out


# ---------------------------------------------------------------------- layers and recipes
@dataclass(frozen=True)
class Layer:
    """One source of settings, in the order they apply (docs/design.md §3.1): library
    defaults < recipe < experiment file < study ``config:`` < study stage < method entry
    < ``--set``.

    Attributes:
        name: what ``splitvit config`` shows as the key's source (``file x.yaml``, ``--set``).
        values: a config file's sections (``nested``), or dotted keys and their values
            (a mapping, or pairs applied in order: ``model.thresholds[0]`` after
            ``model.thresholds``); ``recipe`` may be among them.
        nested: ``values`` is a file's mapping of sections, merged key by key into each
            section; otherwise each dotted key is set (:func:`set_dotted`).
        without: keys of the recipe this layer drops (a study lever's ``without:``):
            they keep the library's defaults unless another layer sets them.
    """

    name: str
    values: Any
    nested: bool = False
    without: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # old key names (LEGACY_KEYS) read as the new ones, one deprecation line per source
        if self.nested:
            values = upgrade_sections(self.values, self.name) if isinstance(self.values, dict) else self.values
        else:
            values = upgrade_dotted(self.values, self.name)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "without", tuple(upgrade_keys(self.without)))

    def apply(self, raw: JsonObject) -> None:
        """Set this layer's values in ``raw`` (a config being assembled): a file's
        sections (and the sections inside them, :data:`SUBSECTIONS`) merged key by key."""
        if self.nested:
            for key, value in self.values.items():
                if isinstance(value, dict) and isinstance(raw.get(key), dict):
                    for name, inner in value.items():
                        current = raw[key].get(name)
                        if f"{key}.{name}" in SUBSECTIONS and isinstance(inner, dict) and isinstance(current, dict):
                            current.update(_deep_copy(inner))
                        else:
                            raw[key][name] = _deep_copy(inner)
                else:
                    raw[key] = _deep_copy(value)
            return
        items = self.values.items() if isinstance(self.values, dict) else self.values
        for key, value in items:
            set_dotted(raw, key, value)

    def keys(self) -> list[str]:
        """The dotted keys this layer sets, as :meth:`apply` sets them: a file's keys one
        level into each section (``model.timm_kwargs`` replaces the whole mapping) and
        into the sections inside them (``model.policy.depth``), dotted keys without their index."""
        if self.nested:
            keys = []
            for section, values in self.values.items():
                if not isinstance(values, dict):
                    keys.append(section)
                    continue
                for key, value in values.items():
                    name = f"{section}.{key}"
                    inner = value if name in SUBSECTIONS and isinstance(value, dict) and value else None
                    keys += [f"{name}.{k}" for k in inner] if inner else [name]
            return keys
        items = self.values.items() if isinstance(self.values, dict) else self.values
        return [".".join(split_key(key)[0]) for key, _ in items]


def resolve_config(layers: list[Layer], *, default_name: str = "experiment") -> ExperimentConfig:
    """The config the ``layers`` give, each over the ones before it, over the recipe it
    names (the last ``recipe:`` among them; for a learned policy that names none, its
    task's current recipe; ``none``: no recipe), over the library's defaults. A recipe
    applies to the learned policy only: full resolution, entropy, random and all-coarse
    ignore it. Every key's layer is kept in ``config.layers``.

    Raises :class:`ConfigError` naming the first bad key, ``recipe`` for an unknown
    recipe or one of another task.
    """
    raw: JsonObject = {}
    for layer in layers:
        layer.apply(raw)
    requested = raw.pop(RECIPE_KEY, None)
    if requested is not None and not isinstance(requested, str):
        raise ConfigError(RECIPE_KEY, f"expected a recipe name or none, got {requested!r}")
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    section = model.get("policy") if isinstance(model.get("policy"), dict) else {}
    task, policy = model.get("task", ModelConfig.task), section.get("kind", PolicyConfig.kind)
    try:
        # a task no recipe is for (a misspelt one) is left to its own check: it names model.task
        name = resolve_name(requested, task) if task in current_recipes() else None
    except RecipeError as exc:
        raise ConfigError(RECIPE_KEY, str(exc)) from None
    applied = name if policy == "learned" else None
    stack = list(layers)
    if applied is not None:
        settings = upgrade_flat(load_recipe(applied).settings)  # recipes keep the names they were made with
        without = [key for layer in layers for key in layer.without]
        for key in without:
            if key not in settings:
                raise ConfigError(f"without.{key}", f"not a setting of recipe {applied}: {', '.join(settings)}")
        recipe = Layer(f"recipe {applied}", {k: v for k, v in settings.items() if k not in without})
        # under every layer: a recipe key goes in only where no layer set it or a section above it
        set_by_layers = {key for layer in layers for key in layer.keys()}
        Layer(recipe.name, {k: v for k, v in recipe.values.items() if not _prefixes(k) & set_by_layers}).apply(raw)
        stack.insert(0, recipe)
    for key in raw:
        if key not in SECTIONS:
            close = difflib.get_close_matches(str(key), [*SECTIONS, RECIPE_KEY], n=1)
            hint = f"did you mean {close[0]}?" if close else f"expected {RECIPE_KEY} or one of {', '.join(SECTIONS)}"
            raise ConfigError(str(key), f"unknown key; {hint}")
    config = build_dataclass(ExperimentConfig, raw)
    config.recipe = applied or NO_RECIPE
    if config.storage.name is None:
        # the time for people, a random tail so two runs started together never share a folder
        config.storage.name = f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    config.layers = _provenance(config, stack)
    try:
        validate(config)
    except ConfigError as exc:
        raise blame_recipe(exc, config) from None
    return config


CANVAS_CACHE = "canvas-cache"  # under a study's or a sweep's storage path


def shared_canvas_cache(config: ExperimentConfig, root: str | Path | None = None) -> dict[str, str]:
    """The setting that renders cluttered canvases once, into ``<root>/canvas-cache``,
    for every run of a study or sweep that reads them (and every later one): rendering a
    canvas costs about a small ViT's training step (``data/cluttered.py``), and a cached
    canvas is the 8-bit one every study trained on. ``{"data.options.cache_dir": ...}`` for
    cluttered data whose config names no cache of its own, else ``{}``. ``root`` defaults
    to the storage path, where that is local (a remote one gets no cache)."""
    data, storage = config.data, config.storage
    if not data.name.startswith("cluttered") or "cache_dir" in data.options:
        return {}
    if root is None:
        if storage.is_remote:
            return {}
        root = storage.resolved_path()
    return {"data.options.cache_dir": str(Path(root) / CANVAS_CACHE)}


def blame_recipe(exc: ConfigError, config: ExperimentConfig) -> ConfigError:
    """``exc``, saying so where the recipe set the key it names (a key the files may not
    show), and what to do instead."""
    if not config.layers.get(exc.key, "").startswith("recipe "):
        return exc
    return ConfigError(
        exc.key,
        f"{exc.reason} (set by recipe {config.recipe}: set {exc.key} yourself, name another recipe, "
        "or recipe: none for the library's defaults)",
    )


def _provenance(config: ExperimentConfig, stack: list[Layer]) -> dict[str, str]:
    """Each of ``config``'s dotted keys -> the last layer of ``stack`` that set it, or a
    section above it (``data.options`` sets ``data.options.val_samples``); ``default``."""
    set_by = [(layer.name, set(layer.keys())) for layer in stack]
    return {
        key: next((name for name, keys in reversed(set_by) if keys & _prefixes(key)), "default")
        for key in config.flat(redact=False)
        if key != RECIPE_KEY
    }


def _prefixes(key: str) -> set[str]:
    """``data.options.val_samples`` -> itself and the sections above it (``data``, ``data.options``)."""
    parts = key.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def config_layers(config: ExperimentConfig) -> JsonObject:
    """The config with each key's layer, as ``splitvit config`` shows it and MLflow's
    training, trial and study runs keep it (``config_layers.json``): the recipe, then
    ``key -> {value, layer}``."""
    flat = config.flat(redact=True)
    return {
        RECIPE_KEY: config.recipe,
        "keys": {k: {"value": v, "layer": config.layers.get(k, "default")} for k, v in flat.items() if k != RECIPE_KEY},
    }


#: settings only the learned policy reads: a run of another policy is the same run
#: whatever they say (a study's control is not made stale by its recipe's keys)
LEARNED_POLICY_KEYS = (
    "model.policy.depth",
    "model.policy.width",
    "model.policy.level_context",
    "model.policy.feature_grad",
    "model.policy.fine_evidence",
    "model.policy.evidence_pooling",
    "model.policy.budget_conditioned",
    "train.teacher.kind",
    "train.teacher.weight",
    "train.teacher.targets",
    "train.teacher.every",
    "train.teacher.scope",
    "train.teacher.context",
    "train.policy.warmup_epochs",
    "train.policy.warmup_min_split",
    "train.policy.epochs",
    "train.policy.lead_epochs",
)


#: policies that split the same way whatever the budget (every node, or none)
UNTHRESHOLDED_POLICIES = ("full", "coarse")
#: settings only a budget reads: the thresholds, the target ratio and the budget penalty
BUDGET_KEYS = (
    "model.thresholds",
    "train.budget.target_ratio",
    "train.budget.ratio_range",
    "train.budget.weight",
    "train.budget.penalty",
)


def inert_keys(flat: dict[str, Any]) -> set[str]:
    """The keys of a flat config (:meth:`ExperimentConfig.flat`; old key names are read
    as the new ones) that its run never reads: the learned policy's own where the
    policy is another, a budget's where the policy splits every node or none, and the
    recipe's name (its settings are the keys themselves)."""
    inert = {RECIPE_KEY}
    policy = upgrade_flat(flat).get("model.policy.kind", PolicyConfig.kind)
    if policy != "learned":
        inert.update(LEARNED_POLICY_KEYS)
    if policy in UNTHRESHOLDED_POLICIES:
        inert.update(BUDGET_KEYS)
    return inert


# ---------------------------------------------------------------------- dotted keys
_INDEXED = re.compile(r"^(?P<key>[A-Za-z_][\w.]*)\[(?P<index>\d+)\]$")


def split_key(key: str) -> tuple[list[str], int | None]:
    """``model.thresholds[1]`` -> ``(["model", "thresholds"], 1)``; ``train.lr`` -> ``(["train", "lr"], None)``."""
    match = _INDEXED.match(key)
    if match:
        return match.group("key").split("."), int(match.group("index"))
    return key.split("."), None


def parse_override(item: str) -> tuple[str, Any]:
    """``"train.epochs=3"`` -> ``("train.epochs", 3)``: the dotted key and the value
    parsed as YAML (text that is not YAML stays text: the type check decides)."""
    if "=" not in item:
        raise ConfigError(item, "override must look like key=value (e.g. train.epochs=3)")
    key, text = item.split("=", 1)
    key = key.strip()
    parts, _ = split_key(key)
    if not key or any(not p for p in parts):
        raise ConfigError(key or item, "override key must be a dotted name like train.epochs")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return key, value


def apply_override(raw: JsonObject, item: str) -> None:
    """Apply one ``dotted.key=value`` (:func:`parse_override`) to a raw config dict."""
    set_dotted(raw, *parse_override(item))


def set_dotted(raw: JsonObject, key: str, value: Any) -> None:
    """Set a dotted, optionally indexed key (``train.lr``, ``model.thresholds[0]``) in a
    raw dict to a copy of ``value``, creating the sections on its way.

    An index into ``model.thresholds`` given as one number (or ``auto``) first
    expands it to one threshold per non-finest level (``model.levels - 1``).
    Raises :class:`ConfigError` where a part of the key is a value, not a section,
    or the index does not fit the list.
    """
    parts, index = split_key(key)
    node = _parent_section(raw, parts, key)
    last = parts[-1]
    if index is None:
        node[last] = _deep_copy(value)
        return
    current = node.get(last)
    if parts == ["model", "thresholds"] and not isinstance(current, list):
        # one number, or ``auto`` (calibrated to the target ratio): setting one level
        # fixes them all, the others at the number (or where ``auto`` starts)
        levels = node.get("levels")
        if isinstance(levels, bool) or not isinstance(levels, int):
            levels = ModelConfig.levels  # unset (or wrong: the type check says so)
        number = isinstance(current, (int, float)) and not isinstance(current, bool)
        current = [current if number else AUTO_THRESHOLD_START] * max(levels - 1, 1)
    if not isinstance(current, list):
        raise ConfigError(".".join(parts), f"is not a list, so {key} cannot index it")
    if index >= len(current):
        raise ConfigError(key, f"index {index} is out of range: {'.'.join(parts)} has {len(current)} entries")
    current = list(current)
    current[index] = _deep_copy(value)
    node[last] = current


def _parent_section(raw: JsonObject, parts: list[str], key: str) -> JsonObject:
    """The section of ``raw`` that holds the dotted key ``parts`` (all but the last
    part), created where missing; ``ConfigError`` where a part is a value."""
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), f"is a value, not a section; cannot set {key}")
        node = child
    return node


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# ---------------------------------------------------------------------- typing
def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(hint))
        return f"{origin.__name__}[{args}]"
    if hint is type(None):
        return "null"
    if hint is Any:
        return "any"
    if hint is Ellipsis:
        return "..."
    if typing.get_origin(hint) is Literal:
        return " or ".join(map(str, typing.get_args(hint)))
    return getattr(hint, "__name__", str(hint))


_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def coerce(value: Any, hint: Any, key: str) -> Any:
    """``value`` checked against the type ``hint`` and returned as that type (ints
    accepted for floats, lists for ``tuple[X, ...]`` and ``tuple[X, Y]``); :class:`ConfigError` on ``key``."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin is Literal:  # a name among the allowed ones: the one place they are checked
        allowed = typing.get_args(hint)
        if isinstance(value, str) and value in allowed:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint_text = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(key, f"must be one of {', '.join(map(str, allowed))}, got {value!r}{hint_text}")
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(key, f"expected {_type_name(hint)}, got {type(value).__name__} {value!r}")
    if hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # PyYAML (YAML 1.1) reads 1e-3 as a string: it wants 1.0e-3
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is tuple and typing.get_args(hint)[1:] != (Ellipsis,):
        # a fixed-length tuple (model.detector's (training, testing) pairs): one type per entry
        args = typing.get_args(hint)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(coerce(v, arg, f"{key}[{i}]") for i, (v, arg) in enumerate(zip(value, args, strict=True)))
    elif origin in (list, tuple):
        args = typing.get_args(hint)
        if isinstance(value, (list, tuple)):
            items = [coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
    elif origin is dict:
        if isinstance(value, dict):
            _, arg = typing.get_args(hint)
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ConfigError(f"{key}.{k}", "keys must be strings")
                out[k] = coerce(v, arg, f"{key}.{k}")
            return out
    else:  # pragma: no cover - a hint no config uses
        raise TypeError(f"unsupported config type {hint!r} for {key}")
    raise ConfigError(key, f"expected {_type_name(hint)}, got {type(value).__name__} {value!r}")


def build_dataclass(cls: type, raw: Any, prefix: str = "") -> Any:
    """The dataclass ``cls`` from a raw mapping: unknown keys refused (with the closest
    name), every value checked by :func:`coerce`, nested dataclass fields built the
    same way. ``prefix`` (``"train."``) starts every key an error names.

    A ``ValueError`` from ``cls`` itself (its ``__post_init__``) becomes a
    :class:`ConfigError` on the field its message starts with (:func:`field_error`).
    """
    where = prefix.rstrip(".") or "<root>"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(where, f"expected a mapping, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; expected one of {', '.join(names)}"
            raise ConfigError(f"{prefix}{key}", f"unknown key{hint}")
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build_dataclass(hint, raw[name], f"{prefix}{name}.")
        else:
            kwargs[name] = coerce(raw[name], hint, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:
        raise field_error(exc, names, prefix, where) from None


def field_error(exc: ValueError, names: Iterable[str], prefix: str, where: str) -> ConfigError:
    """A ``ValueError`` whose message starts with one of ``names``
    (``"weight must be >= 0, got -1"``) as a :class:`ConfigError` on that key,
    ``prefix`` first (``train.budget.weight: must be >= 0, got -1``); any other
    message on the key ``where``."""
    message = str(exc)
    for name in names:
        if re.match(rf"{re.escape(name)}\b", message):  # \b: a name is not the start of a longer one
            return ConfigError(f"{prefix}{name}", _strip_name(message, name))
    return ConfigError(where, message)


# ---------------------------------------------------------------------- validation
def require(ok: bool, key: str, reason: str) -> None:
    """Raise ``ConfigError(key, reason)`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, reason)


def _strip_name(message: str, name: str) -> str:
    """``"weight must be >= 0"`` -> ``"must be >= 0"`` (the key says the name)."""
    for prefix in (f"{name}: ", f"{name} "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message


def validate(config: ExperimentConfig) -> None:
    """Range and consistency checks of every section: all the settings alone can tell.

    Raises :class:`ConfigError` naming the key. The checks that need timm, the model
    or the dataset registry are :func:`splitvit.train.experiment.validate_experiment`'s,
    which runs this first.
    """
    _check_train(config)
    _check_data(config.data)
    _check_scaling(config.scaling)
    _check_storage(config.storage)
    _check_tracking(config.tracking)
    _check_model(config)


def _check_train(config: ExperimentConfig) -> None:
    """The ``train`` section (the SPLIT objective's ranges are its sections' own), and the
    model's policy section."""
    m, t = config.model, config.train
    require(t.epochs >= 1, "train.epochs", f"must be >= 1, got {t.epochs}")
    for key, value in (("epochs", t.policy.epochs), ("lead_epochs", t.policy.lead_epochs)):
        require(
            value == 0 or (m.policy.kind == "learned" and t.teacher.weight > 0),
            f"train.policy.{key}",
            f"trains a learned policy with its relevance teacher, but model.policy.kind is {m.policy.kind!r} and "
            f"train.teacher.weight {t.teacher.weight}: set model.policy.kind=learned and a train.teacher.weight > 0, "
            "or remove it",
        )
    require(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    require(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    require(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0 (0 disables clipping), got {t.grad_clip}")
    require(
        t.lr_warmup_steps is None or t.lr_warmup_steps >= 0,
        "train.lr_warmup_steps",
        f"must be >= 0, got {t.lr_warmup_steps}",
    )
    require(t.lr_warmup_epochs >= 0, "train.lr_warmup_epochs", f"must be >= 0, got {t.lr_warmup_epochs}")
    require(t.max_failures >= -1, "train.max_failures", f"must be >= 0, or -1 for no limit, got {t.max_failures}")
    # the sections check their types, names and ranges when built; again for a config changed since
    for where, section in (
        ("model.policy", m.policy),
        *((f"train.{f.name}", getattr(t, f.name)) for f in dataclasses.fields(SplitLossConfig)),
    ):
        build_dataclass(type(section), dataclasses.asdict(section), f"{where}.")


def _check_data(d: DataConfig) -> None:
    """The ``data`` section (its names re-checked by its type, for a config changed since loading)."""
    build_dataclass(DataConfig, dataclasses.asdict(d), "data.")
    require(d.batch_size >= 1, "data.batch_size", f"must be >= 1, got {d.batch_size}")
    require(
        d.eval_batch_size is None or d.eval_batch_size >= 1,
        "data.eval_batch_size",
        f"must be >= 1, got {d.eval_batch_size}",
    )
    require(d.num_workers >= 0, "data.num_workers", f"must be >= 0, got {d.num_workers}")
    for key in d.options:
        require(key != "image_size", "data.options.image_size", "set the image size with model.image_size")


def _check_scaling(s: ScalingConfig) -> None:
    """The ``scaling`` section (its names re-checked by its type, for a config changed since loading)."""
    build_dataclass(ScalingConfig, dataclasses.asdict(s), "scaling.")
    require(s.num_workers >= 1, "scaling.num_workers", f"must be >= 1, got {s.num_workers}")
    for key, value in s.resources_per_worker.items():
        require(value >= 0, f"scaling.resources_per_worker.{key}", f"must be >= 0, got {value}")


def _check_storage(st: StorageConfig) -> None:
    """The ``storage`` section."""
    if st.is_remote:
        require(
            st.path.startswith("s3://") and len(st.path) > len("s3://"),
            "storage.path",
            f"must be a local folder or s3://bucket/prefix, got {st.path!r}",
        )
    require(
        bool(st.name) and "/" not in st.name and st.name not in (".", ".."),
        "storage.name",
        f"must be a plain folder name (no '/'), got {st.name!r}",
    )
    require(
        st.num_to_keep is None or st.num_to_keep >= 1,
        "storage.num_to_keep",
        f"must be >= 1 or null, got {st.num_to_keep}",
    )


def _check_tracking(tr: TrackingConfig) -> None:
    """The ``tracking`` section."""
    require(bool(tr.experiment), "tracking.experiment", "must not be empty")
    require(tr.split_map_images >= 0, "tracking.split_map_images", f"must be >= 0, got {tr.split_map_images}")


def _check_model(config: ExperimentConfig) -> None:
    """The ``model`` section, as far as it needs no timm and no model (``validate_experiment``
    checks the rest), and the teacher against the task."""
    m, t = config.model, config.train
    require(m.num_classes >= 1, "model.num_classes", f"must be >= 1, got {m.num_classes}")
    require(m.image_size >= 1, "model.image_size", f"must be >= 1, got {m.image_size}")
    require(m.levels >= 2, "model.levels", f"must be >= 2 (one coarse and one fine level), got {m.levels}")
    require(m.length_buckets >= 1, "model.length_buckets", f"must be >= 1, got {m.length_buckets}")
    require(
        (t.teacher.kind == "objects") == (m.task == "detection") or t.teacher.kind == "gradient",
        "train.teacher.kind",
        f"{t.teacher.kind} is not a teacher of a {m.task} model: "
        + (
            "a detector has no class token to attend from; its teachers are gradient and objects"
            if m.task == "detection"
            else "objects reads instance annotations, a detector's (model.task=detection); use gradient or attention"
        ),
    )
    require(
        t.teacher.context == 0 or t.teacher.kind == "objects",
        "train.teacher.context",
        f"is the objects teacher's ring around each instance mask, but train.teacher.kind is {t.teacher.kind!r}: "
        "set train.teacher.kind=objects (a detector's), or remove it",
    )
    require(
        not m.detector or m.task == "detection",
        "model.detector",
        f"sets a detector's options, but model.task is {m.task!r}: set model.task=detection, or remove it",
    )
    if m.checkpoint_path is not None:
        require(
            Path(m.checkpoint_path).expanduser().is_file(),
            "model.checkpoint_path",
            f"file {m.checkpoint_path} does not exist",
        )
    if m.init_from is not None and "://" not in m.init_from:
        local = Path(m.init_from).expanduser()
        require(
            (local / "model.pt").is_file() or local.is_file(),
            "model.init_from",
            f"no splitvit checkpoint at {m.init_from} (a checkpoint folder holding model.pt, or the file)",
        )
    if isinstance(m.thresholds, str):
        require(
            m.thresholds == AUTO_THRESHOLDS,
            "model.thresholds",
            f"must be numbers in [0, 1] or {AUTO_THRESHOLDS!r}, got {m.thresholds!r}",
        )


# ---------------------------------------------------------------------- base configs
class BaseConfigError(ConfigError):
    """The ``base`` of a search space or a study file names no experiment config file
    (``key`` is ``base``). The space and the study report it as their own file's mistake."""


def resolve_base_config(base: Any, root: Path) -> Path:
    """The experiment config file a search space or a study file names as its ``base``:
    a path relative to ``root`` (the naming file's folder), else to the working
    directory, or an absolute one. Raises :class:`BaseConfigError`."""
    if not base or not isinstance(base, str):
        raise BaseConfigError(
            "base", "name the experiment config the space applies to, e.g. base: ../jobs/configs/smoke.yaml"
        )
    candidate = Path(base).expanduser()
    if not candidate.is_absolute():
        # relative to the space file; a path relative to the working directory also works
        for option in (root / candidate, candidate):
            if option.is_file():
                return option.resolve()
        raise BaseConfigError(
            "base", f"experiment config {base} not found (relative to {root} or the working directory)"
        )
    if not candidate.is_file():
        raise BaseConfigError("base", f"experiment config {base} not found")
    return candidate


# ---------------------------------------------------------------------- flattening
def flatten(data: JsonObject, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def is_secret_key(key: str) -> bool:
    """True for names that look like they hold credentials (key, secret, password,
    ``*token``...); token counts and ratios (``token_ratio``, ``tokens_per_image``) are not."""
    last = str(key).rsplit(".", 1)[-1]
    return bool(SECRET_KEY_PATTERN.search(last))


_URI_USERINFO = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^@/]+)@")
# a query parameter; its value is masked when its name looks secret (is_secret_key)
_QUERY_PARAM = re.compile(r"(?P<name>[?&](?P<key>[^=&]*)=)(?P<value>[^&]*)")


def redact_uri(uri: str) -> str:
    """A URI with its password (``user:pass@``) and secret query values replaced by ``***``."""
    if not isinstance(uri, str):
        return uri
    match = _URI_USERINFO.match(uri)
    if match:
        user = match.group("userinfo").split(":", 1)[0]
        uri = (
            f"{match.group('scheme')}{user}:{REDACTED}@{uri[match.end() :]}" if ":" in match.group("userinfo") else uri
        )

    def masked(m: re.Match) -> str:
        return m.group("name") + (REDACTED if is_secret_key(m.group("key")) else m.group("value"))

    return _QUERY_PARAM.sub(masked, uri)


def redact_secrets(data: Any, key: str = "") -> Any:
    """Copy of ``data`` with secret-named values replaced and URIs' passwords removed."""
    if isinstance(data, dict):
        return {k: (REDACTED if is_secret_key(k) and v is not None else redact_secrets(v, k)) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_secrets(v, key) for v in data]
    if isinstance(data, str):
        return redact_uri(data)
    return data
