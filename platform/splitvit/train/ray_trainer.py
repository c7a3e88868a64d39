"""Distributed SPLIT training with Ray Train (V2 API) and MLflow tracking.

:func:`run_training` is the driver side: it opens the MLflow run, starts (or joins)
Ray, and runs a ``TorchTrainer`` whose workers execute :func:`train_loop_per_worker`:

* the model is built from the config on every worker and wrapped by
  ``ray.train.torch.prepare_model`` (DDP); data are sharded per worker with a
  ``DistributedSampler`` (by row group for parquet shards) and moved to the device by ``prepare_data_loader``;
* each step is the shared SPLIT step (:func:`splitvit.train.steps.training_step`),
  run *inside* the DDP module's forward (:class:`SplitStep`), so DDP sees every
  gradient-carrying computation, the policy's teacher loss included;
* AdamW with linear warm-up and cosine decay, gradient clipping, bf16 autocast on CUDA;
* every epoch: validation on each worker's shard, figures combined across workers,
  ``ray.train.report(metrics, checkpoint)``; rank 0 then logs the epoch to MLflow
  with a split-map image;
* a worker failure restarts the group from the latest checkpoint (Ray's
  ``FailureConfig``), unless it is marked deterministic (a strict corrupt file, an
  unreadable checkpoint: :mod:`.failures`); a re-run under the same name resumes too,
  past an unreadable checkpoint to the newest intact one;
* a non-finite loss, gradient or split probability stops every worker at once,
  with status ``diverged``; the last good checkpoint stays the run's checkpoint;
* a label outside ``model.num_classes`` stops every worker at once too (not
  retried: it would fail again) and raises :class:`TrainingError` in the driver;
* Ctrl-C or SIGTERM in the driver aborts Ray Train's controller (which stops the
  workers), logs the kept checkpoint's epochs the MLflow run lacks, ends it ``KILLED``
  and raises
  :class:`~splitvit.errors.Interrupted` naming the last checkpoint, which a
  re-run under the same name resumes from.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import json
import logging
import math
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ..config import AUTO_THRESHOLDS, ConfigError, ExperimentConfig, config_layers, redact_uri
from ..data.parquet import training_sampler
from ..errors import Interrupted, as_interrupted, error_line, is_deterministic, note_signal
from ..jsontypes import JsonObject
from ..model.detection import SplitDetector, split_backbone
from ..tracking import RunTracker
from ..tracking.runs import CHECKPOINT_TAG
from .allocator import get_allocator, loaded_library, worker_env_vars
from .checkpoints import (
    METRICS_FILE,
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
    TrainState,
    checkpoint_dir_name,
    checkpoint_problem,
    earlier_checkpoints,
    init_weights,
    latest_checkpoint,
    read_history,
    read_training_checkpoint,
    rng_file,
    rng_state,
    set_rng_state,
    write_history,
    write_metrics,
)
from .detection import (
    DetectionFigures,
    DetectionTotals,
    detection_area_ranges,
    detection_ground_truth,
    evaluate_detection_totals,
)
from .experiment import build_model, validate_experiment
from .local import param_groups
from .phases import SplitStep, lr_schedule  # shared with the local loop (train/local.py)
from .steps import EvalTotals, calibrate_thresholds, evaluate_totals

if TYPE_CHECKING:
    from PIL import Image

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
    extras: dict[str, float] = field(default_factory=dict)  # further figures (none today; kept in the JSON)

    def to_dict(self) -> JsonObject:
        """Plain dict for JSON."""
        return asdict(self)


@dataclass(frozen=True)
class WorkerOutcome:
    """What :func:`train_loop_per_worker` returns on every rank (Ray hands rank 0's to
    the driver): how training ended and the last epoch's figures."""

    status: str  # completed, diverged (a non-finite loss...), or interrupted (stopped from outside)
    metrics: dict[str, float]  # the last epoch's
    start_epoch: int = 0  # the epoch this attempt started from (> 0 after a resume)
    message: str = ""  # what went wrong, for a run that did not complete
    model_uri: str | None = None  # the logged final model (models:/<id>), with tracking
    error: BaseException | None = None  # the error every worker stopped on (None: none)


# ---------------------------------------------------------------------- driver
def init_ray(address: str | None = None, *, worker_logs: bool | None = None) -> None:
    """Join the Ray cluster the process belongs to, or start a local one.

    Inside a Ray job (``RAY_ADDRESS`` set) or with ``address``, connect to that
    cluster; otherwise start a new Ray instance on this machine. An
    already-initialised Ray is reused. ``worker_logs=False`` keeps Ray's processes'
    output (Train workers and controllers, Ray's own log lines and tracebacks among
    it) off this console (``log_to_driver``); it stays in the Ray dashboard and the
    session's log files. ``None`` follows the process's logging level: forwarded with
    ``-v`` (INFO), kept off otherwise (the driver prints each epoch's line itself:
    :func:`run_training`'s ``on_epoch``).
    """
    import ray

    if ray.is_initialized():
        return
    if worker_logs is None:
        worker_logs = logging.getLogger().isEnabledFor(logging.INFO)
    # ray.init replaces the SIGTERM handler with sys.exit; keep one the process set
    # (splitvit's: SIGTERM ends runs KILLED and says what was kept, as Ctrl-C does)
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    # Ray's own driver log lines (its start, its token-auth notice) follow the process's
    # level: shown with -v (INFO), else only Ray's errors
    level = logging.INFO if logging.getLogger().isEnabledFor(logging.INFO) else logging.ERROR
    if address or os.environ.get("RAY_ADDRESS"):
        # a cluster on loopback (the tests', a local one started the same way) is
        # reached on loopback: Ray would turn 127.0.0.1 into the machine's address
        joining = local_ray_start() if _is_loopback(address or os.environ["RAY_ADDRESS"]) else contextlib.nullcontext()
        with joining:
            ray.init(address=address or "auto", log_to_driver=worker_logs, logging_level=level)
    else:
        # the embedded default: Ray on this machine, dashboard on 127.0.0.1 (Ray Train
        # V2 also watches its controller through the dashboard's state API). "local",
        # not ray.init()'s default: that joins the last `ray start` cluster on the
        # machine (/tmp/ray/ray_current_cluster), someone else's maybe.
        with local_ray_start():
            ray.init(address="local", log_to_driver=worker_logs, logging_level=level)
    if callable(sigterm) and getattr(sigterm, "__module__", "").startswith("splitvit"):
        signal.signal(signal.SIGTERM, sigterm)


