"""``splitvit bench train``: SPLIT's training throughput, Ray Train's overhead and the allocators, side by side.

One experiment config (:class:`~splitvit.config.ExperimentConfig`: model, synthetic
data, batch size, seed) drives both parts, measured in one run on one machine, with
the benchmarks' timer (:mod:`splitvit.bench.timing`) and targets (:mod:`splitvit.bench.report`).

**A. Training-step throughput.** The config's SplitViT (learned policy) and a
full-resolution twin sharing its backbone (``full`` policy) train on the same batch
(the training set's first), in interleaved rounds
(:func:`splitvit.bench.timing.time_interleaved`). Each timed call is one whole optimisation
step, as ``fit_local`` and the Ray loop run it: ``training_step`` (train/steps.py),
``zero_grad``, ``backward``, gradient clipping and ``AdamW.step``:

* ``full``: full resolution (policy ``full``), the baseline of every ratio;
* ``split_warmup``: SPLIT's random-split warm-up step at its last warm-up epoch
  (each image draws its split rate in ``[train.policy.warmup_min_split, 1]``);
* ``split_learned``: the learned-policy step: sampled decisions with straight-through
  gates, the budget penalty and the relevance teacher (a full-resolution
  gradient-saliency pass) on every ``train.teacher.every``-th step: each timed call
  runs that many consecutive steps (one teacher step and the rest without) and
  counts as their mean; with ``train.teacher.every > 1``, ``split_learned_every_step``
  times the step with the teacher on every step beside it;
* ``timm``: the plain timm ViT's step (forward, cross-entropy, backward, clip, AdamW),
  a check on ``full``;
* ``teacher``: ``SplitViT.relevance`` alone: the teacher's share of the learned step.

Before timing, one offset added to the learned policy's output biases is bisected so
the policy's expected token count on the batch is ``train.budget.target_ratio`` of
``N_full``: the operating point the budget penalty trains towards (an untrained
policy would sit anywhere). The learning rate is 0, so every round times the same
weights at the same operating point; a step's cost does not depend on the learning
rate's value. Reported per step: images per second (batch / median step time), the
ratio to ``full``, the token fraction measured over the timed steps, and the ideal
ratio ``1 / token fraction`` (a step whose cost is proportional to its tokens).

**B. Ray Train's overhead.** The same config trained from scratch twice: by
:func:`~splitvit.train.local.fit_local` in this process (the plain PyTorch loop) and
by :func:`~splitvit.train.ray_trainer.run_training` (Ray Train ``TorchTrainer``, one
worker, so no DDP wrapper). Both use the same number of CPU threads: the worker asks
Ray for that many CPUs (Ray sets its ``OMP_NUM_THREADS`` from them), this process
calls ``torch.set_num_threads``; an epoch hook records the worker's thread counts
(and sets torch's if they differ, saying so). What is compared:

* *steady-state images/s* (the target, Ray >= 0.9x plain): training images over
  training-loop time (both loops time the same thing: batches, steps and optimiser,
  not validation), summed over the epochs after the first ``skip_epochs`` (the
  first holds one-off costs and, with ``train.policy.warmup_epochs: 1``, is the warm-up);
* *epoch incl. validation*: the training loop plus threshold calibration and
  validation, which both runs do after every epoch (the plain run does them in its
  ``on_epoch`` callback, as the Ray loop does, and also saves the model weights);
* *end to end*: the plain run from model build to its last epoch; the Ray run's
  ``run_training`` call (worker start-up, data, epochs, checkpoints with optimizer
  and RNG state, ``ray.train.report`` and its commit barrier) plus Ray's own
  start-up when this benchmark started Ray.

MLflow tracking is off in both (``--tracking`` turns it on for the Ray run only,
and the end-to-end figure then includes it); bf16 autocast is off in both; the data
loaders use no worker processes in either. With ``rounds`` > 1 the two runs
alternate (plain, Ray, Ray, plain, ...). When this benchmark starts Ray, it shuts
it down after every Ray run, so the plain loop never shares the machine with an
idle Ray; under an existing Ray (a Ray job, the tests) it cannot, and says so.

**C. The memory allocator** (``parts`` ``allocators``, not run by default): the plain
loop trains the full-resolution control and the SPLIT config from scratch under each
allocator, each run in a child process started with that allocator
(:mod:`splitvit.bench.allocators`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ..config import AUTO_THRESHOLDS, ExperimentConfig
from ..jsontypes import JsonObject
from ..model import SplitViT
from ..model.quadtree import expected_tokens
from ..train.experiment import build_model, experiment_datasets, experiment_from_dict
from .allocators import AllocatorReport, choose_allocators, format_allocator_lines, run_allocator_benchmark
from .records import MachineInfo, PolicyAim, without_unset
from .report import RoundRatios, Target, device_label, make_target, target_table, text_table
from .timing import (
    OTHER_LOAD_WARNING,
    checked_device,
    cpu_busy_seconds,
    machine_info,
    synchronizer,
    time_beside_others,
    timing_summary,
)

if TYPE_CHECKING:
    from ..train.steps import SplitLossConfig

log = logging.getLogger(__name__)

#: Issue #3's target: Ray Train's steady-state images per second with one worker, as a
#: fraction of the plain single-process loop's on the same model and data.
RAY_OVERHEAD_TARGET = 0.9
STEP_NAMES = ("timm", "full", "split_warmup", "split_learned", "split_learned_every_step", "teacher")
#: ``bench train``'s parts: A (training steps), B (Ray Train's overhead), C (allocators)
TRAIN_PARTS = ("steps", "ray", "allocators")


# ---------------------------------------------------------------------- config
def benchmark_config(
    *,
    model_name: str = "vit_tiny_patch16_224",
    timm_kwargs: dict[str, Any] | None = None,
    image_size: int = 96,
    patch_size: int = 8,
    levels: int = 3,
    policy_depth: int = 2,
    policy_width: int | None = None,
    teacher: str = "gradient",
    teacher_every: int = 1,
    num_classes: int = 4,
    batch_size: int = 32,
    epochs: int = 3,
    train_samples: int = 192,
    val_samples: int = 64,
    target_ratio: float = 0.5,
    seed: int = 0,
    recipe: str = "none",
) -> ExperimentConfig:
    """The benchmark's experiment: a timm ViT (``timm_kwargs`` shrink it) as a learned
    SplitViT on the synthetic object-among-clutter task, one warm-up epoch then the
    learned policy; validated like any experiment config. ``recipe``: none by default,
    so that the step is the one these arguments describe (the teacher, its cadence, the
    policy's depth) and a figure says what it timed; a recipe's name adds its settings
    where these arguments leave a key unset (fine aggregation, level context, targets)."""
    raw = {
        "recipe": recipe,
        "model": {
            "name": model_name,
            "timm_kwargs": {**(timm_kwargs or {}), "patch_size": patch_size},
            "image_size": image_size,
            "levels": levels,
            "policy": {"kind": "learned", "depth": policy_depth, "width": policy_width},
            "thresholds": AUTO_THRESHOLDS,
            "num_classes": num_classes,
        },
        "data": {
            "name": "synthetic",
            "options": {"train_samples": train_samples, "val_samples": val_samples},
            "batch_size": batch_size,
            "seed": seed,
        },
        "train": {
            "epochs": epochs,
            "budget": {"target_ratio": target_ratio},
            "policy": {"warmup_epochs": 1},
            "amp": False,
            "teacher": {"kind": teacher, "every": teacher_every},
        },
        "tracking": {"enabled": False},
        "storage": {"name": "bench-train"},
    }
    return experiment_from_dict(raw)


def _first_batch(config: ExperimentConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The training set's first batch (images, labels): Part A's batch."""
    from ..data import build_dataset

    mc, dc = config.model, config.data
    data = build_dataset(dc.name, "train", image_size=mc.image_size, seed=dc.seed, **dc.options)
    if len(data) < dc.batch_size:
        raise ValueError(f"the training set has {len(data)} images, fewer than one batch of {dc.batch_size}")
    batch = next(iter(DataLoader(data, batch_size=dc.batch_size, shuffle=False)))
    return batch[0], batch[1]


# ---------------------------------------------------------------------- part A
@torch.no_grad()
def aim_learned_policy(
    model: SplitViT,
    images: torch.Tensor,
    target_ratio: float,
    iterations: int = 30,
) -> PolicyAim:
    """Shift the learned policy's output biases by one offset so that its expected
    token count on ``images`` is ``target_ratio`` of ``N_full`` (bisection: a larger
    offset raises every split probability). Returns the offset and the reached ratio;
    a policy without per-level ``heads`` ending in a linear layer is left alone."""
    heads = getattr(model.policy, "heads", None)
    lasts = []
    for head in heads or []:
        linears = [m for m in head.modules() if isinstance(m, nn.Linear) and m.bias is not None]
        if linears:
            lasts.append(linears[-1])
    full_tokens = model.geometry_for(tuple(images.shape[-2:])).full_tokens

    def ratio() -> float:
        return float(expected_tokens(model.split_scores(images)).mean()) / full_tokens

    if not lasts or len(lasts) != len(heads):
        log.warning(
            "bench train: the learned policy has no per-level linear output; its operating point is left as it is"
        )
        return PolicyAim(offset=None, expected_ratio=ratio())
    base = [linear.bias.detach().clone() for linear in lasts]

    def set_offset(offset: float) -> float:
        for linear, b in zip(lasts, base):
            linear.bias.copy_(b + offset)
        return ratio()

    lo, hi = -30.0, 30.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if set_offset(mid) < target_ratio:
            lo = mid
        else:
            hi = mid
    offset = min((lo, hi), key=lambda o: abs(set_offset(o) - target_ratio))
    return PolicyAim(offset=offset, expected_ratio=set_offset(offset))


def _optimizer_step(
    params: list[nn.Parameter],
    compute: Callable[[], tuple[torch.Tensor, dict[str, float]]],
    grad_clip: float,
    weight_decay: float,
    record: list[dict[str, float]],
) -> Callable[[], None]:
    """One whole optimisation step as the training loops run it, with its own AdamW
    (learning rate 0: the weights, and so the operating point, stay put)."""
    optimizer = torch.optim.AdamW(params, lr=0.0, weight_decay=weight_decay)
    clip = grad_clip if grad_clip > 0 else math.inf

    def step() -> None:
        loss, stats = compute()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        record.append(stats)

    return step


#: Part A's curriculum: two warm-up epochs, the warm-up step timed at the second (the
#: first is full resolution) and the learned-policy step at the epoch after them.
_WARMUP_EPOCHS, _WARM_EPOCH, _POLICY_EPOCH = 2, 1, 2

StepFn = Callable[[], tuple[torch.Tensor, dict[str, float]]]


@dataclasses.dataclass
class _StepWorkload:
    """Part A's models and batch on one device: the config's learned SplitViT, its
    full-resolution twin (``full`` policy, the same backbone), the training set's
    first batch, the loss of the timed steps and where the policy was aimed."""

    model: SplitViT
    full: SplitViT
    images: torch.Tensor
    target: torch.Tensor
    full_tokens: int
    loss_cfg: SplitLossConfig
    aim: PolicyAim


def _step_names(include: tuple[str, ...], teacher_every: int) -> list[str]:
    """The steps to time, in :data:`STEP_NAMES`' order; ``full`` always (every ratio's
    baseline), ``split_learned_every_step`` only when it differs from ``split_learned``."""
    unknown = set(include) - set(STEP_NAMES)
    if unknown:
        raise ValueError(f"unknown step(s) {', '.join(sorted(unknown))}; expected some of {', '.join(STEP_NAMES)}")
    names = [n for n in STEP_NAMES if n in include or n == "full"]
    if teacher_every == 1:
        names = [n for n in names if n != "split_learned_every_step"]  # it would be split_learned itself
    return names


def _build_step_workload(config: ExperimentConfig, dev: torch.device) -> _StepWorkload:
    """Step 1: the models on ``dev``, the batch, and the learned policy aimed at
    ``train.budget.target_ratio`` (:func:`aim_learned_policy`)."""

    mc, tc = config.model, config.train
    torch.manual_seed(config.data.seed)
    model = build_model(mc).to(dev).train()
    if not model.policy.learned:
        raise ValueError(f"part A needs model.policy.kind learned, got {mc.policy.kind!r}")
    full = (
        SplitViT(
            model.vit,
            levels=mc.levels,
            policy=dataclasses.replace(mc.policy, kind="full"),
            image_size=mc.image_size,
            task=mc.task,
        )
        .to(dev)
        .train()
    )
    images, target = (t.to(dev) for t in _first_batch(config))
    loss = tc.loss_config()
    loss_cfg = dataclasses.replace(loss, policy=dataclasses.replace(loss.policy, warmup_epochs=_WARMUP_EPOCHS))
    aim = aim_learned_policy(model, images, tc.budget.target_ratio)
    log.info("bench train: learned policy aimed at %.2f tokens: %s", tc.budget.target_ratio, aim)
    return _StepWorkload(
        model=model,
        full=full,
        images=images,
        target=target,
        loss_cfg=loss_cfg,
        aim=aim,
        full_tokens=model.geometry_for(tuple(images.shape[-2:])).full_tokens,
    )


def _step_losses(work: _StepWorkload, cycle: int, seed: int) -> dict[str, StepFn]:
    """Each step's loss and statistics, as the training loops compute them."""
    from ..train.steps import training_step

    model, full, images, target, loss_cfg = work.model, work.full, work.images, work.target, work.loss_cfg
    generator = torch.Generator().manual_seed(seed + 1)
    every_step = dataclasses.replace(loss_cfg, teacher=dataclasses.replace(loss_cfg.teacher, every=1))
    step_index = itertools.count()
    return {
        "full": lambda: training_step(full, images, target, loss_cfg, _POLICY_EPOCH, generator),
        "split_warmup": lambda: training_step(model, images, target, loss_cfg, _WARM_EPOCH, generator),
        "split_learned": lambda: training_step(
            model, images, target, loss_cfg, _POLICY_EPOCH, generator, next(step_index) % cycle
        ),
        "split_learned_every_step": lambda: training_step(model, images, target, every_step, _POLICY_EPOCH, generator),
        "timm": lambda: (lambda loss: (loss, {"token_ratio": 1.0}))(F.cross_entropy(model.vit(images), target)),
    }


def _step_callables(
    work: _StepWorkload,
    names: list[str],
    config: ExperimentConfig,
    autocast_bf16: bool,
    dev: torch.device,
) -> tuple[dict[str, Callable[[], Any]], dict[str, list[dict[str, float]]], dict[str, int]]:
    """Step 2: one timed callable per step (``split_learned``: a whole teacher cycle of
    steps), the statistics each step records, and the steps per call."""
    cycle, tc = config.train.teacher.every, config.train
    losses = _step_losses(work, cycle, config.data.seed)
    split_params = list(work.model.parameters())
    params = {
        "full": list(work.full.parameters()),
        "split_warmup": split_params,
        "split_learned": split_params,
        "split_learned_every_step": split_params,
        "timm": list(work.model.vit.parameters()),
    }
    records: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    steps_per_call = {name: cycle if name == "split_learned" else 1 for name in names}

    def under_autocast(fn: Callable[[], Any]) -> Callable[[], Any]:
        def wrapped() -> Any:
            with torch.autocast(dev.type, dtype=torch.bfloat16) if autocast_bf16 else nullcontext():
                return fn()

        return wrapped

    label = work.target if config.model.task == "classification" else None
    fns: dict[str, Callable[[], Any]] = {}
    for name in names:
        if name == "teacher":
            fns[name] = under_autocast(
                partial(work.model.relevance, work.images, work.loss_cfg.teacher.kind, target=label)
            )
        else:
            one = _optimizer_step(params[name], losses[name], tc.grad_clip, tc.weight_decay, records[name])
            fns[name] = under_autocast((lambda f, n: lambda: [f() for _ in range(n)])(one, steps_per_call[name]))
    return fns, records, steps_per_call


def _time_steps(
    fns: dict[str, Callable[[], Any]],
    steps_per_call: dict[str, int],
    *,
    rounds: int,
    warmup: int,
    dev: torch.device,
) -> tuple[dict[str, list[float]], dict[str, list[float]], float | None]:
    """Step 3: wall and CPU seconds per step, interleaved (a call of n steps counts as
    their mean step), and the CPUs other processes used meanwhile."""
    log.info("bench train: timing %d training steps, %d warm-up + %d rounds", len(fns), warmup, rounds)
    samples, cpu_samples, others = time_beside_others(fns, repeats=rounds, warmup=warmup, sync=synchronizer(dev))
    for name, n in steps_per_call.items():
        samples[name] = [t / n for t in samples[name]]
        cpu_samples[name] = [t / n for t in cpu_samples[name]]
    return samples, cpu_samples, others


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Part A's figures of one training step: its timing (:func:`~splitvit.bench.timing.timing_summary`),
    the tokens it kept and its ratios to the full-resolution step."""

    median_s: float
    min_s: float
    max_s: float
    images_per_s: float  # at the median
    samples_s: list[float]
    cpu_median_s: float  # process CPU seconds per step
    cpu_samples_s: list[float]
    token_fraction: float | None  # over the timed steps (None: the teacher's full-resolution pass)
    tokens_per_image: float | None
    ideal_ratio: float | None  # 1 / token_fraction
    ratio_to_full: float  # medians
    ratio_to_full_fastest: float  # fastest rounds
    ratio_to_full_cpu_time: float | None  # median CPU seconds (None: none measured)
    per_round: RoundRatios  # the per-round ratio to full
    share_of_split_learned: float | None = None  # the teacher alone: its share of the learned step

    def to_dict(self) -> JsonObject:
        """Its part of the JSON (``steps``): ``share_of_split_learned`` only for the teacher."""
        return without_unset(dataclasses.asdict(self), ("share_of_split_learned",))


def _step_figures(
    samples: dict[str, list[float]],
    cpu_samples: dict[str, list[float]],
    records: dict[str, list[dict[str, float]]],
    steps_per_call: dict[str, int],
    *,
    warmup: int,
    batch: int,
    full_tokens: int,
) -> dict[str, StepTiming]:
    """Step 4: per step its timing summary, token fraction over the timed steps, the
    ideal ratio, and its ratios to ``full`` (medians, fastest rounds, CPU time, per round)."""
    summaries = {name: timing_summary(s, cpu_samples[name], batch) for name, s in samples.items()}
    ref = summaries["full"]
    steps: dict[str, StepTiming] = {}
    for name, t in summaries.items():
        timed = records[name][warmup * steps_per_call.get(name, 1) :] if records[name] else []
        fraction = statistics.fmean(r["token_ratio"] for r in timed) if timed else 1.0
        rounds_ratio = [f / x for f, x in zip(samples["full"], samples[name])]
        steps[name] = StepTiming(
            **dataclasses.asdict(t),
            token_fraction=fraction,
            tokens_per_image=fraction * full_tokens,
            ideal_ratio=1.0 / fraction,
            ratio_to_full=ref.median_s / t.median_s,
            ratio_to_full_fastest=ref.min_s / t.min_s,
            ratio_to_full_cpu_time=ref.cpu_median_s / t.cpu_median_s if t.cpu_median_s > 0 else None,
            per_round=RoundRatios.of(rounds_ratio),
        )
    if "teacher" in steps and "split_learned" in steps:
        teacher = steps["teacher"]
        steps["teacher"] = dataclasses.replace(
            teacher,
            share_of_split_learned=teacher.median_s / steps["split_learned"].median_s,
            # a full-resolution pass, not a training step at some token count
            token_fraction=None,
            tokens_per_image=None,
            ideal_ratio=None,
        )
    return steps


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Part A's ``config``: how the steps were timed, and what each SPLIT step does."""

    batch_size: int
    rounds: int
    warmup: int
    autocast_bf16: bool
    learning_rate: float
    warmup_step: str  # in words
    policy_step: str  # in words
    policy_aim: PolicyAim
    images: str


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Part A's result (:func:`run_step_benchmark`): how and under what load the steps
    were timed, and every step's figures."""

    config: StepConfig
    load_average_start: list[float]
    load_average_end: list[float]
    other_processes_cpus_during_timing: float | None  # None: unknown
    steps: dict[str, StepTiming]
    warnings: list[str]

    def to_dict(self) -> JsonObject:
        """Its part of the JSON (``steps``)."""
        data = dataclasses.asdict(self)
        data["steps"] = {name: timing.to_dict() for name, timing in self.steps.items()}
        return data


def _step_config(work: _StepWorkload, *, rounds: int, warmup: int, autocast_bf16: bool) -> StepConfig:
    """Part A's ``config``: how the steps were timed, and what each SPLIT step does."""
    loss_cfg = work.loss_cfg
    return StepConfig(
        batch_size=work.images.shape[0],
        rounds=rounds,
        warmup=warmup,
        autocast_bf16=autocast_bf16,
        learning_rate=0.0,
        warmup_step=f"epoch {_WARM_EPOCH} of {loss_cfg.policy.warmup_epochs} warm-up epochs: split rates in "
        f"[{loss_cfg.policy.warmup_min_split}, 1]",
        policy_step=f"epoch {_POLICY_EPOCH}: sampled decisions, budget penalty (lambda {loss_cfg.budget.weight}, "
        f"target {loss_cfg.budget.target_ratio}, {loss_cfg.budget.penalty}), teacher {loss_cfg.teacher.kind} "
        f"(weight {loss_cfg.teacher.weight}, every {loss_cfg.teacher.every} step(s))",
        policy_aim=work.aim,
        images="the training set's first batch",
    )


def run_step_benchmark(
    config: ExperimentConfig,
    *,
    rounds: int = 6,
    warmup: int = 1,
    device: str = "cpu",
    autocast_bf16: bool = False,
    include: tuple[str, ...] = STEP_NAMES,
) -> StepReport:
    """Part A (see the module doc): images/s of full-resolution and SPLIT training
    steps on the same model and batch, interleaved.

    Args:
        config: the experiment (model, data, ``train.budget.target_ratio``, ``train.grad_clip``,
            ``train.weight_decay``, the SPLIT objective).
        rounds, warmup: timed and untimed interleaved rounds.
        device: ``cpu`` or ``cuda`` (``cuda:N``).
        autocast_bf16: run the steps under bf16 autocast (the Ray loop does on CUDA).
        include: which of :data:`STEP_NAMES` to time (``full`` always is).
    """
    dev = checked_device(device)
    names = _step_names(include, config.train.teacher.every)
    load_start = list(os.getloadavg())
    work = _build_step_workload(config, dev)
    fns, records, steps_per_call = _step_callables(work, names, config, autocast_bf16, dev)
    samples, cpu_samples, others = _time_steps(fns, steps_per_call, rounds=rounds, warmup=warmup, dev=dev)
    steps = _step_figures(
        samples,
        cpu_samples,
        records,
        steps_per_call,
        warmup=warmup,
        batch=work.images.shape[0],
        full_tokens=work.full_tokens,
    )
    warnings = []
    if others is not None and others > OTHER_LOAD_WARNING:
        warnings.append(
            f"part A: other processes used {others:.2f} of the {os.cpu_count()} CPUs on average while the "
            f"steps were timed: wall-clock ratios are noisy; see the fastest-round and CPU-time ratios"
        )
    return StepReport(
        config=_step_config(work, rounds=rounds, warmup=warmup, autocast_bf16=autocast_bf16),
        load_average_start=load_start,
        load_average_end=list(os.getloadavg()),
        other_processes_cpus_during_timing=others,
        steps=steps,
        warnings=warnings,
    )


# ---------------------------------------------------------------------- part B
@dataclasses.dataclass(frozen=True)
class WorkerThreads:
    """The Ray worker's thread settings at its first epoch, as :class:`WorkerProbe` found them."""

    pid: int
    omp_num_threads: str | None  # its OMP_NUM_THREADS (None: unset)
    torch_threads_found: int
    torch_threads: int  # after the probe set them (``forced``) where they differed
    interop_threads: int
    forced: bool


class WorkerProbe:
    """Epoch hook for the Ray run, on rank 0: at the first epoch it records the
    worker's thread settings (``OMP_NUM_THREADS``, torch's intra-op and inter-op
    threads) and sets torch's thread count to ``threads`` if it differs (recorded as
    ``forced``); at every epoch's start it records the wall clock and the process's
    CPU time (all its threads). Rewrites it all as JSON to ``uri`` (local or
    ``s3://``, where the driver reads it) each time."""

    def __init__(self, uri: str, threads: int) -> None:
        self.uri, self.threads = uri, threads
        self.found: WorkerThreads | None = None
        self.epoch_starts: list[dict[str, float]] = []

    def __call__(self, epoch: int, rank: int, model: nn.Module) -> None:
        if rank != 0:
            return
        from ..storage.uri import write_bytes

        if self.found is None:
            found = torch.get_num_threads()
            if found != self.threads:
                torch.set_num_threads(self.threads)
            self.found = WorkerThreads(
                pid=os.getpid(),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                torch_threads_found=found,
                torch_threads=torch.get_num_threads(),
                interop_threads=torch.get_num_interop_threads(),
                forced=found != self.threads,
            )
        self.epoch_starts.append({"epoch": epoch, "wall": time.perf_counter(), "cpu": time.process_time()})
        info = {**dataclasses.asdict(self.found), "epoch_starts": self.epoch_starts}
        write_bytes(self.uri, json.dumps(info).encode())


@dataclasses.dataclass
class EpochFigures:
    """One epoch of a part-B run: its training images and seconds, and, where both
    its ends were marked, the whole epoch (:func:`_whole_epochs`)."""

    epoch: int
    images: int
    train_s: float  # the training loop's seconds (images / its images/s)
    images_per_s: float
    epoch_s: float  # the training loop, threshold calibration and validation
    save_s: float | None  # the plain run's model save (None: a Ray run, whose checkpoint is in its epoch)
    token_ratio: float | None  # in training
    val_token_ratio: float | None  # in validation
    whole_epoch_s: float | None = None  # start to the next epoch's start (None: not marked at both ends)
    whole_epoch_cpu_s: float | None = None

    def to_dict(self) -> JsonObject:
        """Its part of the JSON: ``save_s`` and the whole epoch only where measured."""
        data = dataclasses.asdict(self)
        for key in ("save_s", "whole_epoch_s", "whole_epoch_cpu_s"):
            if data[key] is None:
                del data[key]
        return data


@dataclasses.dataclass(frozen=True)
class SteadyFigures:
    """Images over training-loop seconds, summed over the epochs after the skipped ones."""

    epochs: list[int]
    images: int
    train_s: float
    images_per_s: float


@dataclasses.dataclass
class PlainRun:
    """Part B's plain loop (``fit_local``) run: its epochs and what it cost."""

    epochs: list[EpochFigures]
    wall_s: float
    interop_threads: int
    machine_busy_cpus: float | None  # the whole machine's busy CPUs meanwhile (None: unknown)
    this_process_cpus: float
    steady: SteadyFigures | None = None  # set by the pair (:func:`_steady`)

    @property
    def end_to_end_s(self) -> float:
        """The run's wall seconds (nothing to start before it)."""
        return self.wall_s

    def to_dict(self) -> JsonObject:
        """Its part of the JSON."""
        return _run_dict(self)


@dataclasses.dataclass
class RayRun:
    """Part B's Ray Train run (``run_training``, one worker): its epochs and what it cost."""

    epochs: list[EpochFigures]
    wall_s: float
    ray_start_s: float  # Ray's start-up, when started here (else 0)
    end_to_end_s: float
    started_ray: bool
    worker_threads: WorkerThreads | None  # what the worker's probe wrote (None: unreadable)
    machine_busy_cpus: float | None
    this_process_cpus: float
    steady: SteadyFigures | None = None  # set by the pair (:func:`_steady`)

    def to_dict(self) -> JsonObject:
        """Its part of the JSON."""
        return _run_dict(self)


def _run_dict(run: PlainRun | RayRun) -> JsonObject:
    """A run's JSON: its fields in order, the epochs each as :meth:`EpochFigures.to_dict`."""
    data = dataclasses.asdict(run)
    data["epochs"] = [e.to_dict() for e in run.epochs]
    return data


@dataclasses.dataclass(frozen=True)
class OverheadPair:
    """One round of part B: the plain and the Ray run, in the order they ran, and Ray's
    steady images/s over the plain loop's."""

    order: tuple[str, str]
    plain: PlainRun
    ray: RayRun
    ratio: float

    def run(self, kind: str) -> PlainRun | RayRun:
        """The ``plain`` or the ``ray`` run."""
        return self.plain if kind == "plain" else self.ray

    def to_dict(self) -> JsonObject:
        """Its part of the JSON (``runs``): the runs under their kinds, in the order they ran."""
        runs = {kind: self.run(kind).to_dict() for kind in self.order}
        return {"order": list(self.order), **runs, "ratio": self.ratio}


@dataclasses.dataclass(frozen=True)
class OverheadTotal:
    """One kind of run (plain or Ray) over every round (:func:`_overhead_total`)."""

    steady_images_per_s: float
    steady_epoch_incl_validation_s: float
    whole_epoch_s: float | None
    whole_epoch_cpu_s: float | None
    whole_epochs: int
    end_to_end_s: float
    end_to_end_images_per_s: float


@dataclasses.dataclass(frozen=True)
class OverheadFigures:
    """Both kinds' totals and Ray's speed relative to the plain loop (> 1: Ray faster)."""

    plain: OverheadTotal
    ray: OverheadTotal
    ratio_steady: float
    ratio_epoch_incl_validation: float
    ratio_whole_epoch: float | None
    ratio_whole_epoch_cpu_time: float | None
    ratio_end_to_end: float

    def to_dict(self) -> JsonObject:
        """Its keys of part B's JSON."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RayOverheadConfig:
    """Part B's ``config``: the experiment as run and how the pairs were run."""

    experiment: ExperimentConfig  # the first round's config (its JSON redacted: :meth:`to_dict`)
    threads: int
    device: str
    rounds: int
    skip_epochs: int
    tracking: bool
    ray_already_running: bool
    ray_train_health_check_interval_s: float

    def to_dict(self) -> JsonObject:
        """Its JSON: the fields in order, the experiment as :meth:`ExperimentConfig.to_dict` redacts it."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**data, "experiment": self.experiment.to_dict(redact=True)}


@dataclasses.dataclass(frozen=True)
class RayOverheadReport:
    """Part B's result (:func:`run_ray_overhead_benchmark`): every plain/Ray pair, both
    kinds' totals, the target and what each figure includes."""

    config: RayOverheadConfig
    worker_threads: WorkerThreads | None  # the first Ray run's that could be read
    load_average_start: list[float]
    load_average_end: list[float]
    runs: list[OverheadPair]
    figures: OverheadFigures  # written at the top level of part B's JSON
    target: Target
    included: dict[str, str]  # per figure, what it includes, in words
    warnings: list[str]

    def to_dict(self) -> JsonObject:
        """Its part of the JSON (``ray_overhead``)."""
        return {
            "config": self.config.to_dict(),
            "worker_threads": None if self.worker_threads is None else dataclasses.asdict(self.worker_threads),
            "load_average_start": self.load_average_start,
            "load_average_end": self.load_average_end,
            "runs": [p.to_dict() for p in self.runs],
            **self.figures.to_dict(),
            "target": self.target.to_dict(),
            "included": self.included,
            "warnings": self.warnings,
        }


def _whole_epochs(marks: list[dict[str, float]], epochs: list[EpochFigures]) -> None:
    """Add each epoch's whole wall and CPU seconds (start to next epoch's start:
    training, validation, checkpoint, and the Ray loop's report) where both ends
    were marked."""
    by_epoch = {m["epoch"]: m for m in marks}
    for e in epochs:
        a, b = by_epoch.get(e.epoch), by_epoch.get(e.epoch + 1)
        if a is not None and b is not None:
            e.whole_epoch_s, e.whole_epoch_cpu_s = b["wall"] - a["wall"], b["cpu"] - a["cpu"]


def overhead_config(
    config: ExperimentConfig,
    *,
    threads: int,
    device: str,
    storage: str,
    name: str,
    tracking: bool = False,
    tracking_uri: str | None = None,
) -> ExperimentConfig:
    """``config`` as part B runs it: one worker with ``threads`` CPUs (and a GPU on
    CUDA), no loader worker processes, no autocast, storage and run name given,
    MLflow only with ``tracking``; validated again."""
    raw = config.to_dict(redact=False)
    gpu = device.startswith("cuda")
    raw["scaling"] = {
        **raw["scaling"],
        "num_workers": 1,
        "use_gpu": gpu,
        "resources_per_worker": {"CPU": float(threads), **({"GPU": 1.0} if gpu else {})},
    }
    raw["data"]["num_workers"] = 0
    raw["train"]["amp"] = False
    raw["train"]["max_failures"] = 0
    raw["storage"] = {"path": storage, "name": name, "num_to_keep": None}
    raw["tracking"] = {**raw["tracking"], "enabled": bool(tracking), "tracking_uri": tracking_uri if tracking else None}
    return experiment_from_dict(raw)


def _steady(epochs: list[EpochFigures], skip: int) -> SteadyFigures:
    """Images over training-loop seconds, summed over the epochs after ``skip``."""
    kept = [e for e in epochs if e.epoch >= skip]
    images, seconds = sum(e.images for e in kept), sum(e.train_s for e in kept)
    return SteadyFigures(
        epochs=[e.epoch for e in kept],
        images=images,
        train_s=seconds,
        images_per_s=images / seconds if seconds > 0 else 0.0,
    )


def _epoch_pair(pair: OverheadPair, epoch: int) -> list[EpochFigures]:
    """Epoch ``epoch`` of both runs of a plain/Ray pair."""
    return [e for run in (pair.plain, pair.ray) for e in run.epochs if e.epoch == epoch]


def _busy() -> tuple[float | None, float, float]:
    return cpu_busy_seconds(), time.process_time(), time.perf_counter()


def _busy_since(start: tuple[float | None, float, float]) -> tuple[float | None, float]:
    """Average busy CPUs of the whole machine (``None``: unknown), and of this process, since ``start``."""
    busy, own, wall = _busy()
    elapsed = max(wall - start[2], 1e-9)
    machine = (busy - start[0]) / elapsed if busy is not None and start[0] is not None else None
    return machine, (own - start[1]) / elapsed


def _run_plain(config: ExperimentConfig, device: torch.device, folder: Path) -> PlainRun:
    """The config trained by ``fit_local``, with validation (and threshold calibration)
    and a model save after every epoch, as the Ray loop does."""
    from ..train.local import fit_config, validate

    mc, dc, tc = config.model, config.data, config.train
    start, wall = _busy(), time.perf_counter()
    torch.manual_seed(dc.seed * 1000)  # the Ray worker's seed for rank 0
    model = build_model(mc).to(device)
    train_set, val_set = experiment_datasets(config, model.data_config["interpolation"])
    val_loader = DataLoader(val_set, batch_size=dc.eval_batch_size or dc.batch_size, shuffle=False)
    per_batch = (len(train_set) // dc.batch_size) * dc.batch_size
    extras: list[dict[str, float]] = []
    marks = [{"epoch": 0, "wall": time.perf_counter(), "cpu": time.process_time()}]

    def after_epoch(epoch: int, stats: dict[str, float]) -> None:
        t0 = time.perf_counter()
        auto = mc.thresholds == AUTO_THRESHOLDS and model.policy.thresholded
        figures = validate(
            model,
            val_set,
            val_loader,
            num_classes=mc.num_classes,
            calibrate_to=tc.budget.target_ratio if auto else None,
            calibration_images=dc.eval_batch_size or dc.batch_size,
        )
        validated = time.perf_counter() - t0
        model.save(folder / f"epoch{epoch:04d}.pt", extra={"epoch": epoch, "metrics": {**stats, **figures}})
        extras.append({"validation_s": validated, "save_s": time.perf_counter() - t0 - validated, **figures})
        marks.append({"epoch": epoch + 1, "wall": time.perf_counter(), "cpu": time.process_time()})
        log.info(
            "bench train: plain run epoch %d: %s",
            epoch,
            {k: round(v, 4) for k, v in {**stats, **figures}.items() if isinstance(v, float)},
        )

    history = fit_config(model, train_set, config, on_epoch=after_epoch)
    wall = time.perf_counter() - wall
    epochs = []
    for stats, extra in zip(history, extras):
        train_s = per_batch / stats["images_per_s"]
        epochs.append(
            EpochFigures(
                epoch=int(stats["epoch"]),
                images=per_batch,
                train_s=train_s,
                images_per_s=stats["images_per_s"],
                epoch_s=train_s + extra["validation_s"],
                save_s=extra["save_s"],
                token_ratio=stats.get("token_ratio"),
                val_token_ratio=extra.get("token_ratio"),
            )
        )
    _whole_epochs(marks, epochs)
    machine, own = _busy_since(start)
    return PlainRun(epochs, wall, torch.get_num_interop_threads(), machine, own)


def _run_ray(config: ExperimentConfig, threads: int, ray_address: str | None) -> RayRun:
    """The config trained by ``run_training`` (one worker); per-epoch figures from
    the checkpoints' ``metrics.json``."""
    import ray

    from ..storage.uri import join_uri, read_bytes
    from ..train.checkpoints import METRICS_FILE, checkpoint_dir_name
    from ..train.ray_trainer import init_ray, run_training

    started_here = not ray.is_initialized()
    t0 = time.perf_counter()
    init_ray(ray_address)
    ray_start = time.perf_counter() - t0 if started_here else 0.0
    try:
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < threads:
            raise ValueError(f"the Ray cluster has {cpus:g} CPUs; the worker needs {threads} (pass fewer threads)")
        storage = config.storage.resolved_path()
        probe_uri = join_uri(storage, f"{config.storage.name}-worker-threads.json")
        start, wall = _busy(), time.perf_counter()
        result = run_training(config, epoch_hook=WorkerProbe(probe_uri, threads))
        wall = time.perf_counter() - wall
        busy = _busy_since(start)
    finally:
        if started_here:
            ray.shutdown()  # the next plain run must not share the machine with an idle Ray
    if result.status != "completed":
        raise RuntimeError(f"the Ray run stopped: {result.status}: {result.message}")
    from ..data import build_dataset

    dc, mc = config.data, config.model
    per_batch = (
        len(build_dataset(dc.name, "train", image_size=mc.image_size, seed=dc.seed, **dc.options)) // dc.batch_size
    ) * dc.batch_size
    epochs = []
    for epoch in range(config.train.epochs):
        metrics = json.loads(read_bytes(join_uri(config.storage.run_uri(), checkpoint_dir_name(epoch), METRICS_FILE)))
        ips = float(metrics["train_images_per_s"])
        train_s = per_batch / ips
        epochs.append(
            EpochFigures(
                epoch=epoch,
                images=per_batch,
                train_s=train_s,
                images_per_s=ips,
                epoch_s=float(metrics["epoch_time_s"]),
                save_s=None,
                token_ratio=metrics.get("train_token_ratio"),
                val_token_ratio=metrics.get("token_ratio"),
            )
        )
    try:
        probed = json.loads(read_bytes(probe_uri))
    except OSError:
        worker = None
    else:
        _whole_epochs(probed.pop("epoch_starts"), epochs)
        worker = WorkerThreads(**probed)
    return RayRun(epochs, wall, ray_start, ray_start + wall, started_here, worker, *busy)


def _overhead_threads(config: ExperimentConfig, *, threads: int | None, rounds: int, skip_epochs: int) -> int:
    """Part B's settings checked; the thread count of both runs."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not 0 <= skip_epochs < config.train.epochs:
        raise ValueError(f"skip_epochs must be in [0, train.epochs) = [0, {config.train.epochs}), got {skip_epochs}")
    threads = int(threads or torch.get_num_threads())
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return threads


def _overhead_pair(
    r: int,
    rounds: int,
    cfg: ExperimentConfig,
    *,
    dev: torch.device,
    threads: int,
    folder: Path,
    skip_epochs: int,
    ray_address: str | None,
) -> OverheadPair:
    """Round ``r``: the plain and the Ray run, in alternating order, and their ratio."""
    order = ("plain", "ray") if r % 2 == 0 else ("ray", "plain")
    plain: PlainRun | None = None
    ray: RayRun | None = None
    for kind in order:
        log.info("bench train: round %d/%d, %s run", r + 1, rounds, kind)
        if kind == "plain":
            folder.mkdir()
            plain = _run_plain(cfg, dev, folder)
        else:
            ray = _run_ray(cfg, threads, ray_address)
    assert plain is not None and ray is not None
    plain.steady, ray.steady = _steady(plain.epochs, skip_epochs), _steady(ray.epochs, skip_epochs)
    return OverheadPair(order, plain, ray, ray.steady.images_per_s / plain.steady.images_per_s)


def _overhead_runs(
    config: ExperimentConfig,
    *,
    threads: int,
    device: str,
    rounds: int,
    skip_epochs: int,
    tracking: bool,
    storage: str | None,
    ray_address: str | None,
) -> tuple[list[OverheadPair], ExperimentConfig]:
    """Every plain/Ray pair, in a temporary folder (the plain runs' models, and Ray's
    storage and MLflow store unless given); the pairs and the first run's config."""
    dev = torch.device(device)
    with tempfile.TemporaryDirectory(prefix="splitvit-bench-train-") as tmp:
        tmp_path = Path(tmp)
        store = storage or str(tmp_path / "ray")
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{tmp_path}/mlflow.db"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        configs = [
            overhead_config(
                config,
                threads=threads,
                device=device,
                storage=store,
                name=f"bench-ray-{stamp}-{r}",
                tracking=tracking,
                tracking_uri=uri,
            )
            for r in range(rounds)
        ]
        runs = [
            _overhead_pair(
                r,
                rounds,
                cfg,
                dev=dev,
                threads=threads,
                folder=tmp_path / f"plain-{r}",
                skip_epochs=skip_epochs,
                ray_address=ray_address,
            )
            for r, cfg in enumerate(configs)
        ]
    return runs, configs[0]


def _overhead_total(runs: list[OverheadPair], kind: str, skip_epochs: int) -> OverheadTotal:
    """One kind of run (``plain`` or ``ray``) over all rounds: steady images/s, epoch
    seconds with validation, whole epochs (wall and CPU) and end to end."""
    done = [p.run(kind) for p in runs]
    images = sum(r.steady.images for r in done if r.steady is not None)
    seconds = sum(r.steady.train_s for r in done if r.steady is not None)
    epochs_all = [e for r in done for e in r.epochs]
    steady_epochs = [e for e in epochs_all if e.epoch >= skip_epochs]
    trained = sum(e.images for e in epochs_all)
    wall = sum(r.end_to_end_s for r in done)
    # whole epochs both runs marked at both ends (the Ray hook never sees the last one end)
    whole = [
        e
        for p in runs
        for e in p.run(kind).epochs
        if e.epoch >= skip_epochs and all(x.whole_epoch_s is not None for x in _epoch_pair(p, e.epoch))
    ]
    whole_s = [e.whole_epoch_s for e in whole if e.whole_epoch_s is not None]
    whole_cpu_s = [e.whole_epoch_cpu_s for e in whole if e.whole_epoch_cpu_s is not None]
    return OverheadTotal(
        steady_images_per_s=images / seconds,
        steady_epoch_incl_validation_s=statistics.fmean(e.epoch_s for e in steady_epochs),
        whole_epoch_s=statistics.fmean(whole_s) if whole else None,
        whole_epoch_cpu_s=statistics.fmean(whole_cpu_s) if whole else None,
        whole_epochs=len(whole),
        end_to_end_s=wall / len(runs),
        end_to_end_images_per_s=trained / wall,
    )


def _overhead_figures(runs: list[OverheadPair], skip_epochs: int) -> OverheadFigures:
    """Both kinds' totals and Ray's speed relative to the plain loop (> 1: Ray faster),
    steady, per epoch with validation, per whole epoch (wall, CPU time) and end to end."""
    plain, ray_ = _overhead_total(runs, "plain", skip_epochs), _overhead_total(runs, "ray", skip_epochs)
    whole_ratio = whole_cpu_ratio = None
    if plain.whole_epoch_s and ray_.whole_epoch_s:
        whole_ratio = plain.whole_epoch_s / ray_.whole_epoch_s
        if ray_.whole_epoch_cpu_s is not None and ray_.whole_epoch_cpu_s > 0 and plain.whole_epoch_cpu_s is not None:
            whole_cpu_ratio = plain.whole_epoch_cpu_s / ray_.whole_epoch_cpu_s
    return OverheadFigures(
        plain=plain,
        ray=ray_,
        ratio_steady=ray_.steady_images_per_s / plain.steady_images_per_s,
        ratio_epoch_incl_validation=plain.steady_epoch_incl_validation_s / ray_.steady_epoch_incl_validation_s,
        ratio_whole_epoch=whole_ratio,
        ratio_whole_epoch_cpu_time=whole_cpu_ratio,
        ratio_end_to_end=plain.end_to_end_s / ray_.end_to_end_s,
    )


def _overhead_warnings(worker: WorkerThreads | None, threads: int, ray_before: bool) -> list[str]:
    """What made part B's comparison less than like for like."""
    warnings = []
    if worker is None:
        warnings.append("part B: the Ray worker's thread settings could not be read back")
    elif worker.forced:
        warnings.append(
            f"part B: the Ray worker started with {worker.torch_threads_found} torch threads "
            f"(OMP_NUM_THREADS={worker.omp_num_threads}); set to {threads} by the benchmark"
        )
    if ray_before:
        warnings.append(
            "part B: Ray was already running, so the plain loop shared the machine with Ray's idle processes"
        )
    return warnings


def _overhead_included(skip_epochs: int, tracking: bool) -> dict[str, str]:
    """What each of part B's figures includes, in words."""
    return {
        "steady": "training images / training-loop seconds (batches, training_step, backward, clip, AdamW; "
        f"no validation) over epochs >= {skip_epochs}; both loops time exactly this",
        "epoch_incl_validation": "training loop + threshold calibration + validation, per steady epoch "
        "(plain: in fit_local's on_epoch; Ray: its metrics' epoch_time_s)",
        "whole_epoch": "one epoch start to the next: training, validation, the plain run's model save or the "
        "Ray loop's checkpoint, report and commit barrier; wall seconds, and the CPU seconds of the "
        "training process (all its threads: immune to time-slicing by other processes, blind to "
        "Ray's other processes); steady epochs but the last",
        "end_to_end": "plain: model build, data, all epochs with validation and a model save per epoch; "
        "Ray: run_training (worker start-up, data, all epochs with validation, checkpoints "
        "with optimizer/scheduler/RNG state, report and commit barrier"
        + (", MLflow logging" if tracking else "")
        + ") plus Ray's start-up when started here",
        "not_included": "MLflow in the plain run"
        + ("" if tracking else " and in the Ray run (tracking off)")
        + "; bf16 autocast; DataLoader worker processes",
    }


def run_ray_overhead_benchmark(
    config: ExperimentConfig,
    *,
    threads: int | None = None,
    device: str = "cpu",
    rounds: int = 1,
    skip_epochs: int = 1,
    tracking: bool = False,
    storage: str | None = None,
    ray_address: str | None = None,
) -> RayOverheadReport:
    """Part B (see the module doc): the same short training through ``fit_local`` and
    through Ray Train with one worker, the same thread count in both.

    Args:
        config: the experiment; part B forces one worker, ``threads`` CPUs for it,
            no loader processes, no autocast, its own storage and run names.
        threads: CPU threads of both runs (default: this process's torch threads).
        device: ``cpu`` or ``cuda``.
        rounds: plain/Ray pairs, alternating the order.
        skip_epochs: leading epochs left out of the steady-state figures.
        tracking: MLflow logging in the Ray run (a temporary SQLite store unless
            ``$MLFLOW_TRACKING_URI`` is set).
        storage: Ray storage path (default: a temporary local folder, removed after);
            a multi-node cluster needs one every node reaches (``s3://...``).
        ray_address: the Ray cluster to join (default: the job's, or a local Ray).
    """
    import ray

    dev = checked_device(device)
    threads = _overhead_threads(config, threads=threads, rounds=rounds, skip_epochs=skip_epochs)
    ray_before = ray.is_initialized() or bool(ray_address or os.environ.get("RAY_ADDRESS"))
    own_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    load_start = list(os.getloadavg())
    try:
        runs, experiment = _overhead_runs(
            config,
            threads=threads,
            device=device,
            rounds=rounds,
            skip_epochs=skip_epochs,
            tracking=tracking,
            storage=storage,
            ray_address=ray_address,
        )
    finally:
        torch.set_num_threads(own_threads)
    figures = _overhead_figures(runs, skip_epochs)
    worker = next((p.ray.worker_threads for p in runs if p.ray.worker_threads), None)
    target = make_target(
        "ray",
        "Ray Train (1 worker) vs plain loop: steady-state training images/s",
        figures.ratio_steady,
        ">=",
        RAY_OVERHEAD_TARGET,
        "times",
        note=f"epochs {skip_epochs}..{config.train.epochs - 1}, {rounds} round(s)",
        rounds=[p.ratio for p in runs],
    )
    return RayOverheadReport(
        config=RayOverheadConfig(
            experiment=experiment,
            threads=threads,
            device=str(dev),
            rounds=rounds,
            skip_epochs=skip_epochs,
            tracking=tracking,
            ray_already_running=ray_before,
            ray_train_health_check_interval_s=float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2.0)),
        ),
        worker_threads=worker,
        load_average_start=load_start,
        load_average_end=list(os.getloadavg()),
        runs=runs,
        figures=figures,
        target=target,
        included=_overhead_included(skip_epochs, tracking),
        warnings=_overhead_warnings(worker, threads, ray_before),
    )


