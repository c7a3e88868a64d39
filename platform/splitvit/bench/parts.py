"""``splitvit bench parts``: where a SPLIT model's forward time goes, beside full resolution.

The model is one a user trains: a study's method (the study file's config and the
method's settings, random weights), an experiment config, or a trained checkpoint.
A detector is timed twice in the same rounds: whole (its backbone's stages, then its
pyramid, proposals, RoI heads and mask pasting: :data:`~splitvit.model.stages.DETECTOR_STAGES`),
and its backbone alone (``<name>:backbone``), in the pass the detector calls
(:meth:`~splitvit.model.splitvit.SplitViT.fine_features`, whose ``head`` stage lays the
leaves on the finest grid), each against full resolution's same part: its heads do not
shrink with the tokens. Its full-resolution counterpart is the same model with the
``full`` policy (every node splits: the studies' control architecture, the sweeps'
baseline). At every batch size, in ``runs`` interleaved runs
(:func:`~splitvit.bench.timing.time_beside_others`, each run every model in turn, round
after round):

* ``full``: the full-resolution forward pass;
* ``split@R``: the model at token ratio ``R``, its thresholds calibrated once, on
  :data:`CALIBRATION_IMAGES` benchmark images, and used at every batch size;
* the same passes with a :class:`~splitvit.model.stages.StageClock` attached, whose
  per-stage medians say where the time goes: level embeddings, fine aggregation, the
  policy's blocks, level context, the policy's heads, decisions, gather, packing,
  blocks, head (:data:`~splitvit.model.stages.STAGES`).

Each run gives every model a speed-up, full resolution's median over the model's (of
the unclocked passes); the speed-up reported is the median of the runs' and its spread
their minimum and maximum, so that one run's drift shows instead of passing for the
figure. Beside it, the **arithmetic ceiling** (:func:`ceiling_speedup`): the speed-up
the recipe would have if everything but its arithmetic (:data:`ARITHMETIC_STAGES`)
were free, full resolution's whole-pass median over the model's arithmetic stages'
medians; and the measured speed-up's **share of the ceiling**, how much of what the
recipe's arithmetic allows the implementation delivers. Both are computed per run and
reported as the runs' median (with the share's spread).

Images are :func:`~splitvit.bench.forward.benchmark_images` (an object among clutter)
with the model's channel count. Nothing is judged against a target here: the figures
are printed as measured, with the machine's description and a warning when other
processes competed for the cores.
"""

from __future__ import annotations

import copy
import itertools
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from ..jsontypes import JsonObject
from ..model import SplitOutput, SplitViT
from ..model.detection import SplitDetector, split_backbone
from ..model.stages import DETECTOR_STAGES, STAGES, StageClock
from ..train.steps import calibrate_thresholds
from .forward import benchmark_images
from .records import MachineInfo, without_unset
from .report import device_label, text_table
from .speed import BACKBONE_SUFFIX
from .timing import (
    OTHER_LOAD_WARNING,
    checked_device,
    compile_options,
    machine_info,
    synchronizer,
    time_beside_others,
    timing_summary,
)

log = logging.getLogger(__name__)

#: What ``bench parts`` times: a SplitViT, or a detector on one.
Model = SplitViT | SplitDetector

#: Images the thresholds of every ratio are calibrated on (shared by every batch size).
CALIBRATION_IMAGES = 256
#: Batch sizes from latency (1) to throughput (256).
DEFAULT_BATCH_SIZES = (1, 8, 64, 256)
#: Successive calls of a model take the next of up to this many batches (of the
#: calibration images), so a small batch's time is that of typical images, not of one.
ROTATION_BATCHES = 16
#: The stages the arithmetic ceiling counts: the computation the recipe cannot do
#: without (patch embeddings, fine aggregation, the policy's blocks, level context, the
#: ViT's blocks, the head; a detector's pyramid, proposals and RoI heads). The policy's
#: heads, the decisions, gather and packing only choose and arrange tokens (a few small
#: layers, thresholds, index work): the overhead that could in principle cost nothing,
#: and so the ceiling counts it as free.
ARITHMETIC_STAGES = ("embedding", "aggregation", "policy_blocks", "level_context", "blocks", "head", *DETECTOR_STAGES)