#: Ray's switch for its single-machine mode (named for the platforms where it is the
#: default): the node's address is 127.0.0.1 and every Ray server binds loopback
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def local_ray_start() -> Iterator[None]:
    """While a local Ray instance starts (``ray.init(address="local")``): its servers
    listen on 127.0.0.1 only, and its processes run in a session of their own. Also
    while a driver joins a cluster on loopback (it must look for its node there).

    Loopback: Ray resolves a node address of 127.0.0.1 to the machine's routable
    address (``_node_ip_address`` alone does not help) and its gRPC servers listen on
    all interfaces, unless its single-machine mode is on; the switch is read by the
    processes Ray starts (from the environment) and by this one (a constant Ray read
    on import). A multi-node cluster (``--address``, ``RAY_ADDRESS``) is not started
    here and keeps its configured addresses.

    A session of their own: a signal to the driver's process group (``timeout``, a
    batch scheduler, Ctrl-C in a terminal) reaches the driver only. Ray's GCS,
    raylet and workers would otherwise die of the group's SIGTERM at once, and the
    driver could neither stop its Train controller cleanly nor read what was kept
    (it waited 60 s on a dead controller). They still end with the driver: Ray ties
    them to it (``PR_SET_PDEATHSIG``) and ``ray.shutdown`` stops them.
    """
    import ray._private.ray_constants as ray_constants
    import ray._private.services as services

    saved = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER, services.ConsolePopen
    base = saved[2]

    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Ray starts its processes by calling ConsolePopen; a caller's own start_new_session wins
    services.ConsolePopen = functools.partial(base, start_new_session=True)
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = saved[0]
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]
        services.ConsolePopen = base


def _is_loopback(address: str) -> bool:
    """True for a Ray address (``host:port``, ``ray://host:port``) on this machine's loopback."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def run_training(
    config: ExperimentConfig,
    *,
    epoch_hook: EpochHook | None = None,
    ray_address: str | None = None,
    callbacks: Sequence[Any] | None = None,
    on_epoch: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainResult:
    """Train ``config`` (build it with :func:`splitvit.train.experiment.load_experiment`;
    it is validated again here, before Ray starts).

    Re-running with the same ``storage.path`` and ``storage.name`` resumes from the
    latest checkpoint and continues the same MLflow run. ``callbacks`` go to Ray
    Train's ``RunConfig`` (``ray.train.UserCallback`` instances; a sweep trial passes Tune's
    ``TuneReportCallback`` so that its epochs reach Tune). ``on_epoch(epoch, metrics)``
    is called in this process for each epoch Ray commits (its checkpoint's
    ``metrics.json``, watched by :class:`EpochWatcher`): the console's progress when
    the workers' own output is not forwarded.

    Raises:
        TrainingError: the workers failed more often than ``train.max_failures``, or
            hit an error retries cannot mend; the message names the root cause.
        Interrupted: SIGINT or SIGTERM; the workers are stopped, the MLflow run ends
            ``KILLED`` and ``kept`` names the checkpoint a re-run resumes from.
    """
    validate_experiment(config)  # for callers that built the config themselves: before Ray, cheap (meta device)
    init_ray(ray_address)
    _warn_if_storage_is_temporary(config)
    _warn_if_resume_checkpoint_is_unreadable(config)
    tracker = _open_tracker(config)
    storage_path = config.storage.resolved_path()
    trainer = _torch_trainer(config, storage_path, tracker, epoch_hook, callbacks)
    watcher = EpochWatcher(config.storage.run_uri(), on_epoch) if on_epoch is not None else None
    try:
        result = _fit(trainer, config, tracker)
    finally:
        if watcher is not None:
            watcher.stop()
    outcome = _rank0_outcome(result)
    checkpoint_uri = _checkpoint_uri(result.checkpoint, storage_path)
    _end_run(config, tracker, outcome, checkpoint_uri)
    return TrainResult(
        name=config.storage.name,
        status=outcome.status,
        metrics={k: v for k, v in outcome.metrics.items() if isinstance(v, (int, float))},
        checkpoint_uri=checkpoint_uri,
        run_uri=config.storage.run_uri(),
        mlflow_run_id=tracker.run_id if tracker else None,
        mlflow_model_uri=outcome.model_uri,
        tracking_uri=redact_uri(config.tracking_uri()) if tracker else None,
        start_epoch=int(outcome.start_epoch),
        message=outcome.message,
        completed_epochs=_completed_epochs(outcome.metrics),
    )


def _open_tracker(config: ExperimentConfig) -> RunTracker | None:
    """The run's MLflow run (re-opened when a run of the same storage key exists), with
    the config logged; ``None`` with tracking off."""
    if not config.tracking.enabled:
        return None
    tracker, _ = RunTracker.open(
        config.tracking_uri(),
        config.tracking.experiment,
        config.storage.run_uri(),
        config.storage.name,
        params=config.flat(redact=True),
        tags={"splitvit.storage": config.storage.resolved_path(), "splitvit.name": config.storage.name},
    )
    tracker.log_dict(config.to_dict(redact=True), "config.json")
    # what `splitvit config` prints: each key's value and the layer (recipe, file, --set...) that set it
    tracker.log_dict(config_layers(config), "config_layers.json")
    tracker.log_datasets(config.data)
    return tracker


def _torch_trainer(
    config: ExperimentConfig,
    storage_path: str,
    tracker: RunTracker | None,
    epoch_hook: EpochHook | None,
    callbacks: Sequence[Any] | None,
) -> Any:
    """The ``TorchTrainer`` that runs :func:`train_loop_per_worker` on ``scaling.num_workers`` workers."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from ..storage import ray_storage
    from .failures import use_policy

    scaling = config.scaling
    # s3:// storage goes through a filesystem with the project's S3 settings, not one Ray builds
    ray_path, ray_filesystem = ray_storage(storage_path)
    failure_config = ray.train.FailureConfig(max_failures=config.train.max_failures)
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
            storage_path=ray_path,
            storage_filesystem=ray_filesystem,
            failure_config=failure_config,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.storage.num_to_keep),
            callbacks=list(callbacks or []),
            worker_runtime_env=worker_runtime_env(config),
        ),
    )
    use_policy(trainer, failure_config)  # a deterministic error (strict data) is not retried
    log.info(
        "training %s: %d worker(s), storage %s", config.storage.name, scaling.num_workers, redact_uri(storage_path)
    )
    return trainer