# ---------------------------------------------------------------------- both
@dataclasses.dataclass(frozen=True)
class TrainModelInfo:
    """The workload's shape (:func:`_vit_info`): the config's ViT, its quadtree and data."""

    name: str
    timm_kwargs: JsonObject  # timm.create_model's own keyword arguments, as configured
    embed_dim: int
    depth: int
    num_heads: int | None
    image_size: int
    patch_size: int
    levels: int
    coarse_patch_size: int
    full_tokens: int
    min_tokens: int
    policy_depth: int
    num_classes: int
    batch_size: int
    data: str  # the data set and its options, in words
    target_ratio: float


@dataclasses.dataclass(frozen=True)
class TrainReport:
    """What :func:`run_train_benchmark` measured (``splitvit bench train``' JSON): the parts
    asked for (None: not run), the machine, their targets and warnings."""

    model: TrainModelInfo
    load_average_start: list[float]
    steps: StepReport | None  # part A
    ray_overhead: RayOverheadReport | None  # part B
    allocators: AllocatorReport | None  # part C
    machine: MachineInfo
    targets: list[Target]
    warnings: list[str]

    def to_dict(self) -> JsonObject:
        """The JSON ``--json`` writes: ``benchmark: train`` first, only the parts that ran."""
        parts = {"steps": self.steps, "ray_overhead": self.ray_overhead, "allocators": self.allocators}
        return {
            "benchmark": "train",
            "model": dataclasses.asdict(self.model),
            "load_average_start": self.load_average_start,
            **{key: part.to_dict() for key, part in parts.items() if part is not None},
            "machine": self.machine.to_dict(),
            "targets": [t.to_dict() for t in self.targets],
            "warnings": self.warnings,
        }


