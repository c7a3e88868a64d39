"""``splitvit bench parts``: where a SPLIT model's forward time goes, beside full resolution.

The model is one a user trains: a study's method (the study file's config and the
method's settings, random weights), an experiment config, or a trained checkpoint.
Its full-resolution counterpart is the same model with the ``full`` policy (every
node splits: the studies' control architecture, the sweeps' baseline). At every
batch size, in one interleaved run (:func:`~splitvit.bench.timing.time_beside_others`):

* ``full``: the full-resolution forward pass;
* ``split@R``: the model at token ratio ``R``, its thresholds calibrated once, on
  :data:`CALIBRATION_IMAGES` benchmark images, and used at every batch size;
* the same passes with a :class:`~splitvit.model.stages.StageClock` attached, whose
  per-stage medians say where the time goes: level embeddings, fine aggregation, the
  policy's blocks, level context, the policy's heads, decisions, gather, packing,
  blocks, head (:data:`~splitvit.model.stages.STAGES`).

Speed-ups are ratios of medians of the unclocked passes; images are
:func:`~splitvit.bench.forward.benchmark_images` (an object among clutter) with the
model's channel count. Nothing is judged against a target here: the figures are
printed as measured, with the machine's description and a warning when other
processes competed for the cores.
"""

from __future__ import annotations

import copy
import itertools
import logging
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ..model import SplitViT
from ..model.stages import STAGES, StageClock
from ..train.steps import calibrate_thresholds
from .forward import benchmark_images
from .report import device_label, text_table
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

#: Images the thresholds of every ratio are calibrated on (shared by every batch size).
CALIBRATION_IMAGES = 256
#: Batch sizes from latency (1) to throughput (256).
DEFAULT_BATCH_SIZES = (1, 8, 64, 256)
#: Successive calls of a model take the next of up to this many batches (of the
#: calibration images), so a small batch's time is that of typical images, not of one.
ROTATION_BATCHES = 16


@dataclass(frozen=True)
class PartsSettings:
    """What :func:`run_parts_benchmark` times.

    Attributes:
        batch_sizes: images per forward pass, one interleaved run each.
        ratios: token ratios (fractions of ``N_full``) the model is calibrated to.
        repeats, warmup: timed and untimed interleaved rounds per batch size.
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
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.token_buckets < 0:
            raise ValueError(f"token buckets must be >= 0, got {self.token_buckets}")
        if self.token_buckets and not self.compile:
            raise ValueError("token buckets fix the packed shapes for compiled graphs: use them with compile")

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """bf16 autocast on ``device`` where asked, else nothing."""
        return torch.autocast(device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext()


def point_name(ratio: float) -> str:
    """The key of the model at one token ratio: ``split@0.50``."""
    return f"split@{ratio:.2f}"


def run_parts_benchmark(model: SplitViT, settings: PartsSettings, source: str) -> dict[str, Any]:
    """Time ``model`` at every ratio and batch size beside its full-resolution self.

    Args:
        model: the SPLIT model (its policy, settings and weights as trained or built).
        settings: batch sizes, ratios, rounds, threads, device.
        source: what the model is (a study's method, a config, a checkpoint), for the report.

    Returns:
        A JSON-ready result: the model, the machine, the calibrated thresholds, and per
        batch size every model's images/s, speed-up, token ratio and per-stage medians.
    """
    dev = checked_device(settings.device)
    previous_threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        split = model.to(dev).eval()
        full = copy.deepcopy(split)
        full.set_policy("full")
        images = _images(split, max(*settings.batch_sizes, CALIBRATION_IMAGES), settings.seed, dev)
        # one model per ratio, its thresholds set as a calibrated model's are (not passed per call),
        # in the precision it is timed in
        points: dict[str, SplitViT] = {}
        for ratio in settings.ratios:
            point = copy.deepcopy(split)
            with settings.autocast(dev):
                point.set_thresholds(calibrate_thresholds(point, images[:CALIBRATION_IMAGES], ratio))
            points[point_name(ratio)] = point
        if settings.compile:
            _compile(full, points, settings, dev)
        batches = [_time_batch(full, points, _rotation(images, b), settings, dev) for b in settings.batch_sizes]
        machine = machine_info(dev)  # before the threads are restored: it records them
    finally:
        torch.set_num_threads(previous_threads)
    return {
        "benchmark": "parts",
        "source": source,
        "model": split.spec or {},
        "settings": {
            "batch_sizes": list(settings.batch_sizes),
            "ratios": list(settings.ratios),
            "repeats": settings.repeats,
            "warmup": settings.warmup,
            "calibration_images": CALIBRATION_IMAGES,
            "bf16": settings.bf16,
            "compile": settings.compile,
            "token_buckets": settings.token_buckets,
        },
        "machine": machine,
        "thresholds": {name: [float(t) for t in m.thresholds] for name, m in points.items()},
        "stages": list(STAGES),
        "batches": batches,
        "warnings": [w for b in batches for w in b.pop("warnings")],
    }


def _compile(full: SplitViT, points: dict[str, SplitViT], settings: PartsSettings, dev: torch.device) -> None:
    """Every side's encoder under ``torch.compile`` alike (CUDA graphs on a GPU); the split
    models' packed sizes in ``settings.token_buckets`` fixed buckets."""
    options = compile_options(dev)
    full.compile_encoder(**options)
    for point in points.values():
        point.token_buckets = settings.token_buckets
        point.compile_encoder(**options)


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
    full: SplitViT, points: dict[str, SplitViT], batches: list[torch.Tensor], settings: PartsSettings, dev: torch.device
) -> dict[str, Any]:
    """One batch size: every model plain and clocked, interleaved; medians and stages."""
    batch = batches[0].shape[0]
    sync = synchronizer(dev)
    models = {"full": full, **points}
    stage_samples: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    fns: dict[str, Callable[[], Any]] = {}
    for name, model in models.items():
        fns[name] = _rotating(model, batches)
        fns[f"{name}/stages"] = _clocked(model, batches, sync, stage_samples[name])
    with torch.inference_mode(), settings.autocast(dev):
        tokens = {name: statistics.fmean(float(m(b).token_ratio.mean()) for b in batches) for name, m in models.items()}
        samples, cpu, others = time_beside_others(fns, repeats=settings.repeats, warmup=settings.warmup, sync=sync)
    full_median = statistics.median(samples["full"])
    figures = {}
    for name in models:
        summary = timing_summary(samples[name], cpu[name], batch)
        rounds = stage_samples[name][-settings.repeats :]  # the timed rounds, not the warm-up
        stages = {s: statistics.median(r.get(s, 0.0) for r in rounds) for s in STAGES}
        figures[name] = {
            "token_ratio": tokens[name],
            "median_s": summary["median_s"],
            "images_per_s": summary["images_per_s"],
            "speedup_vs_full": full_median / summary["median_s"],
            "stages_s": {s: v for s, v in stages.items() if any(r.get(s) for r in rounds)},
        }
    warnings = []
    if others is not None and others > OTHER_LOAD_WARNING:
        warnings.append(f"batch {batch}: other processes used {others:.2f} CPUs while timing; figures are noisy")
    log.info("bench parts: batch %d timed", batch)
    return {"batch_size": batch, "models": figures, "others_cores": others, "warnings": warnings}


