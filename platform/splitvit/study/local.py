"""The study on one machine, without Ray: the same code path as ``splitvit study``
(:func:`~splitvit.study.execute.execute_study`: the same runs, stored-result reuse,
evaluation at matched token ratios, aggregation, goals, speed comparison and result)
with a local executor.

Each run is trained by :func:`fit_config_local`: the plain single-process loop
(:func:`~splitvit.train.local.fit_local`) with the config's phases and schedule, from
the same code as the Ray loop (:mod:`splitvit.train.phases`: the policy's lead epochs,
the fine-tune, the policy's epochs; bf16 autocast with ``train.amp``, AdamW, warm-up +
cosine, gradient clipping, auto thresholds calibrated after every epoch; a detector
validated by COCO's box and mask AP), on one device. :class:`LocalExecutor` runs the runs
in this process (``workers=1``) or in a pool of spawned processes sharing the device.
MLflow is optional (a lent GPU machine may have none): pass ``tracking_uri``.

``infra/gpu-check/single_gpu_study.py`` is the command line of :func:`run_study_local`.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import logging
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import ExperimentConfig, shared_canvas_cache
from ..jsontypes import JsonObject
from ..train.trial import TrainedRun
from .execute import StudyResult, execute_study, study_name
from .report import study_figure
from .runs import STUDY_RESULT_FILE, BackboneRun, RunFailure, RunOutcome, RunRequest, RunTrainer, study_run
from .spec import StudySpec, load_study

log = logging.getLogger(__name__)


def fit_config_local(
    config: ExperimentConfig, device: str, epoch_hook: Callable[[int, Any], None] | None = None
) -> TrainedRun:
    """Train ``config`` in this process on ``device`` (:func:`~splitvit.train.local.fit_local`
    with the config's phases and schedule, as the Ray loop runs them: ``train.policy.lead_epochs``,
    ``train.epochs``, ``train.policy.epochs``) into its run folder (``storage.path``/``storage.name``):
    ``model.pt`` and :data:`~splitvit.train.checkpoints.HISTORY_FILE`. A run whose training finished (both files
    there) is not trained again. A detector (``model.task: detection``) validates by
    COCO's box and mask AP, as on Ray. ``epoch_hook(epoch, model)``: called before each epoch.

    Returns what a :class:`~splitvit.study.runs.RunTrainer` returns, with ``history``
    (the per-epoch training and validation figures), ``steps`` and ``train_seconds``.
    """
    import torch

    from ..config import AUTO_THRESHOLDS
    from ..model.detection import SplitDetector, split_backbone
    from ..train.checkpoints import HISTORY_FILE, MODEL_FILE, init_weights
    from ..train.detection import detection_ground_truth
    from ..train.experiment import build_model
    from ..train.local import fit_config, validate

    mc, dc, tc = config.model, config.data, config.train
    folder = Path(config.storage.resolved_path()) / config.storage.name
    checkpoint, history_file = folder / MODEL_FILE, folder / HISTORY_FILE
    if checkpoint.is_file() and history_file.is_file():
        return _finished_run(checkpoint, history_file)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(dc.seed * 1000)  # as rank 0 of the Ray loop
    model = build_model(mc)
    if mc.init_from:
        init_weights(model, mc.init_from)
    model.to(device)
    detector = isinstance(model, SplitDetector)
    train_set, val_set, val_loader = _datasets(config, split_backbone(model).data_config["interpolation"], detector)
    steps_per_epoch = len(train_set) // dc.batch_size  # fit_config refuses 0 before training
    auto = mc.thresholds == AUTO_THRESHOLDS and split_backbone(model).policy.thresholded
    ground_truth = detection_ground_truth(val_set) if detector else None  # read once, as the Ray loop's rank 0
    history: list[dict[str, float]] = []
    epoch_started = [time.perf_counter()]

    def after_epoch(epoch: int, stats: dict[str, float]) -> None:
        # the figures the Ray loop reports: train_* means and the learning rates, then validation
        # after calibrating auto thresholds
        metrics = {k if k in ("lr", "lr_policy") else f"train_{k}": v for k, v in stats.items() if k != "epoch"}
        metrics.update(
            validate(
                model,
                val_set,
                val_loader,
                num_classes=mc.num_classes,
                amp=tc.amp,
                calibrate_to=tc.budget.target_ratio if auto else None,
                calibration_images=dc.eval_batch_size or dc.batch_size,
                ground_truth=ground_truth,
            )
        )
        metrics.update({"epoch": epoch, "epoch_time_s": time.perf_counter() - epoch_started[0]})
        epoch_started[0] = time.perf_counter()
        history.append(metrics)
        log.info(
            "%s epoch %d: %s",
            config.storage.name,
            epoch,
            {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)},
        )

    started = time.time()
    fit_config(model, train_set, config, on_epoch=after_epoch, epoch_hook=epoch_hook)
    loss = history[-1].get("train_loss", 0.0)
    if not math.isfinite(loss):  # fit_local does not stop on a non-finite loss: keep no checkpoint of it
        return TrainedRun("diverged", history[-1], None, f"non-finite training loss {loss} in the last epoch")
    model.save(
        checkpoint,
        extra={"epoch": tc.total_epochs - 1, "metrics": history[-1], "config": config.to_dict(redact=True)},
    )
    record = {"history": history, "train_seconds": time.time() - started, "steps": tc.total_epochs * steps_per_epoch}
    history_file.write_text(json.dumps(record, default=float))  # last: its presence says training finished
    return _finished_run(checkpoint, history_file)


def _finished_run(checkpoint: Path, history_file: Path) -> TrainedRun:
    """A finished run as :func:`fit_config_local` returns it, from its checkpoint and its
    history file (``history``, ``train_seconds``, ``steps``): read back as a later
    invocation reads it, so a reused run is the same record."""
    record = json.loads(history_file.read_text())
    return TrainedRun(
        "completed",
        record["history"][-1],
        str(checkpoint),
        history=record["history"],
        train_seconds=record.get("train_seconds"),
        steps=record.get("steps"),
    )


def _datasets(config: ExperimentConfig, interpolation: str, detector: bool) -> tuple[Any, Any, Any]:
    """The run's training and validation sets at the model's input size, and the
    validation loader (a detector's batches collated as lists)."""
    from torch.utils.data import DataLoader

    from ..data import detection_collate
    from ..train.experiment import experiment_datasets

    dc = config.data
    train_set, val_set = experiment_datasets(config, interpolation)
    val_loader = DataLoader(
        val_set,
        batch_size=dc.eval_batch_size or dc.batch_size,
        num_workers=dc.num_workers,
        collate_fn=detection_collate if detector else None,
    )
    return train_set, val_set, val_loader


@dataclass(frozen=True)
class LocalTrainer:
    """:func:`fit_config_local` on ``device``; evaluations on that device, in the calling process."""

    device: str = "cuda"

    def train(self, config: ExperimentConfig) -> TrainedRun:
        """:func:`fit_config_local` of ``config`` on :attr:`device`."""
        return fit_config_local(config, self.device)

    def evaluate(self, config: ExperimentConfig, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn`` here, on :attr:`device`."""
        return fn(*args, device=self.device, **kwargs)


def _pool_init(threads: int) -> None:
    """A pool process: log to stdout like the parent; few threads, the runs share the CPUs."""
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout, force=True)
    torch.set_num_threads(threads)


def _failure(run: RunRequest, exc: BaseException) -> RunFailure:
    log.error("run %s failed: %r", run.to_dict(), exc)
    return RunFailure(run, repr(exc))


@dataclass
class LocalExecutor:
    """The runs on this machine: in this process (``workers=1``) or in a pool of
    ``workers`` spawned processes (CUDA in each) sharing the trainer's device, each with
    ``threads`` CPU threads; the pool lives until :meth:`close`. A finished run that
    is evaluated again (other evaluation settings) runs here, not in the pool.
    ``seconds`` holds what preparing and each stage that ran took."""

    trainer: RunTrainer = field(default_factory=LocalTrainer)
    workers: int = 1
    threads: int = 2
    seconds: dict[str, float] = field(default_factory=dict)
    _pool: futures.ProcessPoolExecutor | None = field(default=None, repr=False)

    def start(self, spec: StudySpec) -> None:
        """Render every canvas into the cache first: the renderer forks, which a process
        that holds CUDA must not."""
        started = time.time()
        prerender(spec)
        self.seconds["render"] = time.time() - started

    def run(
        self,
        spec: StudySpec,
        storage: str,
        runs: list[RunRequest],
        stage: str,
        backbones: dict[int, str] | None = None,
    ) -> list[RunOutcome]:
        """:func:`~splitvit.study.runs.study_run` for each of ``runs``, in order."""
        started = time.time()
        results: dict[int, RunOutcome] = {}
        submitted: dict[int, futures.Future] = {}
        for index, run in enumerate(runs):
            folder = Path(storage) / run.name
            if self.workers <= 1 or (folder / STUDY_RESULT_FILE).is_file():
                try:
                    results[index] = study_run(spec, storage, run, self.trainer, backbones)
                except Exception as exc:  # noqa: BLE001 - reported as the run's failure; the others go on
                    results[index] = _failure(run, exc)
            else:
                submitted[index] = self._pool_executor().submit(study_run, spec, storage, run, self.trainer, backbones)
        for index, job in submitted.items():
            try:
                results[index] = job.result()
            except Exception as exc:  # noqa: BLE001
                results[index] = _failure(runs[index], exc)
        self.seconds[stage] = time.time() - started
        return [results[index] for index in range(len(runs))]

    def _pool_executor(self) -> futures.ProcessPoolExecutor:
        if self._pool is None:  # processes start as runs need them, up to ``workers``
            self._pool = futures.ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=multiprocessing.get_context("spawn"),  # CUDA in each
                initializer=_pool_init,
                initargs=(self.threads,),
            )
        return self._pool

    def close(self) -> None:
        """Stop the pool's processes (a later :meth:`run` starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def prerender(spec: StudySpec) -> None:
    """Every seed's canvases of every split the study reads, into the canvas cache
    (``data.options.cache_dir``; nothing to do without one)."""
    from ..data import build_dataset

    for seed in spec.seeds:
        config = spec.run_config(seed, next(iter(spec.methods)), "render")
        dc = config.data
        if "cache_dir" not in dc.options:
            return
        for split in dict.fromkeys(("train", dc.val_split, "val", spec.split)):
            options = dict(dc.options)
            if split == spec.split and spec.samples is not None:
                options[f"{split}_samples"] = spec.samples
            started = time.time()
            data = build_dataset(dc.name, split, image_size=config.model.image_size, seed=dc.seed, **options)
            log.info("seed %d %s: %d canvases ready in %.1f s", seed, split, len(data), time.time() - started)


def load_local_study(
    study_path: str | Path,
    out: str | Path,
    *,
    scale: str | None = None,
    overrides: list[str] | None = None,
    methods: list[str] | None = None,
    backbone_epochs: int | None = None,
    method_epochs: int | None = None,
    eval_samples: int | None = None,
) -> StudySpec:
    """:func:`~splitvit.study.spec.load_study` with the local runner's settings:
    ``backbone_epochs`` (all warm-up curriculum), ``method_epochs``, ``eval_samples``
    held-out images, and cluttered canvases rendered once into ``out``/canvas-cache."""
    spec = load_study(study_path, scale=scale, overrides=overrides, methods=methods)
    if backbone_epochs is not None:
        spec.backbone.update({"train.epochs": backbone_epochs, "train.policy.warmup_epochs": backbone_epochs})
    if method_epochs is not None:
        spec.method["train.epochs"] = method_epochs
    if eval_samples is not None:
        spec.samples = eval_samples
    base = spec.run_config(spec.seeds[0], None, "base")
    spec.fixed.update(shared_canvas_cache(base, root=out))  # no storage path here: the study's own folder
    return spec


@dataclass
class LocalStudyResult:
    """What :func:`run_study_local` produced: the study's result (the ``--json`` of
    ``splitvit study``) and what the local runner adds (its JSON's further keys)."""

    result: StudyResult
    executor: str  # how the runs ran, in words
    machine: dict[str, str | int | None]  # python, torch, cpus, device (and device_name on CUDA)
    render_seconds: float | None  # rendering the canvas cache
    backbone_seconds: float | None  # the backbones' stage
    backbone_epochs: int | None
    method_epochs: int | None
    backbones: list[BackboneRun]  # the finished backbones' stored results (their config left out)

    def to_dict(self) -> JsonObject:
        """The JSON of ``infra/gpu-check/single_gpu_study.py``: the study's keys, then the
        runner's (every run carries its training curves, ``history``)."""
        return {
            **self.result.to_dict(),
            "executor": self.executor,
            "machine": dict(self.machine),
            "render_seconds": self.render_seconds,
            "backbone_seconds": self.backbone_seconds,
            "backbone_epochs": self.backbone_epochs,
            "method_epochs": self.method_epochs,
            "backbones": [backbone.to_dict() for backbone in self.backbones],
        }

    @classmethod
    def from_dict(cls, data: JsonObject) -> LocalStudyResult:
        """The inverse of :meth:`to_dict`, e.g. a smaller run's JSON read back for
        :func:`plan_epochs` (a missing key raises ``KeyError``)."""
        return cls(
            result=StudyResult.from_dict(data),
            executor=data["executor"],
            machine=dict(data["machine"]),
            render_seconds=data["render_seconds"],
            backbone_seconds=data["backbone_seconds"],
            backbone_epochs=data["backbone_epochs"],
            method_epochs=data["method_epochs"],
            backbones=[BackboneRun.from_dict(backbone) for backbone in data["backbones"]],
        )


def run_study_local(
    spec: StudySpec,
    out: str | Path,
    *,
    device: str = "cuda",
    workers: int = 1,
    name: str | None = None,
    tracking_uri: str | None = None,
    started: float | None = None,
) -> LocalStudyResult:
    """Run (or, where ``out`` holds finished runs, finish) the study ``spec`` on this
    machine's ``device`` (:class:`LocalExecutor`), its runs under ``out``/train, the
    figure at ``out``/study.png; MLflow records it only with ``tracking_uri``.

    Returns the study's result, the machine, stage times, epochs and the backbones'
    results; every run carries its training curves (``history``). Every recipe runs:
    detection studies and methods with the policy's own epochs (``train.policy.lead_epochs``,
    ``train.policy.epochs``) train through the Ray loop's phases (:func:`fit_config_local`).
    Raises :class:`~splitvit.study.spec.StudyError` when ``out`` holds runs made with
    other settings.
    """
    import torch

    started = time.time() if started is None else started
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    executor = LocalExecutor(LocalTrainer(device), workers=workers)
    name = study_name(spec.source, spec.scale, name)
    try:
        result, backbones = execute_study(
            spec, executor, name=name, study_dir=str(out), tracking_uri=tracking_uri, started=started
        )
    finally:
        executor.close()
    machine: dict[str, str | int | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "device": device,
    }
    if device.startswith("cuda"):
        machine["device_name"] = torch.cuda.get_device_name(device)
    if result.rows:
        import matplotlib.pyplot as plt

        fig = study_figure(
            result.rows,
            result.metric,
            title=f"{name}: {result.metric} vs tokens ({len(spec.seeds)} seeds, one {device} device)",
        )
        fig.savefig(out / "study.png")
        plt.close(fig)
    return LocalStudyResult(
        result=result,
        executor=f"{'one process' if workers <= 1 else f'a pool of {workers} processes'} on one machine "
        f"(splitvit.study.local): no Ray{'' if tracking_uri else ', no MLflow'}",
        machine=machine,
        render_seconds=executor.seconds.get("render"),
        backbone_seconds=executor.seconds.get("backbones"),
        backbone_epochs=spec.backbone.get("train.epochs"),
        method_epochs=spec.method.get("train.epochs"),
        backbones=[replace(b, config=None) for b in backbones],
    )


def plan_epochs(
    smoke: LocalStudyResult, spec: StudySpec, budget_s: float, workers: int, fixed_s: float = 60.0
) -> dict[str, int]:
    """Epochs for ``spec`` that fit ``budget_s`` on the machine ``smoke`` (a smaller
    :func:`run_study_local` result, e.g. its JSON file read back, same workers) ran on: ``backbone_epochs``,
    ``method_epochs``, ``estimated_s`` and ``train_images``. Training time from each run's
    measured images/s, evaluation scaled by the evaluated images, the method runs spread
    over ``workers``; ``fixed_s`` covers rendering, start-up and the speed comparison.

    Raises ``ValueError`` when not even one method epoch fits.
    """
    train_images = len(_dataset(spec, "train"))
    test_images = len(_dataset(spec, spec.split, spec.samples))
    runs, smoke_seeds = smoke.result.runs, len(smoke.result.seeds)
    smoke_test = runs[0].points[0].images
    backbone_ips = min(_train_images_per_s(b.history) for b in smoke.backbones)
    method_s_per_epoch = (
        sum(train_images / _train_images_per_s(r.history) for r in runs) * len(spec.seeds) / smoke_seeds
    )
    eval_s = sum(r.eval_seconds for r in runs) * test_images / smoke_test * len(spec.seeds) / smoke_seeds
    best = None
    for method_epochs in range(1, 101):
        backbone_s = 2 * method_epochs * train_images / backbone_ips
        methods_s = (method_epochs * method_s_per_epoch + eval_s) / workers * 1.15  # imperfect packing
        if fixed_s + backbone_s + methods_s > budget_s:
            break
        best = {
            "backbone_epochs": 2 * method_epochs,
            "method_epochs": method_epochs,
            "estimated_s": round(fixed_s + backbone_s + methods_s),
            "train_images": train_images,
        }
    if best is None:
        raise ValueError(f"not even one method epoch fits {budget_s} s")
    return best


def _train_images_per_s(history: list[dict[str, float]] | None) -> float:
    """A run's training images/s, the mean over its epochs (``KeyError``: a run that kept no curve)."""
    if not history:
        raise KeyError("history")
    return statistics.fmean(h["train_images_per_s"] for h in history)


def _dataset(spec: StudySpec, split: str, samples: int | None = None):
    from ..data import build_dataset

    config = spec.run_config(spec.seeds[0], next(iter(spec.methods)), "plan")
    options = {k: v for k, v in config.data.options.items() if k != "cache_dir"}
    if samples is not None:
        options[f"{split}_samples"] = samples
    return build_dataset(config.data.name, split, image_size=config.model.image_size, seed=0, **options)
