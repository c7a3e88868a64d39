"""Distributed SPLIT training with Ray Train (V2 API) and MLflow tracking.

:func:`run_training` is the driver side: it opens the MLflow run, starts (or joins)
Ray, and runs a ``TorchTrainer`` whose workers execute :func:`train_loop_per_worker`:

* the model is built from the config on every worker and wrapped by
  ``ray.train.torch.prepare_model`` (DDP); data are sharded per worker with a
  ``DistributedSampler`` and moved to the device by ``prepare_data_loader``;
* each step is the shared SPLIT step (:func:`splitvit.train.steps.training_step`),
  run *inside* the DDP module's forward (:class:`SplitStep`), so DDP sees every
  gradient-carrying computation, the policy's teacher loss included;
* AdamW with linear warm-up and cosine decay, gradient clipping, bf16 autocast on CUDA;
* every epoch: validation on each worker's shard, figures combined across workers,
  ``ray.train.report(metrics, checkpoint)``; rank 0 then logs the epoch to MLflow
  with a split-map image;
* a worker failure restarts the group from the latest checkpoint (Ray's
  ``FailureConfig``); a re-run under the same name resumes too;
* a non-finite loss, gradient or split probability stops every worker at once,
  with status ``diverged``; the last good checkpoint stays the run's checkpoint;
* a label outside ``model.num_classes`` stops every worker at once too (not
  retried: it would fail again) and raises :class:`TrainingError` in the driver;
* Ctrl-C or SIGTERM in the driver aborts Ray Train's controller (which stops the
  workers), ends the MLflow run ``KILLED`` and raises
  :class:`~splitvit.errors.Interrupted` naming the last checkpoint, which a
  re-run under the same name resumes from.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ..config import AUTO_THRESHOLDS, ConfigError, ExperimentConfig, quality_metric, redact_uri
from .experiment import build_model
from ..errors import Interrupted, as_interrupted, error_line, note_signal
from ..tracking import RunTracker
from ..tracking.runs import CHECKPOINT_TAG
from .checkpoints import (
    MODEL_FILE,
    STATE_FILE,
    checkpoint_dir_name,
    init_weights,
    latest_checkpoint,
    rng_file,
    rng_state,
    set_rng_state,
    write_metrics,
)
from .local import warmup_cosine
from .steps import SplitLossConfig, calibrate_thresholds, evaluate, training_step

log = logging.getLogger(__name__)

#: Called at the start of every epoch on every worker: ``hook(epoch, world_rank, model)``.
#: An extension point (custom schedules, fault injection in tests); must be picklable.
EpochHook = Callable[[int, int, nn.Module], None]


class TrainingError(RuntimeError):
    """Training failed after Ray Train's retries were spent, or on an error that
    retries cannot mend (a bad label). The message ends with the root cause's (the
    exception a worker raised, unwrapped from Ray's), which is chained."""


@dataclass
class TrainResult:
    """What :func:`run_training` returns (and ``splitvit train --json`` writes).

    Attributes:
        name: the Ray Train run name.
        status: ``completed`` or ``diverged`` (non-finite loss, gradient or split
            probabilities).
        metrics: the last epoch's figures (accuracy or miou, tokens_per_image,
            token_ratio, images_per_s, train_loss...).
        checkpoint_uri: the latest checkpoint folder (local path or ``s3://``).
        run_uri: the run's folder under the storage path.
        mlflow_run_id: the MLflow run, when tracking is on.
        mlflow_model_uri: ``models:/<id>`` of the logged final model.
        tracking_uri: the MLflow store (password removed).
        start_epoch: the epoch the last attempt started from (> 0 after a resume).
        message: what went wrong, for a diverged run.
        completed_epochs: epochs that finished in this run, earlier attempts included
            (0 when it diverged in its first epoch: no metrics, no checkpoint).
    """

    name: str
    status: str
    metrics: dict[str, float]
    checkpoint_uri: str | None
    run_uri: str
    mlflow_run_id: str | None = None
    mlflow_model_uri: str | None = None
    tracking_uri: str | None = None
    start_epoch: int = 0
    message: str = ""
    completed_epochs: int = 0
    extras: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


