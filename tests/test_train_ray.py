"""Ray Train (V2) fits of a tiny SPLIT model on synthetic data: real Ray, real MLflow.

Every fit here is a few seconds of training; the cost is Ray starting worker
processes. The two-node test needs a cluster of its own and runs last.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow import MlflowClient  # noqa: E402

from splitvit.cli import main  # noqa: E402
from splitvit.config import ExperimentConfig  # noqa: E402
from splitvit.model import SplitViT  # noqa: E402
from splitvit.train.experiment import build_model
from splitvit.train.ray_trainer import run_training  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# A 16x16 image, 4-pixel base patches, two levels: 4 coarse or 16 fine tokens (the library's
# plain settings: the recipes' level context needs three levels)
TINY = {
    "recipe": "none",
    "model": {
        "name": "vit_tiny_patch16_224",
        "timm_kwargs": {"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
        "image_size": 16,
        "levels": 2,
        "num_classes": 4,
        "policy": {"kind": "learned", "depth": 1},
    },
    "data": {
        "name": "synthetic",
        "options": {"train_samples": 64, "val_samples": 32, "object_size": 4},
        "batch_size": 16,
    },
    "train": {"epochs": 2, "lr": 0.002, "max_failures": 2, "policy": {"warmup_epochs": 1}},
    "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
    "tracking": {"experiment": "tests", "split_map_images": 4},
}


def tiny_config(tmp_path: Path, mlflow_uri: str, name: str, overrides: list[str] | None = None) -> ExperimentConfig:
    raw = json.loads(json.dumps(TINY))
    raw["storage"] = {"path": str(tmp_path / "runs"), "name": name}
    raw["tracking"]["tracking_uri"] = mlflow_uri
    return ExperimentConfig.from_dict(raw, overrides)


def _write_yaml(path: Path, cfg: ExperimentConfig) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cfg.to_dict(redact=False)))
    return path


# ---------------------------------------------------------------------- epoch hooks (run on the workers)
class CrashOnce:
    """Kill worker ``rank``'s process at the start of ``epoch``, the first time only."""

    def __init__(self, marker: str, epoch: int = 1, rank: int = 1) -> None:
        self.marker, self.epoch, self.rank = marker, epoch, rank

    def __call__(self, epoch, rank, model):
        if epoch == self.epoch and rank == self.rank and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os._exit(1)


class PoisonAt:
    """Fill a part of rank 0's model with NaN at ``epoch``: the classifier (``head``:
    the loss is no longer finite) or the split policy (``policy``: its split
    probabilities are NaN)."""

    def __init__(self, epoch: int, part: str = "head") -> None:
        self.epoch, self.part = epoch, part

    def __call__(self, epoch, rank, model):
        if epoch == self.epoch and rank == 0:
            params = list(model.policy.parameters()) if self.part == "policy" else [model.vit.head.weight]
            with torch.no_grad():
                for p in params:
                    p.fill_(float("nan"))


class RecordPlacement:
    """Write each worker's Ray node id and a checksum of its parameters, at the start of
    every epoch, into ``folder/epoch<e>_rank<r>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, epoch, rank, model):
        import ray

        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        record = {"node": ray.get_runtime_context().get_node_id(), "params": checksum}
        Path(self.folder, f"epoch{epoch}_rank{rank}.json").write_text(json.dumps(record))


# ---------------------------------------------------------------------- pieces, without Ray
def test_split_steps_phases_are_the_policys_lead_the_fine_tune_then_the_policys_tail():
    """``SplitStep.for_config``: the ``train.policy.lead_epochs`` train the policy alone
    (the teacher's loss, no other weight's gradient), the fine-tune counts its epochs
    from the end of the lead (its first is ``warmup_epochs``' random splits, the policy
    without gradient), and the ``train.policy.epochs`` after it are the policy's again."""
    from splitvit.train.ray_trainer import SplitStep

    cfg = ExperimentConfig.from_dict(
        dict(
            json.loads(json.dumps(TINY)),
            train=dict(TINY["train"], policy={**TINY["train"]["policy"], "lead_epochs": 1, "epochs": 1}),
        )
    )
    assert cfg.train.total_epochs == 4 and cfg.train.policy.warmup_epochs == 1
    model = build_model(cfg.model)
    step = SplitStep.for_config(model, cfg.train)
    images, target = torch.rand(4, 3, 16, 16), torch.randint(0, 4, (4,))
    policy = {id(p) for p in model.policy.parameters()}
    phases = []
    for epoch in range(cfg.train.total_epochs):
        model.zero_grad(set_to_none=True)
        loss, stats = step(images, target, epoch, torch.Generator().manual_seed(0))
        loss.backward()
        policy_grad = any(p.grad is not None for p in model.policy.parameters())
        other_grad = any(p.grad is not None for p in model.parameters() if id(p) not in policy)
        phases.append((set(stats) == {"teacher_loss", "loss"}, policy_grad, other_grad))
    assert phases == [
        (True, True, False),  # the lead: the policy alone
        (False, False, True),  # the fine-tune's warm-up epoch: random splits
        (False, True, True),  # the fine-tune: everything
        (True, True, False),  # the tail: the policy alone
    ]


