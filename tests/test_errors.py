"""Errors end as one line, interruptions stop cleanly (issue #14, parts 2-4).

* every exception class of the package survives pickling (Ray pickles a worker's
  exception to hand it to the driver);
* Ray's wrappers (WorkerGroupError, UserExceptionWithTraceback, RayTaskError...)
  unwrap to the worker's own exception, printed as one line (its traceback with -v);
* a checkpoint ``eval`` cannot read is one line naming the file, exit 2;
* a run that diverged in its first epoch prints what happened, not a TypeError;
* labels outside ``model.num_classes`` stop training with that key named;
* a deterministic error (a corrupt image read with ``strict=true``) ends the run on
  its first attempt, whatever ``train.max_failures`` allows (issue #61);
* Ctrl-C / SIGTERM on ``splitvit train``: exit 130 / 143, the kept checkpoint named,
  the MLflow run KILLED; a re-run resumes from the checkpoint;
* a resumed sweep or study ends the runs a dead driver left RUNNING.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import splitvit  # noqa: E402
from splitvit.cli import main  # noqa: E402
from splitvit.config import (
    ConfigError,  # noqa: E402
    PolicyConfig,
)
from splitvit.data.common import CorruptDataError  # noqa: E402
from splitvit.errors import Interrupted, error_line, root_cause, worker_traceback  # noqa: E402
from splitvit.train.ray_trainer import TrainingError, TrainResult  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(splitvit.__file__).parent


# ---------------------------------------------------------------------- part 2: pickling
def project_exceptions() -> dict[str, type]:
    """Every exception class defined in the package (every module imported, namespace
    folders such as ``train/`` included)."""
    found: dict[str, type] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.split(".")[0] == "splitvit":
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def _job_result():
    from splitvit.cluster.submit import JobResult

    return JobResult(
        job_id="raysubmit_1",
        address="http://127.0.0.1:8265",
        entrypoint="splitvit train x.yaml",
        status="FAILED",
        message="exit 1",
        log_tail="line 1\nline 2",
    )


#: arguments for classes whose __init__ takes something other than strings
SAMPLES = {
    "JobFailed": lambda: ((_job_result(),), {}),
    "Interrupted": lambda: ((int(signal.SIGTERM), "kept checkpoint /runs/x/checkpoint_epoch0001"), {}),
}


def sample(cls: type) -> BaseException:
    if cls.__name__ in SAMPLES:
        args, kwargs = SAMPLES[cls.__name__]()
        return cls(*args, **kwargs)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if any(p.kind is p.VAR_POSITIONAL for p in params):  # BaseException's: a message
        return cls("something failed in s3://bucket/runs/x: reason")
    args = [f"<{p.name}>" for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = {p.name: f"<{p.name}>" for p in params if p.kind is p.KEYWORD_ONLY}
    return cls(*args, **kwargs)


EXCEPTIONS = project_exceptions()


def test_the_package_defines_the_exceptions_the_issue_names():
    names = {name.rsplit(".", 1)[-1] for name in EXCEPTIONS}
    assert {
        "ConfigError",
        "CorruptDataError",
        "SearchSpaceError",
        "TrainingError",
        "CheckpointError",
        "JobFailed",
        "Interrupted",
    } <= names


@pytest.mark.parametrize("name", sorted(EXCEPTIONS))
def test_every_project_exception_survives_pickling(name):
    """A class this fails for needs ``__reduce__`` (or, for arguments other than
    strings, an entry in SAMPLES): Ray could not hand it from a worker to the driver."""
    exc = sample(EXCEPTIONS[name])
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc) and back.args == exc.args
    assert vars(back) == vars(exc)


def test_a_worker_error_inside_ray_wrappers_pickles_and_unwraps():
    """As Ray Train hands it over: WorkerGroupError -> UserExceptionWithTraceback ->
    the worker's CorruptDataError, pickled on the way."""
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    cause = CorruptDataError("s3://bucket/shards/part-0003.parquet", "not a parquet file")
    wrapped = WorkerGroupError(
        "[Rank 1]\nTraceback ...",
        {1: UserExceptionWithTraceback(cause, "Traceback (most recent call last):\n  worker frame\n")},
    )
    wrapped = pickle.loads(pickle.dumps(wrapped))
    try:
        try:
            raise wrapped
        except WorkerGroupError as exc:
            raise TrainingError(f"training run1 failed: {error_line(exc)}") from exc
    except TrainingError as err:
        error = err
    root = root_cause(error)
    assert type(root) is CorruptDataError and root.source == "s3://bucket/shards/part-0003.parquet"
    assert str(error) == (
        "training run1 failed: corrupt or unreadable data in s3://bucket/shards/part-0003.parquet: not a parquet file"
    )
    assert error_line(error) == str(error)
    assert "worker frame" in worker_traceback(error)