# ---------------------------------------------------------------------- driver
def init_ray(address: str | None = None) -> None:
    """Join the Ray cluster the process belongs to, or start a local one.

    Inside a Ray job (``RAY_ADDRESS`` set) or with ``address``, connect to that
    cluster; otherwise start a new Ray instance on this machine. An
    already-initialised Ray is reused.
    """
    import ray

    if ray.is_initialized():
        return
    # ray.init replaces the SIGTERM handler with sys.exit; keep one the process set
    # (splitvit's: SIGTERM ends runs KILLED and says what was kept, as Ctrl-C does)
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or "auto")
    else:
        # the embedded default: Ray on this machine, dashboard on 127.0.0.1 (Ray Train
        # V2 also watches its controller through the dashboard's state API). "local",
        # not ray.init()'s default: that joins the last `ray start` cluster on the
        # machine (/tmp/ray/ray_current_cluster), someone else's maybe.
        ray.init(address="local")
    if callable(sigterm) and getattr(sigterm, "__module__", "").startswith("splitvit"):
        signal.signal(signal.SIGTERM, sigterm)


def run_training(
    config: ExperimentConfig,
    *,
    epoch_hook: EpochHook | None = None,
    ray_address: str | None = None,
    callbacks: Sequence[Any] | None = None,
) -> TrainResult:
    """Train ``config`` (already validated: build it with :func:`splitvit.config.load_config`).

    Re-running with the same ``storage.path`` and ``storage.name`` resumes from the
    latest checkpoint and continues the same MLflow run. ``callbacks`` go to Ray
    Train's ``RunConfig`` (``ray.train.UserCallback`` instances; a sweep trial passes Tune's
    ``TuneReportCallback`` so that its epochs reach Tune).

    Raises:
        TrainingError: the workers failed more often than ``train.max_failures``, or
            hit an error retries cannot mend; the message names the root cause.
        Interrupted: SIGINT or SIGTERM; the workers are stopped, the MLflow run ends
            ``KILLED`` and ``kept`` names the checkpoint a re-run resumes from.
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    init_ray(ray_address)
    _warn_if_storage_is_temporary(config)
    tracker = None
    if config.tracking.enabled:
        tracker, resumed = RunTracker.open(
            config.tracking_uri(),
            config.tracking.experiment,
            config.storage.run_uri(),
            config.storage.name,
            params=config.flat(redact=True),
            tags={"splitvit.storage": config.storage.resolved_path(), "splitvit.name": config.storage.name},
        )
        tracker.log_dict(config.to_dict(redact=True), "config.json")
    storage_path = config.storage.resolved_path()
    scaling = config.scaling
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": config, "tracker": tracker, "epoch_hook": epoch_hook},
        scaling_config=ray.train.ScalingConfig(
            num_workers=scaling.num_workers,
            use_gpu=scaling.use_gpu,
            resources_per_worker=dict(scaling.resources_per_worker) or None,
            placement_strategy=scaling.placement_strategy,
        ),
        run_config=ray.train.RunConfig(
            name=config.storage.name,
            storage_path=storage_path,
            failure_config=ray.train.FailureConfig(max_failures=config.train.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.storage.num_to_keep),
            callbacks=list(callbacks or []),
        ),
    )
    stopper = _SignalStop(trainer)
    log.info("training %s: %d worker(s), storage %s", config.storage.name, scaling.num_workers, redact_uri(storage_path))
    try:
        with tracker.closed_on_error() if tracker is not None else contextlib.nullcontext():
            try:
                result = trainer.fit()
            except KeyboardInterrupt as exc:
                raise _interrupted(exc, stopper, config, tracker) from None
            finally:
                stopper.restore()
    except ray.train.TrainingFailedError as exc:
        raise TrainingError(f"training {config.storage.name} failed: {error_line(exc)}") from exc
    outcome = result.return_value or {}
    # rank 0 always returns its outcome; none means the run was stopped from outside
    status = outcome.get("status", "interrupted")
    checkpoint_uri = _checkpoint_uri(result.checkpoint, storage_path)
    metrics = outcome.get("metrics") or dict(result.metrics or {})
    error = outcome.get("error")
    if tracker is not None:
        tags = {CHECKPOINT_TAG: checkpoint_uri or ""}
        if outcome.get("message"):
            tags["splitvit.message"] = outcome["message"][:2000]
        if error is not None:
            tags["splitvit.error"] = error_line(error)[:2000]
        tracker.close(status, tags=tags)
    if error is not None:  # every worker stopped on it: retrying would fail the same way
        raise TrainingError(f"training {config.storage.name} failed: {error_line(error)}"
                            + (f" (last good checkpoint {checkpoint_uri})" if checkpoint_uri else "")) from error
    if status != "completed":
        log.error("training %s stopped: %s (last good checkpoint: %s)", config.storage.name, outcome.get("message"), checkpoint_uri)
    return TrainResult(
        name=config.storage.name,
        status=status,
        metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        checkpoint_uri=checkpoint_uri,
        run_uri=config.storage.run_uri(),
        mlflow_run_id=tracker.run_id if tracker else None,
        mlflow_model_uri=outcome.get("model_uri"),
        tracking_uri=redact_uri(config.tracking_uri()) if tracker else None,
        start_epoch=int(outcome.get("start_epoch", 0)),
        message=outcome.get("message", ""),
        completed_epochs=int(metrics["epoch"]) + 1 if isinstance(metrics.get("epoch"), (int, float)) else 0,
    )


class _SignalStop:
    """Ctrl-C or SIGTERM during ``trainer.fit()``: abort Ray Train's controller (it
    stops the workers) and raise :class:`Interrupted` in the driver.

    Ray Train V2's ``fit`` installs a SIGINT handler of its own when it runs in the
    main thread (``_register_sigint_handler``: it aborts the controller, then exits
    0 or leaves the driver blocked); this one takes its place for SIGINT and SIGTERM
    and is undone after ``fit``. In a thread (a Tune trial) Ray installs none and
    neither does this.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, trainer: Any) -> None:
        self.controller = None
        self.abort_ref = None
        self.previous: dict[int, Any] = {}
        if hasattr(type(trainer), "_register_sigint_handler"):
            trainer._register_sigint_handler = self._register

    def _register(self, controller: Any) -> None:
        self.controller = controller
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        stop = note_signal(signum)  # ray.get re-raises it as a plain KeyboardInterrupt
        self.request_abort()
        raise stop

    def request_abort(self) -> None:
        if self.controller is not None and self.abort_ref is None:
            try:
                self.abort_ref = self.controller.abort.remote()
            except Exception as exc:  # noqa: BLE001 - the controller may be gone already
                log.debug("could not ask the Ray Train controller to abort: %s", exc)

    def wait(self, timeout_s: float = 60.0) -> None:
        """Abort the controller (once) and wait until it has stopped the workers."""
        import ray

        self.request_abort()
        if self.abort_ref is None:
            return
        try:
            ray.get(self.abort_ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            log.warning("Ray Train's controller did not stop within %.0f s", timeout_s)
        except Exception:  # noqa: BLE001 - the controller exits once it has aborted (RayActorError)
            pass

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self.previous.clear()


def _interrupted(exc: KeyboardInterrupt, stopper: _SignalStop, config: ExperimentConfig,
                 tracker: RunTracker | None) -> Interrupted:
    """Stop the workers after Ctrl-C or SIGTERM, record the last checkpoint on the
    MLflow run (which ``closed_on_error`` then ends KILLED) and say what was kept."""
    signum = as_interrupted(exc).signum
    stopper.wait()  # the workers stop before their folder is read
    checkpoint = latest_checkpoint(config.storage.run_uri())
    stopped = Interrupted(signum)
    if checkpoint:
        kept = (f"training {config.storage.name} stopped; kept its last checkpoint {redact_uri(checkpoint)} "
                "(run the same command again to resume from it)")
    else:
        kept = f"training {config.storage.name} stopped before its first checkpoint; nothing to resume from"
    if tracker is not None:
        try:
            tracker.set_tags({CHECKPOINT_TAG: checkpoint or "", "splitvit.message": f"{stopped}: {kept}"})
        except Exception as err:  # noqa: BLE001 - the run is still ended KILLED by closed_on_error
            log.warning("could not tag MLflow run %s: %s", tracker.run_id, err)
    log.info("%s: %s", stopped, kept)  # the caller says it (splitvit train: one line)
    return Interrupted(signum, kept)


def _warn_if_storage_is_temporary(config: ExperimentConfig) -> None:
    """A Ray job with a ``working_dir`` runs in a temporary copy of it: a relative
    storage path (the default ``runs``) would put checkpoints and the MLflow store there."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # set by Ray for job entrypoints
    if not raw or config.storage.is_remote or Path(config.storage.path).expanduser().is_absolute():
        return
    try:
        import json

        working_dir = (json.loads(raw).get("runtime_env") or {}).get("working_dir")
    except (ValueError, AttributeError):
        return
    if working_dir:
        log.warning("storage.path %r is relative and this Ray job runs in a temporary copy of its working_dir: "
                    "results go to %s, which Ray may delete; pass storage.path=s3://... or an absolute shared folder",
                    config.storage.path, config.storage.resolved_path())


def _checkpoint_uri(checkpoint, storage_path: str) -> str | None:
    """A checkpoint's location as a user gives it back: a local path or ``s3://...``."""
    if checkpoint is None:
        return None
    path = checkpoint.path
    if "://" in storage_path and "://" not in path:
        scheme = storage_path.split("://", 1)[0]
        return f"{scheme}://{path.lstrip('/')}"
    return path


# ---------------------------------------------------------------------- worker
class SplitStep(nn.Module):
    """The SPLIT training step as a module, for DDP.

    ``training_step`` needs the plain SplitViT (``.policy``, ``.relevance``) and, on
    teacher steps, runs a full-resolution relevance pass beside the model's forward.
    Running the whole step inside this module's ``forward`` lets DDP wrap it: every
    pass happens within DDP's forward, so its reducer sees every parameter that
    receives a gradient.
    """

    def __init__(self, model: nn.Module, loss: SplitLossConfig) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, images: torch.Tensor, target: torch.Tensor, epoch: int, generator: torch.Generator | None = None,
                step: int = 0):
        return training_step(self.model, images, target, self.loss, epoch, generator, step)