@pytest.mark.parametrize("task", ["classification", "dense"])
def test_split_step_trains_every_parameter_and_eval_figures_combine(task):
    """The step module runs the whole SPLIT step (policy teacher + model forward) in
    one forward, the way DDP calls it; figures combine unchanged on one worker."""
    from splitvit.data import build_dataset
    from splitvit.train.ray_trainer import SplitStep, _combine_eval
    from splitvit.train.steps import evaluate_totals

    cfg = ExperimentConfig.from_dict(dict(json.loads(json.dumps(TINY)), model=dict(TINY["model"], task=task)))
    model = build_model(cfg.model)
    step = SplitStep(model, cfg.train.loss_config())
    images = torch.rand(4, 3, 16, 16)
    target = torch.randint(0, 4, (4, 16, 16) if task == "dense" else (4,))
    policy_weight = model.policy.heads[0][1].weight
    for epoch in (0, 1):  # random warm-up splits, then the policy's
        model.zero_grad(set_to_none=True)
        loss, stats = step(images, target, epoch, torch.Generator().manual_seed(0))
        loss.backward()
        assert torch.isfinite(loss)
        if epoch < cfg.train.policy.warmup_epochs:
            # warm-up leaves the policy without gradient: why DDP needs find_unused_parameters
            assert policy_weight.grad is None
        else:
            assert "teacher_loss" in stats and "budget_penalty" in stats
            assert policy_weight.grad is not None and policy_weight.grad.abs().sum() > 0
    if task == "dense":
        data = torch.utils.data.TensorDataset(torch.rand(8, 3, 16, 16), torch.randint(0, 4, (8, 16, 16)))
    else:
        data = build_dataset("synthetic", "val", image_size=16, num_samples=8, object_size=4)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    totals = evaluate_totals(model, loader, num_classes=4, object_masks=task != "dense")
    figures = totals.figures()
    combined = _combine_eval(totals, torch.device("cpu"))
    quality = "miou" if task == "dense" else "accuracy"
    assert combined[quality] == figures[quality]
    for key in ("fine_on_object", "object_coverage"):  # the synthetic data carry object masks
        assert (key in combined) == (task != "dense") and combined.get(key) == figures.get(key)
    assert combined["tokens_per_image"] == figures["tokens_per_image"]
    assert combined["val_images"] == 8


