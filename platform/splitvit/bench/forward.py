"""``splitvit bench``: SPLIT's forward speed, where its time goes, and memory, side by side.

Every figure comes from one run on one machine; no figure is tuned to a target and
no timing is compared with a number measured elsewhere. The workload is any timm
``VisionTransformer`` (default ``vit_base_patch16_224`` at its own 224 px, 16-px
fine patches and a 2-level quadtree of 32-px coarse patches; :func:`benchmark_vit`),
with random weights: speed does not depend on them. Timed, interleaved:

* ``timm``: the plain timm ViT at full resolution (the baseline);
* ``split_full``: the same ViT wrapped in :class:`SplitViT` with the ``full`` policy
  (every node splits), i.e. our code path doing the same work as timm;
* one **operating point** per policy and token ratio (``learned@0.50``): the policy's
  thresholds calibrated on the benchmark images to that share of ``N_full``, on
  the default packed path. Policies: ``learned`` (SPLIT's policy with narrow blocks
  of its own, ``policy_width``), ``learned_shared`` (the policy on the ViT's first
  ``policy_depth`` blocks) and ``entropy`` (APT-style); untrained learned policies
  are as fast as trained ones;
* per point, ``.../encoder``: :meth:`SplitViT.encode` alone on the point's gathered
  leaves; per policy, ``policy/...``: ``split_scores`` alone; optionally
  ``.../padded_b{b}``: the padded path with ``length_buckets=b``;
* ``seq/{n}``: the timm ViT's encoder (``norm_pre``, blocks, ``norm``, head) on
  fixed-length random token sequences of ``N_full`` and of each point's mean count.

**Ideal speed-up.** For a point that keeps a mean of ``n`` image tokens out of
``N_full``: ``t_seq(N_full) / t_seq(n)``, both measured in this run. It is what a
perfect mixed-scale ViT would reach: no policy, no embedding of extra scales, no
gather, no padding, no attention mask.

**Where the time goes** (per point, from medians): the policy (``split_scores``);
embedding, gather and head (the forward pass minus policy and encoder); attention
kernel and packing (the encoder minus the fixed-length blocks of the same mean
length); and the blocks themselves. Time outside the ViT blocks is the forward pass
minus the encoder.

**Timing.** Under ``torch.inference_mode()`` (and bf16 autocast when asked), after
``warmup`` rounds, ``repeats`` rounds in which every callable runs once, interleaved
(A, B, C, ... then ..., C, B, A) so that drift in clock speed or cache state falls
on all models alike; each figure is the median of its ``repeats`` timings, with
``torch.cuda.synchronize`` around each call on CUDA. The targets are judged on the
medians; the same ratios from each model's fastest round are reported beside them
as a check. On Linux the CPU time other processes used during the timing is
measured (``/proc/stat`` minus this process's CPU time) and a warning is added to
the result when they competed for the cores (:func:`~splitvit.bench.timing.time_beside_others`).

**Memory** (peak working memory of one batch forward pass of timm, SplitViT(full) and
each policy at the first ratio): ``rss`` and ``profiler`` on CPU, ``cuda`` on a GPU,
as :mod:`splitvit.bench.memory` describes them.

**Layout.** The timer is :mod:`splitvit.bench.timing` and the targets' table
:mod:`splitvit.bench.report` (both shared with ``splitvit bench train``); this module
holds the workload (:func:`benchmark_vit`, :func:`build_benchmark_models`), its
settings (:class:`ForwardSettings`) and the steps of :func:`run_forward_benchmark`:
build the models, calibrate the operating points, time, measure memory, judge the
targets, assemble the result; and :func:`format_report`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, fields
from typing import Any

import timm
import torch
import torch.nn as nn
from timm.models.vision_transformer import VisionTransformer

from ..config import PolicyConfig
from ..data.synthetic import SyntheticObjects
from ..jsontypes import JsonObject
from ..model import SplitViT
from ..model.quadtree import QuadtreeGeometry
from ..train.steps import calibrate_thresholds
from .memory import MemoryFigures, measure_memory
from .records import MachineInfo
from .report import Target, device_label, make_target, target_table, text_table
from .timing import (
    OTHER_LOAD_WARNING,
    TimingSummary,
    checked_device,
    compile_options,
    machine_info,
    synchronizer,
    time_beside_others,
    timing_summary,
)

log = logging.getLogger(__name__)

#: The project's targets: (a) SplitViT(full) overhead over timm; (b) the learned
#: policy's speed-up over timm at a token ratio (CPU: ViT-B/16 at 224 px, batch 8;
#: GPU: bf16, batch 256); (c) its time outside the ViT blocks.
OVERHEAD_TARGET = 0.05
CPU_SPEEDUP_TARGETS = {0.5: 1.85, 0.7: 1.38}
GPU_SPEEDUP_TARGETS = {0.5: 1.6}
OUTSIDE_BLOCKS_TARGET = 0.05

DEFAULT_MODEL = "vit_base_patch16_224"
#: The learned policy's own blocks in the benchmark: narrow beside a ViT-B (768).
DEFAULT_POLICY_WIDTH = 192
#: ``learned``: the policy with blocks of its own (``policy_width``); ``learned_shared``:
#: the policy on the ViT's first ``policy_depth`` blocks; ``entropy``: APT-style.
BENCH_POLICIES = ("learned", "learned_shared", "entropy")

IDEAL_DEFINITION = (
    "t(N_full)/t(n): the timm encoder (norm_pre, blocks, norm, head) on fixed-length random "
    "sequences of num_prefix+N_full vs num_prefix+round(mean tokens) tokens, same run"
)
BREAKDOWN_DEFINITION = (
    "policy = split_scores alone (the level embeddings it needs and the policy); "
    "embedding+gather+head = forward - policy - encoder; encoder = SplitViT.encode on the gathered leaves "
    "(packing, blocks, attention kernel, norm); attention+packing = encoder - fixed-length blocks of the "
    "same mean length; outside the blocks = forward - encoder"
)


# ---------------------------------------------------------------------- settings
@dataclass(frozen=True)
class ForwardSettings:
    """What :func:`run_forward_benchmark` measures, and how (checked on construction).

    Attributes:
        model_name, image_size, patch_size, levels, timm_kwargs, num_classes: the
            workload (see :func:`benchmark_vit`); sizes default to the model's own.
        batch_size: images per forward pass.
        ratios: token budgets (fractions of ``N_full``) at which every split policy is
            timed, its thresholds calibrated on the benchmark images.
        policies: split policies to time (:data:`BENCH_POLICIES`); without a
            ``policy_width`` ``learned_shared`` is dropped (it would be ``learned``).
        policy_width, policy_depth: the learned policy's blocks (``learned``: its own
            blocks of ``policy_width``; ``learned_shared``: the ViT's first
            ``policy_depth`` blocks).
        fine_aggregation: the policies' models aggregate fine patches into coarse
            tokens (``model.fine_aggregation``); ``split_full`` never does.
        level_context: the learned policies score every finer level in context
            (``model.policy.level_context``: their blocks also run on all of a finer
            level's nodes), to time its cost; needs ``levels >= 3``.
        buckets: ``length_buckets`` of padded-path variants timed beside each point
            (the default packed path is what the targets judge); ``()``: none.
        token_buckets: the split policies' packed sizes rounded up to this many fixed
            sizes (``SplitViT(token_buckets=...)``); ``0``: exact sizes.
        compile: ``torch.compile`` the timm ViT, the fixed-length encoder of the ideal
            and the split policies' packed encoders (:meth:`SplitViT.compile_encoder`,
            CUDA graphs on a GPU); pair it with ``token_buckets``. SplitViT(full) stays
            eager, so the overhead target means nothing under it.
        repeats, warmup: timed and untimed interleaved rounds.
        device, autocast_bf16: where and in which precision.
        memory: ``rss`` and/or ``profiler`` on CPU, ``cuda`` on a GPU; ``None``: the
            device's default; ``()``: no memory figures.
        memory_parallel: CPU RSS probes run at once (default: CPU count).
        seed: weights and images.

    Raises:
        ValueError: for a ratio outside (0, 1], an unknown or empty set of policies, or
            a bucket count below 1.
    """

    model_name: str = DEFAULT_MODEL
    image_size: int | None = None
    patch_size: int | None = None
    levels: int | None = None
    timm_kwargs: Mapping[str, Any] | None = None
    num_classes: int | None = None
    batch_size: int = 8
    ratios: tuple[float, ...] = (0.5, 0.7)
    policies: tuple[str, ...] = BENCH_POLICIES
    policy_width: int | None = DEFAULT_POLICY_WIDTH
    policy_depth: int = 2
    fine_aggregation: bool = False
    level_context: bool = False
    buckets: tuple[int, ...] = ()
    token_buckets: int = 0
    compile: bool = False
    repeats: int = 10
    warmup: int = 2
    device: str = "cpu"
    autocast_bf16: bool = False
    memory: tuple[str, ...] | None = None
    memory_parallel: int | None = None
    seed: int = 0

    @property
    def policy(self) -> PolicyConfig:
        """The learned policies' settings (``model.policy``) these options give."""
        return PolicyConfig(depth=self.policy_depth, width=self.policy_width, level_context=self.level_context)

    def __post_init__(self) -> None:
        ratios = tuple(float(r) for r in self.ratios)
        if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
            raise ValueError(f"ratios must be token fractions in (0, 1], got {list(ratios)}")
        policies = tuple(self.policies)
        unknown = [p for p in policies if p not in BENCH_POLICIES]
        if unknown or not policies:
            raise ValueError(
                f"policies: unknown {unknown or 'none given'}; expected some of {', '.join(BENCH_POLICIES)}"
            )
        if self.policy_width is None:  # learned and learned_shared would be the same model
            policies = tuple(p for p in policies if p != "learned_shared") or ("learned",)
        if any(b < 1 for b in self.buckets):
            raise ValueError(f"buckets must be positive integers, got {self.buckets}")
        # frozen: normalised values go in through object.__setattr__
        object.__setattr__(self, "ratios", ratios)
        object.__setattr__(self, "policies", policies)
        object.__setattr__(self, "buckets", tuple(int(b) for b in self.buckets))

    def autocast(self) -> AbstractContextManager:
        """bf16 autocast on the benchmark's device when asked, else nothing."""
        kind = torch.device(self.device).type
        return torch.autocast(kind, dtype=torch.bfloat16) if self.autocast_bf16 else nullcontext()

    def memory_methods(self) -> tuple[str, ...]:
        """The memory methods to run: those given, or the device's default."""
        if self.memory is not None:
            return tuple(self.memory)
        return ("cuda",) if torch.device(self.device).type == "cuda" else ("rss", "profiler")