def worker_runtime_env(config: ExperimentConfig) -> dict[str, dict[str, str]] | None:
    """The training workers' own Ray runtime environment: ``scaling.allocator``'s
    environment variables (:func:`~splitvit.train.allocator.worker_env_vars`), None
    with the default allocator, so that the workers start as they always did. Ray
    merges them into the job's runtime environment; only the workers get them, not the
    driver nor Ray Train's controller."""
    env_vars = worker_env_vars(config.scaling.allocator)
    return {"env_vars": env_vars} if env_vars else None


class EpochWatcher:
    """Calls ``on_epoch(epoch, metrics)`` from a thread of the driver for each
    ``checkpoint_epochNNNN/metrics.json`` that appears under ``run_uri`` (local or
    ``s3://``), in epoch order; checkpoints already there when it starts (a resumed
    run's) are not reported again. ``stop`` reports the last ones and ends it."""

    def __init__(self, run_uri: str, on_epoch: Callable[[int, dict[str, float]], None], interval: float = 1.0):
        self.run_uri, self.on_epoch, self.interval = run_uri, on_epoch, interval
        self._seen = set(self._epochs())
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitvit-epochs", daemon=True)
        self._thread.start()

    def _epochs(self) -> dict[int, str]:
        from ..storage import exists, list_files

        try:
            if not exists(self.run_uri):
                return {}
            files = list_files(self.run_uri, METRICS_FILE)
        except OSError:  # storage briefly unreadable: the next poll tries again
            return {}
        found = {}
        for path in files:
            match = re.search(r"checkpoint_epoch(\d+)/" + re.escape(METRICS_FILE) + "$", path)
            if match:
                found[int(match.group(1))] = path
        return found

    def _report_new(self) -> None:
        from ..storage import read_bytes

        for epoch, path in sorted(self._epochs().items()):
            if epoch in self._seen:
                continue
            try:
                metrics = json.loads(read_bytes(path))
            except (OSError, ValueError):  # being written: the next poll reads it whole
                continue
            self._seen.add(epoch)
            self.on_epoch(epoch, metrics)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            self._report_new()

    def stop(self) -> None:
        """Report what is there, then end the thread."""
        self._stopped.set()
        self._thread.join(timeout=10)
        self._report_new()


def _fit(trainer: Any, config: ExperimentConfig, tracker: RunTracker | None) -> Any:
    """``trainer.fit()``, its result; a signal stops the workers and raises
    :class:`Interrupted`, spent retries raise :class:`TrainingError` (the MLflow run
    is ended in both cases)."""
    import ray.train

    stopper = _SignalStop(trainer)
    try:
        with tracker.closed_on_error() if tracker is not None else contextlib.nullcontext():
            try:
                return trainer.fit()
            except KeyboardInterrupt as exc:
                raise _interrupted(exc, stopper, config, tracker) from None
            finally:
                stopper.restore()
    except ray.train.TrainingFailedError as exc:
        deterministic = config.train.max_failures != 0 and is_deterministic(exc)
        retries = " (not retried: it would fail the same way)" if deterministic else ""
        raise TrainingError(f"training {config.storage.name} failed: {error_line(exc)}{retries}") from exc


def _rank0_outcome(result: Any) -> WorkerOutcome:
    """What rank 0's :func:`train_loop_per_worker` returned. Rank 0 always returns its
    outcome; none means the run was stopped from outside: status ``interrupted`` and
    the last reported metrics."""
    outcome: WorkerOutcome | None = result.return_value
    if outcome is None:
        return WorkerOutcome("interrupted", dict(result.metrics or {}))
    return outcome if outcome.metrics else replace(outcome, metrics=dict(result.metrics or {}))


def _end_run(
    config: ExperimentConfig, tracker: RunTracker | None, outcome: WorkerOutcome, checkpoint_uri: str | None
) -> None:
    """End the MLflow run with the outcome's status, checkpoint, message and error;
    raise :class:`TrainingError` when the workers stopped on an error."""
    status, error = outcome.status, outcome.error
    if tracker is not None:
        tags = {CHECKPOINT_TAG: checkpoint_uri or ""}
        if outcome.message:
            tags["splitvit.message"] = outcome.message[:2000]
        if error is not None:
            tags["splitvit.error"] = error_line(error)[:2000]
        tracker.close(status, tags=tags)
    if error is not None:  # every worker stopped on it: retrying would fail the same way
        raise TrainingError(
            f"training {config.storage.name} failed: {error_line(error)}"
            + (f" (last good checkpoint {checkpoint_uri})" if checkpoint_uri else "")
        ) from error
    if status != "completed":
        log.error(
            "training %s stopped: %s (last good checkpoint: %s)",
            config.storage.name,
            outcome.message,
            checkpoint_uri,
        )


def _completed_epochs(metrics: dict[str, float]) -> int:
    """Epochs finished, earlier attempts included: the last reported epoch + 1 (0 with none)."""
    return int(metrics["epoch"]) + 1 if isinstance(metrics.get("epoch"), (int, float)) else 0


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

    def wait(self, timeout_s: float = 5.0) -> None:
        """Abort the controller (once) and wait until it has stopped the workers: 1-2 s
        on the busy 2-core machine. Bounded well inside the 15 s a stop may take: a
        controller signalled itself (a scheduler that signals every process of the
        job) never answers, and a Ray whose GCS or raylet exited is not waited on."""
        import ray

        self.request_abort()
        if self.abort_ref is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ray.get(self.abort_ref, timeout=0.5)
                return
            except ray.exceptions.GetTimeoutError:
                if _local_ray_gone():  # signalled too (every process of the job): no one left to answer
                    log.warning("the local Ray stopped before Ray Train's controller answered")
                    return
                if time.monotonic() > deadline:
                    log.warning("Ray Train's controller did not stop within %.0f s", timeout_s)
                    return
            except Exception:  # noqa: BLE001 - the controller exits once it has aborted (RayActorError)
                return

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self.previous.clear()