def test_ray_task_and_controller_errors_unwrap_to_their_cause():
    from ray.exceptions import RayTaskError
    from ray.train import ControllerError

    cause = ConfigError("model.num_classes", "the training data hold label 7")
    task_error = RayTaskError("evaluate", "Traceback: task frame", cause).as_instanceof_cause()
    assert root_cause(task_error) is cause or type(root_cause(task_error)) is ConfigError
    assert error_line(task_error) == "config error: model.num_classes: the training data hold label 7"
    assert "task frame" in worker_traceback(task_error)
    assert (
        error_line(ControllerError(IndexError("Target 7 is out of bounds.")))
        == "IndexError: Target 7 is out of bounds."
    )
    assert error_line(KeyError("spec")) == "KeyError: 'spec'"


def test_interrupted_says_its_signal_and_exit_status():
    assert Interrupted(signal.SIGINT).exit_code == 130 and Interrupted(signal.SIGTERM).exit_code == 143
    assert str(Interrupted(signal.SIGTERM, "kept x")) == "interrupted by SIGTERM; kept x"
    assert isinstance(Interrupted(), KeyboardInterrupt)


# ---------------------------------------------------------------------- part 3: one line from the CLI
class _Passed:
    """What a passing preflight returns, whatever its report's fields."""

    lines = ["preflight: ok"]

    def __getattr__(self, name):
        return "preflight: ok"


def _fake_training(monkeypatch, effect):
    """``splitvit train`` with ``run_training`` raising ``effect`` or returning ``effect(config)``
    (and the driver's preflight, tested elsewhere, passing)."""
    import splitvit.train.ray_trainer as ray_trainer

    try:
        import splitvit.cluster.preflight as preflight

        monkeypatch.setattr(preflight, "preflight", lambda *a, **k: _Passed())
    except ImportError:
        pass

    def fake(config, **kwargs):
        if isinstance(effect, BaseException):
            raise effect
        return effect(config)

    monkeypatch.setattr(ray_trainer, "run_training", fake)


def _tiny_yaml(tmp_path: Path, name: str = "run", **sections) -> Path:
    import yaml

    from tests.test_train_ray import TINY

    raw = json.loads(json.dumps(TINY))
    raw["storage"] = {"path": str(tmp_path / "runs"), "name": name}
    raw["tracking"]["tracking_uri"] = f"sqlite:///{tmp_path}/mlflow.db"
    for key, value in sections.items():
        raw[key].update(value)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _worker_failure() -> TrainingError:
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    cause = CorruptDataError("/data/imgs/cat/003.jpg", "cannot identify image file")
    group = WorkerGroupError(
        "[Rank 0] long Ray text\nTraceback ...",
        {0: UserExceptionWithTraceback(cause, 'Traceback (most recent call last):\n  File "worker.py"\n')},
    )
    try:
        raise TrainingError(f"training run failed: {error_line(group)}") from group
    except TrainingError as exc:
        return exc


