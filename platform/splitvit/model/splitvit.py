"""SplitViT: a timm VisionTransformer that reads a per-image quadtree of mixed-scale patches.

The forward pass:

1. embeds the image at every scale it needs: a leaf of side ``s`` is area-resized to
   ``p x p`` (an average pool of the whole image by ``s / p``) and goes through the
   model's own patch embedding; its position embedding is the base grid's, pooled
   over the area it covers; a zero-initialised level embedding marks its scale;
   with ``fine_aggregation``, a zero-initialised term adds what the model's patch
   embedding says of the fine patches under it (APT's aggregation, see
   :mod:`~splitvit.model.aggregation`);
2. asks the policy for split scores and turns them into top-down decisions;
3. gathers each image's leaves into one sequence;
4. runs timm's own blocks, then a classification or dense head. By default
   (``attention='packed'``) the batch's tokens are packed into one ``(T, D)``
   tensor: norms, linear layers and MLP run on real tokens only and just the
   attention kernel groups them per image (varlen attention on CUDA; elsewhere a
   key-masked ``scaled_dot_product_attention`` on groups of similar length, each
   padded to its longest sequence). ``attention='padded'`` pads
   the batch to the longest sequence and masks the padding keys (no query row is
   ever fully masked), optionally in length buckets to cut padding; it is also the
   path for ``return_attention=True``.

Inputs are images in ``[0, 1]``; the model normalises them itself with its timm
data config's mean and std (buffers ``input_mean`` / ``input_std``, saved in the
state dict), so every caller feeds the same pixels the pretrained weights saw.

A ``budget_conditioned`` model's learned policy is told the target token ratio: the
``budget`` buffer (saved in the state dict; :meth:`SplitViT.set_budget`, or set by
threshold calibration), or ``forward(..., budget=...)`` for one call.

With the ``full`` policy steps 1-4 are exactly timm's forward on the normalised
images: same logits.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import resolve_model_data_config
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer

from ..config import PolicyConfig
from ..jsontypes import JsonObject
from .aggregation import FineAggregation
from .heads import DenseHead, masked_pool
from .names import INPUT_NORMALIZATIONS, POLICY_NAMES, TASKS
from .packed import (
    CompiledBlock,
    PackedBatch,
    bucket_capacity,
    grouped_kernel,
    packed_block,
    padded_sdpa_kernel,
    sorted_chunks,
    supports_packing,
    token_chunks,
    varlen_kernel,
)
from .policies import PolicyContext, SplitPolicy, build_policy, check_split_probabilities
from .quadtree import (
    QuadtreeGeometry,
    expected_tokens,
    fine_cell_level,
    leaf_counts_per_level,
    leaf_masks,
    nodes_mass,
    repeat_cells,
    top_down_decisions,
    upsample_to_children,
)
from .spec import (
    PLAIN_TYPES,
    SPEC_OPTIONS,
    CheckpointPayload,
    DataConfig,
    ModelSpec,
    TrainingFacts,
    checkpoint_spec,
    policy_settings,
)
from .stages import StageClock

ATTENTION_MODES = ("packed", "padded")
#: Input sizes whose geometry a model keeps besides its own (a few sizes are typical).
GEOMETRY_CACHE_SIZE = 8
#: The state-dict names of the input normalisation buffers.
NORMALISATION_BUFFERS = ("input_mean", "input_std")
#: The target token ratio a budget-conditioned model is told until set otherwise.
DEFAULT_BUDGET = 0.5
#: What a stage mark is without a clock: one shared, reusable no-op context.
_NO_CLOCK = nullcontext()

log = logging.getLogger(__name__)


@dataclass
class SplitOutput:
    """What a SplitViT forward pass returns.

    Attributes:
        logits: ``(B, num_classes)``, or ``(B, num_classes, H, W)`` for the dense task.
        tokens: ``(B,)`` image tokens each image attended to (prefix tokens excluded).
        expected_tokens: ``(B,)`` differentiable expected token count (equals
            ``tokens`` for policies without split probabilities); computed when first
            read (training's budget penalty), not in every forward pass.
        decisions: per non-finest level, bool ``(B, H_l, W_l)``: which nodes split.
        split_probs: per non-finest level, the policy's scores in ``[0, 1]``
            (``None`` when decisions were given from outside).
        full_tokens: ``N_full`` for this image size.
        padded_tokens: image-token slots the encoder's blocks processed, padding
            included (prefix tokens excluded). The packed path's norms, linear
            layers and MLP process no padding, so there it equals ``tokens.sum()``.
        fine_attention: ``return_attention=True`` only: the last block's attention from
            the prefix (or mean) query onto each finest cell, ``(B, H_f, W_f)``.
        attention_slots: when the packed path padded its attention (the CPU kernel):
            the image-token slots its attention processed, padding included; else ``None``.
    """

    logits: torch.Tensor
    tokens: torch.Tensor
    decisions: list[torch.Tensor]
    split_probs: list[torch.Tensor] | None
    full_tokens: int
    padded_tokens: int = 0
    fine_attention: torch.Tensor | None = None
    attention_slots: int | None = None
    _expected_tokens: torch.Tensor | None = field(default=None, repr=False)

    @property
    def expected_tokens(self) -> torch.Tensor:
        """``(B,)`` differentiable expected token count (see the class docstring)."""
        if self._expected_tokens is None:
            probs = self.split_probs
            self._expected_tokens = expected_tokens(probs) if probs is not None else self.tokens.to(self.logits.dtype)
        return self._expected_tokens

    @property
    def token_ratio(self) -> torch.Tensor:
        """Tokens per image as a fraction of full resolution."""
        return self.tokens.float() / self.full_tokens

    def fine_cell_level(self) -> torch.Tensor:
        """Per finest cell, the level of the leaf covering it (draws the quadtree)."""
        return fine_cell_level(self.decisions)


class _Encoded(NamedTuple):
    """One encoder pass, what a head needs of it (:meth:`SplitViT._encode_leaves`)."""

    geometry: QuadtreeGeometry
    decisions: list[torch.Tensor]
    probs: list[torch.Tensor] | None
    leaves: list[torch.Tensor]
    counts: torch.Tensor
    valid: torch.Tensor | None
    layout: tuple
    features: torch.Tensor
    padded: int
    attention: torch.Tensor | None
    attention_slots: int | None


def validate_thresholds(thresholds: Any, levels: int) -> torch.Tensor:
    """Per-level thresholds as a tensor; one float applies to every level.

    Raises ``ValueError`` naming the bad value when a threshold is outside ``[0, 1]``
    or the count does not match ``levels - 1``.
    """
    if isinstance(thresholds, (int, float)):
        thresholds = [float(thresholds)] * (levels - 1)
    values = [float(t) for t in thresholds]
    if len(values) != levels - 1:
        raise ValueError(f"thresholds: expected {levels - 1} values (one per non-finest level), got {len(values)}")
    for i, t in enumerate(values):
        if not 0.0 <= t <= 1.0 or t != t:
            raise ValueError(f"thresholds[{i}] = {t} is outside [0, 1]")
    return torch.tensor(values)


def validate_budget(ratio: float) -> float:
    """``ratio`` as a float; ``ValueError`` naming it unless it is a target token ratio in ``(0, 1]``."""
    value = float(ratio)
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise ValueError(f"budget (target token ratio) must be in (0, 1], got {ratio}")
    return value


class SplitViT(nn.Module):
    """A timm ``VisionTransformer`` that attends to a learned quadtree of patches.

    Build it with :meth:`from_timm`.

    Args:
        vit: the timm ViT whose patch embedding, position embedding, blocks and
            head are used as they are; its patch size is the finest patch ``p``.
        levels: quadtree levels ``L`` (coarsest patch ``p * 2**(L-1)``).
        policy: the split policy's settings (:class:`~splitvit.config.PolicyConfig`:
            ``kind``, and the learned policy's ``depth``, ``width``, ``level_context``,
            ``feature_grad``, ``fine_evidence``, ``evidence_pooling``,
            ``budget_conditioned``; other policies ignore those), a mapping of them (a
            checkpoint's spec), or a policy's name (the rest at their defaults); a
            built :class:`SplitPolicy` goes in through :meth:`set_policy`. ``depth``: how
            many of the ViT's own blocks run on the coarse tokens to give the learned
            policy the model's view of the image (with
            ``width``, how many blocks of its own it runs at that width, see
            :class:`~splitvit.model.policies.LearnedPolicy`); ``budget_conditioned``: the
            policy is told the target token ratio, the ``budget`` buffer or ``forward``'s
            ``budget``; ``feature_grad``: its features are not detached in :meth:`forward`
            (:meth:`split_scores` detaches them whatever it says).
        image_size: input side (defaults to the ViT's; position embeddings are resampled).
        thresholds: per-level split thresholds in ``[0, 1]`` used at evaluation.
        task: ``classification`` or ``dense`` (per-pixel logits).
        num_classes: classes of the dense head (classification uses the ViT's head).
        length_buckets: padded path only: encode the batch in this many groups of
            similar length (less padding). The packed path needs no buckets: its
            CPU attention kernel picks its own length groups (see
            :func:`~splitvit.model.packed.length_groups`), CUDA's pads nothing.
        token_buckets: packed path: ``0`` (default) packs exactly the batch's tokens;
            ``N`` rounds the packed size up to one of ``N`` fixed sizes (dummy
            sequences fill the rest), so the encoder sees at most ``N`` shapes: what
            ``torch.compile`` and CUDA graphs need (see :meth:`compile_encoder`).
        attention: ``packed`` (default): tokens packed without padding, only
            attention grouped per image; used when the batch mixes lengths, unless
            ``return_attention=True`` or attention dropout is active in training
            (those take the padded path). ``padded``: always pad to the longest
            sequence with a key mask. Blocks other than timm's standard ``Block``
            cannot be packed and always take the padded path.
        data_config: timm's data config (``mean``, ``std``, ``interpolation``,
            ``crop_pct``...); ``None`` resolves the ViT's own with
            ``timm.data.resolve_model_data_config``. Its mean and std become the
            ``input_mean`` / ``input_std`` buffers that :meth:`normalize` applies.
        fine_aggregation: add to every coarse token a zero-initialised aggregation
            of the finest patch embeddings it covers (:class:`FineAggregation`):
            coarse tokens carry fine detail the area resize averages away, and a
            model fine-tuned from a full-resolution reference starts exactly there.
    """

    def __init__(
        self,
        vit: VisionTransformer,
        *,
        levels: int,
        policy: PolicyConfig | JsonObject | str = "learned",
        image_size: int | tuple[int, int] | None = None,
        thresholds: float | list[float] = 0.5,
        task: str = "classification",
        num_classes: int | None = None,
        length_buckets: int = 1,
        attention: str = "packed",
        token_buckets: int = 0,
        spec: ModelSpec | None = None,
        data_config: DataConfig | None = None,
        fine_aggregation: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(vit, VisionTransformer):
            raise TypeError(f"SplitViT needs a timm VisionTransformer, got {type(vit).__name__}")
        if vit.pos_embed is None:
            raise ValueError("SplitViT needs a ViT with absolute position embeddings (pos_embed is None)")
        if getattr(vit, "attn_pool", None) is not None or vit.global_pool not in ("token", "avg"):
            raise ValueError(f"SplitViT supports global_pool 'token' or 'avg', got {vit.global_pool!r}")
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        #: the policy's settings (``model.policy``): its modules are built from them; to share one
        #: built policy between two models, build both from the same settings and assign it
        #: (:meth:`set_policy`), as the packed and padded pairs of the tests and benchmarks do
        self.policy_config = policy_settings(policy)
        settings = self.policy_config
        if settings.width is None and not 0 <= settings.depth <= len(vit.blocks):
            raise ValueError(f"policy.depth must be in [0, {len(vit.blocks)}] (the ViT's depth), got {settings.depth}")
        if length_buckets < 1:
            raise ValueError(f"length_buckets must be >= 1, got {length_buckets}")
        if token_buckets < 0:
            raise ValueError(f"token_buckets must be >= 0, got {token_buckets}")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.packable = all(supports_packing(b) for b in vit.blocks)
        if attention == "packed" and not self.packable:
            log.warning("attention='packed' needs timm's standard Block and Attention modules; using the padded path")
        self.vit = vit
        ph, pw = vit.patch_embed.patch_size
        if ph != pw:
            raise ValueError(f"SplitViT needs square patches, got {ph}x{pw}")
        self.patch_size = ph
        self.levels = levels
        size = image_size if image_size is not None else tuple(vit.patch_embed.img_size)
        self.geometry = QuadtreeGeometry(size, ph, levels)  # validates sizes now, not at first batch
        # other input sizes' geometries, per model: a cache on the class would keep models alive
        self._geometries: dict[tuple[int, int], QuadtreeGeometry] = {}
        self.embed_dim = vit.embed_dim
        self.task = task
        self.length_buckets = length_buckets
        self.attention = attention
        self.token_buckets = token_buckets
        self._compiled_blocks: list[CompiledBlock] | None = None
        self._compiled_dense: list[nn.Module] | None = None
        #: attached by a benchmark to time the forward pass's stages (:mod:`.stages`)
        self.clock: StageClock | None = None
        self.spec = spec
        self.register_buffer("thresholds", validate_thresholds(thresholds, levels), persistent=True)
        config = DataConfig(**(data_config if data_config is not None else resolve_model_data_config(vit)))
        mean, std = channel_stats(config, vit.patch_embed.proj.in_channels)
        # buffers, not settings: they travel with the weights (state dict, init_from), which
        # were trained on inputs normalised by exactly these values
        self.register_buffer("input_mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("input_std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self._data_config: DataConfig = {k: v for k, v in config.items() if k not in ("mean", "std")}
        # timm reports its pretrained config's size (224) whatever img_size built the ViT
        self._data_config["input_size"] = (len(mean), *self.geometry.image_size)
        self._note_normalisation()  # see _normalisation_is_identity
        self.register_load_state_dict_post_hook(SplitViT._note_normalisation)
        self._register_load_state_dict_pre_hook(_fill_legacy_normalisation)
        # the ratio a conditioned policy is told at evaluation: travels with the calibrated thresholds
        self.register_buffer("budget", torch.tensor(DEFAULT_BUDGET), persistent=True)
        self._register_load_state_dict_pre_hook(_keep_budget_if_missing, with_module=True)
        # Zero-initialised level embedding: at init a token means what the timm model's does.
        self.level_embed = nn.Parameter(torch.zeros(levels, vit.embed_dim))
        self.fine_aggregation = FineAggregation(vit.embed_dim, levels) if fine_aggregation else None
        self.policy = self._build_policy(settings.kind)
        if task == "dense":
            classes = num_classes if num_classes is not None else vit.num_classes
            self.dense_head: DenseHead | None = DenseHead(vit.embed_dim, classes, self.patch_size)
        else:
            self.dense_head = None

    # ------------------------------------------------------------------ building
    @classmethod
    def from_timm(
        cls,
        model_or_name: VisionTransformer | str,
        *,
        levels: int,
        policy: PolicyConfig | JsonObject | str = "learned",
        pretrained: bool = False,
        checkpoint_path: str | Path | None = None,
        image_size: int | None = None,
        num_classes: int | None = None,
        timm_kwargs: dict[str, Any] | None = None,
        normalize: str = "auto",
        **kwargs: Any,
    ) -> SplitViT:
        """Wrap a timm ViT.

        Args:
            model_or_name: a ``VisionTransformer`` instance or a timm model name.
            levels: quadtree levels ``L``; the ViT's patch size is the finest patch.
            policy: the split policy's settings (:class:`~splitvit.config.PolicyConfig`),
                a mapping of them, or a policy's name: ``learned``, ``entropy``,
                ``random``, ``full``, ``coarse``.
            pretrained: load timm's pretrained weights (needs the hub).
            checkpoint_path: local weights for the named model (a timm/PyTorch
                state dict or a safetensors file, head included), loaded by timm's
                ``load_checkpoint``, for machines without the hub.
            image_size: input side; defaults to the ViT's.
            num_classes: classifier size (timm's ``num_classes``).
            timm_kwargs: further ``timm.create_model`` arguments (``embed_dim``, ``depth``...).
            normalize: ``timm``, ``none`` or ``auto`` (see :func:`input_data_config`;
                weights from timm are a named model's ``pretrained`` or
                ``checkpoint_path``, or a ``VisionTransformer`` instance); ignored when
                ``data_config`` is given.
            **kwargs: :class:`SplitViT` options (``thresholds``, ``task``,
                ``fine_aggregation``...); those of plain types are kept in the spec
                (the policy's settings as a mapping).
        """
        spec = None
        timm_weights = not isinstance(model_or_name, str) or pretrained or checkpoint_path is not None
        if isinstance(model_or_name, str):
            create: dict[str, Any] = dict(timm_kwargs or {})
            if image_size is not None:
                create["img_size"] = image_size
            if num_classes is not None:
                create["num_classes"] = num_classes
            if checkpoint_path is not None:
                path = Path(checkpoint_path)
                if not path.is_file():
                    raise FileNotFoundError(f"checkpoint_path {path} does not exist")
                # timm's own loader (load_checkpoint): the whole state dict, head included
                create["checkpoint_path"] = str(path)
            vit = timm.create_model(model_or_name, pretrained=pretrained, **create)
            spec = ModelSpec(
                name=model_or_name,
                levels=levels,
                policy=dataclasses.replace(policy_settings(policy)),  # a copy: the caller's settings may change
                image_size=image_size,
                num_classes=num_classes,
                timm_kwargs=dict(timm_kwargs or {}),
                normalize=normalize,
                **{k: v for k, v in kwargs.items() if k in SPEC_OPTIONS and isinstance(v, PLAIN_TYPES)},
            )
        else:
            vit = model_or_name
            if (
                num_classes is not None
                and num_classes != vit.num_classes
                and kwargs.get("task", "classification") == "classification"
            ):
                vit.reset_classifier(num_classes)
        if kwargs.get("data_config") is None:
            kwargs["data_config"] = input_data_config(vit, normalize, timm_weights=timm_weights)
        return cls(
            vit, levels=levels, policy=policy, image_size=image_size, num_classes=num_classes, spec=spec, **kwargs
        )

    def save(self, path: str | Path, extra: TrainingFacts | None = None) -> None:
        """Save weights with the spec that rebuilds the model (see :meth:`load`) and
        the data config its inputs are prepared with (``data_config``)."""
        if self.spec is None:
            raise ValueError("only a SplitViT built from a timm model name can be saved with its spec")
        payload: CheckpointPayload = {
            "spec": self.spec.to_dict(),
            "state_dict": self.state_dict(),
            "data_config": self.data_config,
        }
        torch.save({**payload, **(extra or {})}, path)

    @classmethod
    def from_spec(cls, spec: ModelSpec, data_config: DataConfig | None = None) -> SplitViT:
        """Build the model ``spec`` describes (no pretrained weights: a checkpoint brings its
        own), with a saved ``data_config`` rather than the one timm resolves today (a trained
        model keeps its own; mean and std also come back with the state dict's buffers)."""
        return cls.from_timm(
            spec.name,
            levels=spec.levels,
            policy=spec.policy,
            image_size=spec.image_size,
            num_classes=spec.num_classes,
            timm_kwargs=spec.timm_kwargs,
            normalize=spec.normalize,
            data_config=data_config,
            **spec.options(),
        )

    @classmethod
    def from_checkpoint(cls, payload: CheckpointPayload, **overrides: Any) -> SplitViT:
        """Rebuild from a payload written by :meth:`save` (``overrides`` change the spec, e.g. the policy)."""
        spec = checkpoint_spec(payload, overrides)
        model = cls.from_spec(spec, payload.get("data_config"))
        load_checkpoint_state(model, payload, spec)
        return model

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> SplitViT:
        """Load a model written by :meth:`save`."""
        return cls.from_checkpoint(torch.load(path, map_location="cpu", weights_only=False), **overrides)

    # ------------------------------------------------------------------ settings
    @property
    def data_config(self) -> DataConfig:
        """timm's data config of this model: ``mean`` and ``std`` (the normalisation
        :meth:`forward` applies, from the buffers), ``interpolation``, ``crop_pct``,
        ``crop_mode`` as timm resolved them, and this model's ``input_size``."""
        return {
            **self._data_config,
            "mean": tuple(float(v) for v in self.input_mean.flatten().tolist()),
            "std": tuple(float(v) for v in self.input_std.flatten().tolist()),
        }

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """``[0, 1]`` images -> the model's normalised inputs ``(images - mean) / std``
        (what timm's ViT expects; what a timm ViT is given to compare with this one)."""
        if self._normalisation_is_identity():
            return images  # mean 0, std 1 (a model trained on the pixels as they are): x - 0 / 1 is x
        return (images - self.input_mean.to(images.dtype)) / self.input_std.to(images.dtype)

    def _normalisation_is_identity(self) -> bool:
        """Whether the buffers are mean 0 and std 1, as noted when they were last set
        (:meth:`_note_normalisation`: construction, a load, a move); read again only
        after an in-place write, so the forward pass reads no value back."""
        mean, std = self.input_mean, self.input_std
        if (mean._version, std._version, mean.data_ptr(), std.data_ptr()) != self._identity_key:
            self._note_normalisation()
        return self._identity

    def _note_normalisation(self, *_: Any) -> None:
        """Note whether the normalisation buffers are the identity (also a load-state-dict post-hook)."""
        mean, std = self.input_mean, self.input_std
        self._identity_key = (mean._version, std._version, mean.data_ptr(), std.data_ptr())
        self._identity = not mean.is_meta and bool((mean == 0).all()) and bool((std == 1).all())

    def _apply(self, fn: Any, recurse: bool = True) -> SplitViT:
        """``nn.Module._apply`` (``to``, ``cuda``, ``float``...), then the new buffers noted."""
        module = super()._apply(fn, recurse)
        self._note_normalisation()
        return module

    def set_thresholds(self, thresholds: float | list[float]) -> None:
        """Set the per-level evaluation thresholds (validated to lie in [0, 1])."""
        self.thresholds.copy_(validate_thresholds(thresholds, self.levels))

    def set_budget(self, ratio: float) -> None:
        """Set the target token ratio a budget-conditioned policy is told when
        :meth:`forward` gets no ``budget`` (``ValueError`` unless in ``(0, 1]``)."""
        self.budget.fill_(validate_budget(ratio))

    @property
    def uses_budget(self) -> bool:
        """Whether the current policy is told the budget (a budget-conditioned learned policy)."""
        return bool(getattr(self.policy, "budget_conditioned", False))

    def set_policy(self, policy: str | SplitPolicy) -> None:
        """Swap the split policy (a learned policy keeps its weights only if it is the same object)."""
        if isinstance(policy, str):
            if policy not in POLICY_NAMES:
                raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICY_NAMES)}")
            policy = self._build_policy(policy)
        self.policy = policy.to(self.level_embed.device)

    def _build_policy(self, name: str) -> SplitPolicy:
        """A policy by name; a learned one with this model's policy blocks' and budget settings."""
        if name != "learned":
            return build_policy(name, embed_dim=self.embed_dim, levels=self.levels)
        settings = self.policy_config
        options: dict[str, bool | int | str] = {"budget_conditioned": True} if settings.budget_conditioned else {}
        if settings.level_context:
            options["level_context"] = True
        if settings.feature_grad:
            options["detach_features"] = False
        if settings.fine_evidence:
            options.update(fine_evidence=True, evidence_pooling=settings.evidence_pooling)
        if settings.width is not None:
            options.update(width=settings.width, depth=settings.depth)
        return build_policy(name, embed_dim=self.embed_dim, levels=self.levels, **options)

    def geometry_for(self, size: tuple[int, int]) -> QuadtreeGeometry:
        """The quadtree geometry of ``(H, W)`` inputs (built once per size and model)."""
        if size == self.geometry.image_size:
            return self.geometry
        geometry = self._geometries.get(size)
        if geometry is None:
            if len(self._geometries) >= GEOMETRY_CACHE_SIZE:
                self._geometries.clear()
            geometry = self._geometries[size] = QuadtreeGeometry(size, self.patch_size, self.levels)
        return geometry

    def stage(self, name: str) -> AbstractContextManager:
        """Mark a stage of the forward pass for an attached :class:`StageClock` (a no-op without one)."""
        return _NO_CLOCK if self.clock is None else self.clock.stage(name)

    # ------------------------------------------------------------------ embedding
    def _prefix_tokens(self, batch: int) -> torch.Tensor | None:
        vit = self.vit
        parts = []
        if vit.cls_token is not None:
            parts.append(vit.cls_token.expand(batch, -1, -1))
        if vit.reg_token is not None:
            parts.append(vit.reg_token.expand(batch, -1, -1))
        if not parts:
            return None
        prefix = torch.cat(parts, dim=1)
        if not vit.no_embed_class:
            prefix = prefix + vit.pos_embed[:, : vit.num_prefix_tokens]
        return prefix

    def _pos_grid(self, geometry: QuadtreeGeometry) -> torch.Tensor:
        """Base-grid position embedding at this image size: ``(1, D, H_{L-1}, W_{L-1})``."""
        vit = self.vit
        num_prefix = 0 if vit.no_embed_class else vit.num_prefix_tokens
        native = tuple(vit.patch_embed.grid_size)
        target = geometry.grid(geometry.levels - 1)
        pos = vit.pos_embed
        if target != native:
            pos = resample_abs_pos_embed(pos, new_size=target, old_size=native, num_prefix_tokens=num_prefix)
        pos = pos[:, num_prefix:]
        return pos.reshape(1, target[0], target[1], -1).permute(0, 3, 1, 2)

    def patch_tokens(self, images: torch.Tensor, factor: int = 1) -> torch.Tensor:
        """The ViT's patch embedding of ``images`` area-resized by ``1 / factor``,
        without position or level: ``(B, H_l, W_l, D)``."""
        # normalising after the pool is exact (a per-channel affine map commutes with an
        # average) and touches factor**2 times fewer pixels; at factor 1 it is timm's
        # own (images - mean) / std, so the ``full`` policy keeps timm's logits
        x = self.normalize(images if factor == 1 else _area_downsample(images, factor))
        patch_embed = self.vit.patch_embed
        proj = patch_embed.proj
        if factor == 1 or not _is_patchify_conv(proj, self.patch_size):
            # the finest level through timm's own convolution: the ``full`` policy's logits are timm's
            return patch_embed.norm(proj(x).permute(0, 2, 3, 1))
        # a coarse level's convolution as the matrix product it is (kernel = stride =
        # patch): the same sums, without the CPU convolution's fixed cost, which a coarse
        # level's few patches (and batch 1) pay in full
        b, c, h, w = x.shape
        p = self.patch_size
        patches = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, h // p, w // p, c * p * p)
        return patch_embed.norm(F.linear(patches, proj.weight.reshape(proj.out_channels, -1), proj.bias))

    def embed_level(
        self,
        images: torch.Tensor,
        geometry: QuadtreeGeometry,
        level: int,
        pos_grid: torch.Tensor,
        patches: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens of every node at ``level``: ``(B, H_l, W_l, D)``; ``patches``: the
        level's :meth:`patch_tokens` when already computed (with fine aggregation, a
        coarse level's aggregation term already added)."""
        factor = 2 ** (geometry.levels - 1 - level)
        tokens = patches if patches is not None else self.patch_tokens(images, factor)
        pos = pos_grid if factor == 1 else F.avg_pool2d(pos_grid, factor)
        return tokens + pos.permute(0, 2, 3, 1) + self.level_embed[level]

    # ------------------------------------------------------------------ policy
    def _level_sequence(self, level_tokens: torch.Tensor) -> torch.Tensor:
        """Every node of one level as one sequence per image, prefix tokens first:
        ``(B, S_prefix + H_l * W_l, D)``."""
        b, h, w, d = level_tokens.shape
        x = level_tokens.reshape(b, h * w, d)
        prefix = self._prefix_tokens(b)
        return x if prefix is None else torch.cat([prefix, x], dim=1)

    def _context_features(self, level_tokens: torch.Tensor) -> torch.Tensor:
        """The ViT's first ``policy_config.depth`` blocks on the sequence of every node at
        one level (the all-coarse sequence for level 0): ``(B, H_l, W_l, D)``."""
        x = self.vit.norm_pre(self._level_sequence(level_tokens))
        for block in self.vit.blocks[: self.policy_config.depth]:
            x = block(x)
        return x[:, self.vit.num_prefix_tokens :].reshape(level_tokens.shape)

    def _levels_context_features(self, levels: list[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`_context_features` of several levels in one pass through the blocks.

        Each level's sequences are rows of one packed ``(T, D)`` tensor, so the norms,
        linear layers and MLP run once on all of them and only attention goes level by
        level (:func:`grouped_kernel`, views of the rows, no padding): one block call
        instead of one per level. Inference with timm's standard blocks only: in
        training, drop path would draw per level as :meth:`_context_features` does.
        """
        if self.training or not self.packable:
            return [self._context_features(tokens) for tokens in levels]
        sequences = [self._level_sequence(tokens) for tokens in levels]
        kernel = grouped_kernel([(x.shape[0], x.shape[1]) for x in sequences])
        packed = self.vit.norm_pre(torch.cat([x.reshape(-1, x.shape[-1]) for x in sequences]))
        for block in self.vit.blocks[: self.policy_config.depth]:
            packed = packed_block(block, packed, None, kernel)
        out, start = [], 0
        for x, tokens in zip(sequences, levels):
            rows = x.shape[0] * x.shape[1]
            features = packed[start : start + rows].view(x.shape)[:, self.vit.num_prefix_tokens :]
            out.append(features.reshape(tokens.shape))
            start += rows
        return out

    def _budget_per_image(self, budget: float | torch.Tensor | None, images: torch.Tensor) -> torch.Tensor:
        """The target ratio told to the policy, ``(B,)`` float32: ``budget`` (a number,
        a scalar or a ``(B,)`` tensor), or the ``budget`` buffer when ``None``. A number
        is validated; a tensor's values are not (reading them would sync the device)."""
        batch = images.shape[0]
        if budget is None:
            value = self.budget
        elif isinstance(budget, torch.Tensor):
            if budget.dim() > 1 or (budget.dim() == 1 and budget.shape[0] != batch):
                raise ValueError(
                    f"budget must be a number, a scalar tensor or one ratio per image ({batch},), "
                    f"got shape {tuple(budget.shape)}"
                )
            value = budget
        else:
            value = torch.tensor(validate_budget(budget))
        return value.to(device=images.device, dtype=torch.float32).expand(batch)

    def _policy_scores(
        self,
        images: torch.Tensor,
        geometry: QuadtreeGeometry,
        embeds: _LevelEmbeddings,
        budget: float | torch.Tensor | None = None,
        detach_features: bool = False,
    ) -> list[torch.Tensor]:
        """The policy's per-level scores; ``detach_features``: its features computed
        without a graph whatever ``policy_config.feature_grad`` says (only the policy's own
        modules get a gradient, and the blocks that make the features keep no activations)."""
        context = PolicyContext()
        # Policies get the raw [0, 1] images: the entropy policy's grey level is the mean
        # of the channels, which a per-channel normalisation would re-weight (APT's
        # entropy is of pixel intensities); the learned policy sees the model's own
        # (normalised) embeddings through the context.
        if self.policy.learned:
            with torch.no_grad() if detach_features else nullcontext():
                own = getattr(self.policy, "own_blocks", False)
                context.node_embeddings = [embeds[level] for level in range(geometry.levels - 1)]
                if getattr(self.policy, "level_context", False) and not own:
                    # every scored level through the blocks together: the level context
                    with self.stage("level_context"):
                        context.level_features = self._levels_context_features(context.node_embeddings)
                    context.coarse_features = context.level_features[0]
                else:
                    with self.stage("policy_blocks"):
                        context.coarse_features = embeds[0] if own else self._context_features(embeds[0])
                if getattr(self.policy, "fine_evidence", False):
                    context.fine_embeddings = embeds[geometry.levels - 1]  # the leaves' own, embedded once
        with self.stage("policy_head"):
            if self.uses_budget:
                context.budget = self._budget_per_image(budget, images)
            return self.policy(images, geometry, context)

    def split_scores(self, images: torch.Tensor, budget: float | torch.Tensor | None = None) -> list[torch.Tensor]:
        """The policy's per-node scores in ``[0, 1]`` without running the encoder
        (cheap threshold calibration and split-map drawing, the policy's own epochs);
        ``budget`` as in :meth:`forward`. The policy's features are detached: a loss on
        these scores trains the policy's own modules alone."""
        geometry = self.geometry_for(tuple(images.shape[-2:]))
        embeds = _LevelEmbeddings(self, images, geometry)
        return self._policy_scores(images, geometry, embeds, budget, detach_features=True)

    def encoder_inputs(self, images: torch.Tensor, thresholds: float | list[float] | None = None):
        """The leaf token sequences :meth:`forward` hands its encoder, as ``(tokens
        (B, S, D), valid (B, S) or None)``: with :meth:`encode` this times the encoder
        alone (``splitvit bench forward`` splits a forward pass into policy, gather and encoder)."""
        geometry = self.geometry_for(tuple(images.shape[-2:]))
        tau = self.thresholds if thresholds is None else validate_thresholds(thresholds, self.levels).to(images.device)
        embeds = _LevelEmbeddings(self, images, geometry)
        decisions = self.decide(self._policy_scores(images, geometry, embeds), tau)
        leaves = leaf_masks(decisions)
        per_level = leaf_counts_per_level(leaves)
        tokens, valid, _, _ = self._gather_leaves(embeds, leaves, per_level, None, geometry)
        return tokens, valid

    def encode(self, tokens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """The encoder (prefix tokens, the ViT's blocks, final norm) on leaf sequences
        from :meth:`encoder_inputs`: ``(B, S_prefix + S, D)``."""
        lengths = None if valid is None else valid.sum(1).tolist()
        return self._encode(tokens, valid, False, lengths)[0]

    def decide(self, scores: list[torch.Tensor], thresholds: torch.Tensor) -> list[torch.Tensor]:
        """Hierarchical decisions from scores: ``score > tau_l`` and the parent split.

        Fixed policies (``full``, ``coarse``) ignore thresholds; a learned policy in
        training mode samples its decisions from its probabilities, for exploration.

        Raises:
            FloatingPointError: sampling from non-finite probabilities (a diverged policy).
        """
        if not self.policy.thresholded:
            wishes = [p > 0.5 for p in scores]
        elif self.training and self.policy.learned:
            check_split_probabilities(scores)  # bernoulli would fail on NaN with a RuntimeError
            wishes = [torch.bernoulli(p.detach()).bool() for p in scores]
        else:
            wishes = [p > thresholds[level] for level, p in enumerate(scores)]
        return top_down_decisions(wishes)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        images: torch.Tensor,
        *,
        thresholds: float | list[float] | torch.Tensor | None = None,
        decisions: list[torch.Tensor] | None = None,
        return_attention: bool = False,
        embeddings: _LevelEmbeddings | None = None,
        budget: float | torch.Tensor | None = None,
    ) -> SplitOutput:
        """Run the model.

        Args:
            images: ``(B, C, H, W)``; ``H`` and ``W`` multiples of the coarsest patch.
            thresholds: per-level split thresholds overriding the model's for this call.
            decisions: explicit hierarchical split decisions (e.g. random warm-up
                splits); bypasses the policy.
            return_attention: also return the last block's attention from the prefix
                (or mean) query onto each finest cell, in ``fine_attention``.
            embeddings: precomputed level embeddings (saliency needs a handle on them).
            budget: the target token ratio a budget-conditioned policy is told for
                this call: a number in ``(0, 1]``, or a scalar or ``(B,)`` tensor;
                ``None``: the ``budget`` buffer. Other policies ignore it.
        """
        encoded = self._encode_leaves(images, thresholds, decisions, return_attention, embeddings, budget)
        with self.stage("head"):
            if self.task == "dense":
                fine = self._scatter_to_fine(encoded.features, encoded.layout, encoded.leaves, encoded.geometry)
                logits = self.dense_head(fine, encoded.geometry.image_size)
            else:
                pooled = self._pool(encoded.features, encoded.valid)
                logits = self.vit.head(self.vit.head_drop(self.vit.fc_norm(pooled)))
        return self._output(encoded, logits, return_attention)

    def fine_features(
        self,
        images: torch.Tensor,
        *,
        thresholds: float | list[float] | torch.Tensor | None = None,
        decisions: list[torch.Tensor] | None = None,
        budget: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, SplitOutput]:
        """The encoder's leaf features laid on the finest grid, without a head: a
        backbone's output for a detector (:mod:`~splitvit.model.detection`).

        The same pass as :meth:`forward` up to the head (arguments as there): each leaf's
        feature fills the finest cells it covers, as the dense head receives them; with
        the ``full`` policy the map is timm's ``forward_features`` patch tokens on their grid.

        Returns:
            ``(fine_map (B, D, H / p, W / p), output)``; ``output.logits`` is the same fine map
            (this pass has no head), its tokens, decisions and split probabilities as
            :meth:`forward`'s (the budget penalty reads them).
        """
        encoded = self._encode_leaves(images, thresholds, decisions, False, None, budget)
        with self.stage("head"):
            fine = self._scatter_to_fine(encoded.features, encoded.layout, encoded.leaves, encoded.geometry)
        return fine, self._output(encoded, fine, False)

    def _encode_leaves(
        self,
        images: torch.Tensor,
        thresholds: float | list[float] | torch.Tensor | None,
        decisions: list[torch.Tensor] | None,
        return_attention: bool,
        embeddings: _LevelEmbeddings | None,
        budget: float | torch.Tensor | None,
    ) -> _Encoded:
        """:meth:`forward` up to its head: embeddings, decisions, leaf gather, encoder."""
        geometry = self.geometry_for(tuple(images.shape[-2:]))
        if thresholds is None:
            tau = self.thresholds
        elif isinstance(thresholds, torch.Tensor):
            tau = thresholds
        else:
            tau = validate_thresholds(thresholds, self.levels)
        embeds = embeddings if embeddings is not None else _LevelEmbeddings(self, images, geometry)
        probs = None
        scores = self._policy_scores(images, geometry, embeds, budget) if decisions is None else None
        with self.stage("decision"):
            if scores is not None:
                decisions = self.decide(scores, tau.to(images.device))
                probs = scores if self.policy.learned else None
            else:
                decisions = top_down_decisions([d.bool() for d in decisions])
            leaves = leaf_masks(decisions)
            per_level = leaf_counts_per_level(leaves)
            counts = per_level.sum(0)
            gates = straight_through_gates(decisions, probs) if (probs is not None and self.training) else None
        with self.stage("gather"):
            tokens, valid, layout, lengths = self._gather_leaves(
                embeds, leaves, per_level, gates, geometry, return_attention
            )
        with self.stage("blocks"):
            features, padded, attention, attention_slots = self._encode(tokens, valid, return_attention, lengths)
        return _Encoded(
            geometry, decisions, probs, leaves, counts, valid, layout, features, padded, attention, attention_slots
        )

    def _output(self, encoded: _Encoded, logits: torch.Tensor, return_attention: bool) -> SplitOutput:
        """The :class:`SplitOutput` of an encoder pass and its head's ``logits``."""
        geometry = encoded.geometry
        out = SplitOutput(
            logits=logits,
            tokens=encoded.counts,
            decisions=encoded.decisions,
            split_probs=encoded.probs,
            full_tokens=geometry.full_tokens,
            padded_tokens=encoded.padded,
            attention_slots=encoded.attention_slots,
        )
        if return_attention:
            out.fine_attention = self._attention_to_fine(encoded.attention, encoded.layout, encoded.leaves, geometry)
        return out

    def _gather_leaves(self, embeds, leaves, per_level, gates, geometry, return_attention: bool = False):
        """Pack each image's leaves, in level-then-raster order, into a padded batch.

        ``per_level``: :func:`leaf_counts_per_level` of ``leaves``. Returns ``(tokens
        (B, S, D), valid (B, S) or None, layout, lengths)`` where ``layout`` maps
        sequence slots back to the all-levels node layout and ``lengths`` are the
        images' token counts on the host (``None`` with ``valid``). The forward pass's
        one host synchronisation is here: every image's leaf count at every level,
        which says which levels hold leaves and each image's length.
        """
        batch = leaves[0].shape[0]
        host = per_level.tolist()  # the one host sync
        lengths = [sum(column) for column in zip(*host)]
        every = [all(n == mask[0].numel() for n in row) for row, mask in zip(host, leaves)]
        some = [any(row) for row in host]
        # fast path: one level holds every leaf of every image (full or coarse): no gather
        for level, full in enumerate(every):
            if full:
                x = embeds[level]
                if gates is not None:
                    x = x * gates[level].unsqueeze(-1)
                return x.flatten(1, 2), None, ("level", level), None
        fixed = bool(self.token_buckets) and self._can_pack(return_attention)
        # with fixed shapes every level takes part, so that N_full slots always exist
        used = list(range(len(leaves))) if fixed else [level for level, present in enumerate(some) if present]
        parts, masks, offsets, offset = [], [], {}, 0
        for level in used:
            x = embeds[level]
            if gates is not None:
                x = x * gates[level].unsqueeze(-1)
            parts.append(x.flatten(1, 2))
            masks.append(leaves[level].flatten(1))
            offsets[level] = offset
            offset += masks[-1].shape[1]
        all_tokens = torch.cat(parts, dim=1)
        is_leaf = torch.cat(masks, dim=1)
        length = geometry.full_tokens if fixed else max(lengths)  # fixed shapes: every batch gathers N_full slots
        # stable sort puts each image's leaves first, in layout order
        order = torch.argsort((~is_leaf).to(torch.int8), dim=1, stable=True)[:, :length]
        # rows of the flattened batch: index_select copies whole rows, where gather with an
        # expanded index reads its index once per element (several times slower on the CPU)
        rows = (order + torch.arange(batch, device=order.device).unsqueeze(1) * all_tokens.shape[1]).flatten()
        tokens = all_tokens.flatten(0, 1).index_select(0, rows).view(batch, length, all_tokens.shape[-1])
        if min(lengths) == length:
            return tokens, None, ("gather", order, used, offsets, is_leaf.shape[1], batch), None
        valid = torch.arange(length, device=tokens.device).unsqueeze(0) < per_level.sum(0).unsqueeze(1)
        return tokens, valid, ("gather", order, used, offsets, is_leaf.shape[1], batch), lengths

    def _packs(self, valid: torch.Tensor | None, return_attention: bool) -> bool:
        """Whether this batch takes the packed path (see the ``attention`` option)."""
        return valid is not None and self._can_pack(return_attention)

    def _can_pack(self, return_attention: bool) -> bool:
        """Whether a batch of mixed lengths would take the packed path."""
        if return_attention or self.attention != "packed" or not self.packable:
            return False
        # the packed kernels have no attention dropout: keep training with it exact
        return not (
            self.training and any(getattr(getattr(b.attn, "attn_drop", None), "p", 0.0) > 0 for b in self.vit.blocks)
        )

    def compile_encoder(self, **options: Any) -> SplitViT:
        """Run the encoder's blocks under ``torch.compile`` in inference (``options`` go
        to ``torch.compile``, e.g. ``mode="reduce-overhead"`` for CUDA graphs): the
        packed encoder's per-token work, and whole blocks where every image has the
        same length (the ``full`` and ``coarse`` policies, a batch of one). Pair it with
        ``token_buckets`` so that each compiled piece sees a few fixed shapes. Training,
        and padded batches of mixed lengths, keep the eager blocks. Returns the model."""
        options.setdefault("dynamic", False)  # one static graph per bucket, as CUDA graphs need
        self._compiled_blocks = [CompiledBlock(block, **options) for block in self.vit.blocks]
        # blocks of one structure share one graph (torch.compile inlines the modules)
        self._compiled_dense = [torch.compile(block, **options) for block in self.vit.blocks]
        return self

    def _encode(
        self, tokens: torch.Tensor, valid: torch.Tensor | None, return_attention: bool, lengths: list[int] | None = None
    ):
        """Prefix tokens, timm's blocks, final norm.

        Packed (see :meth:`_packs`): one ``(T, D)`` sequence of real tokens.
        Padded: a key-padding mask, in ``length_buckets`` groups of similar length.
        ``lengths``: the images' token counts on the host (read from ``valid`` if not given).
        Returns ``(features (B, S_prefix + S, D), padded slot count, last-block
        attention, attention slots of the packed CPU kernel or None)``.
        """
        if valid is not None and lengths is None:
            lengths = valid.sum(1).tolist()
        if self._packs(valid, return_attention):
            return self._encode_packed(tokens, valid, lengths)
        batch = tokens.shape[0]
        if valid is None or self.length_buckets == 1 or batch < 2:
            feats, attention = self._encode_group(tokens, valid, return_attention)
            return feats, tokens.shape[0] * tokens.shape[1], attention, None
        order = sorted(range(batch), key=lambda i: -lengths[i])
        num_prefix = self.vit.num_prefix_tokens
        feats = tokens.new_zeros(batch, num_prefix + tokens.shape[1], tokens.shape[2])
        attention = None
        padded = 0
        for group in (g.tolist() for g in torch.tensor_split(torch.tensor(order), min(self.length_buckets, batch))):
            idx = torch.tensor(group, device=tokens.device)
            length = max(lengths[i] for i in group)
            full = min(lengths[i] for i in group) == length
            sub, att = self._encode_group(tokens[idx, :length], None if full else valid[idx, :length], return_attention)
            feats[idx, : num_prefix + length] = sub
            padded += len(group) * length
            if att is not None:
                if attention is None:
                    attention = att.new_zeros(batch, tokens.shape[1])
                attention[idx, :length] = att
        return feats, padded, attention, None

    def _encode_packed(self, tokens: torch.Tensor, valid: torch.Tensor, lengths: list[int]):
        """The encoder on packed real tokens; only attention groups them per image.

        With CUDA's varlen kernel the whole batch is one packed sequence, built from
        the host's ``lengths`` without reading the device. Elsewhere, in inference,
        the images are packed longest first (:meth:`_encode_sorted`); in training, they
        are encoded in chunks of similar length (:func:`token_chunks`), for cache
        locality, each chunk's attention kernel padding per length group. With
        ``token_buckets`` the batch is one chunk of a fixed size.
        """
        with self.stage("packing"):
            if not self.training and not self.token_buckets and varlen_kernel(tokens.device) is None:
                return self._encode_sorted(tokens, lengths)
            return self._encode_packed_chunks(tokens, valid, lengths)

    def _encode_sorted(self, tokens: torch.Tensor, lengths: list[int]):
        """The packed encoder in inference on the CPU: the images longest first, so that
        images of equal length are neighbours in the packed rows.

        One ``index_select`` gathers every image's prefix tokens and leaves into the
        packed rows. Each length's images then attend together as one view of their
        rows (:func:`grouped_kernel`): no padding, no mask, and no copy into a padded
        layout and back in every block, which the padded kernel pays. Large batches are
        encoded in contiguous runs of at most :data:`~splitvit.model.packed.CPU_CHUNK_TOKENS`
        rows (:func:`sorted_chunks`), whose activations stay in cache through a block.
        """
        vit = self.vit
        b, s, d = tokens.shape
        num_prefix = vit.num_prefix_tokens
        order = sorted(range(b), key=lambda i: -lengths[i])  # stable: equal lengths keep batch order
        seq = [lengths[i] + num_prefix for i in order]
        device = tokens.device
        seq_t = torch.tensor(seq, device=device)
        total = sum(seq)
        image = torch.repeat_interleave(torch.tensor(order, device=device), seq_t, output_size=total)
        first_row = torch.repeat_interleave(torch.cumsum(seq_t, 0) - seq_t, seq_t, output_size=total)
        pos = torch.arange(total, device=device) - first_row  # each row's position in its sequence
        source, rows = tokens.reshape(b * s, d), image * s + pos - num_prefix
        prefix = self._prefix_tokens(1)
        if prefix is not None:  # the prefix tokens' rows follow every image's slots
            source = torch.cat([source, prefix[0]])
            rows = torch.where(pos < num_prefix, b * s + pos, rows)
        packed = source.index_select(0, rows)
        with self.stage("blocks"):
            packed = vit.norm_pre(vit.pos_drop(packed))
            compiled = self._compiled_blocks
            runs = []
            for start, end, groups in sorted_chunks(seq):
                x, kernel = packed[start:end], grouped_kernel(groups)
                for i, block in enumerate(vit.blocks):
                    x = compiled[i](x, None, kernel) if compiled else packed_block(block, x, None, kernel)
                runs.append(x)
            packed = vit.norm(runs[0] if len(runs) == 1 else torch.cat(runs))
        features = packed.new_zeros(b * (num_prefix + s), d)
        features.index_copy_(0, image * (num_prefix + s) + pos, packed)
        real = sum(lengths)
        return features.view(b, num_prefix + s, d), real, None, real

    def _encode_packed_chunks(self, tokens: torch.Tensor, valid: torch.Tensor, lengths: list[int]):
        """:meth:`_encode_packed`'s work, in the ``packing`` stage but for the blocks."""
        vit = self.vit
        b = tokens.shape[0]
        num_prefix = vit.num_prefix_tokens
        prefix = self._prefix_tokens(b)
        x = tokens if prefix is None else torch.cat([prefix, tokens], dim=1)
        keep = torch.cat([valid.new_ones(b, num_prefix), valid], dim=1)
        seq_lengths = [n + num_prefix for n in lengths]
        real = sum(lengths)
        varlen = varlen_kernel(x.device)
        # fixed shapes: one chunk, padded to its bucket
        capacity = (
            bucket_capacity(sum(seq_lengths), b, keep.shape[1], self.token_buckets) if self.token_buckets else None
        )
        chunks = token_chunks(keep.sum(1)) if varlen is None and capacity is None else []
        if len(chunks) <= 1:
            # one chunk: in batch order, nothing to scatter back
            batch = PackedBatch(keep, seq_lengths, capacity=capacity)
            kernel = varlen if varlen is not None else padded_sdpa_kernel(batch.cu_seqlens)
            slots = None if varlen is not None else kernel.padded_rows - b * num_prefix
            return self._encode_packed_chunk(x, batch, kernel), real, None, slots
        features = x.new_zeros(x.shape)
        slots = 0
        for idx in chunks:
            batch = PackedBatch(keep[idx], [seq_lengths[i] for i in idx.tolist()])
            # scatter/gather indices built once per chunk, shared by every block
            kernel = padded_sdpa_kernel(batch.cu_seqlens)
            slots += kernel.padded_rows - len(idx) * num_prefix
            features[idx] = self._encode_packed_chunk(x[idx], batch, kernel)
        return features, real, None, slots

    def _encode_packed_chunk(self, x: torch.Tensor, batch: PackedBatch, kernel) -> torch.Tensor:
        """Blocks and final norm on the real slots of ``x`` (prefix included), packed."""
        vit = self.vit
        packed = batch.pack(x)
        with self.stage("blocks"):
            # pos_drop and norm_pre act per token: run them on the packed tokens only
            packed = vit.norm_pre(vit.pos_drop(packed))
            compiled = self._compiled_blocks if not self.training else None
            for i, block in enumerate(vit.blocks):
                packed = compiled[i](packed, batch, kernel) if compiled else packed_block(block, packed, batch, kernel)
            packed = vit.norm(packed)
        return batch.unpack(packed)

    def _encode_group(self, tokens, valid, return_attention):
        """The padded path on one group: timm's blocks with a key-padding mask."""
        vit = self.vit
        b = tokens.shape[0]
        prefix = self._prefix_tokens(b)
        num_prefix = vit.num_prefix_tokens
        x = tokens if prefix is None else torch.cat([prefix, tokens], dim=1)
        x = vit.norm_pre(vit.pos_drop(x))
        attn_mask = None
        if valid is not None:
            keep = torch.cat([valid.new_ones(b, num_prefix), valid], dim=1)
            # mask padding *keys* only; every query row keeps its valid keys
            attn_mask = keep[:, None, None, :]
        attention = None
        last = len(vit.blocks) - 1
        # compiled: one length per batch, so one static graph per batch size
        compiled = self._compiled_dense if attn_mask is None and not (self.training or return_attention) else None
        for i, block in enumerate(vit.blocks):
            if return_attention and i == last:
                attention = _query_attention(block, x, attn_mask, num_prefix, valid)
            if attn_mask is None:
                x = compiled[i](x) if compiled else block(x)
            else:
                x = block(x, attn_mask=attn_mask)
        return vit.norm(x), attention

    def _pool(self, features: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        return masked_pool(features, valid, self.vit.global_pool, self.vit.num_prefix_tokens)

    def _to_layout(self, values: torch.Tensor, layout, leaves, geometry) -> list[torch.Tensor]:
        """Per-slot values ``(B, S, ...)`` back onto each level's grid ``(B, H_l, W_l, ...)``."""
        batch = values.shape[0]
        tail = values.shape[2:]
        grids = []
        if layout[0] == "level":
            for level in range(geometry.levels):
                gh, gw = geometry.grid(level)
                if level == layout[1]:
                    grids.append(values.reshape(batch, gh, gw, *tail))
                else:
                    grids.append(values.new_zeros(batch, gh, gw, *tail))
            return grids
        _, order, used, offsets, total, _ = layout
        flat = values.new_zeros(batch, total, *tail)
        index = order.reshape(batch, -1, *([1] * len(tail))).expand(-1, -1, *tail)
        flat.scatter_(1, index, values[:, : order.shape[1]])
        for level in range(geometry.levels):
            gh, gw = geometry.grid(level)
            if level in offsets:
                o = offsets[level]
                grids.append(flat[:, o : o + gh * gw].reshape(batch, gh, gw, *tail))
            else:
                grids.append(values.new_zeros(batch, gh, gw, *tail))
        return grids

    def _fill_fine(self, grids, leaves, geometry) -> torch.Tensor:
        """Each leaf's value fills the finest cells it covers: ``(B, H_{L-1}, W_{L-1}, ...)``."""
        fine = 0
        for level, (grid, mask) in enumerate(zip(grids, leaves)):
            m = mask.to(grid.dtype).reshape(*mask.shape, *([1] * (grid.dim() - 3)))
            factor = 2 ** (geometry.levels - 1 - level)
            fine = fine + repeat_cells(grid * m, factor, dim=1)
        return fine

    def _scatter_to_fine(self, features, layout, leaves, geometry) -> torch.Tensor:
        """Each leaf's feature on the finest cells it covers: ``(B, D, Hf, Wf)``.

        One row gather from ``features``: every finest cell reads its leaf's slot. The
        same values as :meth:`_fill_fine` on :meth:`_to_layout`'s grids (a leaf's value
        plus zeros), without scattering every slot's ``D`` values onto the all-levels
        layout and masking each level's grid.
        """
        batch, slots, dim = features.shape
        finest = geometry.levels - 1
        hf, wf = geometry.grid(finest)
        num_prefix = self.vit.num_prefix_tokens
        if layout[0] == "level":  # every leaf at one level: its grid, repeated onto the finest cells
            level = layout[1]
            grid = features[:, num_prefix:].reshape(batch, *geometry.grid(level), dim)
            fine = grid if level == finest else repeat_cells(grid, 2 ** (finest - level), dim=1)
            return fine.permute(0, 3, 1, 2)
        _, order, used, offsets, total, _ = layout
        device = order.device
        # each layout node's slot in its image's sequence (order lists the slots' nodes)
        slot_of_node = torch.zeros(batch, total, dtype=torch.long, device=device)
        slot_of_node.scatter_(1, order, torch.arange(order.shape[1], device=device).expand(batch, -1))
        # each finest cell's leaf node in the layout: exactly one level's mask covers it
        cell_node = 0
        for level in used:
            gh, gw = geometry.grid(level)
            nodes = torch.arange(offsets[level], offsets[level] + gh * gw, device=device).view(1, gh, gw)
            cell_node = cell_node + repeat_cells(leaves[level] * nodes, 2 ** (finest - level), dim=1)
        rows = slot_of_node.gather(1, cell_node.flatten(1)) + num_prefix
        rows = rows + torch.arange(batch, device=device).unsqueeze(1) * slots
        fine = features.reshape(batch * slots, dim).index_select(0, rows.flatten())
        return fine.view(batch, hf, wf, dim).permute(0, 3, 1, 2)

    def _attention_to_fine(self, attention, layout, leaves, geometry) -> torch.Tensor:
        """Attention mass per finest cell: a leaf's mass spreads evenly over its cells."""
        grids = self._to_layout(attention, layout, leaves, geometry)
        per_cell = [g / 4 ** (geometry.levels - 1 - level) for level, g in enumerate(grids)]
        return self._fill_fine(per_cell, leaves, geometry)

    def full_decisions(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Decisions that split every node of ``images``: the full-resolution pass,
        whatever the policy (``forward(images, decisions=...)``)."""
        geometry = self.geometry_for(tuple(images.shape[-2:]))
        b = images.shape[0]
        return [
            torch.ones(b, *geometry.grid(level), dtype=torch.bool, device=images.device)
            for level in range(self.levels - 1)
        ]

    def relevance(
        self, images: torch.Tensor, method: str = "attention", target: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """The model's own relevance of every non-finest node, from a full-resolution
        pass, summed over the node's area. Used to teach the learned policy.

        ``attention``: the last block's attention from the class token (or all
        queries). ``gradient``: gradient x input saliency of the target (or
        predicted) class score with respect to each fine token's embedding.
        """
        return self.relevance_and_logits(images, method, target)[0]

    def relevance_and_logits(
        self, images: torch.Tensor, method: str = "attention", target: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`relevance` and the full-resolution pass's logits (detached): the
        self-distillation's teacher comes with the relevance teacher's pass for free."""
        geometry = self.geometry_for(tuple(images.shape[-2:]))
        full = self.full_decisions(images)
        if method == "attention":
            with torch.no_grad():
                out = self.forward(images, decisions=full, return_attention=True)
            fine, logits = out.fine_attention, out.logits
        elif method == "gradient":
            embeds = _LevelEmbeddings(self, images, geometry)
            with torch.enable_grad():
                tokens = embeds[self.levels - 1].detach().requires_grad_(True)
                embeds._cache[self.levels - 1] = tokens
                logits = self.forward(images, decisions=full, embeddings=embeds).logits
                cls = (target if target is not None else logits.argmax(1)).unsqueeze(1)
                score = logits.gather(1, cls).sum()
                (grad,) = torch.autograd.grad(score, tokens)
            fine = (grad * tokens.detach()).sum(-1).abs()
        else:
            raise ValueError(f"relevance method must be 'attention' or 'gradient', got {method!r}")
        return nodes_mass(fine.detach(), geometry), logits.detach()


class _LevelEmbeddings:
    """Per-level token embeddings, computed on first use (a full-resolution pass
    never embeds the coarse levels)."""

    def __init__(self, model: SplitViT, images: torch.Tensor, geometry: QuadtreeGeometry) -> None:
        self.model, self.images, self.geometry = model, images, geometry
        self._pos = None
        self._cache: dict[int, torch.Tensor] = {}
        self._fine_patches: torch.Tensor | None = None  # with fine aggregation: shared by every level
        self._aggregated: list[torch.Tensor] | None = None

    def __getitem__(self, level: int) -> torch.Tensor:
        if level not in self._cache:
            with self.model.stage("embedding"):
                self._cache[level] = self._embed(level)
        return self._cache[level]

    def _embed(self, level: int) -> torch.Tensor:
        """Embed one level (patch, position and level embeddings, fine aggregation)."""
        model, finest = self.model, self.geometry.levels - 1
        if self._pos is None:
            self._pos = model._pos_grid(self.geometry)
        patches = None
        if model.fine_aggregation is not None:
            if self._fine_patches is None:
                self._fine_patches = model.patch_tokens(self.images)
            if level == finest:
                patches = self._fine_patches
            else:
                if self._aggregated is None:
                    with model.stage("aggregation"):
                        self._aggregated = model.fine_aggregation(self._fine_patches)
                factor = 2 ** (finest - level)
                patches = model.patch_tokens(self.images, factor) + self._aggregated[level]
        return model.embed_level(self.images, self.geometry, level, self._pos, patches)


def load_checkpoint_state(model: nn.Module, payload: CheckpointPayload, spec: ModelSpec, prefix: str = "") -> None:
    """Load a payload's weights into the model rebuilt from it by ``spec`` (its
    :func:`checkpoint_spec`). Under another policy than the saved one the policy's
    parameters (under ``prefix + "policy."``) are left out: that policy has other (or no)
    parameters; the backbone's are kept."""
    state = payload["state_dict"]
    if spec.policy.kind != ModelSpec.from_dict(payload["spec"]).policy.kind:
        state = {k: v for k, v in state.items() if not k.startswith(prefix + "policy.")}
        model.load_state_dict(state, strict=False)
    else:
        model.load_state_dict(state)


def _area_downsample(images: torch.Tensor, factor: int) -> torch.Tensor:
    """``F.avg_pool2d(images, factor)``, bit for bit. At factor 2 as the sum of the four
    strided views in the kernel's own order: on the CPU, torch's 2x2 pooling of NCHW
    images runs several times slower than these four reads (0.72 against 0.18 ms for
    64 images of 3x64x64 here)."""
    if factor != 2:
        return F.avg_pool2d(images, factor)
    top, bottom = images[..., 0::2, :], images[..., 1::2, :]
    return (top[..., 0::2] + top[..., 1::2] + bottom[..., 0::2] + bottom[..., 1::2]) * 0.25


def _is_patchify_conv(proj: nn.Module, patch: int) -> bool:
    """Whether ``proj`` is a plain patchify convolution (kernel = stride = ``patch``, no
    padding, dilation or groups), i.e. a linear map of each patch's pixels."""
    return (
        isinstance(proj, nn.Conv2d)
        and proj.kernel_size == (patch, patch)
        and proj.stride == (patch, patch)
        and proj.padding == (0, 0)
        and proj.dilation == (1, 1)
        and proj.groups == 1
        and proj.padding_mode == "zeros"
    )


def input_data_config(vit: VisionTransformer, normalize: str, *, timm_weights: bool) -> DataConfig:
    """timm's data config of ``vit``, with the mean and std ``normalize`` asks for.

    ``timm``: timm's own (what its pretrained weights saw); ``none``: mean 0 and std 1,
    the pixels as they are; ``auto``: ``timm`` when ``timm_weights`` (the weights come
    from timm), else ``none``: a model trained from scratch learns on the data as it
    is, and timm's default of mean = std = 0.5 only slows its start (the demo recipe's
    full-resolution ViT: 1.00 accuracy without, 0.69 with, in the same 6 epochs; its
    loss stays at chance for 4 of them).
    """
    if normalize not in INPUT_NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {', '.join(INPUT_NORMALIZATIONS)}, got {normalize!r}")
    config = DataConfig(**resolve_model_data_config(vit))
    if normalize == "none" or (normalize == "auto" and not timm_weights):
        channels = len(config["mean"])
        config["mean"], config["std"] = (0.0,) * channels, (1.0,) * channels
    return config


def channel_stats(config: DataConfig, channels: int) -> tuple[list[float], list[float]]:
    """The data config's mean and std as ``channels`` values each: timm resolves three
    (RGB) even for a one-channel ViT; then each is averaged to one grey value."""
    mean, std = [float(v) for v in config["mean"]], [float(v) for v in config["std"]]
    if len(mean) != channels:
        mean = [sum(mean) / len(mean)] * channels
    if len(std) != channels:
        std = [sum(std) / len(std)] * channels
    if any(v <= 0 for v in std):
        raise ValueError(f"data config std must be positive, got {config['std']}")
    return mean, std


def fill_legacy_normalisation(state_dict: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Give a state dict written before SplitViT normalised its inputs (a backbone, no
    ``input_mean`` / ``input_std``) the buffers it was trained with: its weights saw
    raw ``[0, 1]`` images, so it loads as un-normalised, mean 0 and std 1 (the
    identity), not timm's values, which would feed it inputs it never saw. A partial
    state (no patch embedding) is left alone: nothing can be inferred from it."""
    weight = state_dict.get(prefix + "vit.patch_embed.proj.weight")
    if weight is None:
        return
    shape = (1, weight.shape[1], 1, 1)  # one value per input channel
    for name, fill in zip(NORMALISATION_BUFFERS, (0.0, 1.0)):
        if prefix + name not in state_dict:
            state_dict[prefix + name] = torch.full(shape, fill, dtype=torch.float32)


def _fill_legacy_normalisation(state_dict: dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: :func:`fill_legacy_normalisation` on every load
    (``from_checkpoint``, a resumed run, ``init_from``)."""
    fill_legacy_normalisation(state_dict, prefix)


def _keep_budget_if_missing(module: SplitViT, state_dict: dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: a state dict written before the ``budget`` buffer
    existed (or a partial one) keeps the model's current budget, so it still loads strictly."""
    state_dict.setdefault(prefix + "budget", module.budget.detach().clone())


def straight_through_gates(decisions: list[torch.Tensor], probs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-level leaf gates whose values are the hard 0/1 leaf masks and whose
    gradients flow to the split probabilities (straight-through estimator).

    ``d = hard + (q - q.detach())`` is exactly ``hard`` in value, so a gated token
    equals the ungated one bit for bit.
    """
    gates = []
    active = torch.ones_like(probs[0])
    for hard, q in zip(decisions, probs):
        d = hard.to(q.dtype) + (q - q.detach())
        gates.append(active * (1 - d))
        active = upsample_to_children(active * d)
    gates.append(active)
    return gates


def _query_attention(block, x, attn_mask, num_prefix: int, valid) -> torch.Tensor:
    """Attention of the class token (or the mean over valid queries) onto every
    image token in ``block``, averaged over heads: ``(B, S)``."""
    attn = block.attn
    if not hasattr(attn, "qkv"):
        raise ValueError(f"relevance needs timm's standard Attention, got {type(attn).__name__}")
    h = block.norm1(x)
    b, n, c = h.shape
    qkv = attn.qkv(h).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, _ = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    scores = (q * attn.scale) @ k.transpose(-2, -1)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    probs = scores.softmax(-1).mean(1)  # (B, N, N)
    if num_prefix > 0:
        row = probs[:, 0]
    else:
        weights = torch.ones(b, n, device=x.device) if valid is None else valid.float()
        row = (probs * weights.unsqueeze(-1)).sum(1) / weights.sum(1, keepdim=True)
    return row[:, num_prefix:]