def _local_ray_gone() -> bool:
    """True when the GCS or the raylet of the Ray this driver started has exited (a
    scheduler that signals every process of the job); False for a joined cluster."""
    import ray._private.worker as ray_worker

    processes = getattr(getattr(ray_worker, "_global_node", None), "all_processes", None) or {}
    for kind in ("gcs_server", "raylet"):
        for info in processes.get(kind, []):
            if getattr(info, "process", None) is not None and info.process.poll() is not None:
                return True
    return False


def _interrupted(
    exc: KeyboardInterrupt, stopper: _SignalStop, config: ExperimentConfig, tracker: RunTracker | None
) -> Interrupted:
    """Stop the workers after Ctrl-C or SIGTERM, record the last checkpoint on the
    MLflow run (which ``closed_on_error`` then ends KILLED) and say what was kept."""
    signum = as_interrupted(exc).signum
    stopper.wait()  # the workers stop before their folder is read
    checkpoint = latest_checkpoint(config.storage.run_uri())
    stopped = Interrupted(signum)
    if tracker is not None and checkpoint:
        _log_kept_epochs(tracker, checkpoint)
    # The driver's exit then costs Python's last garbage collection over torch's, Ray's
    # and MLflow's objects: 5-7 s of the 11-14 s a stop took on the 2-core machine.
    # Nothing is left to collect that matters (the run is ended, Ray shut down at exit):
    # frozen objects are skipped.
    atexit.register(gc.freeze)
    if checkpoint:
        kept = (
            f"training {config.storage.name} stopped; kept its last checkpoint {redact_uri(checkpoint)} "
            "(run the same command again to resume from it)"
        )
    else:
        kept = f"training {config.storage.name} stopped before its first checkpoint; nothing to resume from"
    if tracker is not None:
        try:
            tracker.set_tags({CHECKPOINT_TAG: checkpoint or "", "splitvit.message": f"{stopped}: {kept}"})
        except Exception as err:  # noqa: BLE001 - the run is still ended KILLED by closed_on_error
            log.warning("could not tag MLflow run %s: %s", tracker.run_id, err)
    log.info("%s: %s", stopped, kept)  # the caller says it (splitvit train: one line)
    return Interrupted(signum, kept)


def _log_kept_epochs(tracker: RunTracker, checkpoint: str) -> None:
    """Log to MLflow the epochs of the kept ``checkpoint`` it lacks: rank 0 logs an
    epoch only after Ray Train committed its checkpoint, so a stop in between left the
    last epoch on the console (its ``metrics.json``) and in the checkpoint, not in the
    run (a resumed run wrote it later)."""
    try:
        history = read_history(checkpoint)
        logged = tracker.logged_epochs()
        for metrics in history:
            epoch = metrics.get("epoch")
            if isinstance(epoch, (int, float)) and int(epoch) not in logged:
                tracker.log_epoch(int(epoch), metrics)
    except Exception as err:  # noqa: BLE001 - the stop goes on; a resumed run logs them
        log.warning("could not log the kept epochs to MLflow run %s: %s", tracker.run_id, err)


def _warn_if_resume_checkpoint_is_unreadable(config: ExperimentConfig) -> None:
    """On the console, before the workers start: the checkpoint a re-run would resume
    from has a truncated or missing file, so the workers resume from the newest intact
    one before it (:func:`_load_checkpoint`; the workers' own log is not on the console)."""
    latest = latest_checkpoint(config.storage.run_uri())
    problem = checkpoint_problem(latest) if latest else None
    if problem is None:
        return
    from ..storage import filesystem_for

    fs, path = filesystem_for(latest)
    intact = next((p for p in earlier_checkpoints(path, fs) if checkpoint_problem(_rejoin(latest, p)) is None), None)
    if intact is None:
        log.warning("%s; no intact checkpoint before it", problem)
    else:
        log.warning("%s; resuming from the newest intact checkpoint, %s", problem, _rejoin(latest, intact))


def _rejoin(uri: str, path: str) -> str:
    """``path`` (a filesystem path) with ``uri``'s scheme, when it has one."""
    return f"{uri.split('://', 1)[0]}://{path.lstrip('/')}" if "://" in uri else path


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
        log.warning(
            "storage.path %r is relative and this Ray job runs in a temporary copy of its working_dir: "
            "results go to %s, which Ray may delete; pass storage.path=s3://... or an absolute shared folder",
            config.storage.path,
            config.storage.resolved_path(),
        )


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
def _calibrate_thresholds(model, val_shard, count: int, target_ratio: float, device: torch.device) -> None:
    """``model.thresholds: auto``: thresholds that meet the token budget on this
    worker's first ``count`` validation images, averaged over workers so every rank
    (and the checkpoint) holds the same values."""
    from ..data import first_images

    local = (
        calibrate_thresholds(model, first_images(val_shard, count).to(device), target_ratio) if len(val_shard) else None
    )
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


def _combine_eval(totals: EvalTotals, device: torch.device) -> dict[str, float]:
    """A worker's :class:`~.steps.EvalTotals` -> the figures over the whole validation
    set, exactly as one process evaluating every shard would give them: the counts
    (images, correct, tokens, and the dense task's confusion matrix) are summed over the
    workers and the figures computed once from the sums (``EvalTotals.figures``)."""
    counts = _all_reduce(
        [
            totals.images,
            totals.correct,
            totals.tokens,
            totals.full_tokens,
            totals.fine_total,
            totals.fine_on_object,
            totals.object_cells,
        ],
        device=device,
    )  # float64: integer counts stay exact below 2**53
    (longest,) = _all_reduce([totals.elapsed], op="max", device=device)
    images, correct, tokens, full_tokens = (int(round(v)) for v in counts[:4])
    whole = EvalTotals(
        task=totals.task,
        images=images,
        correct=correct,
        tokens=tokens,
        full_tokens=full_tokens,
        # workers evaluate in parallel: the set's throughput is its size over the slowest shard
        elapsed=longest,
        confusion=None if totals.confusion is None else _all_reduce_tensor(totals.confusion, device),
        fine_total=counts[4],
        fine_on_object=counts[5],
        object_cells=counts[6],
    )
    figures = whole.figures()
    figures["val_images"] = float(figures.pop("images"))
    return figures