# ---------------------------------------------------------------------- models
def benchmark_vit(
    model_name: str = DEFAULT_MODEL,
    *,
    image_size: int | None = None,
    patch_size: int | None = None,
    levels: int | None = None,
    timm_kwargs: Mapping[str, Any] | None = None,
    num_classes: int | None = None,
    seed: int = 0,
) -> tuple[VisionTransformer, int]:
    """The timm ViT to benchmark (random weights) and the quadtree's levels.

    Image and patch size default to the model's own; ``levels`` defaults to the
    deepest quadtree (3, else 2) whose coarsest patch divides the image, e.g. 2 levels
    (32-px coarse patches over 16-px fine ones) for ViT-B/16 at 224 px.

    Raises:
        ValueError: naming ``--model`` for a name timm does not know or a model that
            is not a ``VisionTransformer``, ``--image-size`` when no quadtree fits.
    """
    create: dict[str, Any] = dict(timm_kwargs or {})
    for key, value in (("img_size", image_size), ("patch_size", patch_size), ("num_classes", num_classes)):
        if value is not None:
            create[key] = value
    torch.manual_seed(seed)
    try:
        vit = timm.create_model(model_name, pretrained=False, **create).eval()
    except RuntimeError as exc:  # timm: "Unknown model (...)"
        raise ValueError(f"--model {model_name!r}: {exc}") from None
    if not isinstance(vit, VisionTransformer):
        raise ValueError(f"--model {model_name!r} is a {type(vit).__name__}, not a timm VisionTransformer")
    size, patch = vit.patch_embed.img_size[0], vit.patch_embed.patch_size[0]
    if levels is None:
        levels = next((n for n in (3, 2) if size % (patch * 2 ** (n - 1)) == 0), 0)
        if not levels:
            raise ValueError(f"--image-size {size} is not a multiple of twice the {patch}-px patch: no quadtree fits")
    return vit, levels