def test_an_error_inside_ray_is_one_line_exit_1_traceback_only_with_v(monkeypatch, tmp_path, capsys):
    config = _tiny_yaml(tmp_path)
    _fake_training(monkeypatch, _worker_failure())
    assert main(["train", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "splitvit train: error: training run failed: corrupt or unreadable data in "
        "/data/imgs/cat/003.jpg: cannot identify image file"
    ]
    assert main(["-v", "train", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("splitvit train: error: training run failed: corrupt") and 'File "worker.py"' in err


def test_divergence_in_the_first_epoch_prints_what_happened(monkeypatch, tmp_path, capsys):
    config = _tiny_yaml(tmp_path)
    _fake_training(
        monkeypatch,
        lambda cfg: TrainResult(
            name=cfg.storage.name,
            status="diverged",
            metrics={},
            checkpoint_uri=None,
            run_uri=cfg.storage.run_uri(),
            message="non-finite loss nan at epoch 0",
        ),
    )
    out_json = tmp_path / "out.json"
    assert main(["train", str(config), "--json", str(out_json)]) == 1
    out, err = capsys.readouterr()
    assert "no epoch completed" in out and "status: diverged" in out
    assert err.strip().splitlines() == [
        "splitvit train: error: run diverged: non-finite loss nan at epoch 0; no epoch "
        "completed, so no checkpoint was kept"
    ]
    written = json.loads(out_json.read_text())  # the envelope: the command failed, the run diverged
    assert written["status"] == "failed" and written["run_status"] == "diverged"
    assert written["error"] == err.strip().removeprefix("splitvit train: error: ")


def test_ctrl_c_and_sigterm_outside_ray_exit_130_and_143(monkeypatch, tmp_path, capsys):
    config = _tiny_yaml(tmp_path)

    def interrupted(signum):
        def effect(cfg):
            os.kill(os.getpid(), signum)  # main's handler raises Interrupted here
            time.sleep(5)
            raise AssertionError("the signal did not interrupt")

        return effect

    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or Ray's if an earlier test started Ray in this process
    for signum, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        _fake_training(monkeypatch, interrupted(signum))
        assert main(["train", str(config)]) == status
        assert f"splitvit train: interrupted by {signal.Signals(signum).name}" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before  # put back


# ---------------------------------------------------------------------- eval on bad checkpoints
def test_eval_on_a_file_that_is_no_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    good = {"a": torch.zeros(256)}
    torch.save(good, tmp_path / "foreign.pt")
    data = (tmp_path / "foreign.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(os.urandom(4096))
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "folder").mkdir()
    cases = {
        "truncated.pt": "not a readable torch file",
        "garbage.pt": "not a readable torch file",
        "empty.pt": "not a readable torch file (0 bytes",
        "foreign.pt": "a torch file without 'spec' and 'state_dict', not a SplitViT checkpoint",
        "missing.pt": "no checkpoint at",
        "folder": "no checkpoint at",
    }
    for name, message in cases.items():
        path = str(tmp_path / name)
        assert main(["eval", path]) == 2, name
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("splitvit eval: error: ") and path in lines[0], (name, err)
        assert message in lines[0], (name, lines[0])
        assert "Traceback" not in err
    assert main(["viz", "--checkpoint", str(tmp_path / "garbage.pt"), "--out", str(tmp_path / "x.png")]) == 2
    assert "not a readable torch file" in capsys.readouterr().err


def test_weights_that_do_not_fit_their_spec_are_a_checkpoint_error(tmp_path):
    from splitvit.model import SplitViT
    from splitvit.train.checkpoints import CheckpointError, load_payload, model_from_payload

    model = SplitViT.from_timm(
        "vit_tiny_patch16_224",
        policy=PolicyConfig(depth=1),
        levels=2,
        image_size=16,
        num_classes=4,
        timm_kwargs={"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
    )
    model.save(tmp_path / "model.pt")
    payload = load_payload(tmp_path)
    assert model_from_payload(payload, "x").levels == 2
    payload["spec"] = {**payload["spec"], "timm_kwargs": {**payload["spec"]["timm_kwargs"], "embed_dim": 32}}
    with pytest.raises(CheckpointError, match="its weights do not fit the model its spec builds"):
        model_from_payload(payload, str(tmp_path))


# ---------------------------------------------------------------------- labels >= model.num_classes
def test_a_label_outside_num_classes_fails_the_step_naming_the_key():
    from splitvit.model import SplitViT
    from splitvit.train.losses import IGNORE_INDEX
    from splitvit.train.steps import SplitLossConfig, check_labels, training_step

    model = SplitViT.from_timm(
        "vit_tiny_patch16_224",
        policy=PolicyConfig(kind="entropy", depth=1),
        levels=2,
        image_size=16,
        num_classes=4,
        timm_kwargs={"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
    )
    with pytest.raises(
        ConfigError,
        match=r"model.num_classes: the training data hold label 7, outside 0..3 for "
        r"model.num_classes = 4",
    ) as info:
        training_step(model, torch.rand(2, 3, 16, 16), torch.tensor([1, 7]), SplitLossConfig(), epoch=0)
    assert info.value.key == "model.num_classes"
    with pytest.raises(ConfigError, match="labels -1, 9"):
        check_labels(torch.tensor([-1, 9, 2]), 4)
    check_labels(torch.tensor([[0, IGNORE_INDEX], [3, 1]]), 4)  # masks may hold the ignore index


# ---------------------------------------------------------------------- stale RUNNING runs
def test_close_stale_runs_ends_what_a_dead_driver_left_running(mlflow_uri):
    from mlflow import MlflowClient

    from splitvit.tracking import RunTracker, ensure_experiment
    from splitvit.tracking.runs import close_stale_runs

    client = MlflowClient(mlflow_uri)
    experiment = ensure_experiment(mlflow_uri, "stale-runs")
    parent = client.create_run(experiment, run_name="sweep").info.run_id
    child = client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
    grandchild = client.create_run(experiment, tags={"mlflow.parentRunId": child}).info.run_id
    done = client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
    client.set_terminated(done, "FINISHED")
    other = client.create_run(experiment, run_name="someone else's").info.run_id
    closed = close_stale_runs(RunTracker(mlflow_uri, experiment, parent))
    assert sorted(closed) == sorted([child, grandchild])
    for run_id in (child, grandchild):
        run = client.get_run(run_id)
        assert run.info.status == "KILLED" and run.data.tags["splitvit.status"] == "interrupted"
    assert client.get_run(done).info.status == "FINISHED"
    assert client.get_run(parent).info.status == "RUNNING"  # the resuming driver's own
    assert client.get_run(other).info.status == "RUNNING"
    assert close_stale_runs(RunTracker(mlflow_uri, experiment, parent)) == []

    # a run that ends otherwise than completed (a sweep stopped by Ctrl-C) ends its running children
    kid = client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
    RunTracker(mlflow_uri, experiment, parent).close("interrupted")
    assert client.get_run(parent).info.status == "KILLED" and client.get_run(kid).info.status == "KILLED"
    finished = client.create_run(experiment, run_name="finished").info.run_id
    running_kid = client.create_run(experiment, tags={"mlflow.parentRunId": finished}).info.run_id
    RunTracker(mlflow_uri, experiment, finished).close("completed")  # completed: children are its business
    assert client.get_run(running_kid).info.status == "RUNNING"


# ---------------------------------------------------------------------- through Ray
def test_a_worker_error_reaches_the_driver_with_its_type(ray_local, mlflow_uri, tmp_path):
    """A worker raising CorruptDataError (strict data): the driver's TrainingError names
    the file; the MLflow run ends FAILED with that line."""
    from mlflow import MlflowClient

    from splitvit.train.ray_trainer import run_training
    from tests.test_train_ray import tiny_config

    cfg = tiny_config(
        tmp_path,
        mlflow_uri,
        "corrupt",
        [
            "train.epochs=1",
            "train.max_failures=0",
            "scaling.num_workers=1",
            "tracking.split_map_images=0",
            "tracking.log_model=false",
        ],
    )
    with pytest.raises(TrainingError) as info:
        run_training(cfg, epoch_hook=RaiseCorrupt())
    assert str(info.value) == "training corrupt failed: corrupt or unreadable data in /data/broken.png: truncated image"
    root = root_cause(info.value)
    assert type(root) is CorruptDataError and root.source == "/data/broken.png"
    runs = MlflowClient(mlflow_uri).search_runs(
        [MlflowClient(mlflow_uri).get_experiment_by_name("tests").experiment_id],
        filter_string="tags.`splitvit.name` = 'corrupt'",
    )
    assert runs[0].info.status == "FAILED"
    assert runs[0].data.tags["splitvit.error"] == "corrupt or unreadable data in /data/broken.png: truncated image"


class RaiseCorrupt:
    """An epoch hook (runs on the workers) that fails as a strict dataset would."""

    def __call__(self, epoch, rank, model):
        raise CorruptDataError("/data/broken.png", "truncated image")


def test_labels_beyond_num_classes_stop_every_worker_with_one_line(ray_local, mlflow_uri, tmp_path):
    """Synthetic data with 4 classes, a model with 2: every worker stops at the first
    bad batch (no retry, no hang), the error names model.num_classes and the label."""
    from mlflow import MlflowClient

    from splitvit.train.ray_trainer import run_training
    from tests.test_train_ray import tiny_config

    cfg = tiny_config(
        tmp_path,
        mlflow_uri,
        "labels",
        [
            "model.num_classes=2",
            "train.epochs=1",
            "train.max_failures=2",
            "tracking.split_map_images=0",
            "tracking.log_model=false",
        ],
    )
    with pytest.raises(TrainingError) as info:  # run_training has no driver-side check: the workers find it
        run_training(cfg)
    line = error_line(info.value)
    assert line.startswith("training labels failed: config error: model.num_classes: the training data hold label")
    assert "model.num_classes = 2" in line and "\n" not in line
    assert type(root_cause(info.value)) is ConfigError
    runs = MlflowClient(mlflow_uri).search_runs(
        [MlflowClient(mlflow_uri).get_experiment_by_name("tests").experiment_id],
        filter_string="tags.`splitvit.name` = 'labels'",
    )
    assert runs[0].info.status == "FAILED" and "model.num_classes" in runs[0].data.tags["splitvit.error"]
    # not retried max_failures times: the workers returned the error as their result, so the
    # driver raised from it directly, not from Ray Train's failure after spent retries
    assert type(info.value.__cause__) is ConfigError


# ---------------------------------------------------------------------- Ctrl-C / SIGTERM on a real run
def _spawn_train(config: Path, tmp_path: Path, name: str) -> subprocess.Popen:
    """``splitvit train CONFIG`` as a driver of the session's Ray instance (a second
    instance on the machine would make Ray's own actors, which look the cluster up,
    find two)."""
    import ray

    env = {
        **os.environ,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        "PYTHONUNBUFFERED": "1",
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
    }
    out = open(tmp_path / f"{name}.out", "w")
    err = open(tmp_path / f"{name}.err", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "splitvit.cli", "train", str(config)],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=err,
        start_new_session=True,
    )


def _checkpoints(folder: Path) -> set[str]:
    return {p.parent.name for p in folder.glob("checkpoint_epoch*/train_state.pt")}


def _wait_for_new_checkpoint(
    folder: Path, before: set[str], proc: subprocess.Popen, timeout: float = 240.0
) -> set[str]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if new := _checkpoints(folder) - before:
            return new
        if proc.poll() is not None:
            raise AssertionError(f"splitvit train ended early with {proc.returncode}")
        time.sleep(0.5)
    raise AssertionError(f"no new checkpoint in {folder} after {timeout:.0f} s")


def _wait_for_commit(folder: Path, new: set[str], timeout: float = 30.0) -> None:
    """Wait until Ray Train has committed one of the ``new`` checkpoints (its snapshot
    names it as the latest): what the stopped run keeps and a re-run resumes from."""
    from splitvit.train.checkpoints import SNAPSHOT_FILE

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            snapshot = json.loads((folder / SNAPSHOT_FILE).read_text())
        except (OSError, ValueError):  # not written yet, or caught mid-write
            snapshot = {}
        if (snapshot.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name") in new:
            return
        time.sleep(0.1)
    raise AssertionError(f"Ray committed none of {sorted(new)} in {folder} after {timeout:.0f} s")


#: how long `splitvit train` may take to end after SIGINT or SIGTERM (issue #61); it
#: took 4-6 s on the busy 2-core machine, 61 s before Ray left the driver's group
STOP_WITHIN_S = 15.0


def _stop(proc: subprocess.Popen, signum: int, tmp_path: Path, name: str) -> tuple[int, str]:
    """Send ``signum`` to the driver's process group, as ``timeout`` and schedulers do;
    the driver must end within :data:`STOP_WITHIN_S`."""
    sent = time.monotonic()
    os.killpg(proc.pid, signum)
    try:
        status = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    elapsed = time.monotonic() - sent
    err = (tmp_path / f"{name}.err").read_text()
    assert elapsed < STOP_WITHIN_S, f"{signal.Signals(signum).name}: ended {elapsed:.1f} s after it\n{err}"
    return status, err


def _assert_kept_epoch_logged(client, run, kept: str) -> None:
    """The kept checkpoint's epoch is in the MLflow run with its figures (rank 0 logs
    an epoch only after its commit: a stop in between left it out)."""
    metrics = json.loads((Path(kept) / "metrics.json").read_text())
    epoch = int(metrics["epoch"])
    assert epoch in {m.step for m in client.get_metric_history(run.info.run_id, "epoch")}
    accuracy = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "accuracy")}
    assert accuracy.get(epoch) == pytest.approx(metrics["accuracy"]), (epoch, accuracy, metrics)


@pytest.mark.slow
def test_sigterm_to_the_group_of_a_run_with_its_own_ray_ends_it_within_15_s(mlflow_uri, tmp_path):
    """`splitvit train` starting its own local Ray, SIGTERM to its process group (what
    `timeout` and schedulers send): Ray's processes are out of that group, so the
    driver stops the workers, exits 143 within 15 s, the MLflow run is KILLED with the
    kept epoch's figures, and Ray's processes end with it."""
    from mlflow import MlflowClient

    config = _tiny_yaml(
        tmp_path,
        "grouprun",
        train={"epochs": 40, "max_failures": 0},
        data={"options": {"train_samples": 256, "val_samples": 16, "object_size": 4}},
        scaling={"num_workers": 1, "resources_per_worker": {"CPU": 1}},
        tracking={"experiment": "tests", "split_map_images": 0, "log_model": False, "tracking_uri": mlflow_uri},
    )
    run_dir = tmp_path / "runs" / "grouprun"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env.update(MLFLOW_DISABLE_TELEMETRY="true", RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5", PYTHONUNBUFFERED="1")
    env.update(PYTHONPATH=str(ROOT / "platform"))
    with open(tmp_path / "group.out", "w") as out, open(tmp_path / "group.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitvit.cli", "train", str(config)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,  # a group of its own, as a job under `timeout` or a scheduler
        )
    _wait_for_commit(run_dir, _wait_for_new_checkpoint(run_dir, set(), proc))
    ray_pids = _ray_children(proc.pid)
    assert ray_pids, "the driver started no GCS or raylet of its own"
    assert all(os.getpgid(pid) != proc.pid for pid in ray_pids)  # out of the group the signal goes to
    status, err = _stop(proc, signal.SIGTERM, tmp_path, "group")
    assert status == 143, err
    line = [line for line in err.splitlines() if line.startswith("splitvit train:")]
    assert len(line) == 1 and "interrupted by SIGTERM" in line[0] and "kept its last checkpoint" in line[0], err
    assert "did not stop" not in err and "GCS" not in err, err
    kept = line[0].split("kept its last checkpoint ", 1)[1].split(" ", 1)[0]
    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("tests").experiment_id
    (run,) = client.search_runs([experiment], filter_string="tags.`splitvit.name` = 'grouprun'")
    assert run.info.status == "KILLED" and run.data.tags["splitvit.checkpoint"] == kept
    _assert_kept_epoch_logged(client, run, kept)
    # Ray's processes, out of the driver's group, still ended with it
    deadline = time.time() + 10
    while time.time() < deadline and [pid for pid in ray_pids if Path(f"/proc/{pid}").exists()]:
        time.sleep(0.5)
    assert not [pid for pid in ray_pids if Path(f"/proc/{pid}").exists()]


def _ray_children(driver_pid: int) -> list[int]:
    """The GCS and raylet processes the driver ``driver_pid`` started (``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == driver_pid and cmd.rsplit("/", 1)[-1] in ("gcs_server", "raylet"):
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_ctrl_c_and_sigterm_stop_training_and_a_rerun_resumes(ray_local, mlflow_uri, tmp_path):
    """`splitvit train` in a process of its own: SIGINT after the first
    checkpoint -> exit 130, the kept checkpoint named, the MLflow run KILLED; run again,
    SIGTERM -> 143; a last run resumes from the checkpoint and finishes the same MLflow run."""
    from mlflow import MlflowClient

    from splitvit.config import load_config
    from splitvit.train.ray_trainer import run_training

    config = _tiny_yaml(
        tmp_path,
        "sigrun",
        train={"epochs": 40, "max_failures": 0},
        data={"options": {"train_samples": 256, "val_samples": 16, "object_size": 4}},
        scaling={"num_workers": 1, "resources_per_worker": {"CPU": 1}},
        tracking={
            "experiment": "tests",
            "split_map_images": 0,
            "log_model": False,
            # the session's store: a store of its own costs MLflow's migrations in the first run
            "tracking_uri": mlflow_uri,
        },
    )
    run_dir = tmp_path / "runs" / "sigrun"
    client = MlflowClient(mlflow_uri)

    def the_run():
        experiment = client.get_experiment_by_name("tests").experiment_id
        runs = client.search_runs([experiment], filter_string="tags.`splitvit.name` = 'sigrun'")
        assert len(runs) == 1
        return runs[0]

    kept = []
    for round_, (signum, expected) in enumerate(((signal.SIGINT, 130), (signal.SIGTERM, 143))):
        name = f"round{round_}"
        before = _checkpoints(run_dir)
        proc = _spawn_train(config, tmp_path, name)
        _wait_for_commit(run_dir, _wait_for_new_checkpoint(run_dir, before, proc))
        status, err = _stop(proc, signum, tmp_path, name)
        assert status == expected, err
        lines = [line for line in err.splitlines() if line.startswith("splitvit train:")]
        assert len(lines) == 1 and f"interrupted by {signal.Signals(signum).name}" in lines[0], err
        assert "kept its last checkpoint" in lines[0] and "checkpoint_epoch" in lines[0], lines[0]
        # our own output holds no traceback (Ray's forwarded worker logs start with "(name pid=...)")
        assert not [line for line in err.splitlines() if line.startswith("Traceback")], err
        kept.append(lines[0].split("kept its last checkpoint ", 1)[1].split(" ", 1)[0])
        run = the_run()
        assert run.info.status == "KILLED", run.info.status
        assert run.data.tags["splitvit.status"] == "interrupted"
        assert run.data.tags["splitvit.checkpoint"] == kept[-1]
        _assert_kept_epoch_logged(client, run, kept[-1])

    # the last kept checkpoint is where a re-run starts
    last_epoch = int(kept[-1].rsplit("checkpoint_epoch", 1)[1])
    assert last_epoch >= 1
    cfg = load_config(str(config), [f"train.epochs={last_epoch + 2}"])
    result = run_training(cfg)
    assert result.status == "completed" and result.start_epoch == last_epoch + 1
    run = the_run()
    assert run.info.run_id == result.mlflow_run_id and run.info.status == "FINISHED"


def test_a_sweep_stopped_with_unfinished_trials_is_an_interruption():
    """Ray Tune's own Ctrl-C handler makes ``Tuner.fit`` return with trials unfinished:
    the sweep raises ``Interrupted`` (exit 130) saying how to resume, not an error."""
    from splitvit.errors import Interrupted
    from splitvit.tune.state import SweepError
    from splitvit.tune.sweep import stopped_early

    stopped = stopped_early("s1", started=3, unfinished=2, planned=8)
    assert isinstance(stopped, Interrupted) and stopped.exit_code in (130, 143)
    assert "3 of 8 trials started and 2 unfinished" in str(stopped) and "--resume --name s1" in str(stopped)
    short = stopped_early("s1", started=5, unfinished=0, planned=8)
    assert isinstance(short, SweepError) and "--resume --name s1" in str(short)


# ---------------------------------------------------------------------- deterministic errors: one attempt
def _image_folder(root: Path, corrupt: str) -> Path:
    """An imagefolder dataset of 4 classes x 4 PNGs per split; one training image
    (``corrupt``, under class ``c0``) holds bytes no decoder reads."""
    from PIL import Image

    for split in ("train", "val"):
        for c in range(4):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (16, 16), (40 * c, 10 * i, 0)).save(folder / f"{i}.png")
    (root / "train" / "c0" / corrupt).write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return root


class CountAttempts:
    """An epoch hook that appends a line to ``path`` each time a worker starts epoch 0:
    one line per attempt of the run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, epoch, rank, model):
        if epoch == 0:
            with open(self.path, "a") as f:
                f.write(f"{os.getpid()}\n")


def test_a_strict_data_error_ends_the_run_on_its_first_attempt(ray_local, mlflow_uri, tmp_path):
    """A corrupt image read with strict=true would fail every retry the same way: with
    train.max_failures=2 the run still makes one attempt; the line names the file."""
    from mlflow import MlflowClient

    from splitvit.config import ExperimentConfig
    from splitvit.train.ray_trainer import run_training
    from tests.test_train_ray import TINY

    root = _image_folder(tmp_path / "images", "broken.png")
    raw = json.loads(json.dumps(TINY))
    raw["data"] = {"name": "imagefolder", "options": {"root": str(root), "strict": True}, "batch_size": 4}
    raw["storage"] = {"path": str(tmp_path / "runs"), "name": "strictdata"}
    raw["tracking"]["tracking_uri"] = mlflow_uri
    cfg = ExperimentConfig.from_dict(
        raw,
        [
            "train.epochs=1",
            "train.max_failures=2",
            "scaling.num_workers=1",
            "tracking.split_map_images=0",
            "tracking.log_model=false",
        ],
    )
    attempts = tmp_path / "attempts.txt"
    started = time.monotonic()
    with pytest.raises(TrainingError) as info:
        run_training(cfg, epoch_hook=CountAttempts(str(attempts)))
    elapsed = time.monotonic() - started
    assert len(attempts.read_text().splitlines()) == 1  # not 3 (1 + max_failures)
    line = str(info.value)
    assert f"corrupt or unreadable data in {root / 'train' / 'c0' / 'broken.png'}" in line, line
    assert line.endswith("(not retried: it would fail the same way)"), line
    assert elapsed < 60, elapsed  # three attempts took 115 s on the 2-core machine
    run = MlflowClient(mlflow_uri).search_runs(
        [MlflowClient(mlflow_uri).get_experiment_by_name("tests").experiment_id],
        filter_string="tags.`splitvit.name` = 'strictdata'",
    )[0]
    assert run.info.status == "FAILED" and "broken.png" in run.data.tags["splitvit.error"]


@pytest.mark.parametrize(
    ("make", "deterministic"),
    [
        (lambda: CorruptDataError("/d/a.png", "not a recognised image format"), True),
        (lambda: CorruptDataError("/d/a.png", "EIO", deterministic=False), False),
        (lambda: ValueError("x"), False),
    ],
)
def test_is_deterministic_sees_through_ray_wrappers_and_pickling(make, deterministic):
    """The flag survives pickling (Ray sends a worker's error to the controller) and is
    found under Ray's wrappers; torch's DataLoader re-raising a loader process's error
    (with its traceback as the one argument) keeps the type, the file and the flag."""
    from ray.train import WorkerGroupError

    from splitvit.errors import is_deterministic

    exc = pickle.loads(pickle.dumps(make()))
    wrapped = WorkerGroupError("workers failed", {0: exc})
    assert is_deterministic(exc) is deterministic and is_deterministic(wrapped) is deterministic
    assert is_deterministic(TrainingError("training x failed")) is False


def test_a_loader_process_error_keeps_its_file_and_flag(tmp_path):
    from torch.utils.data import DataLoader

    from splitvit.data import build_dataset
    from splitvit.errors import is_deterministic

    root = _image_folder(tmp_path / "images", "broken.png")
    data = build_dataset("imagefolder", "train", seed=0, image_size=16, root=str(root), strict=True)
    with pytest.raises(CorruptDataError) as info:
        list(DataLoader(data, batch_size=17, num_workers=1))
    assert info.value.source == str(root / "train" / "c0" / "broken.png")
    assert info.value.reason == "OSError: Truncated File Read"  # the PNG signature, then nothing
    assert is_deterministic(info.value)