def _all_reduce_tensor(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Sum a tensor (e.g. an int64 confusion matrix, exactly) over all workers; the
    identity on one worker. Returned on the CPU."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor.cpu()
    # gloo reduces CPU tensors, NCCL CUDA ones
    on = device if (device is not None and dist.get_backend() == "nccl") else torch.device("cpu")
    summed = tensor.to(on).clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed.cpu()


@dataclass
class _WorkerData:
    """One worker's share of the data: its training shard (sampler and loader) and its
    validation shard."""

    sampler: DistributedSampler
    loader: Any  # a DataLoader, as prepare_data_loader returns it
    train_set: Any
    val_set: Any
    val_shard: Subset
    val_loader: DataLoader

    @property
    def steps_per_epoch(self) -> int:
        """Training batches per epoch on this worker (the same on every worker)."""
        return len(self.loader)


class ClassAP(TypedDict):
    """A detection evaluation's table for MLflow (``per_class_ap/epoch_NNNN.json``): box
    and mask AP per class name, and the object-size ranges (pixels of area) used."""

    per_class: dict[str, dict[str, float]] | None
    area_ranges: dict[str, list[float | None]] | None


@dataclass
class _Worker:
    """What one worker trains with; set up by :func:`_set_up_worker` and handed to each
    step of :func:`train_loop_per_worker`."""

    config: ExperimentConfig
    rank: int
    world: int
    device: torch.device
    tracker: RunTracker | None  # rank 0's only
    generator: torch.Generator  # warm-up random splits, per worker
    model: nn.Module  # the plain SplitViT
    step: nn.Module  # SplitStep, wrapped for DDP
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: _WorkerData
    history: list[dict[str, float]] = field(default_factory=list)  # every epoch's figures, resumed ones too
    ground_truth: Any = None  # detection: the validation set's COCO ground truth (rank 0, built once)
    per_class: ClassAP | None = None  # detection: the last evaluation's AP per class (rank 0)

    def autocast(self) -> torch.autocast:
        """bf16 autocast on CUDA with ``train.amp``; a no-op otherwise."""
        use_amp = self.config.train.amp and self.device.type == "cuda"
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=use_amp)


@dataclass
class _Stop:
    """Why every worker stopped training: ``failed`` (a label outside
    ``model.num_classes``; ``error`` is the first rank's) or ``diverged`` (a non-finite
    loss, gradient or split probability)."""

    status: str
    message: str
    error: BaseException | None = None


@dataclass
class _EpochPass:
    """One worker's training pass over its shard: the step statistics summed (and how
    many steps reported each), the images seen and the time taken, or why it stopped."""

    totals: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    seen: int = 0
    seconds: float = 0.0
    stop: _Stop | None = None


def train_loop_per_worker(loop_config: dict[str, Any]) -> WorkerOutcome:
    """One Ray Train worker's training loop (see the module docstring).

    ``loop_config`` (Ray Train's ``train_loop_config``) holds ``config`` (an
    :class:`ExperimentConfig`), ``tracker`` (a :class:`RunTracker` or ``None``) and
    ``epoch_hook``. Returns its :class:`WorkerOutcome` on every rank; Ray hands rank 0's
    to the driver.
    """
    hook: EpochHook | None = loop_config.get("epoch_hook")
    worker, saved_state = _set_up_worker(loop_config["config"], loop_config.get("tracker"))
    start_epoch, metrics = _resume(worker, saved_state)
    stop: _Stop | None = None
    for epoch in range(start_epoch, worker.config.train.total_epochs):
        if hook is not None:
            hook(epoch, worker.rank, worker.model)
        started = time.perf_counter()
        skips = _skip_counts(worker)
        trained = _train_one_epoch(worker, epoch)
        if trained.stop is not None:
            stop = trained.stop
            break
        metrics = _training_metrics(worker, trained)
        metrics.update(_evaluate_epoch(worker))
        metrics.update(_skipped_in_epoch(worker, skips))
        metrics["epoch"] = epoch
        metrics["epoch_time_s"] = time.perf_counter() - started
        worker.history.append(metrics)
        _checkpoint_and_report(worker, epoch, metrics)
        _log_epoch(worker, epoch, metrics)
    status, message = (stop.status, stop.message) if stop is not None else ("completed", "")
    model_uri = _end_tracking(worker, status, message, metrics, start_epoch)
    return WorkerOutcome(
        status=status,
        metrics=metrics,
        start_epoch=start_epoch,
        message=message,
        model_uri=model_uri,
        error=stop.error if stop is not None else None,
    )


# ---------------------------------------------------------------------- worker: set-up and resume
def _set_up_worker(config: ExperimentConfig, tracker: RunTracker | None) -> tuple[_Worker, TrainState | None]:
    """Seed this worker, build its model (from the checkpoint a restart resumes from,
    else from ``model.init_from``), wrap it for DDP, and make its optimizer, data and
    learning-rate schedule. Returns the worker and the checkpoint's training state
    (``None`` on a fresh start)."""
    import ray.train.torch

    rank, world = _world()
    device = ray.train.torch.get_device()
    _check_allocator(config.scaling.allocator, rank)
    seed = config.data.seed * 1000 + rank
    torch.manual_seed(seed)  # before the model is built: its initial weights come from it
    generator = torch.Generator().manual_seed(seed + 1)
    model = build_model(config.model)
    state = _load_checkpoint(model, rank, generator, config.storage.resolved_path(), tracker if rank == 0 else None)
    if state is None and config.model.init_from:
        fresh = init_weights(model, config.model.init_from)
        if rank == 0:
            log.info(
                "initialised from %s (%d tensors not in it: %s)",
                config.model.init_from,
                len(fresh),
                ", ".join(fresh[:8]),
            )
    # find_unused_parameters: which parameters get gradients varies by phase (in the
    # random-split warm-up the policy gets none; the dense task never uses the ViT's
    # classifier); the graph walk costs little next to a SPLIT step.
    step = ray.train.torch.prepare_model(
        SplitStep.for_config(model, config.train),
        parallel_strategy_kwargs={"find_unused_parameters": True},
    )
    model = _unwrap(step).model
    optimizer = torch.optim.AdamW(
        param_groups(model, config.train.lr, config.train.policy.lr_scale),
        lr=config.train.lr,
        weight_decay=config.train.weight_decay,
    )
    data = _worker_data(config, rank, world, device, split_backbone(model).data_config["interpolation"])
    scheduler = lr_schedule(optimizer, config.train, data.steps_per_epoch)
    worker = _Worker(
        config=config,
        rank=rank,
        world=world,
        device=device,
        tracker=tracker if rank == 0 else None,  # one writer: SQLite dislikes concurrent ones
        generator=generator,
        model=model,
        step=step,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
    )
    return worker, state