@dataclass(frozen=True)
class PartsSettings:
    """What :func:`run_parts_benchmark` times.

    Attributes:
        batch_sizes: images per forward pass, one interleaved run each.
        ratios: token ratios (fractions of ``N_full``) the model is calibrated to.
        repeats, warmup: timed and untimed interleaved rounds per batch size and run.
        runs: interleaved runs per batch size; speed-ups, ceilings and shares are the
            runs' medians, with their spread.
        threads: torch's CPU threads while timing (``None``: torch's default).
        device: where the models run.
        bf16: bf16 autocast for every pass and the calibration.
        compile: ``torch.compile`` every model's encoder blocks, full resolution's too
            (:meth:`~splitvit.model.SplitViT.compile_encoder`; CUDA graphs on a GPU).
        token_buckets: the split models' packed sizes rounded up to this many fixed
            sizes (``SplitViT.token_buckets``), so that compiled graphs see few shapes.
        seed: the benchmark images.
    """

    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    ratios: tuple[float, ...] = (0.5, 0.7)
    repeats: int = 20
    warmup: int = 3
    runs: int = 3
    threads: int | None = None
    device: str = "cpu"
    bf16: bool = False
    compile: bool = False
    token_buckets: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(int(b) < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be positive integers, got {list(self.batch_sizes)}")
        if not self.ratios or any(not 0.0 < float(r) <= 1.0 for r in self.ratios):
            raise ValueError(f"ratios must be token fractions in (0, 1], got {list(self.ratios)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.runs < 1:
            raise ValueError(f"runs must be >= 1, got {self.runs}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.token_buckets < 0:
            raise ValueError(f"token buckets must be >= 0, got {self.token_buckets}")
        if self.token_buckets and not self.compile:
            raise ValueError("token buckets fix the packed shapes for compiled graphs: use them with compile")

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """bf16 autocast on ``device`` where asked, else nothing."""
        return torch.autocast(device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext()


#: a model's figures that only some files hold: per-run figures (``runs``) and a split
#: model's ceiling came later, and full resolution has no ceiling
_UNSET_FIGURES = ("runs", "speedup_range", "ceiling_speedup", "ceiling_range", "share_of_ceiling", "share_range")


@dataclass(frozen=True)
class CeilingFigures:
    """A split model's speed-up, arithmetic ceiling and share of it over the runs
    (:func:`split_figures_across_runs`): each the median of the per-run figures, with
    the runs' ``[min, max]``."""

    speedup_vs_full: float
    speedup_range: list[float]
    ceiling_speedup: float
    ceiling_range: list[float]
    share_of_ceiling: float
    share_range: list[float]
    runs: dict[str, list[float]]  # per run: speedup_vs_full, ceiling_speedup, share_of_ceiling


@dataclass(frozen=True)
class PartsModelFigures:
    """One model at one batch size: its speed, tokens and per-stage medians; a split
    model's also its runs' speed-ups, ceilings and shares (:class:`CeilingFigures`)."""

    token_ratio: float
    median_s: float  # over all the runs' timed rounds together
    images_per_s: float
    speedup_vs_full: float  # 1.0 for full resolution; a split model's: the runs' median
    stages_s: dict[str, float]  # per stage, its median seconds
    # each run's median_s, and a split model's per-run figures (None: a file from before runs)
    runs: dict[str, list[float]] | None = None
    speedup_range: list[float] | None = None  # the runs' [min, max] (None: full resolution, older files)
    ceiling_speedup: float | None = None
    ceiling_range: list[float] | None = None
    share_of_ceiling: float | None = None
    share_range: list[float] | None = None

    def with_ceiling(self, figures: CeilingFigures) -> PartsModelFigures:
        """These figures with a split model's speed-up, ceiling and share over the runs."""
        runs = {**(self.runs or {}), **figures.runs}
        return replace(self, **{**asdict(figures), "runs": runs})

    def to_dict(self) -> JsonObject:
        """Its JSON: the fields in order, those not measured left out."""
        return without_unset(asdict(self), _UNSET_FIGURES)

    @classmethod
    def from_dict(cls, data: JsonObject) -> PartsModelFigures:
        """The inverse of :meth:`to_dict`, for files of every version."""
        return cls(**{f.name: data[f.name] if f.name not in _UNSET_FIGURES else data.get(f.name) for f in fields(cls)})


@dataclass(frozen=True)
class PartsBatch:
    """One batch size: every model's figures (full resolution first) and the most CPUs
    other processes used on average in any one run (None: unknown)."""

    batch_size: int
    models: dict[str, PartsModelFigures]
    others_cores: float | None

    def to_dict(self) -> JsonObject:
        """Its JSON (an entry of ``batches``)."""
        models = {name: m.to_dict() for name, m in self.models.items()}
        return {"batch_size": self.batch_size, "models": models, "others_cores": self.others_cores}

    @classmethod
    def from_dict(cls, data: JsonObject) -> PartsBatch:
        """The inverse of :meth:`to_dict`."""
        models = {name: PartsModelFigures.from_dict(m) for name, m in data["models"].items()}
        return cls(batch_size=data["batch_size"], models=models, others_cores=data["others_cores"])


#: settings only some files hold: ``runs``, the precision and compilation came later
_UNSET_SETTINGS = ("runs", "bf16", "compile", "token_buckets")


@dataclass(frozen=True)
class PartsSettingsRecord:
    """How :func:`run_parts_benchmark` timed (its result's ``settings``). A file written
    before ``runs``, ``bf16``, ``compile`` and ``token_buckets`` existed lacks them: None
    here, read as one run, fp32, eager."""

    batch_sizes: list[int]
    ratios: list[float]
    repeats: int
    warmup: int
    runs: int | None = field(default=None, kw_only=True)
    calibration_images: int
    bf16: bool | None = field(default=None, kw_only=True)
    compile: bool | None = field(default=None, kw_only=True)
    token_buckets: int | None = field(default=None, kw_only=True)

    def to_dict(self) -> JsonObject:
        """Its JSON: the fields in order, those an older file lacks left out."""
        return without_unset(asdict(self), _UNSET_SETTINGS)

    @classmethod
    def from_dict(cls, data: JsonObject) -> PartsSettingsRecord:
        """The inverse of :meth:`to_dict`, for files of every version."""
        return cls(**{f.name: data[f.name] if f.name not in _UNSET_SETTINGS else data.get(f.name) for f in fields(cls)})


@dataclass(frozen=True)
class PartsReport:
    """What :func:`run_parts_benchmark` measured: the model, the machine, the calibrated
    thresholds and every batch size's figures (``splitvit bench parts``' JSON)."""

    source: str  # what the model is (a study's method, a config, a checkpoint)
    model: JsonObject  # the model's spec, as its checkpoint holds it
    settings: PartsSettingsRecord
    machine: MachineInfo
    thresholds: dict[str, list[float]]  # per split model, its calibrated thresholds
    stages: list[str]  # the stages, in the order the report lists them
    batches: list[PartsBatch]
    warnings: list[str]

    def to_dict(self) -> JsonObject:
        """The JSON ``--json`` writes (``benchmark: parts`` first)."""
        return {
            "benchmark": "parts",
            "source": self.source,
            "model": self.model,
            "settings": self.settings.to_dict(),
            "machine": self.machine.to_dict(),
            "thresholds": self.thresholds,
            "stages": self.stages,
            "batches": [b.to_dict() for b in self.batches],
            "warnings": self.warnings,
        }

    @classmethod
    def from_dict(cls, data: JsonObject) -> PartsReport:
        """The inverse of :meth:`to_dict` (the envelope's keys ignored), for files of every version."""
        return cls(
            source=data["source"],
            model=data["model"],
            settings=PartsSettingsRecord.from_dict(data["settings"]),
            machine=MachineInfo.from_dict(data["machine"]),
            thresholds=data["thresholds"],
            stages=data["stages"],
            batches=[PartsBatch.from_dict(b) for b in data["batches"]],
            warnings=data["warnings"],
        )


def point_name(ratio: float) -> str:
    """The key of the model at one token ratio: ``split@0.50``."""
    return f"split@{ratio:.2f}"


def ceiling_speedup(full_s: float, stages_s: Mapping[str, float]) -> float:
    """The speed-up a split model would have if everything but its arithmetic were free.

    Args:
        full_s: full resolution's whole-pass seconds (unclocked).
        stages_s: the split model's seconds per stage (a stage it does not run may be absent).

    Returns:
        ``full_s`` over the split model's :data:`ARITHMETIC_STAGES` seconds together.
    """
    arithmetic = sum(stages_s.get(stage, 0.0) for stage in ARITHMETIC_STAGES)
    if arithmetic <= 0.0:
        raise ValueError(f"no time in the arithmetic stages {list(ARITHMETIC_STAGES)}: {dict(stages_s)}")
    return full_s / arithmetic


def split_figures_across_runs(
    full_s: Sequence[float], model_s: Sequence[float], stages_s: Sequence[Mapping[str, float]]
) -> CeilingFigures:
    """A split model's speed-up, arithmetic ceiling and share of it, from its runs.

    Args:
        full_s: full resolution's whole-pass median in each run.
        model_s: the split model's whole-pass median in each run.
        stages_s: the split model's per-stage medians in each run.

    Returns:
        ``speedup_vs_full``, ``ceiling_speedup`` and ``share_of_ceiling``: the medians of
        the per-run figures (each run's share is its own speed-up over its own ceiling);
        ``speedup_range``, ``ceiling_range``, ``share_range``: their ``[min, max]``;
        ``runs``: the per-run figures themselves.
    """
    if not len(full_s) == len(model_s) == len(stages_s):
        raise ValueError(f"one figure per run each: {len(full_s)}, {len(model_s)} and {len(stages_s)} runs")
    runs: dict[str, list[float]] = {
        "speedup_vs_full": [f / m for f, m in zip(full_s, model_s)],
        "ceiling_speedup": [ceiling_speedup(f, stages) for f, stages in zip(full_s, stages_s)],
    }
    runs["share_of_ceiling"] = [m / c for m, c in zip(runs["speedup_vs_full"], runs["ceiling_speedup"])]
    speedup, ceiling, share = (across_runs(runs[k]) for k in ("speedup_vs_full", "ceiling_speedup", "share_of_ceiling"))
    return CeilingFigures(
        speedup_vs_full=speedup["median"],
        speedup_range=[speedup["min"], speedup["max"]],
        ceiling_speedup=ceiling["median"],
        ceiling_range=[ceiling["min"], ceiling["max"]],
        share_of_ceiling=share["median"],
        share_range=[share["min"], share["max"]],
        runs=runs,
    )


def across_runs(values: Sequence[float]) -> dict[str, float]:
    """One figure over the runs: their median, and their spread as minimum and maximum."""
    if not values:
        raise ValueError("no runs to summarise")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_parts_benchmark(model: Model, settings: PartsSettings, source: str) -> PartsReport:
    """Time ``model`` at every ratio and batch size beside its full-resolution self.

    Args:
        model: the SPLIT model or detector (its policy, settings and weights as trained or built).
        settings: batch sizes, ratios, rounds, threads, device.
        source: what the model is (a study's method, a config, a checkpoint), for the report.

    Returns:
        The model, the machine, the calibrated thresholds, and per batch size every
        model's images/s, speed-up, token ratio and per-stage medians; for every split
        model also its arithmetic ceiling and share of it (see :func:`_time_batch`).
    """
    dev = checked_device(settings.device)
    previous_threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        split = model.to(dev).eval()
        full = copy.deepcopy(split)
        split_backbone(full).set_policy("full")
        images = _images(split_backbone(split), max(*settings.batch_sizes, CALIBRATION_IMAGES), settings.seed, dev)
        # one model per ratio, its thresholds set as a calibrated model's are (not passed per call),
        # in the precision it is timed in
        points: dict[str, Model] = {}
        for ratio in settings.ratios:
            point = copy.deepcopy(split)
            backbone = split_backbone(point)
            with settings.autocast(dev):
                backbone.set_thresholds(calibrate_thresholds(backbone, images[:CALIBRATION_IMAGES], ratio))
            points[point_name(ratio)] = point
        if settings.compile:
            _compile(full, points, settings, dev)
        timed = [_time_batch(full, points, _rotation(images, b), settings, dev) for b in settings.batch_sizes]
        machine = machine_info(dev)  # before the threads are restored: it records them
    finally:
        torch.set_num_threads(previous_threads)
    return PartsReport(
        source=source,
        model=spec.to_dict() if (spec := split_backbone(split).spec) else {},
        settings=PartsSettingsRecord(
            batch_sizes=list(settings.batch_sizes),
            ratios=list(settings.ratios),
            repeats=settings.repeats,
            warmup=settings.warmup,
            runs=settings.runs,
            calibration_images=CALIBRATION_IMAGES,
            bf16=settings.bf16,
            compile=settings.compile,
            token_buckets=settings.token_buckets,
        ),
        machine=machine,
        thresholds={name: [float(t) for t in split_backbone(m).thresholds] for name, m in points.items()},
        stages=list(STAGES + DETECTOR_STAGES) if isinstance(split, SplitDetector) else list(STAGES),
        batches=[batch for batch, _ in timed],
        warnings=[w for _, warnings in timed for w in warnings],
    )


def _compile(full: Model, points: dict[str, Model], settings: PartsSettings, dev: torch.device) -> None:
    """Every side's encoder under ``torch.compile`` alike (CUDA graphs on a GPU); the split
    models' packed sizes in ``settings.token_buckets`` fixed buckets."""
    options = compile_options(dev)
    split_backbone(full).compile_encoder(**options)
    for point in points.values():
        backbone = split_backbone(point)
        backbone.token_buckets = settings.token_buckets
        backbone.compile_encoder(**options)


def _images(model: SplitViT, count: int, seed: int, dev: torch.device) -> torch.Tensor:
    """``count`` benchmark images at the model's size, with its input channels."""
    size = model.geometry.image_size[0]
    images = benchmark_images(count, size, seed=seed)
    channels = model.vit.patch_embed.proj.in_channels
    if images.shape[1] != channels:
        images = images.mean(1, keepdim=True).expand(-1, channels, -1, -1).contiguous()
    return images.to(dev)


def _rotation(images: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """The batches of ``batch`` images a model's successive calls take in turn."""
    count = max(1, min(ROTATION_BATCHES, images.shape[0] // batch))
    return [images[i * batch : (i + 1) * batch] for i in range(count)]


def _time_batch(
    full: Model,
    points: dict[str, Model],
    batches: list[torch.Tensor],
    settings: PartsSettings,
    dev: torch.device,
) -> tuple[PartsBatch, list[str]]:
    """One batch size: every model plain and clocked, interleaved, in ``settings.runs`` runs,
    and a warning when other processes competed for the cores.

    Every model's ``median_s``, ``images_per_s`` and ``stages_s`` are medians over all the
    runs' timed rounds together (one pool of samples); ``runs.median_s`` holds each run's
    median. A split model's ``speedup_vs_full``, ``ceiling_speedup`` and
    ``share_of_ceiling`` are the medians of the per-run figures (``runs.*``), each with
    its ``*_range`` (the runs' minimum and maximum). ``others_cores`` is the most CPUs
    other processes used on average in any one run.
    """
    batch = batches[0].shape[0]
    sync = synchronizer(dev)
    passes = _timed_passes({"full": full, **points})
    runs = {name: run for name, (_, run) in passes.items()}
    stage_samples: dict[str, list[dict[str, float]]] = {name: [] for name in passes}
    fns: dict[str, Callable[[], Any]] = {}
    for name, (clock_holder, run) in passes.items():
        fns[name] = _rotating(run, batches)
        fns[f"{name}/stages"] = _clocked(clock_holder, run, batches, sync, stage_samples[name])
    samples: dict[str, list[float]] = {name: [] for name in passes}
    cpu: dict[str, list[float]] = {name: [] for name in passes}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in passes}
    per_run_s: list[dict[str, float]] = []  # per run, per model: its median seconds
    per_run_stages: list[dict[str, dict[str, float]]] = []  # per run, per model: its stage medians
    others_runs: list[float] = []
    with torch.inference_mode(), settings.autocast(dev):
        tokens = {
            name: statistics.fmean(float(run(b).token_ratio.mean()) for b in batches) for name, run in runs.items()
        }
        for _ in range(settings.runs):
            for clocked in stage_samples.values():
                clocked.clear()
            run_samples, run_cpu, others = time_beside_others(
                fns, repeats=settings.repeats, warmup=settings.warmup, sync=sync
            )
            if others is not None:
                others_runs.append(others)
            per_run_s.append({})
            per_run_stages.append({})
            for name in passes:
                timed = stage_samples[name][-settings.repeats :]  # the timed rounds, not the warm-up
                samples[name] += run_samples[name]
                cpu[name] += run_cpu[name]
                rounds[name] += timed
                per_run_s[-1][name] = statistics.median(run_samples[name])
                per_run_stages[-1][name] = _medians(timed)
    figures: dict[str, PartsModelFigures] = {}
    for name in passes:
        summary = timing_summary(samples[name], cpu[name], batch)
        figures[name] = PartsModelFigures(
            token_ratio=tokens[name],
            median_s=summary.median_s,
            images_per_s=summary.images_per_s,
            speedup_vs_full=1.0,  # full resolution's; a split model's is its runs' median, below
            stages_s=_medians(rounds[name]),
            runs={"median_s": [run[name] for run in per_run_s]},
        )
    for name in passes:
        reference = _full_of(name)
        if name == reference:
            continue
        full_runs_s = [run[reference] for run in per_run_s]
        model_runs_s = [run[name] for run in per_run_s]
        ceiling = split_figures_across_runs(full_runs_s, model_runs_s, [run[name] for run in per_run_stages])
        figures[name] = figures[name].with_ceiling(ceiling)
    others = max(others_runs) if others_runs else None
    warnings = []
    if others is not None and others > OTHER_LOAD_WARNING:
        warnings.append(f"batch {batch}: other processes used {others:.2f} CPUs while timing; figures are noisy")
    log.info("bench parts: batch %d timed", batch)
    return PartsBatch(batch_size=batch, models=figures, others_cores=others), warnings


def _medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per stage, the median seconds over ``rounds`` (a round that did not run it: 0), for
    the stages some round ran."""
    return {
        s: statistics.median(r.get(s, 0.0) for r in rounds)
        for s in STAGES + DETECTOR_STAGES
        if any(r.get(s) for r in rounds)
    }


def _timed_passes(models: dict[str, Model]) -> dict[str, tuple[SplitViT, Callable[[torch.Tensor], SplitOutput]]]:
    """Per timed name, the SplitViT a stage clock is attached to and the pass timed on a
    batch (returning the SplitViT's output): a SplitViT's forward; a detector whole, then
    (``<name>:backbone``) its backbone's ``fine_features`` alone, full resolution first in
    each group."""
    whole: dict[str, tuple[SplitViT, Callable[[torch.Tensor], SplitOutput]]] = {}
    alone: dict[str, tuple[SplitViT, Callable[[torch.Tensor], SplitOutput]]] = {}
    for name, model in models.items():
        if isinstance(model, SplitDetector):
            backbone = model.backbone
            whole[name] = (backbone, lambda images, m=model: m(images).split)
            alone[name + BACKBONE_SUFFIX] = (backbone, lambda images, b=backbone: b.fine_features(images)[1])
        else:
            whole[name] = (model, model)
    return {**whole, **alone}


def _full_of(name: str) -> str:
    """The full-resolution pass a timed pass is compared with: ``full``, or ``full:backbone``."""
    return "full" + (BACKBONE_SUFFIX if name.endswith(BACKBONE_SUFFIX) else "")


def _rotating(run: Callable[[torch.Tensor], Any], batches: list[torch.Tensor]) -> Callable[[], Any]:
    """``run`` (a model's timed pass) on the next of ``batches`` at every call."""
    turn = itertools.cycle(batches)
    return lambda: run(next(turn))


def _clocked(
    model: SplitViT,
    run: Callable[[torch.Tensor], Any],
    batches: list[torch.Tensor],
    sync: Callable[[], None],
    out: list[dict[str, float]],
) -> Callable[[], None]:
    """:func:`_rotating` with a stage clock attached to ``model``; each call appends its stages' seconds."""
    turn = itertools.cycle(batches)

    def call() -> None:
        clock = StageClock(sync)
        model.clock = clock
        try:
            run(next(turn))
        finally:
            model.clock = None
        out.append(clock.seconds)

    return call


def format_parts_report(result: PartsReport) -> str:
    """The result as text: per batch size, every model's speed, its arithmetic ceiling and
    share of it, and its stages in ms. Files written before ``runs`` (one run, no ceiling)
    print as they did then."""
    settings, machine = result.settings, result.machine
    rounds = f"{settings.repeats} interleaved rounds"
    timed = (
        f"speed-ups: median (min-max) of {settings.runs} runs of {rounds} each"
        if settings.runs
        else f"medians of {rounds}"
    )
    lines = [
        f"splitvit bench parts: {result.source}",
        f"{device_label(machine)}, {machine.torch_threads} torch threads, "
        f"{_precision(settings)}; {timed}; thresholds calibrated on {settings.calibration_images} images",
    ]
    for entry in result.batches:
        models = list(entry.models.values())
        rows = [
            ["tokens / full", *(f"{m.token_ratio:.2f}" for m in models)],
            ["forward ms", *(f"{m.median_s * 1e3:.2f}" for m in models)],
            ["images/s", *(f"{m.images_per_s:.0f}" for m in models)],
            ["speed-up vs full", *(_times(m.speedup_vs_full, m.speedup_range) for m in models)],
        ]
        if any(m.ceiling_speedup is not None for m in models):
            rows.append(["ceiling vs full", *(_ceiling(m) for m in models)])
            rows.append(["share of ceiling", *(_share(m) for m in models)])
        for stage in result.stages:
            if any(stage in m.stages_s for m in models):
                rows.append([f"  {stage} ms", *(_ms(m.stages_s.get(stage)) for m in models)])
        lines += ["", f"batch {entry.batch_size}", *text_table(["", *entry.models], rows)]
    lines += [f"warning: {w}" for w in result.warnings]
    return "\n".join(lines)


def _times(value: float, spread: list[float] | None) -> str:
    """``1.28x``, or ``1.28x (1.21-1.33)`` with the runs' spread."""
    return f"{value:.2f}x" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")


def _ceiling(figures: PartsModelFigures) -> str:
    return f"{figures.ceiling_speedup:.2f}x" if figures.ceiling_speedup is not None else "-"


def _share(figures: PartsModelFigures) -> str:
    """``67% (63-70%)``: the median share of the ceiling and the runs' spread."""
    if figures.share_of_ceiling is None or figures.share_range is None:
        return "-"
    low, high = figures.share_range
    return f"{figures.share_of_ceiling:.0%} ({low * 100:.0f}-{high:.0%})"


def _precision(settings: PartsSettingsRecord) -> str:
    """``bf16 autocast, torch.compile (4 token buckets)``, ``fp32, eager`` and the like
    (files written before these settings existed read as fp32, eager)."""
    text = "bf16 autocast" if settings.bf16 else "fp32"
    if not settings.compile:
        return text + ", eager"
    buckets = settings.token_buckets
    return text + ", torch.compile" + (f" ({buckets} token buckets)" if buckets else " (exact token counts)")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"