def _rotating(model: SplitViT, batches: list[torch.Tensor]) -> Callable[[], Any]:
    """A forward pass on the next of ``batches`` at every call."""
    turn = itertools.cycle(batches)
    return lambda: model(next(turn))


def _clocked(
    model: SplitViT, batches: list[torch.Tensor], sync: Callable[[], None], out: list[dict[str, float]]
) -> Callable[[], None]:
    """:func:`_rotating` with a stage clock attached; each call appends its stages' seconds."""
    turn = itertools.cycle(batches)

    def call() -> None:
        clock = StageClock(sync)
        model.clock = clock
        try:
            model(next(turn))
        finally:
            model.clock = None
        out.append(clock.seconds)

    return call


def format_parts_report(result: dict[str, Any]) -> str:
    """The result as text: per batch size, every model's speed and its stages in ms."""
    lines = [
        f"splitvit bench parts: {result['source']}",
        f"{device_label(result['machine'])}, {result['machine']['torch_threads']} torch threads, "
        f"{_precision(result['settings'])}; medians of {result['settings']['repeats']} interleaved rounds; "
        f"thresholds calibrated on {result['settings']['calibration_images']} images",
    ]
    for entry in result["batches"]:
        models = entry["models"]
        names = list(models)
        rows = [
            ["tokens / full", *(f"{models[n]['token_ratio']:.2f}" for n in names)],
            ["forward ms", *(f"{models[n]['median_s'] * 1e3:.2f}" for n in names)],
            ["images/s", *(f"{models[n]['images_per_s']:.0f}" for n in names)],
            ["speed-up vs full", *(f"{models[n]['speedup_vs_full']:.2f}x" for n in names)],
        ]
        for stage in result["stages"]:
            if any(stage in models[n]["stages_s"] for n in names):
                rows.append([f"  {stage} ms", *(_ms(models[n]["stages_s"].get(stage)) for n in names)])
        lines += ["", f"batch {entry['batch_size']}", *text_table(["", *names], rows)]
    lines += [f"warning: {w}" for w in result["warnings"]]
    return "\n".join(lines)


def _precision(settings: dict[str, Any]) -> str:
    """``bf16 autocast, torch.compile (4 token buckets)``, ``fp32, eager`` and the like
    (files written before these settings existed read as fp32, eager)."""
    text = "bf16 autocast" if settings.get("bf16") else "fp32"
    if not settings.get("compile"):
        return text + ", eager"
    buckets = settings.get("token_buckets")
    return text + ", torch.compile" + (f" ({buckets} token buckets)" if buckets else " (exact token counts)")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"