def _check_allocator(name: str, rank: int) -> None:
    """Warn where ``scaling.allocator``'s library is not loaded in this worker: its node
    lacks it, and the dynamic linker ignored ``LD_PRELOAD`` (saying so only on stderr)."""
    allocator = get_allocator(name)
    if allocator.preloads and loaded_library(name) is None:
        log.warning(
            "worker %d: scaling.allocator=%s, but %s is not loaded (LD_PRELOAD=%s): this node lacks it "
            "(install %s); the worker runs on glibc's malloc",
            rank,
            name,
            allocator.libraries[0],
            os.environ.get("LD_PRELOAD", ""),
            allocator.package,
        )


def _load_checkpoint(
    model: nn.Module, rank: int, generator: torch.Generator, storage_path: str, tracker: RunTracker | None = None
) -> TrainState | None:
    """Load the weights of the checkpoint Ray Train resumes from into ``model`` and this
    rank's random state into ``generator``; return the checkpoint's training state
    (optimizer, schedule, epoch, metrics), or ``None`` when there is no checkpoint.

    A checkpoint with an unreadable file is named (a warning) and the newest intact one
    before it is resumed from instead (rank 0 tags the MLflow run
    ``splitvit.unreadable_checkpoint``); with none intact, :class:`CheckpointError`
    (deterministic: not retried) names the file."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    # an unreadable checkpoint (a truncated train_state.pt: the disk filled, the copy
    # was cut) is named and passed over for the newest intact one before it; its epochs
    # are trained again and their folders written anew
    candidates = [checkpoint.path, *earlier_checkpoints(checkpoint.path, checkpoint.filesystem)]
    unreadable: list[CheckpointError] = []
    for path in candidates:
        source = _checkpoint_uri(SimpleNamespace(path=path), storage_path) or path
        try:
            with ray.train.Checkpoint(path, filesystem=checkpoint.filesystem).as_directory() as folder:
                payload, state, rng = read_training_checkpoint(Path(folder), rank, source)
        except CheckpointError as exc:
            unreadable.append(exc)
            continue
        if unreadable and rank == 0:
            passed = f"{unreadable[0]}; resumed from {source}, the newest intact checkpoint (epoch {state['epoch']})"
            log.warning("%s", passed)
            if tracker is not None:  # the run says why its epochs after that one were trained twice
                tracker.set_tags({"splitvit.unreadable_checkpoint": passed[:2000]})
        model.load_state_dict(payload["state_dict"])
        if rng is not None:
            set_rng_state(rng, generator)
        return state
    run_folder = _checkpoint_uri(SimpleNamespace(path=str(Path(checkpoint.path).parent)), storage_path)
    raise CheckpointError(
        unreadable[0].source,
        f"{unreadable[0].reason}; no intact checkpoint before it to resume from (remove {run_folder} to start over)",
    )


def _worker_data(
    config: ExperimentConfig, rank: int, world: int, device: torch.device, interpolation: str
) -> _WorkerData:
    """This worker's training loader (a ``DistributedSampler`` shard) and validation
    shard, resized with the model's ``interpolation``."""
    import ray.train.torch

    from ..data import detection_collate
    from .experiment import experiment_datasets

    dc = config.data
    train_set, val_set = experiment_datasets(config, interpolation)
    # our own DistributedSampler (for parquet shards one by row group, each group read once
    # per epoch): its seed is the config's; prepare_data_loader keeps it
    sampler = training_sampler(
        train_set,
        num_replicas=world,
        rank=rank,
        seed=dc.seed,
        drop_last=True,
        batch_size=dc.batch_size,
        loader_workers=dc.num_workers,
    )
    # detection targets are one dict per image: the batch keeps them a list
    collate = detection_collate if config.model.task == "detection" else None
    loader = DataLoader(
        train_set,
        batch_size=dc.batch_size,
        sampler=sampler,
        num_workers=dc.num_workers,
        drop_last=True,
        pin_memory=device.type == "cuda",
        collate_fn=collate,
    )
    loader = ray.train.torch.prepare_data_loader(loader)
    if len(loader) == 0:
        raise ValueError(
            f"data: {len(train_set)} training images give no batch of {dc.batch_size} on each of {world} workers"
        )
    # validation: each worker takes every world-th image (exact shards, no padding)
    val_shard = Subset(val_set, range(rank, len(val_set), world))
    val_loader = DataLoader(
        val_shard,
        batch_size=dc.eval_batch_size or dc.batch_size,
        shuffle=False,
        num_workers=dc.num_workers,
        collate_fn=collate,
    )
    return _WorkerData(
        sampler=sampler, loader=loader, train_set=train_set, val_set=val_set, val_shard=val_shard, val_loader=val_loader
    )


def _resume(worker: _Worker, state: TrainState | None) -> tuple[int, dict[str, float]]:
    """Restore the optimizer and schedule from a checkpoint's training state; returns
    the epoch to start from and the last epoch's metrics (``0, {}`` on a fresh start)."""
    if state is None:
        return 0, {}
    worker.optimizer.load_state_dict(state["optimizer"])
    worker.scheduler.load_state_dict(state["scheduler"])
    metrics = dict(state.get("metrics") or {})
    # a checkpoint from before histories were kept starts the curve at its last epoch
    worker.history = list(state.get("history") or ([metrics] if metrics else []))
    if worker.tracker is not None and metrics:
        # the previous attempt may have stopped between its report and its MLflow write
        worker.tracker.log_epoch(state["epoch"], metrics)
    if worker.rank == 0:
        log.info("resuming %s from epoch %d", worker.config.storage.name, state["epoch"])
    return state["epoch"] + 1, metrics