def _evaluate_shard(rank: int, world: int, folder: str) -> None:
    """One process of :func:`test_distributed_eval_figures_equal_one_process`: join a
    gloo group, evaluate this rank's batches of every model, combine with the others."""
    import torch.distributed as dist

    from splitvit.train.ray_trainer import _combine_eval
    from splitvit.train.steps import evaluate_totals

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        work = torch.load(Path(folder, "work.pt"), weights_only=False)
        combined = {}
        for task, shards in work.items():
            model = SplitViT.load(Path(folder, f"{task}.pt")).eval()
            combined[task] = _combine_eval(evaluate_totals(model, shards[rank], num_classes=4), torch.device("cpu"))
        torch.save(combined, Path(folder, f"combined{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_distributed_eval_figures_equal_one_process(tmp_path):
    """The same models and batches evaluated by one process and split unevenly across a
    real two-process gloo group give identical figures: mIoU from the all-reduced
    confusion matrix (not a mean of the shards' mIoUs, which differs here), accuracy,
    tokens, token ratio and the image count."""
    import torch.multiprocessing as mp

    from splitvit.train.steps import evaluate

    gen = torch.Generator().manual_seed(0)
    work: dict[str, list] = {}
    reference: dict[str, dict] = {}
    shard_means: dict[str, float] = {}
    for task in ("dense", "classification"):
        torch.manual_seed(1)
        cfg = ExperimentConfig.from_dict(dict(json.loads(json.dumps(TINY)), model=dict(TINY["model"], task=task)))
        model = build_model(cfg.model).eval()
        model.save(tmp_path / f"{task}.pt")
        batches = []
        for n in (4, 3, 1):  # 7 images on rank 0, 1 on rank 1
            images = torch.rand(n, 3, 16, 16, generator=gen)
            if task == "dense":
                target = torch.randint(0, 3, (n, 16, 16), generator=gen)  # class 3 only in the last batch
                target[:, :2] = 255  # ignored pixels
                if n == 1:
                    target[0, 8:] = 3
            else:
                target = torch.randint(0, 4, (n,), generator=gen)
            batches.append((images, target))
        shards = [batches[:2], batches[2:]]
        work[task] = shards
        reference[task] = evaluate(model, batches, num_classes=4)
        quality = "miou" if task == "dense" else "accuracy"
        per_shard = [evaluate(model, shard, num_classes=4) for shard in shards]
        shard_means[task] = sum(f[quality] * f["images"] for f in per_shard) / 8
    # the old image-weighted mean of shard mIoUs is not the whole set's mIoU on these data
    assert abs(shard_means["dense"] - reference["dense"]["miou"]) > 1e-3
    torch.save(work, tmp_path / "work.pt")
    mp.spawn(_evaluate_shard, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        combined = torch.load(tmp_path / f"combined{rank}.pt", weights_only=False)
        for task, one in reference.items():
            quality = "miou" if task == "dense" else "accuracy"
            both = combined[task]
            assert both[quality] == one[quality], (task, rank)
            assert both["tokens_per_image"] == one["tokens_per_image"]
            assert both["token_ratio"] == one["token_ratio"]
            assert both["val_images"] == one["images"] == 8
            assert both["images_per_s"] > 0


@pytest.mark.parametrize(
    ("part", "teacher_weight", "message"),
    [
        ("policy", 1.0, "non-finite split probabilities"),
        ("policy", 0.0, "non-finite split probabilities"),
        ("head", 1.0, "non-finite loss nan at epoch 1"),
    ],
)
def test_nan_in_the_model_is_a_divergence_not_a_crash(part, teacher_weight, message):
    """NaN in the model raises FloatingPointError, which the training loop reports as
    ``diverged``: a NaN policy's split probabilities are caught before the teacher loss or
    the sampled decisions (torch.bernoulli) reject the NaN with a RuntimeError; a NaN
    classifier makes the loss non-finite."""
    from splitvit.train.ray_trainer import SplitStep

    cfg = ExperimentConfig.from_dict(json.loads(json.dumps(TINY)), [f"train.teacher.weight={teacher_weight}"])
    model = build_model(cfg.model)
    PoisonAt(epoch=1, part=part)(1, 0, model)
    step = SplitStep(model, cfg.train.loss_config()).train()
    images, target = torch.rand(4, 3, 16, 16), torch.randint(0, 4, (4,))
    with pytest.raises(FloatingPointError, match=message):
        step(images, target, 1, torch.Generator().manual_seed(0))
    if part == "policy":
        with pytest.raises(FloatingPointError, match=message):
            model.decide(model.split_scores(images), model.thresholds)


def test_run_training_hands_its_callbacks_to_ray_train(monkeypatch, tmp_path):
    """``callbacks`` reach Ray Train's RunConfig (a sweep trial's TuneReportCallback)."""
    from types import SimpleNamespace

    import ray.train
    import ray.train.torch

    import splitvit.train.ray_trainer as ray_trainer

    made: list[dict] = []

    class FakeTrainer:
        def __init__(self, loop, **kwargs):
            made.append(kwargs)

        def fit(self):
            outcome = ray_trainer.WorkerOutcome("completed", {"accuracy": 0.5})
            return SimpleNamespace(return_value=outcome, checkpoint=None, metrics={})

    monkeypatch.setattr(ray.train.torch, "TorchTrainer", FakeTrainer)
    monkeypatch.setattr(ray_trainer, "init_ray", lambda address=None: None)
    raw = dict(json.loads(json.dumps(TINY)), storage={"path": str(tmp_path / "runs"), "name": "cb"})
    cfg = ExperimentConfig.from_dict(raw, ["tracking.enabled=false"])
    callback = ray.train.UserCallback()
    result = run_training(cfg, callbacks=[callback])
    assert made[0]["run_config"].callbacks == [callback]
    assert result.status == "completed" and result.metrics == {"accuracy": 0.5}
    run_training(cfg)
    assert made[1]["run_config"].callbacks == []


def test_a_truncated_train_state_is_named_and_the_resume_takes_the_intact_one_before(
    ray_local, mlflow_uri, tmp_path, caplog
):
    """Issue #61: a re-run whose latest checkpoint has a truncated train_state.pt names
    the file and resumes from the newest intact checkpoint; the MLflow run finishes."""
    import logging

    from splitvit.train.checkpoints import STATE_FILE

    overrides = ["scaling.num_workers=1", "train.max_failures=0", "tracking.split_map_images=0"]
    overrides.append("tracking.log_model=false")
    first = run_training(tiny_config(tmp_path, mlflow_uri, "truncated", ["train.epochs=2", *overrides]))
    assert first.status == "completed" and first.checkpoint_uri.endswith("checkpoint_epoch0001")
    state = Path(first.checkpoint_uri) / STATE_FILE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # the disk filled mid-copy

    with caplog.at_level(logging.WARNING, logger="splitvit.train.ray_trainer"):
        again = run_training(tiny_config(tmp_path, mlflow_uri, "truncated", ["train.epochs=3", *overrides]))
    warned = [r.getMessage() for r in caplog.records if str(state) in r.getMessage()]
    assert warned and "checkpoint_epoch0000" in warned[0], caplog.text
    assert again.status == "completed" and again.start_epoch == 1  # epoch 1 trained again, then 2
    assert again.mlflow_run_id == first.mlflow_run_id
    assert again.checkpoint_uri.endswith("checkpoint_epoch0002")
    torch.load(state, weights_only=False)  # written anew by the re-trained epoch 1
    run = MlflowClient(mlflow_uri).get_run(again.mlflow_run_id)
    assert run.info.status == "FINISHED"
    tag = run.data.tags["splitvit.unreadable_checkpoint"]
    assert str(state) in tag and "resumed from" in tag and "checkpoint_epoch0000" in tag
    steps = [m.step for m in MlflowClient(mlflow_uri).get_metric_history(again.mlflow_run_id, "epoch")]
    assert sorted(set(steps)) == [0, 1, 2]


def test_a_checkpoint_with_every_file_unreadable_is_named(tmp_path):
    """The reads a resume makes name the unreadable file by its URI and size."""
    from splitvit.errors import is_deterministic
    from splitvit.train.checkpoints import (
        MODEL_FILE,
        STATE_FILE,
        CheckpointError,
        checkpoint_problem,
        read_training_checkpoint,
    )

    model = build_model(ExperimentConfig.from_dict(json.loads(json.dumps(TINY))).model)
    folder = tmp_path / "checkpoint_epoch0003"
    folder.mkdir()
    model.save(folder / MODEL_FILE)
    torch.save({"epoch": 3}, folder / STATE_FILE)
    assert checkpoint_problem(str(folder)) is None
    payload, state, rng = read_training_checkpoint(folder, 0, "s3://b/runs/x/checkpoint_epoch0003")
    assert state == {"epoch": 3} and rng is None and "state_dict" in payload
    (folder / STATE_FILE).write_bytes(b"PK\x03\x04 cut")
    with pytest.raises(CheckpointError) as info:
        read_training_checkpoint(folder, 0, "s3://b/runs/x/checkpoint_epoch0003")
    assert info.value.source == f"s3://b/runs/x/checkpoint_epoch0003/{STATE_FILE}"
    assert "(8 bytes; truncated" in info.value.reason and is_deterministic(info.value)
    assert checkpoint_problem(str(folder)).startswith(f"{folder}/{STATE_FILE} is not a readable torch file (8 bytes)")
    (folder / MODEL_FILE).unlink()
    assert checkpoint_problem(str(folder)) == f"{folder}/{MODEL_FILE} is missing"


@pytest.fixture
def fake_ray_init(monkeypatch):
    """``ray.init`` recording its keyword arguments instead of starting Ray."""
    import ray

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


@pytest.mark.parametrize(
    ("address", "env", "expected"),
    [
        (None, None, "local"),  # not ray.init()'s default, which joins a `ray start` cluster
        (None, "10.0.0.1:6379", "auto"),  # a Ray job: RAY_ADDRESS says where
        ("10.0.0.2:6379", None, "10.0.0.2:6379"),
        ("10.0.0.2:6379", "10.0.0.1:6379", "10.0.0.2:6379"),
    ],
)
def test_init_ray_starts_a_local_instance_unless_told_where(fake_ray_init, monkeypatch, address, env, expected):
    from splitvit.train.ray_trainer import init_ray

    if env:
        monkeypatch.setenv("RAY_ADDRESS", env)
    init_ray(address)
    assert [call["address"] for call in fake_ray_init] == [expected]


@pytest.mark.parametrize("env", [None, "10.0.0.1:6379"])
def test_a_sweep_keeps_ray_worker_output_off_the_console_unless_verbose(fake_ray_init, monkeypatch, env):
    """Ray forwards its workers' and controllers' log lines to the driver by default:
    dozens of ``(RayTrainWorker pid=...)`` lines around a sweep's own, Ray's own log
    lines and tracebacks among them. A sweep keeps them off unless ``-v``; a plain
    ``init_ray`` follows the process's level (INFO: ``-v``), as ``splitvit train``'s does."""
    import logging

    from splitvit.train.console import ray_output_shown, show_ray_output
    from splitvit.train.ray_trainer import init_ray

    if env:
        monkeypatch.setenv("RAY_ADDRESS", env)
    root = logging.getLogger()
    before = root.level
    try:
        for level in (logging.WARNING, logging.INFO):
            root.setLevel(level)
            init_ray()
        for verbose in (False, True):
            show_ray_output(verbose)
            init_ray(worker_logs=ray_output_shown())
    finally:
        show_ray_output(False)
        root.setLevel(before)
    assert [call["log_to_driver"] for call in fake_ray_init] == [False, True, False, True]


def test_a_study_keeps_ray_worker_output_its_epoch_lines_come_from(fake_ray_init):
    """A study's runs train inside its Tune trials: their per-epoch lines reach the
    console only as Ray's forwarded worker output, so a study keeps it, -v or not."""
    from splitvit.study.ray_executor import TuneExecutor
    from splitvit.train.console import show_ray_output

    for verbose in (False, True):
        show_ray_output(verbose)
        TuneExecutor(study_dir="unused").start(None)
    show_ray_output(False)
    assert [call["log_to_driver"] for call in fake_ray_init] == [True, True]


def test_test_session_ray_is_a_one_node_instance_of_its_own(ray_session):
    """The tests' Ray is a fresh one-node instance with the tests' CPUs, never a
    cluster that happens to run on the machine."""
    import ray

    from tests.fixtures_ray import RAY_CPUS

    ray_session.ensure()
    assert len([n for n in ray.nodes() if n["Alive"]]) == 1
    assert ray.cluster_resources().get("CPU") == RAY_CPUS


# ---------------------------------------------------------------------- a fit through the CLI
@pytest.fixture(scope="module")
def trained(ray_session, mlflow_uri, tmp_path_factory):
    """`splitvit train` on two CPU workers, two epochs."""
    ray_session.ensure()
    tmp = tmp_path_factory.mktemp("fit")
    cfg = tiny_config(tmp, mlflow_uri, "cli-fit")
    config_file = _write_yaml(tmp / "tiny.yaml", cfg)
    out = tmp / "result.json"
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        rc = main(["train", str(config_file), "--json", str(out)])
    assert rc == 0
    return {
        "result": json.loads(out.read_text()),
        "config": config_file,
        "tmp": tmp,
        "uri": mlflow_uri,
        "console": console.getvalue(),
    }


def test_train_prints_each_committed_epoch_from_the_driver(trained):
    """Without -v the workers' output stays off the console; the driver prints one
    line per epoch Ray committed, from the checkpoint's metrics.json."""
    lines = [line for line in trained["console"].splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1"], trained["console"]
    assert all("accuracy" in line and "tokens_per_image" in line for line in lines)
    assert "RayTrainWorker" not in trained["console"]


def test_the_epoch_watcher_reports_new_checkpoints_once_in_order(tmp_path):
    from splitvit.train.ray_trainer import EpochWatcher

    def commit(epoch: int) -> None:
        folder = tmp_path / f"checkpoint_epoch{epoch:04d}"
        folder.mkdir()
        (folder / "metrics.json").write_text(json.dumps({"accuracy": epoch / 10}))

    commit(0)  # a resumed run's earlier epoch: not reported again
    seen: list[tuple[int, float]] = []
    # no poll before stop(): what stop() finds is reported in epoch order
    watcher = EpochWatcher(str(tmp_path), lambda epoch, m: seen.append((epoch, m["accuracy"])), interval=3600)
    commit(2)
    commit(1)
    watcher.stop()
    assert seen == [(1, 0.1), (2, 0.2)]
    # polling: a new epoch is reported while training runs, and only once
    seen.clear()
    watcher = EpochWatcher(str(tmp_path), lambda epoch, m: seen.append((epoch, m["accuracy"])), interval=0.05)
    commit(3)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen == [(3, 0.3)]
    watcher.stop()
    assert seen == [(3, 0.3)]


def test_two_worker_fit_is_tracked_in_mlflow(trained):
    result, client = trained["result"], MlflowClient(trained["uri"])
    assert result["status"] == "ok" and result["run_status"] == "completed" and result["start_epoch"] == 0
    assert result["mlflow"]["run_id"] == result["mlflow_run_id"] and result["mlflow"]["experiment_id"]
    assert result["checkpoint_uri"].endswith("cli-fit/checkpoint_epoch0001")
    for key in ("accuracy", "tokens_per_image", "token_ratio", "images_per_s", "train_loss"):
        assert key in result["metrics"]
    assert 4 <= result["metrics"]["tokens_per_image"] <= 16

    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["train.epochs"] == "2" and params["scaling.num_workers"] == "2"
    assert params["model.timm_kwargs.embed_dim"] == "16" and params["train.budget.weight"] == "1.0"
    for key in ("accuracy", "tokens_per_image", "token_ratio", "images_per_s", "train_loss"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == [0, 1], key
    assert run.data.metrics["final_accuracy"] == pytest.approx(result["metrics"]["accuracy"])
    assert run.data.tags["splitvit.checkpoint"] == result["checkpoint_uri"]

    maps = sorted(f.path for f in client.list_artifacts(run.info.run_id, "split_maps"))
    assert maps == ["split_maps/epoch_0000.png", "split_maps/epoch_0001.png"]
    png = Path(client.download_artifacts(run.info.run_id, maps[-1])).read_bytes()
    assert png.startswith(b"\x89PNG")

    import mlflow
    import mlflow.pytorch

    mlflow.set_tracking_uri(trained["uri"])  # models:/<id> resolves in the run's store
    model = mlflow.pytorch.load_model(result["mlflow_model_uri"]).eval()
    with torch.no_grad():
        out = model(torch.rand(2, 3, 16, 16))
    assert out.logits.shape == (2, 4)


def test_checkpoint_holds_model_optimizer_and_rng(trained):
    folder = Path(trained["result"]["checkpoint_uri"])
    model = SplitViT.load(folder / "model.pt")
    payload = torch.load(folder / "model.pt", weights_only=False)
    assert payload["epoch"] == 1 and model.levels == 2
    assert payload["metrics"]["accuracy"] == pytest.approx(trained["result"]["metrics"]["accuracy"])
    # the inputs' normalisation travels with the weights: a model trained from scratch
    # sees the raw pixels (model.normalize: auto); timm's interpolation resizes its data
    assert payload["data_config"] == model.data_config and payload["data_config"]["interpolation"] == "bicubic"
    assert payload["state_dict"]["input_mean"].flatten().tolist() == [0.0, 0.0, 0.0]
    assert payload["state_dict"]["input_std"].flatten().tolist() == [1.0, 1.0, 1.0]
    state = torch.load(folder / "train_state.pt", weights_only=False)
    assert (
        state["epoch"] == 1 and state["optimizer"]["state"] and state["scheduler"]["last_epoch"] == state["global_step"]
    )
    for rank in (0, 1):
        rng = torch.load(folder / f"rng_rank{rank}.pt", weights_only=False)
        assert {"torch", "numpy", "python", "generator"} <= set(rng)
    # the two workers drew different random warm-up splits
    r0 = torch.load(folder / "rng_rank0.pt", weights_only=False)["generator"]
    r1 = torch.load(folder / "rng_rank1.pt", weights_only=False)["generator"]
    assert not torch.equal(r0, r1)


def test_eval_command_on_the_checkpoint(trained, capsys):
    ckpt = trained["result"]["checkpoint_uri"]
    out = trained["tmp"] / "eval.json"
    assert main(["eval", ckpt, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())
    for key in ("accuracy", "tokens_per_image", "token_ratio", "images_per_s"):
        assert key in printed and key in figures
    assert figures["images"] == 32 and figures["policy"] == "learned"
    # the two workers' combined figures are the whole validation set's, as one process finds them
    trained_metrics = torch.load(Path(ckpt) / "model.pt", weights_only=False)["metrics"]
    assert figures["accuracy"] == trained_metrics["accuracy"]
    assert figures["tokens_per_image"] == pytest.approx(trained_metrics["tokens_per_image"])
    # thresholds 0: every node splits (16 tokens); 1: none does (4 tokens)
    assert main(["eval", ckpt, "--thresholds", "0", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tokens_per_image"] == 16
    assert main(["eval", ckpt + "/model.pt", "--thresholds", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tokens_per_image"] == 4
    assert main(["eval", ckpt, "--policy", "coarse", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["token_ratio"] == 0.25
    capsys.readouterr()
    assert main(["eval", ckpt, "--thresholds", "1.5"]) == 2
    assert "thresholds[0] = 1.5 is outside [0, 1]" in capsys.readouterr().err
    assert main(["eval", str(trained["tmp"] / "missing")]) == 2
    # the oracle splits where a detection set's instance masks are: a classifier has none
    assert main(["eval", ckpt, "--oracle"]) == 2
    assert "is not a detector (model.task=detection)" in capsys.readouterr().err
    assert main(["eval", ckpt, "--oracle", "--thresholds", "0.5"]) == 2
    assert "--oracle splits where the annotations' instances are" in capsys.readouterr().err
    assert main(["eval", ckpt, "--oracle-context", "4"]) == 2
    assert "it goes with --oracle" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:  # the parser's own check: before anything loads
        main(["eval", ckpt, "--oracle", "--oracle-context", "-1"])
    assert stopped.value.code == 2
    assert "argument --oracle-context: must be >= 0, got -1" in capsys.readouterr().err


def test_bad_input_errors_before_ray_and_keeps_earlier_results(trained, monkeypatch, capsys):
    """A bad override on an existing run stops with the key named; checkpoints and the
    MLflow run written earlier are untouched."""
    import ray.train.torch

    def forbidden(*args, **kwargs):
        raise AssertionError("a Ray fit started despite the bad config")

    monkeypatch.setattr(ray.train.torch.TorchTrainer, "fit", forbidden)
    run_dir = Path(trained["result"]["run_uri"])
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file())
    client = MlflowClient(trained["uri"])
    run_before = client.get_run(trained["result"]["mlflow_run_id"])
    runs_before = len(client.search_runs([run_before.info.experiment_id]))
    for bad, message in (
        ("train.budget.weight=-1", "config error: train.budget.weight: must be >= 0, got -1.0"),
        ("model.thresholds=[2.0]", "config error: model.thresholds: thresholds[0] = 2.0 is outside [0, 1]"),
        ("model.image_size=18", "config error: model.image_size: image size 18x18"),
    ):
        assert main(["train", str(trained["config"]), bad]) == 2
        assert message in capsys.readouterr().err
    after = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file())
    assert after == before
    run_after = client.get_run(run_before.info.run_id)
    assert run_after.info.status == "FINISHED" and run_after.data.metrics == run_before.data.metrics
    assert len(client.search_runs([run_before.info.experiment_id])) == runs_before


# ---------------------------------------------------------------------- fault tolerance, S3
def test_killed_worker_resumes_from_s3_checkpoint_and_a_rerun_continues(ray_local, mlflow_uri, s3_bucket, tmp_path):
    """Checkpoints go to s3:// on the local endpoint. A worker killed at the start of
    epoch 1 makes Ray restart the group from epoch 0's S3 checkpoint; every epoch is
    logged once. Re-running under the same name (one more epoch, one worker) resumes
    from the S3 checkpoint and continues the same MLflow run."""
    import boto3

    storage = f"s3://{s3_bucket}/experiments"
    marker = tmp_path / "crashed"
    overrides = [f"storage.path={storage}", "train.epochs=2", "tracking.log_model=false"]
    first = run_training(
        tiny_config(tmp_path, mlflow_uri, "on-s3", overrides), epoch_hook=CrashOnce(str(marker), epoch=1, rank=1)
    )
    assert marker.exists(), "the worker was never killed"
    assert first.status == "completed"
    assert first.start_epoch == 1  # the last attempt resumed after epoch 0's checkpoint
    assert first.checkpoint_uri == f"{storage}/on-s3/checkpoint_epoch0001"
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=s3_bucket)["Contents"]}
    for epoch in (0, 1):
        for name in ("model.pt", "train_state.pt", "rng_rank0.pt", "rng_rank1.pt"):
            assert f"experiments/on-s3/checkpoint_epoch{epoch:04d}/{name}" in keys
    assert not (tmp_path / "runs" / "on-s3").exists()  # nothing went to the local folder
    client = MlflowClient(mlflow_uri)
    for key in ("epoch", "accuracy", "train_loss"):
        steps = sorted(m.step for m in client.get_metric_history(first.mlflow_run_id, key))
        assert steps == [0, 1], key  # every epoch once: none lost, none repeated
    assert client.get_run(first.mlflow_run_id).info.status == "FINISHED"

    second = run_training(
        tiny_config(tmp_path, mlflow_uri, "on-s3", overrides + ["train.epochs=3", "scaling.num_workers=1"])
    )
    assert second.status == "completed" and second.start_epoch == 2
    assert second.checkpoint_uri == f"{storage}/on-s3/checkpoint_epoch0002"
    assert second.mlflow_run_id == first.mlflow_run_id
    assert sorted(m.step for m in client.get_metric_history(second.mlflow_run_id, "epoch")) == [0, 1, 2]

    out = tmp_path / "eval.json"
    assert main(["eval", second.checkpoint_uri, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["images"] == 32 and figures["epoch"] == 2


def test_non_finite_split_probabilities_stop_the_run_and_keep_the_last_good_checkpoint(ray_local, mlflow_uri, tmp_path):
    """NaN split probabilities in the policy phase (epoch 1) end a Ray run ``diverged``.
    A non-finite loss raises the same FloatingPointError (the step test above) and
    ends the same way; a sweep's diverging trial shows that through Ray too
    (tests/test_sweep.py)."""
    cfg = tiny_config(tmp_path, mlflow_uri, "nan", ["train.epochs=2"])
    result = run_training(cfg, epoch_hook=PoisonAt(epoch=1, part="policy"))
    assert result.status == "diverged"
    assert "non-finite split probabilities" in result.message
    assert result.start_epoch == 0  # not retried: a NaN is not a worker failure
    assert result.checkpoint_uri.endswith("checkpoint_epoch0000")
    model = SplitViT.load(Path(result.checkpoint_uri) / "model.pt")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not list(Path(result.run_uri).glob("checkpoint_epoch0001"))
    client = MlflowClient(mlflow_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FAILED" and run.data.tags["splitvit.status"] == "diverged"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "epoch")) == [0]
    assert "splitvit.model_id" not in run.data.tags


# ---------------------------------------------------------------------- two nodes (own cluster)
def test_two_node_cluster_fit(ray_session, mlflow_uri, tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the shared instance goes for a while; started again at the end
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        seen = tmp_path / "nodes"
        seen.mkdir()
        cfg = tiny_config(tmp_path, mlflow_uri, "two-nodes", ["train.epochs=2", "tracking.enabled=false"])
        result = run_training(cfg, epoch_hook=RecordPlacement(str(seen)))
        assert result.status == "completed" and result.checkpoint_uri.endswith("checkpoint_epoch0001")
        records = {p.stem: json.loads(p.read_text()) for p in seen.iterdir()}
        assert set(records) == {"epoch0_rank0", "epoch0_rank1", "epoch1_rank0", "epoch1_rank1"}
        assert {records["epoch0_rank0"]["node"], records["epoch0_rank1"]["node"]} == nodes  # one worker per node
        # DDP kept the replicas identical through a training epoch on different shards
        assert records["epoch1_rank0"]["params"] == records["epoch1_rank1"]["params"]
        assert records["epoch1_rank0"]["params"] != records["epoch0_rank0"]["params"]
    finally:
        ray.shutdown()
        cluster.shutdown()
        # the session's instance again: tests that only hold ray_session expect it, and
        # without it the next `splitvit` command here would start a Ray of its own size
        ray_session.ensure()