def build_benchmark_models(
    vit: VisionTransformer,
    *,
    levels: int,
    policies: tuple[str, ...] = BENCH_POLICIES,
    policy: PolicyConfig | None = None,
    fine_aggregation: bool = False,
    buckets: tuple[int, ...] = (),
    token_buckets: int = 0,
) -> dict[str, SplitViT]:
    """The SplitViT variants that wrap ``vit`` (sharing its weights), in eval mode.

    Keys: ``split_full`` (the ``full`` policy: timm's own work), each of ``policies``
    (the default packed path; see :data:`BENCH_POLICIES`), and ``{policy}_padded_b{b}``
    (``attention='padded'``, ``length_buckets=b``) for each of ``buckets``, sharing
    the policy module of the packed model (identical decisions). ``fine_aggregation``
    gives the policies' models (not ``split_full``) the coarse tokens' aggregation of
    their fine patches (``model.fine_aggregation``). ``policy``: the learned policies'
    settings (``model.policy``; default: blocks of width :data:`DEFAULT_POLICY_WIDTH`,
    depth 2): ``learned`` has its ``width``, ``learned_shared`` runs on the ViT's first
    ``depth`` blocks; its ``level_context`` scores every finer level in context, to time
    what each costs.
    """
    policy = policy or PolicyConfig(width=DEFAULT_POLICY_WIDTH)
    models: dict[str, SplitViT] = {"split_full": SplitViT(vit, levels=levels, policy="full").eval()}
    for key in policies:
        name = "learned" if key.startswith("learned") else key
        settings = dataclasses.replace(
            policy,
            kind=name,
            width=policy.width if key == "learned" else None,
            level_context=policy.level_context and name == "learned",
        )
        first = SplitViT(
            vit,
            levels=levels,
            policy=settings,
            token_buckets=token_buckets,
            fine_aggregation=fine_aggregation,
        ).eval()
        models[key] = first
        for b in buckets:
            padded = SplitViT(
                vit,
                levels=levels,
                policy=settings,
                length_buckets=b,
                attention="padded",
                fine_aggregation=fine_aggregation,
            )
            padded.set_policy(first.policy)  # the packed model's policy module: the same decisions
            models[f"{key}_padded_b{b}"] = padded.eval()
    return models