# ---------------------------------------------------------------------- worker: one epoch
def _train_one_epoch(worker: _Worker, epoch: int) -> _EpochPass:
    """One pass over this worker's training shard; every worker stops at the same step
    when any of them hits a bad label or a non-finite value."""
    worker.data.sampler.set_epoch(epoch)
    worker.step.train()
    started = time.perf_counter()
    done = _EpochPass()
    for index, batch in enumerate(worker.data.loader):
        images, target = batch[0], batch[1]
        loss, stats, stop = _guarded_forward(worker, images, target, epoch, index)
        if stop is None:
            stop = _apply_gradients(worker, loss, epoch)
        if stop is not None:
            done.stop = stop
            return done
        done.seen += images.shape[0]
        for key, value in stats.items():
            done.totals[key] = done.totals.get(key, 0.0) + value
            done.counts[key] = done.counts.get(key, 0) + 1  # teacher_loss: teacher steps only
    done.seconds = time.perf_counter() - started
    return done


def _guarded_forward(
    worker: _Worker, images: torch.Tensor, target: torch.Tensor, epoch: int, index: int
) -> tuple[Any, dict[str, float], _Stop | None]:
    """The SPLIT step's forward, then agreement over every worker on whether any of
    them must stop: a worker that stopped alone would leave the others hanging in a
    collective. Returns ``(loss, stats, stop)``."""
    loss, stats, bad, wrong = None, {}, "", None
    try:
        with worker.autocast():
            loss, stats = worker.step(images, target, epoch, worker.generator, index)
    except FloatingPointError as exc:
        bad = str(exc)
    except ConfigError as exc:  # a label outside model.num_classes: retrying would not help
        wrong = exc
    any_bad, any_wrong = _all_reduce([1.0 if bad else 0.0, 1.0 if wrong else 0.0], op="max", device=worker.device)
    if any_wrong:
        error = _first_error(wrong, worker.world)
        return loss, stats, _Stop("failed", str(error), error)
    if any_bad:
        return loss, stats, _Stop("diverged", bad or f"non-finite values on another worker at epoch {epoch}")
    return loss, stats, None


def _apply_gradients(worker: _Worker, loss: torch.Tensor, epoch: int) -> _Stop | None:
    """Backward pass, clipped optimizer step and schedule step; a non-finite gradient
    norm stops training instead (no step taken)."""
    grad_clip = worker.config.train.grad_clip
    worker.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    # gradients are all-reduced by now: every worker sees the same norm
    norm = torch.nn.utils.clip_grad_norm_(worker.model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    if not torch.isfinite(norm):
        return _Stop("diverged", f"non-finite gradient norm {float(norm)} at epoch {epoch}")
    worker.optimizer.step()
    worker.scheduler.step()
    return None


def _training_metrics(worker: _Worker, trained: _EpochPass) -> dict[str, float]:
    """The epoch's training figures over all workers: mean step statistics
    (``train_<name>``), ``train_images_per_s`` and the learning rate."""
    keys = _agreed_keys(trained.totals, worker.world)
    sums = _all_reduce(
        [trained.totals.get(k, 0.0) for k in keys]
        + [float(trained.counts.get(k, 0)) for k in keys]
        + [float(trained.seen)],
        device=worker.device,
    )
    (slowest,) = _all_reduce([trained.seconds], op="max", device=worker.device)
    seen_all = sums[-1]
    per_key = zip(keys, sums[: len(keys)], sums[len(keys) : 2 * len(keys)])  # (name, total, steps)
    metrics = {f"train_{k}": v / max(n, 1.0) for k, v, n in per_key}
    metrics["train_images_per_s"] = seen_all / slowest
    rates = worker.scheduler.get_last_lr()
    metrics["lr"] = rates[0]
    if len(rates) > 1:  # train.policy.lr_scale: SplitViT's own modules in a group of their own
        metrics["lr_policy"] = rates[1]
    return metrics


def _skip_counts(worker: _Worker) -> list[int] | None:
    """Items the training and validation sets passed over as corrupt so far (their
    ``skips``, loader processes included); None for sets made without files."""
    counters = [getattr(ds, "skips", None) for ds in (worker.data.train_set, worker.data.val_set)]
    return [c.value for c in counters] if all(c is not None for c in counters) else None


def _skipped_in_epoch(worker: _Worker, before: list[int] | None) -> dict[str, float]:
    """``train_skipped_items`` and ``val_skipped_items``: corrupt items passed over in
    this epoch over all workers (a skipped image was otherwise only in Ray's worker
    logs); nothing for sets made without files."""
    after = _skip_counts(worker)
    if before is None or after is None:
        return {}
    train, val = _all_reduce([float(after[0] - before[0]), float(after[1] - before[1])], device=worker.device)
    return {"train_skipped_items": train, "val_skipped_items": val}


def _evaluate_epoch(worker: _Worker) -> dict[str, float]:
    """Calibrate ``auto`` thresholds, then evaluate on this worker's validation shard;
    returns the figures over the whole validation set (:func:`_combine_eval`)."""
    mc, dc = worker.config.model, worker.config.data
    if mc.thresholds == AUTO_THRESHOLDS and split_backbone(worker.model).policy.thresholded:
        with worker.autocast():  # as evaluated
            _calibrate_thresholds(
                split_backbone(worker.model),
                worker.data.val_shard,
                dc.eval_batch_size or dc.batch_size,
                worker.config.train.budget.target_ratio,
                worker.device,
            )
    # a worker with no validation images (more workers than images) counts nothing, yet
    # takes part in the collectives (with a zero confusion matrix of the same shape)
    batches = worker.data.val_loader if len(worker.data.val_shard) else ()  # no loader workers for nothing
    if isinstance(worker.model, SplitDetector):
        return _evaluate_detection(worker, batches)
    with worker.autocast():
        totals = evaluate_totals(worker.model, batches, num_classes=mc.num_classes)
    return _combine_eval(totals, worker.device)


def _evaluate_detection(worker: _Worker, batches: Any) -> dict[str, float]:
    """Detect on this worker's validation shard; the figures over the whole validation
    set (:func:`_combine_detection`). AP per class and the size ranges are kept on rank
    0 for MLflow (``worker.per_class``)."""
    val_set = worker.data.val_set
    with worker.autocast():
        shard = evaluate_detection_totals(worker.model, batches, [0, *val_set.category_ids], device=worker.device)
    if worker.rank == 0 and worker.ground_truth is None:
        worker.ground_truth = detection_ground_truth(val_set)
    figures = _combine_detection(
        shard, worker.ground_truth, detection_area_ranges(worker.config.model.image_size), worker.rank, worker.world
    )
    if worker.rank == 0:
        worker.per_class = ClassAP(per_class=figures.get("per_class"), area_ranges=figures.get("area_ranges"))
    return {k: float(v) for k, v in figures.items() if isinstance(v, (int, float))}


def _combine_detection(
    shard: DetectionTotals,
    ground_truth: Any,
    area_ranges: dict[str, tuple[float, float]] | None,
    rank: int,
    world: int,
) -> DetectionFigures:
    """Every worker's detections gathered and evaluated once by rank 0 (COCO's
    evaluation of the whole set: what one process evaluating every shard gives), the
    figures sent back to every rank. ``ground_truth`` is read on rank 0 only."""
    shards: list[DetectionTotals | None] = [shard]
    distributed = world > 1 and dist.is_available() and dist.is_initialized()
    if distributed:
        shards = [None] * world
        dist.all_gather_object(shards, shard)
    figures: list[DetectionFigures | None] = [None]
    if rank == 0:
        whole = DetectionTotals.merge(s for s in shards if s is not None)
        figures = [whole.figures(ground_truth, area_ranges=area_ranges)]
        figures[0]["val_images"] = float(whole.images)
    if distributed:
        dist.broadcast_object_list(figures, src=0)
    return DetectionFigures(**(figures[0] or {}))


# ---------------------------------------------------------------------- worker: checkpoint, report, MLflow
def _checkpoint_and_report(worker: _Worker, epoch: int, metrics: dict[str, float]) -> None:
    """Write the epoch's checkpoint (every rank its random state; rank 0 the model,
    the optimizer and schedule state and the metrics), report it to Ray Train and wait
    until the report is committed."""
    import ray.train

    with tempfile.TemporaryDirectory(prefix="splitvit-ckpt-") as folder:
        folder = Path(folder)
        torch.save(rng_state(worker.generator), folder / rng_file(worker.rank))
        if worker.rank == 0:
            worker.model.save(
                folder / MODEL_FILE,
                extra={"epoch": epoch, "metrics": metrics, "config": worker.config.to_dict(redact=True)},
            )
            state: TrainState = {
                "epoch": epoch,
                "optimizer": worker.optimizer.state_dict(),
                "scheduler": worker.scheduler.state_dict(),
                "metrics": metrics,
                "history": worker.history,
                "world_size": worker.world,
                "global_step": (epoch + 1) * worker.data.steps_per_epoch,
            }
            torch.save(state, folder / STATE_FILE)
            write_metrics(folder, metrics)
            write_history(folder, worker.history)
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(str(folder)),
            checkpoint_dir_name=checkpoint_dir_name(epoch),
        )
    # Commit barrier. The controller registers a report only when it next polls
    # every worker (every couple of seconds); a worker that dies before that poll
    # takes its queued report with it and the epoch's checkpoint, though written,
    # is not the one a restart resumes from. Waiting here until the report is
    # committed makes "reported" mean "resumable", and MLflow (_log_epoch) only ever
    # records committed epochs.
    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def _log_epoch(worker: _Worker, epoch: int, metrics: dict[str, float]) -> None:
    """Rank 0: the epoch's figures to the log and, with tracking on, to MLflow with a
    split-map image."""
    if worker.rank == 0:
        log.info("epoch %d: %s", epoch, {k: round(v, 4) for k, v in metrics.items()})
    tracking = worker.config.tracking
    if worker.tracker is not None:
        worker.tracker.log_epoch(epoch, metrics)
        if worker.per_class is not None:  # detection: AP per class, a table per epoch
            worker.tracker.log_dict(worker.per_class, f"per_class_ap/epoch_{epoch:04d}.json")
        if tracking.split_map_images > 0:
            worker.tracker.log_image(
                _draw_split_maps(worker.model, worker.data.val_set, tracking.split_map_images, worker.device),
                f"split_maps/epoch_{epoch:04d}.png",
            )