def _calibrate_thresholds(model, val_shard, count: int, target_ratio: float, device: torch.device) -> None:
    """``model.thresholds: auto``: thresholds that meet the token budget on this
    worker's first ``count`` validation images, averaged over workers so every rank
    (and the checkpoint) holds the same values."""
    from ..data import first_images

    local = calibrate_thresholds(model, first_images(val_shard, count).to(device), target_ratio) if len(val_shard) else None
    weight = 0.0 if local is None else 1.0
    values = _all_reduce([*(local or [0.0] * (model.levels - 1)), weight], device=device)
    if values[-1] > 0:
        model.set_thresholds([v / values[-1] for v in values[:-1]])


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def _world() -> tuple[int, int]:
    import ray.train

    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size()


def _all_reduce(values: list[float], op: str = "sum", device: torch.device | None = None) -> list[float]:
    """Sum (or max) a few numbers over all workers; the identity on one worker."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    # gloo reduces CPU tensors, NCCL CUDA ones
    on = device if (device is not None and dist.get_backend() == "nccl") else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.cpu().tolist()


def _agreed_keys(totals: dict[str, float], world: int) -> list[str]:
    """The statistic names of every worker, in one order, so that an all-reduce of
    their values lines up (a worker's step may report a statistic others do not)."""
    if world == 1 or not dist.is_initialized():
        return sorted(totals)
    gathered: list[list[str] | None] = [None] * world
    dist.all_gather_object(gathered, sorted(totals))
    return sorted(set().union(*gathered))


def _combine_eval(result: dict[str, float], task: str, device: torch.device) -> dict[str, float]:
    """Per-worker ``evaluate`` figures -> figures over the whole validation set."""
    n = float(result["images"])
    quality = quality_metric(task)
    elapsed = n / result["images_per_s"] if result["images_per_s"] > 0 else 0.0
    sums = _all_reduce([result[quality] * n, result["tokens_per_image"] * n, result["token_ratio"] * n, n], device=device)
    (longest,) = _all_reduce([elapsed], op="max", device=device)
    total = max(sums[3], 1.0)
    # mIoU from per-shard mIoUs weighted by images is an approximation (exact with one worker)
    return {
        quality: sums[0] / total,
        "tokens_per_image": sums[1] / total,
        "token_ratio": sums[2] / total,
        # workers evaluate in parallel: the set's throughput is its size over the slowest shard
        "images_per_s": sums[3] / longest if longest > 0 else 0.0,
        "val_images": sums[3],
    }


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any]:
    """One Ray Train worker's training loop (see the module docstring).

    ``loop_config`` holds ``config`` (an :class:`ExperimentConfig`), ``tracker`` (a
    :class:`RunTracker` or ``None``) and ``epoch_hook``. Returns, on every rank,
    ``{"status", "metrics", "start_epoch", "message", "model_uri"}``; Ray hands rank
    0's to the driver.
    """
    import ray.train
    import ray.train.torch

    from ..data import build_dataset

    config: ExperimentConfig = loop_config["config"]
    tracker: RunTracker | None = loop_config.get("tracker")
    hook: EpochHook | None = loop_config.get("epoch_hook")
    rank, world = _world()
    tracker = tracker if rank == 0 else None  # one writer: SQLite dislikes concurrent ones
    mc, dc, tc = config.model, config.data, config.train
    device = ray.train.torch.get_device()
    use_amp = tc.amp and device.type == "cuda"

    seed = dc.seed * 1000 + rank
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)  # warm-up random splits, per worker

    model = build_model(mc)
    checkpoint = ray.train.get_checkpoint()
    state: dict[str, Any] | None = None
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            folder = Path(folder)
            payload = torch.load(folder / MODEL_FILE, map_location="cpu", weights_only=False)
            model.load_state_dict(payload["state_dict"])
            state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
            own = folder / rng_file(rank)
            rng = torch.load(own, map_location="cpu", weights_only=False) if own.is_file() else None
        if rng is not None:
            set_rng_state(rng, generator)

    if state is None and mc.init_from:
        fresh = init_weights(model, mc.init_from)
        if rank == 0:
            log.info("initialised from %s (%d tensors not in it: %s)", mc.init_from, len(fresh), ", ".join(fresh[:8]))

    # find_unused_parameters: which parameters get gradients varies by phase (in the
    # random-split warm-up the policy gets none; the dense task never uses the ViT's
    # classifier); the graph walk costs little next to a SPLIT step.
    step = ray.train.torch.prepare_model(SplitStep(model, tc.loss_config()),
                                         parallel_strategy_kwargs={"find_unused_parameters": True})
    model = _unwrap(step).model
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)

    train_set = build_dataset(dc.name, "train", image_size=mc.image_size, seed=dc.seed, **dc.options)
    val_set = build_dataset(dc.name, dc.val_split, image_size=mc.image_size, seed=dc.seed, **dc.options)
    # our own DistributedSampler: its seed is the config's; prepare_data_loader keeps it
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=dc.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=dc.batch_size, sampler=sampler, num_workers=dc.num_workers,
                        drop_last=True, pin_memory=device.type == "cuda")
    loader = ray.train.torch.prepare_data_loader(loader)
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise ValueError(f"data: {len(train_set)} training images give no batch of {dc.batch_size} on each of {world} workers")
    total_steps = tc.epochs * steps_per_epoch
    warmup = tc.lr_warmup_steps if tc.lr_warmup_steps is not None else round(tc.lr_warmup_epochs * steps_per_epoch)
    scheduler = warmup_cosine(optimizer, min(warmup, total_steps), total_steps)
    # validation: each worker takes every world-th image (exact shards, no padding)
    val_shard = Subset(val_set, range(rank, len(val_set), world))
    val_loader = DataLoader(val_shard, batch_size=dc.eval_batch_size or dc.batch_size, shuffle=False, num_workers=dc.num_workers)

    start_epoch, metrics = 0, {}
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, metrics = state["epoch"] + 1, dict(state.get("metrics") or {})
        if tracker is not None and metrics:
            # the previous attempt may have stopped between its report and its MLflow write
            tracker.log_epoch(state["epoch"], metrics)
        if rank == 0:
            log.info("resuming %s from epoch %d", config.storage.name, state["epoch"])

    status, message, error = "completed", "", None
    for epoch in range(start_epoch, tc.epochs):
        if hook is not None:
            hook(epoch, rank, model)
        sampler.set_epoch(epoch)
        step.train()
        started = time.perf_counter()
        totals: dict[str, float] = {}
        counts: dict[str, int] = {}
        seen = 0
        for index, batch in enumerate(loader):
            images, target = batch[0], batch[1]
            bad, wrong = "", None
            try:
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
                    loss, stats = step(images, target, epoch, generator, index)
            except FloatingPointError as exc:
                bad = str(exc)
            except ConfigError as exc:  # a label outside model.num_classes: retrying would not help
                wrong = exc
            # every worker must stop at the same step, or the others hang in a collective
            any_bad, any_wrong = _all_reduce([1.0 if bad else 0.0, 1.0 if wrong else 0.0], op="max", device=device)
            if any_wrong:
                status, error = "failed", _first_error(wrong, world)
                message = str(error)
                break
            if any_bad:
                status, message = "diverged", bad or f"non-finite values on another worker at epoch {epoch}"
                break
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # gradients are all-reduced by now: every worker sees the same norm
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip if tc.grad_clip > 0 else math.inf)
            if not torch.isfinite(norm):
                status, message = "diverged", f"non-finite gradient norm {float(norm)} at epoch {epoch}"
                break
            optimizer.step()
            scheduler.step()
            seen += images.shape[0]
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1  # teacher_loss: teacher steps only
        if status != "completed":
            break
        train_time = time.perf_counter() - started
        keys = _agreed_keys(totals, world)
        sums = _all_reduce([totals.get(k, 0.0) for k in keys] + [float(counts.get(k, 0)) for k in keys] + [float(seen)],
                           device=device)
        (slowest,) = _all_reduce([train_time], op="max", device=device)
        seen_all = sums[-1]
        metrics = {f"train_{k}": v / max(n, 1.0) for k, v, n in zip(keys, sums[: len(keys)], sums[len(keys) : 2 * len(keys)])}
        metrics["train_images_per_s"] = seen_all / slowest
        metrics["lr"] = scheduler.get_last_lr()[0]
        if mc.thresholds == AUTO_THRESHOLDS and model.policy.thresholded:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):  # as evaluated
                _calibrate_thresholds(model, val_shard, dc.eval_batch_size or dc.batch_size, tc.target_ratio, device)
        if len(val_shard):
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
                figures = evaluate(model, val_loader, num_classes=mc.num_classes)
        else:  # more workers than validation images: this one adds nothing
            figures = {mc.metric: 0.0, "tokens_per_image": 0.0, "token_ratio": 0.0,
                       "images_per_s": 0.0, "images": 0}
        metrics.update(_combine_eval(figures, mc.task, device))
        metrics["epoch"] = epoch
        metrics["epoch_time_s"] = time.perf_counter() - started

        with tempfile.TemporaryDirectory(prefix="splitvit-ckpt-") as folder:
            folder = Path(folder)
            torch.save(rng_state(generator), folder / rng_file(rank))
            if rank == 0:
                model.save(folder / MODEL_FILE, extra={"epoch": epoch, "metrics": metrics, "config": config.to_dict(redact=True)})
                torch.save({"epoch": epoch, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                            "metrics": metrics, "world_size": world, "global_step": (epoch + 1) * steps_per_epoch},
                           folder / STATE_FILE)
                write_metrics(folder, metrics)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(folder)),
                             checkpoint_dir_name=checkpoint_dir_name(epoch))
        # Commit barrier. The controller registers a report only when it next polls
        # every worker (every couple of seconds); a worker that dies before that poll
        # takes its queued report with it and the epoch's checkpoint, though written,
        # is not the one a restart resumes from. Waiting here until the report is
        # committed makes "reported" mean "resumable", and MLflow (below) only ever
        # records committed epochs.
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        if rank == 0:
            log.info("epoch %d: %s", epoch, {k: round(v, 4) for k, v in metrics.items()})
        if tracker is not None:
            tracker.log_epoch(epoch, metrics)
            if config.tracking.split_map_images > 0:
                tracker.log_image(_split_map(model, val_set, config.tracking.split_map_images, device),
                                  f"split_maps/epoch_{epoch:04d}.png")

    model_uri = None
    if tracker is not None:
        if status == "completed":
            if metrics and (start_epoch < tc.epochs or not tracker.has_final()):
                tracker.log_final({k: v for k, v in metrics.items() if k != "epoch"})
            if config.tracking.log_model:
                model_uri = tracker.log_model(model, params={"levels": mc.levels, "policy": mc.policy})
        else:
            tracker.set_tags({"splitvit.status": status, "splitvit.message": message[:2000]})
    return {"status": status, "metrics": metrics, "start_epoch": start_epoch, "message": message, "model_uri": model_uri,
            "error": error}


def _first_error(own: BaseException | None, world: int) -> BaseException:
    """The error of the lowest rank that has one (every rank calls this together)."""
    if world > 1 and dist.is_available() and dist.is_initialized():
        gathered: list[BaseException | None] = [None] * world
        dist.all_gather_object(gathered, own)  # the project's exceptions pickle (splitvit.errors)
        own = next((e for e in gathered if e is not None), own)
    return own if own is not None else RuntimeError("a worker stopped on an error it could not send")


@torch.no_grad()
def _split_map(model, dataset, count: int, device: torch.device):
    """The policy's quadtree over the first ``count`` images of ``dataset``."""
    from ..tracking.split_maps import split_map_grid

    count = min(count, len(dataset))
    images = torch.stack([dataset[i][0] for i in range(count)])
    was_training = model.training
    model.eval()
    out = model(images.to(device))
    model.train(was_training)
    captions = [f"{int(t)}/{out.full_tokens} tok" for t in out.tokens]
    return split_map_grid(images, [d.cpu() for d in out.decisions], model.geometry, captions)