def run_train_benchmark(
    config: ExperimentConfig | None = None,
    *,
    parts: tuple[str, ...] = ("steps", "ray"),
    device: str = "cpu",
    rounds: int = 6,
    warmup: int = 1,
    ray_rounds: int = 1,
    threads: int | None = None,
    skip_epochs: int = 1,
    tracking: bool = False,
    storage: str | None = None,
    ray_address: str | None = None,
    autocast_bf16: bool = False,
    allocators: tuple[str, ...] = ("all",),
    allocator_rounds: int = 3,
) -> TrainReport:
    """The parts on one config (default :func:`benchmark_config`); ``parts`` picks
    ``steps`` (A), ``ray`` (B) and ``allocators`` (C,
    :func:`~splitvit.bench.allocators.run_allocator_benchmark`: ``allocators`` in
    ``allocator_rounds`` rounds); ``threads`` (default: this process's torch threads)
    holds for all; ``autocast_bf16`` applies to part A's steps. The :class:`TrainReport`:
    ``model``, ``machine``, ``steps`` (part A), ``ray_overhead`` (part B), ``allocators``
    (part C), ``targets``, ``warnings``."""
    config = config or benchmark_config()
    unknown = set(parts) - set(TRAIN_PARTS)
    if unknown or not parts:
        raise ValueError(f"parts must be some of {', '.join(TRAIN_PARTS)}; got {', '.join(parts) or 'none'}")
    if "allocators" in parts:  # every allocator's library found before anything is timed
        choose_allocators(allocators)
    dev = torch.device(device)
    model, load_start = _vit_info(config), list(os.getloadavg())
    steps = ray_overhead = allocator_figures = None
    own_threads = torch.get_num_threads()
    threads = int(threads or own_threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)  # part A too: both parts run at the same thread count
    try:
        if "steps" in parts:
            steps = run_step_benchmark(config, rounds=rounds, warmup=warmup, device=device, autocast_bf16=autocast_bf16)
        if "ray" in parts:
            ray_overhead = run_ray_overhead_benchmark(
                config,
                threads=threads,
                device=device,
                rounds=ray_rounds,
                skip_epochs=skip_epochs,
                tracking=tracking,
                storage=storage,
                ray_address=ray_address,
            )
        if "allocators" in parts:
            allocator_figures = run_allocator_benchmark(
                config,
                allocators=allocators,
                rounds=allocator_rounds,
                threads=threads,
                skip_epochs=skip_epochs,
                device=device,
            )
        machine = machine_info(dev)
    finally:
        torch.set_num_threads(own_threads)
    targets = [ray_overhead.target] if ray_overhead is not None else []
    targets += allocator_figures.targets if allocator_figures is not None else []
    return TrainReport(
        model=model,
        load_average_start=load_start,
        steps=steps,
        ray_overhead=ray_overhead,
        allocators=allocator_figures,
        machine=machine,
        targets=targets,
        warnings=[w for part in (steps, ray_overhead, allocator_figures) if part is not None for w in part.warnings],
    )