def _end_tracking(
    worker: _Worker, status: str, message: str, metrics: dict[str, float], start_epoch: int
) -> str | None:
    """Rank 0, tracking on: the final metrics and the model of a completed run (returns
    the model's URI), or the status and message of one that stopped."""
    tracker = worker.tracker
    if tracker is None:
        return None
    if status != "completed":
        tracker.set_tags({"splitvit.status": status, "splitvit.message": message[:2000]})
        return None
    if metrics and (start_epoch < worker.config.train.total_epochs or not tracker.has_final()):
        tracker.log_final({k: v for k, v in metrics.items() if k != "epoch"})
    if not worker.config.tracking.log_model:
        return None
    mc = worker.config.model
    return tracker.log_model(worker.model, params={"levels": mc.levels, "policy": mc.policy.kind})


def _first_error(own: BaseException | None, world: int) -> BaseException:
    """The error of the lowest rank that has one (every rank calls this together)."""
    if world > 1 and dist.is_available() and dist.is_initialized():
        gathered: list[BaseException | None] = [None] * world
        dist.all_gather_object(gathered, own)  # the project's exceptions pickle (splitvit.errors)
        own = next((e for e in gathered if e is not None), own)
    return own if own is not None else RuntimeError("a worker stopped on an error it could not send")


@torch.no_grad()
def _draw_split_maps(model: nn.Module, dataset: Any, count: int, device: torch.device) -> Image.Image:
    """The policy's quadtree over the first ``count`` images of ``dataset``, as one
    captioned grid image (tokens kept per image); a detector's confident detections
    drawn over it."""
    from ..tracking.split_maps import split_map_grid

    count = min(count, len(dataset))
    images = torch.stack([dataset[i][0] for i in range(count)])
    was_training = model.training
    model.eval()
    out = model(images.to(device))
    model.train(was_training)
    detections = getattr(out, "detections", None)
    split = out.split if detections is not None else out
    captions = [f"{int(t)}/{split.full_tokens} tok" for t in split.tokens]
    return split_map_grid(
        images,
        [d.cpu() for d in split.decisions],
        split_backbone(model).geometry,
        captions,
        detections=detections,
        names=list(getattr(dataset, "categories", []) or []) or None,
    )