def benchmark_images(batch_size: int, image_size: int, seed: int = 0) -> torch.Tensor:
    """A batch of :class:`SyntheticObjects` images (an object among clutter): content
    with structure, so the entropy policy's decisions are those of a real image."""
    data = SyntheticObjects(batch_size, image_size=image_size, object_size=max(image_size // 8, 2), seed=seed)
    return torch.stack([data[i][0] for i in range(batch_size)])


def _encode_sequence(vit: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The timm ViT's encoder and head on an already-embedded sequence (no patch
    embedding, no mask): the cost a ViT pays for a sequence of this length."""
    x = vit.norm_pre(tokens)
    x = vit.blocks(x)
    x = vit.norm(x)
    return vit.forward_head(x)


@dataclass
class _Workload:
    """Everything the timed callables run: the timm ViT, its SplitViT variants (see
    :func:`build_benchmark_models`), the runners of the timm side (``timm``: the ViT,
    ``sequence``: :func:`_encode_sequence`; compiled or not), and the images, all on
    ``device``."""

    vit: VisionTransformer
    levels: int
    models: dict[str, SplitViT]
    runners: dict[str, Callable]
    images: torch.Tensor
    device: torch.device
    #: ``images`` normalised with the model's timm data config: what the timm ViT is given,
    #: since a SplitViT normalises its [0, 1] inputs itself (``SplitViT.normalize``)
    timm_images: torch.Tensor

    @property
    def geometry(self) -> QuadtreeGeometry:
        """The quadtree at the benchmark's image size."""
        return self.models["split_full"].geometry


def _build_workload(s: ForwardSettings, dev: torch.device) -> _Workload:
    """Step 1: the ViT, its SplitViT variants and the images, on ``dev``."""
    vit, levels = benchmark_vit(
        s.model_name,
        image_size=s.image_size,
        patch_size=s.patch_size,
        levels=s.levels,
        timm_kwargs=s.timm_kwargs,
        num_classes=s.num_classes,
        seed=s.seed,
    )
    if s.level_context and levels < 3:  # before the models: LearnedPolicy's own error names no option
        size, patch = vit.patch_embed.img_size[0], vit.patch_embed.patch_size[0]
        raise ValueError(
            f"--level-context needs a 3-level quadtree: {size}-px images with {patch}-px patches give "
            f"{levels} levels (e.g. --image-size 256 for a /16 model)"
        )
    models = build_benchmark_models(
        vit,
        levels=levels,
        policies=s.policies,
        policy=s.policy,
        fine_aggregation=s.fine_aggregation,
        buckets=s.buckets,
        token_buckets=s.token_buckets,
    )
    vit.to(dev)
    for m in models.values():
        m.to(dev)
    eager = {"timm": vit, "sequence": _encode_sequence}
    runners = _compiled_runners(vit, models, s.policies, dev) if s.compile else eager
    size = models["split_full"].geometry.image_size[0]
    images = benchmark_images(s.batch_size, size, seed=s.seed).to(dev)
    with torch.no_grad():
        timm_images = models["split_full"].normalize(images)
    return _Workload(
        vit=vit, levels=levels, models=models, runners=runners, images=images, device=dev, timm_images=timm_images
    )


def _compiled_runners(vit, models, policies, device) -> dict[str, Callable]:
    """``torch.compile`` for every side alike: timm's ViT, the ideal's encoder, and the
    split policies' packed encoders (CUDA graphs on a GPU)."""
    options = {"dynamic": False, **compile_options(device)}
    for policy in policies:
        models[policy].compile_encoder(**options)
    return {"timm": torch.compile(vit, **options), "sequence": torch.compile(_encode_sequence, **options)}


# ---------------------------------------------------------------------- operating points
def point_key(policy: str, ratio: float) -> str:
    """The key of one operating point (a policy at a target token ratio): ``learned@0.50``."""
    return f"{policy}@{ratio:.2f}"


@dataclass(frozen=True)
class TokenStats:
    """Token counts and padding of one forward pass (:func:`_token_stats`)."""

    mean: float  # image tokens per image
    min: int
    max: int
    fraction: float  # mean / N_full
    padded_slots: int  # image-token slots the blocks' norms, linear layers and MLP processed
    real_tokens: int
    padding_waste: float  # padded slots over real tokens, minus 1
    attention_slots: int  # those attention processed (only the CPU attention kernel pads the packed path)
    attention_padding_waste: float


@dataclass(frozen=True)
class CalibratedPoint:
    """An operating point before timing: a policy calibrated to a target token ratio on
    the benchmark images, and the tokens it keeps there (:func:`_operating_points`)."""

    key: str  # :func:`point_key`
    policy: str
    target_ratio: float
    thresholds: list[float]
    token_ratio: float
    tokens: TokenStats
    padded_tokens: dict[str, TokenStats]  # per padded variant ("b4"), its tokens and padding


@dataclass(frozen=True)
class ForwardPoint(CalibratedPoint):
    """An operating point as timed (:func:`_summarise_point`): its speed-ups, the ideal,
    and where its time goes."""

    images_per_s: float
    speedup_vs_timm: float  # medians
    ideal_speedup: float  # t_seq(N_full) / t_seq(n), same run
    sequence_tokens: int  # n: the mean token count, rounded
    speedup_fastest: float  # from the fastest rounds
    speedup_cpu_time: float  # from the median process CPU seconds
    breakdown_s: dict[str, float]  # the forward pass and its parts (:data:`BREAKDOWN_DEFINITION`)
    outside_blocks_share: float
    padded_speedup_vs_timm: dict[str, float]  # per padded variant ("b4")
    efficiency: float  # speedup_vs_timm / ideal_speedup


@dataclass(frozen=True)
class ForwardConfig:
    """The result's ``config``: the settings and the workload's shape (:func:`_config_record`)."""

    model_name: str
    timm_kwargs: JsonObject  # timm.create_model's own keyword arguments, as given
    embed_dim: int
    depth: int
    num_heads: int | None
    num_prefix_tokens: int
    num_classes: int
    batch_size: int
    image_size: int
    patch_size: int
    levels: int
    coarse_patch_size: int
    full_tokens: int
    min_tokens: int
    ratios: list[float]
    policies: list[str]
    policy_width: int | None
    policy_depth: int
    fine_aggregation: bool
    level_context: bool
    buckets: list[int]
    token_buckets: int
    compile: bool
    repeats: int
    warmup: int
    autocast_bf16: bool
    images: str
    seed: int


@dataclass(frozen=True)
class ForwardReport:
    """What :func:`run_forward_benchmark` measured (``splitvit bench forward``' JSON)."""

    config: ForwardConfig
    machine: MachineInfo
    load_average_start: list[float]
    others_cores: float | None  # CPUs other processes used while timing (None: unknown)
    timings: dict[str, TimingSummary]  # per timed callable
    points: list[ForwardPoint]
    overhead: dict[str, float]  # SplitViT(full) over timm, minus 1: medians, fastest rounds
    warnings: list[str]
    memory: MemoryFigures | None  # None: no memory method asked for
    checks: dict[str, float]
    targets: list[Target]

    def to_dict(self) -> JsonObject:
        """The JSON ``--json`` writes: the machine with the load and other processes'
        CPUs, memory ``{}`` where none was measured, and the definitions."""
        return {
            "config": asdict(self.config),
            "machine": {
                **self.machine.to_dict(),
                "load_average_start": self.load_average_start,
                "other_processes_cpus_during_timing": self.others_cores,
            },
            "timings": {name: t.to_dict() for name, t in self.timings.items()},
            "points": [asdict(p) for p in self.points],
            "overhead": self.overhead,
            "warnings": self.warnings,
            "memory": {} if self.memory is None else self.memory.to_dict(),
            "checks": self.checks,
            "targets": [t.to_dict() for t in self.targets],
            "ideal_definition": IDEAL_DEFINITION,
            "breakdown_definition": BREAKDOWN_DEFINITION,
        }


def _token_stats(out, full_tokens: int) -> TokenStats:
    """Token counts and padding of one forward pass. ``padded_slots``: image-token
    slots the blocks' norms, linear layers and MLP processed; ``attention_slots``:
    those attention processed (they differ on the packed path, where only the CPU
    attention kernel pads)."""
    tokens = out.tokens.float()
    real = float(tokens.sum())
    attention_slots = int(out.padded_tokens if out.attention_slots is None else out.attention_slots)
    return TokenStats(
        mean=float(tokens.mean()),
        min=int(out.tokens.min()),
        max=int(out.tokens.max()),
        fraction=float(tokens.mean()) / full_tokens,
        padded_slots=int(out.padded_tokens),
        real_tokens=int(real),
        padding_waste=(int(out.padded_tokens) - real) / real,
        attention_slots=attention_slots,
        attention_padding_waste=(attention_slots - real) / real,
    )


def _operating_points(
    work: _Workload, s: ForwardSettings
) -> tuple[dict[str, CalibratedPoint], dict[str, tuple], float]:
    """Step 2: calibrate every policy to every ratio on the benchmark images; token
    figures per point, the encoder's inputs at each point, and the full policy's logit
    difference to timm."""
    models, images, full_tokens = work.models, work.images, work.geometry.full_tokens
    points: dict[str, CalibratedPoint] = {}
    inputs: dict[str, tuple] = {}
    for policy in s.policies:
        model = models[policy]
        for ratio in s.ratios:
            key = point_key(policy, ratio)
            tau = [float(t) for t in calibrate_thresholds(model, images, ratio)]
            stats = _token_stats(model(images, thresholds=tau), full_tokens)
            padded = {
                b: _token_stats(models[f"{policy}_padded_b{b}"](images, thresholds=tau), full_tokens) for b in s.buckets
            }
            points[key] = CalibratedPoint(
                key=key,
                policy=policy,
                target_ratio=ratio,
                thresholds=tau,
                token_ratio=stats.fraction,
                tokens=stats,
                padded_tokens={f"b{b}": t for b, t in padded.items()},
            )
            inputs[key] = model.encoder_inputs(images, thresholds=tau)
            log.info("bench: %s thresholds %s, %.1f tokens per image", key, tau, stats.mean)
    diff = float((work.vit(work.timm_images).float() - models["split_full"](images).logits.float()).abs().max())
    return points, inputs, diff


# ---------------------------------------------------------------------- timing
@dataclass
class _Timed:
    """Step 3's output: raw seconds per round, their summaries, and the CPUs other
    processes used meanwhile."""

    samples: dict[str, list[float]]
    timings: dict[str, TimingSummary]
    others_cores: float | None

    @property
    def overhead(self) -> float:
        """SplitViT(full)'s median time over timm's, minus 1."""
        return self.timings["split_full"].median_s / self.timings["timm"].median_s - 1.0


def _timed_callables(
    work: _Workload, points: dict[str, CalibratedPoint], encoder_inputs, s: ForwardSettings
) -> dict[str, Callable[[], Any]]:
    """Everything timed in one interleaved run: timm, SplitViT(full), per point the
    forward pass and the encoder alone, per policy its scores alone, and the timm
    encoder on fixed-length sequences of every point's mean length (the ideal)."""
    vit, models, images, timm_images = work.vit, work.models, work.images, work.timm_images
    num_prefix, dim, batch = vit.num_prefix_tokens, vit.embed_dim, images.shape[0]
    gen = torch.Generator().manual_seed(s.seed + 1)
    lengths = sorted(
        {work.geometry.full_tokens, *(max(1, round(p.tokens.mean)) for p in points.values())}, reverse=True
    )
    sequences = {n: torch.randn(batch, num_prefix + n, dim, generator=gen).to(images.device) for n in lengths}
    timm_vit, encode = work.runners["timm"], work.runners["sequence"]
    fns: dict[str, Callable[[], Any]] = {
        "timm": lambda: timm_vit(timm_images),
        "split_full": lambda: models["split_full"](images),
    }
    # the factories bind each loop variable now, not at call time
    for n, seq in sequences.items():
        fns[f"seq/{n}"] = (lambda q: lambda: encode(vit, q))(seq)
    for policy in dict.fromkeys(p.policy for p in points.values()):
        fns[f"policy/{policy}"] = (lambda m: lambda: m.split_scores(images))(models[policy])
    for key, point in points.items():
        model, tau = models[point.policy], point.thresholds
        fns[key] = (lambda m, t: lambda: m(images, thresholds=t))(model, tau)
        fns[f"{key}/encoder"] = (lambda m, args: lambda: m.encode(*args))(model, encoder_inputs[key])
        for b in s.buckets:
            padded = models[f"{point.policy}_padded_b{b}"]
            fns[f"{key}/padded_b{b}"] = (lambda m, t: lambda: m(images, thresholds=t))(padded, tau)
    return fns


def _time_points(
    work: _Workload, points: dict[str, CalibratedPoint], encoder_inputs, s: ForwardSettings
) -> tuple[_Timed, list[ForwardPoint]]:
    """Step 3: time every callable interleaved; every point with its speed-ups, ideal
    and time breakdown."""
    fns = _timed_callables(work, points, encoder_inputs, s)
    log.info("bench: timing %d callables, %d warm-up + %d rounds", len(fns), s.warmup, s.repeats)
    with torch.inference_mode(), s.autocast():
        samples, cpu_samples, others_cores = time_beside_others(
            fns, repeats=s.repeats, warmup=s.warmup, sync=synchronizer(work.device)
        )
    timings = {name: timing_summary(t, cpu_samples[name], s.batch_size) for name, t in samples.items()}
    timed = [_summarise_point(point, timings, s.buckets) for point in points.values()]
    return _Timed(samples=samples, timings=timings, others_cores=others_cores), timed


def _summarise_point(
    point: CalibratedPoint, timings: dict[str, TimingSummary], buckets: tuple[int, ...]
) -> ForwardPoint:
    """The point with its speed-ups, the ideal, and where the time goes, from the medians."""
    key, full_tokens = point.key, round(point.tokens.mean / point.tokens.fraction)
    med = {name: t.median_s for name, t in timings.items()}
    n = max(1, round(point.tokens.mean))
    total, policy, encoder, blocks = med[key], med[f"policy/{point.policy}"], med[f"{key}/encoder"], med[f"seq/{n}"]
    speedup, ideal = med["timm"] / total, med[f"seq/{full_tokens}"] / blocks
    return ForwardPoint(
        **{f.name: getattr(point, f.name) for f in fields(CalibratedPoint)},
        images_per_s=timings[key].images_per_s,
        speedup_vs_timm=speedup,
        ideal_speedup=ideal,
        sequence_tokens=n,
        speedup_fastest=timings["timm"].min_s / timings[key].min_s,
        speedup_cpu_time=timings["timm"].cpu_median_s / timings[key].cpu_median_s,
        breakdown_s={
            "forward": total,
            "policy": policy,
            "embedding_gather_head": total - policy - encoder,
            "attention_packing": encoder - blocks,
            "blocks_fixed_length": blocks,
        },
        outside_blocks_share=(total - encoder) / total,
        padded_speedup_vs_timm={f"b{b}": med["timm"] / med[f"{key}/padded_b{b}"] for b in buckets},
        efficiency=speedup / ideal,
    )


# ---------------------------------------------------------------------- memory
def _point_memory(work: _Workload, points: dict[str, CalibratedPoint], s: ForwardSettings) -> MemoryFigures | None:
    """Step 4: peak forward memory of timm, SplitViT(full) and each policy at the
    first ratio; None when no memory method is asked for."""
    methods = s.memory_methods()
    if not methods:
        return None
    probes: dict[str, tuple[nn.Module, str]] = {
        "timm": (work.vit, "timm"),
        "split_full": (work.models["split_full"], "split"),
    }
    for point in points.values():
        if point.target_ratio == s.ratios[0]:
            model = work.models[point.policy]
            model.set_thresholds(point.thresholds)  # the probe runs the model with its own thresholds
            probes[point.key] = (model, "split")
    log.info("bench: measuring memory of %d models by %s", len(probes), ", ".join(methods))
    # every probe, timm's included, gets the [0, 1] images: peak memory depends on the
    # shapes alone, not on whether the values were normalised
    return measure_memory(
        probes, work.images, methods=methods, bf16=s.autocast_bf16, parallel=s.memory_parallel or os.cpu_count() or 1
    )


# ---------------------------------------------------------------------- targets
def _speed_targets(device: torch.device) -> dict[float, float]:
    """The speed-up bounds of target (b) on this kind of device."""
    return GPU_SPEEDUP_TARGETS if device.type == "cuda" else CPU_SPEEDUP_TARGETS


def _forward_targets(points: list[ForwardPoint], timed: _Timed, speed_bounds: dict[float, float]) -> list[Target]:
    """Step 5: the targets, judged on medians, for the learned policy (the product):
    speed-up at the ratios that have a bound on this device, and its time outside the
    blocks."""
    samples = timed.samples

    def per_round(num: str, den: str, offset: float = 0.0) -> list[float]:
        return [a / b + offset for a, b in zip(samples[num], samples[den])]

    targets = [
        make_target(
            "a",
            "overhead of SplitViT(full) vs timm ViT",
            timed.overhead,
            "<=",
            OVERHEAD_TARGET,
            "percent",
            rounds=per_round("split_full", "timm", -1.0),
        )
    ]
    for point in points:
        if point.policy != "learned":
            continue
        key, ratio, share = point.key, point.target_ratio, f"{point.token_ratio:.0%}"
        bound = next((b for r, b in speed_bounds.items() if math.isclose(r, ratio)), None)
        if bound is not None:
            targets.append(
                make_target(
                    "b",
                    f"learned@{share} tokens: img/s vs timm ViT",
                    point.speedup_vs_timm,
                    ">=",
                    bound,
                    "times",
                    note=f"ideal {point.ideal_speedup:.2f}x",
                    rounds=per_round("timm", key),
                )
            )
        targets.append(
            make_target(
                "c",
                f"learned@{share} tokens: time outside the ViT blocks",
                point.outside_blocks_share,
                "<=",
                OUTSIDE_BLOCKS_TARGET,
                "percent",
                rounds=[(t - e) / t for t, e in zip(samples[key], samples[f"{key}/encoder"])],
            )
        )
    return targets


def _load_warnings(others_cores: float | None) -> list[str]:
    """A warning when other processes competed for the cores while timing."""
    if others_cores is None or others_cores <= OTHER_LOAD_WARNING:
        return []
    return [
        f"other processes used {others_cores:.2f} of the {os.cpu_count()} CPUs on average while the models "
        f"were timed: wall-clock timings are noisy; see the fastest-round and CPU-time ratios, and rerun on an "
        f"idle machine"
    ]


# ---------------------------------------------------------------------- result
def _config_record(s: ForwardSettings, work: _Workload) -> ForwardConfig:
    """Step 6: the result's ``config``: the settings and the workload's shape."""
    vit, geometry = work.vit, work.geometry
    return ForwardConfig(
        model_name=s.model_name,
        timm_kwargs=dict(s.timm_kwargs or {}),
        embed_dim=int(vit.embed_dim),
        depth=len(vit.blocks),
        num_heads=int(vit.blocks[0].attn.num_heads) if hasattr(vit.blocks[0].attn, "num_heads") else None,
        num_prefix_tokens=int(vit.num_prefix_tokens),
        num_classes=int(vit.num_classes),
        batch_size=s.batch_size,
        image_size=geometry.image_size[0],
        patch_size=geometry.patch_size,
        levels=work.levels,
        coarse_patch_size=geometry.coarse_patch_size,
        full_tokens=geometry.full_tokens,
        min_tokens=geometry.min_tokens,
        ratios=list(s.ratios),
        policies=list(s.policies),
        policy_width=s.policy_width,
        policy_depth=s.policy_depth,
        fine_aggregation=s.fine_aggregation,
        level_context=s.level_context,
        buckets=list(s.buckets),
        token_buckets=s.token_buckets,
        compile=s.compile,
        repeats=s.repeats,
        warmup=s.warmup,
        autocast_bf16=s.autocast_bf16,
        images=f"SyntheticObjects(seed={s.seed})",
        seed=s.seed,
    )


def run_forward_benchmark(settings: ForwardSettings | None = None) -> ForwardReport:
    """Measure SplitViT against the plain timm ViT, side by side in one run.

    Args:
        settings: the workload, the operating points and how to time them (default:
            :class:`ForwardSettings`' defaults: ViT-B/16 at 224 px, batch 8).

    Returns:
        The :class:`ForwardReport`: ``config``, ``machine``, ``timings`` (per timed
        callable), ``points`` (one per policy and ratio, with ``token_ratio``,
        ``speedup_vs_timm``, ``ideal_speedup`` and the time breakdown), ``overhead``,
        ``memory``, ``checks``, ``targets`` (value, bound, ``passed`` as measured) and
        ``warnings``; its :meth:`~ForwardReport.to_dict` is the JSON.

    Raises:
        ValueError: for a CUDA device where CUDA is not available, or a workload
            :func:`benchmark_vit` rejects.
    """
    s = settings or ForwardSettings()
    dev = checked_device(s.device)
    load_start = list(os.getloadavg())
    work = _build_workload(s, dev)
    with torch.inference_mode(), s.autocast():
        calibrated, encoder_inputs, full_diff = _operating_points(work, s)
    timed, points = _time_points(work, calibrated, encoder_inputs, s)
    memory = _point_memory(work, calibrated, s)
    timings = timed.timings
    return ForwardReport(
        config=_config_record(s, work),
        machine=machine_info(dev),
        load_average_start=load_start,
        others_cores=timed.others_cores,
        timings=timings,
        points=points,
        overhead={
            "split_full_vs_timm": timed.overhead,
            "fastest": timings["split_full"].min_s / timings["timm"].min_s - 1.0,
        },
        warnings=_load_warnings(timed.others_cores),
        memory=memory,
        checks={"split_full_vs_timm_max_abs_logit_diff": full_diff},
        targets=_forward_targets(points, timed, _speed_targets(dev)),
    )


# ---------------------------------------------------------------------- report
def _timing_label(name: str) -> str:
    """How the report names a timed callable or a probed model."""
    if name == "timm":
        return "timm ViT (full res)"
    if name == "split_full":
        return "SplitViT full"
    if name.startswith("seq/"):
        return f"timm encoder, fixed {name[4:]} tokens"
    if name.startswith("policy/"):
        return f"{name[7:]} split_scores"
    key, _, part = name.partition("/")
    return f"SplitViT {key}" + (f" {part.replace('_b', ' buckets=')}" if part else "")


def _report_header(result: ForwardReport) -> list[str]:
    """Where and what was measured: machine, load, model, operating-point method."""
    cfg, mach, others = result.config, result.machine, result.others_cores
    return [
        f"SPLIT forward benchmark: {device_label(mach)}, {mach.torch_threads} torch threads, "
        f"torch {mach.torch_version}, "
        f"timm {mach.timm_version}, {'bf16 autocast' if cfg.autocast_bf16 else 'fp32'}; other processes used "
        + (f"{others:.2f}" if others is not None else "?")
        + f" CPUs while timing (1-min load average {result.load_average_start[0]:.2f} at start, "
        f"{mach.load_average_end[0]:.2f} at end)",
        f"model {cfg.model_name} (dim {cfg.embed_dim}, depth {cfg.depth}, heads {cfg.num_heads}), "
        f"{cfg.image_size} px, fine patch {cfg.patch_size} px, L={cfg.levels} levels (coarse patch "
        f"{cfg.coarse_patch_size} px), N_full={cfg.full_tokens}, N_min={cfg.min_tokens}, "
        f"batch {cfg.batch_size}",
        f"learned policy: own blocks of width {cfg.policy_width}, depth {cfg.policy_depth}; learned_shared: "
        f"the ViT's first {cfg.policy_depth} blocks; median of {cfg.repeats} interleaved rounds after "
        f"{cfg.warmup} warm-up; inference_mode; thresholds calibrated on the batch"
        + (f"; packed sizes in {cfg.token_buckets} fixed buckets" if cfg.token_buckets else "")
        + ("; split policies with fine-patch aggregation" if cfg.fine_aggregation else "")
        + ("; learned policies score every finer level in context" if cfg.level_context else "")
        + ("; torch.compile (timm, ideal encoder, packed encoders; SplitViT full eager)" if cfg.compile else ""),
        "",
    ]


def _timings_lines(timings: dict[str, TimingSummary]) -> list[str]:
    """One row per timed callable: median, range, images/s, ratio to timm."""
    base = timings["timm"].median_s
    rows = [
        [
            _timing_label(name),
            f"{t.median_s * 1e3:.1f}",
            f"{t.min_s * 1e3:.1f}-{t.max_s * 1e3:.1f}",
            f"{t.images_per_s:.1f}",
            f"{base / t.median_s:.2f}x",
        ]
        for name, t in timings.items()
    ]
    return text_table(["timed", "ms/batch", "min-max ms", "img/s", "vs timm"], rows)


def _points_lines(result: ForwardReport) -> list[str]:
    """One row per operating point (tokens, speed-ups, ideal, breakdown), the
    definitions, and the full policy's logit check."""
    rows = []
    parts = ("policy", "embedding_gather_head", "attention_packing", "blocks_fixed_length")
    for p in result.points:
        b, tokens = p.breakdown_s, p.tokens
        rows.append(
            [
                p.policy,
                f"{p.target_ratio:.2f}",
                f"{tokens.mean:.1f} ({tokens.min}-{tokens.max})",
                f"{p.token_ratio:.3f}",
                f"{p.images_per_s:.1f}",
                f"{p.speedup_vs_timm:.2f}x",
                f"{p.ideal_speedup:.2f}x",
                f"{p.efficiency:.0%}",
                f"{p.outside_blocks_share:.1%}",
                " / ".join(f"{b[k] * 1e3:.1f}" for k in parts),
                ", ".join(f"{k} {v:.2f}x" for k, v in p.padded_speedup_vs_timm.items()),
            ]
        )
    lines = text_table(
        [
            "policy",
            "ratio",
            "tokens/img (min-max)",
            "token ratio",
            "img/s",
            "vs timm",
            "ideal",
            "of ideal",
            "outside blocks",
            "ms: policy / embed+gather+head / attn+packing / blocks",
            "padded",
        ],
        rows,
    )
    diff = result.checks["split_full_vs_timm_max_abs_logit_diff"]
    return lines + [
        f"ideal = {IDEAL_DEFINITION}",
        f"time breakdown: {BREAKDOWN_DEFINITION}",
        f"check: SplitViT(full) vs timm max |logit diff| = {diff:.3g}",
    ]


def _targets_lines(result: ForwardReport) -> list[str]:
    """The targets marked PASS or MISS, the checks beside the medians, and warnings."""
    points = result.points
    lines = target_table(result.targets)
    lines.append(
        "checks on the medians: speed-up vs timm from each model's fastest round: "
        + ", ".join(f"{p.key} {p.speedup_fastest:.2f}x" for p in points)
        + "; from median process CPU time: "
        + ", ".join(f"{p.key} {p.speedup_cpu_time:.2f}x" for p in points)
    )
    return lines + [f"WARNING: {warning}" for warning in result.warnings]


def _memory_lines(mem: MemoryFigures | None, ratio: float) -> list[str]:
    """Part d: peak memory per model and method, as MiB and ratio to timm; none
    without memory figures."""
    if mem is None or not mem.models:
        return []
    columns = [
        (key, label)
        for key, label in (("rss_growth", "rss"), ("profiler_peak", "profiler"), ("cuda_growth", "cuda"))
        if label in mem.methods
    ]
    base = mem.models.get("timm", {})
    rows = []
    for name, m in mem.models.items():
        row = [_timing_label(name)]
        for key, _ in columns:
            share = f" ({m[key] / base[key]:.2f}x)" if base.get(key) else ""
            row.append(f"{m[key] / 2**20:.1f}{share}")
        rows.append(row)
    lines = ["", f"d. peak memory of one batch forward pass (MiB; ratio to the timm ViT), at {ratio:.0%} tokens:"]
    lines += text_table(["model"] + [label for _, label in columns], rows)
    return lines + [f"  {method}: {text}" for method, text in mem.methods.items()]


def format_report(result: ForwardReport) -> str:
    """A readable report of :func:`run_forward_benchmark`'s result, targets marked
    PASS or MISS as measured."""
    lines = _report_header(result)
    lines += _timings_lines(result.timings) + [""]
    lines += _points_lines(result) + [""]
    lines += _targets_lines(result)
    lines += _memory_lines(result.memory, result.config.ratios[0])
    return "\n".join(lines)