def _vit_info(config: ExperimentConfig) -> TrainModelInfo:
    """The workload's shape, from the config's ViT built on the meta device."""
    mc, dc = config.model, config.data
    with torch.device("meta"):
        model = build_model(dataclasses.replace(mc, checkpoint_path=None), pretrained=False)
    vit = model.vit
    return TrainModelInfo(
        name=mc.name,
        timm_kwargs=dict(mc.timm_kwargs),
        embed_dim=int(vit.embed_dim),
        depth=len(vit.blocks),
        num_heads=int(getattr(vit.blocks[0].attn, "num_heads", 0)) or None,
        image_size=mc.image_size,
        patch_size=model.patch_size,
        levels=mc.levels,
        coarse_patch_size=model.geometry.coarse_patch_size,
        full_tokens=model.geometry.full_tokens,
        min_tokens=model.geometry.min_tokens,
        policy_depth=mc.policy.depth,
        num_classes=mc.num_classes,
        batch_size=dc.batch_size,
        data=f"{dc.name} {dc.options}",
        target_ratio=config.train.budget.target_ratio,
    )


# ---------------------------------------------------------------------- report
_STEP_LABELS = {
    "timm": "timm ViT step (full res)",
    "full": "SplitViT full (full res)",
    "split_warmup": "SPLIT warm-up (random splits)",
    "split_learned": "SPLIT learned (policy+teacher)",
    "split_learned_every_step": "SPLIT learned, teacher every step",
    "teacher": "teacher relevance alone",
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def _train_header(result: TrainReport) -> list[str]:
    """Where it ran and the workload."""
    mach, m = result.machine, result.model
    return [
        f"SPLIT training benchmark: {device_label(mach)}, torch {mach.torch_version}, "
        f"timm {mach.timm_version}; 1-min load average {result.load_average_start[0]:.2f} at start, "
        f"{mach.load_average_end[0]:.2f} at end",
        f"model {m.name} (dim {m.embed_dim}, depth {m.depth}, heads {m.num_heads}), {m.image_size} px, "
        f"p={m.patch_size}, L={m.levels} (P={m.coarse_patch_size}), N_full={m.full_tokens}, "
        f"N_min={m.min_tokens}, policy depth {m.policy_depth}, batch {m.batch_size}, data {m.data}",
    ]


def _steps_lines(a: StepReport, machine: MachineInfo, target_ratio: float) -> list[str]:
    """Part A: how the steps were timed, one row per step, and the checks beside the medians."""
    cfg, others = a.config, a.other_processes_cpus_during_timing
    lines = [
        "",
        f"A. training-step throughput: one optimisation step (training_step, backward, clip, AdamW at lr 0), "
        f"median of {cfg.rounds} interleaved rounds after {cfg.warmup} warm-up, {machine.torch_threads} "
        f"torch threads; other processes used " + (f"{others:.2f}" if others is not None else "?") + " CPUs",
        f"  warm-up step: {cfg.warmup_step}",
        f"  learned step: {cfg.policy_step}; policy aimed at "
        f"{target_ratio:.0%} expected tokens (reached {cfg.policy_aim.expected_ratio:.3f})",
    ]
    rows = []
    for name, t in a.steps.items():
        frac = t.token_fraction
        share = t.share_of_split_learned
        rows.append(
            [
                _STEP_LABELS.get(name, name),
                f"{t.tokens_per_image:.1f}" if frac is not None else "",
                f"{frac:.3f}" if frac is not None else "",
                _ms(t.median_s),
                f"{_ms(t.min_s)}-{_ms(t.max_s)}",
                f"{t.images_per_s:.1f}",
                f"{t.ratio_to_full:.2f}x",
                f"{t.per_round.q1:.2f}x .. {t.per_round.q3:.2f}x",
                f"{t.ideal_ratio:.2f}x"
                if frac is not None
                else (f"{share:.0%} of learned step" if share is not None else ""),
            ]
        )
    lines += [
        "  " + line
        for line in text_table(
            [
                "step",
                "tokens/img",
                "fraction",
                "ms/step",
                "min-max ms",
                "img/s",
                "vs full",
                "per-round IQR",
                "ideal (1/fraction)",
            ],
            rows,
        )
    ]
    others_steps = [(n, t) for n, t in a.steps.items() if n != "full"]
    lines.append(
        "  checks, ratio to full from each step's fastest round: "
        + ", ".join(f"{n} {t.ratio_to_full_fastest:.2f}x" for n, t in others_steps)
        + "; from median process CPU time: "
        + ", ".join(
            f"{n} {t.ratio_to_full_cpu_time:.2f}x" for n, t in others_steps if t.ratio_to_full_cpu_time is not None
        )
    )
    return lines


def _ray_runs_lines(b: RayOverheadReport) -> list[str]:
    """Part B: what was compared, and one row per run."""
    cfg, worker = b.config, b.worker_threads
    lines = [
        "",
        f"B. Ray Train overhead: the same config trained by fit_local (plain loop, this process) and by "
        f"run_training (TorchTrainer, 1 worker); {cfg.threads} CPU threads in both (worker: OMP_NUM_THREADS="
        f"{worker.omp_num_threads if worker else None}, torch {worker.torch_threads if worker else None}"
        + (" after being set" if worker and worker.forced else "")
        + f"), {cfg.rounds} round(s), "
        f"{cfg.experiment.train.epochs} epochs of {b.runs[0].plain.epochs[0].images} images",
    ]
    rows = []
    for i, pair in enumerate(b.runs):
        for kind in pair.order:
            run = pair.run(kind)
            steady_epochs = [e.epoch_s for e in run.epochs if e.epoch >= cfg.skip_epochs]
            ray_start = run.ray_start_s if isinstance(run, RayRun) else 0.0
            rows.append(
                [
                    f"{i + 1}",
                    kind,
                    " | ".join(f"{e.images_per_s:.1f}" for e in run.epochs),
                    f"{run.steady.images_per_s:.1f}" if run.steady is not None else "?",
                    f"{statistics.fmean(steady_epochs):.1f}",
                    f"{run.wall_s:.1f}" + (f" + {ray_start:.1f} Ray start" if ray_start else ""),
                    f"{run.machine_busy_cpus:.2f}" if run.machine_busy_cpus is not None else "?",
                ]
            )
    return lines + [
        "  " + line
        for line in text_table(
            [
                "round",
                "run",
                "train img/s per epoch",
                f"steady img/s (epochs >= {cfg.skip_epochs})",
                "epoch incl. val s",
                "wall s",
                "machine busy CPUs",
            ],
            rows,
        )
    ]


def _ray_summary_lines(b: RayOverheadReport) -> list[str]:
    """Part B: the target, and Ray's speed per epoch with validation, per whole epoch
    and end to end."""
    f = b.figures
    plain, ray_ = f.plain, f.ray
    lines = ["  " + line for line in target_table([b.target])]
    lines.append(
        f"  per steady epoch incl. threshold calibration and validation: plain "
        f"{plain.steady_epoch_incl_validation_s:.2f} s, Ray {ray_.steady_epoch_incl_validation_s:.2f} s "
        f"(Ray/plain speed {f.ratio_epoch_incl_validation:.2f}x)"
    )
    if f.ratio_whole_epoch is not None:
        cpu = f.ratio_whole_epoch_cpu_time
        lines.append(
            f"  whole epoch (start to next start, incl. checkpoint and report), {plain.whole_epochs} epoch(s): "
            f"plain {plain.whole_epoch_s:.2f} s / {plain.whole_epoch_cpu_s:.2f} CPU-s, "
            f"Ray {ray_.whole_epoch_s:.2f} s / {ray_.whole_epoch_cpu_s:.2f} CPU-s of the worker process; "
            f"Ray/plain speed {f.ratio_whole_epoch:.2f}x wall, "
            + (f"{cpu:.2f}x CPU time" if cpu is not None else "? CPU time")
        )
    lines.append(
        f"  END TO END (incl. Ray start-up): plain {plain.end_to_end_s:.1f} s "
        f"({plain.end_to_end_images_per_s:.1f} img/s), Ray {ray_.end_to_end_s:.1f} s "
        f"({ray_.end_to_end_images_per_s:.1f} img/s); Ray/plain speed {f.ratio_end_to_end:.2f}x"
    )
    return lines + [f"  {key}: {text}" for key, text in b.included.items()]


def format_train_report(result: TrainReport) -> str:
    """A readable report of :func:`run_train_benchmark`'s result."""
    lines = _train_header(result)
    if result.steps is not None:
        lines += _steps_lines(result.steps, result.machine, result.model.target_ratio)
    if result.ray_overhead is not None:
        lines += _ray_runs_lines(result.ray_overhead) + _ray_summary_lines(result.ray_overhead)
    if result.allocators is not None:
        lines += format_allocator_lines(result.allocators)
    lines += [f"WARNING: {warning}" for warning in result.warnings]
    return "\n".join(lines)
