"""MLflow tracking against a real embedded store (SQLite + local artifacts), read back
with MlflowClient: params, per-epoch metrics logged once, images, the logged model,
run status, and no secrets anywhere."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow import MlflowClient  # noqa: E402

from splitvit.config import (
    ExperimentConfig,  # noqa: E402
    PolicyConfig,
)
from splitvit.tracking import RunTracker  # noqa: E402

SECRETS = ("AKIAEXAMPLESECRET", "s3cr3t-t0ken", "hunter2")


def _tiny_model(policy: str = "learned"):
    from splitvit.model import SplitViT

    torch.manual_seed(0)
    return SplitViT.from_timm(
        "vit_tiny_patch16_224",
        policy=PolicyConfig(kind=policy, depth=1),
        levels=2,
        image_size=16,
        num_classes=3,
        timm_kwargs={"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
    )


def _open(uri: str, run_uri: str, params: dict, tags: dict | None = None):
    return RunTracker.open(uri, "tests", run_uri, Path(run_uri).name, params=params, tags=tags)


def test_open_logs_params_without_secrets_and_resumes_same_run(mlflow_uri, caplog):
    cfg = ExperimentConfig.from_dict(
        {
            "data": {"options": {"aws_secret_access_key": SECRETS[0], "session_token": SECRETS[1]}},
            "tracking": {"tracking_uri": f"https://bob:{SECRETS[2]}@mlflow.example"},
        }
    )
    run_uri = f"/runs/{uuid.uuid4().hex}"
    with caplog.at_level(logging.DEBUG):
        tracker, resumed = _open(
            mlflow_uri,
            run_uri,
            cfg.flat(),
            tags={"source": f"https://bob:{SECRETS[2]}@git.example/repo", "api_key": SECRETS[0]},
        )
    assert not resumed
    client = MlflowClient(mlflow_uri)
    run = client.get_run(tracker.run_id)
    assert run.data.params["train.epochs"] == str(cfg.train.epochs)
    assert run.data.params["model.levels"] == str(cfg.model.levels)
    assert run.data.params["data.options.aws_secret_access_key"] == "***"
    assert run.data.tags["splitvit.run_uri"] == run_uri
    stored = repr(run.data.params) + repr(run.data.tags) + caplog.text
    for secret in SECRETS:
        assert secret not in stored
    assert run.info.status == "RUNNING"

    tracker.close("completed")
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    # the same run folder re-opens the same MLflow run; a changed setting is recorded, not lost
    changed = dict(cfg.flat(), **{"train.epochs": cfg.train.epochs + 5})
    again, resumed = _open(mlflow_uri, run_uri, changed)
    assert resumed and again.run_id == tracker.run_id
    run = client.get_run(again.run_id)
    assert run.info.status == "RUNNING"
    assert run.data.params["train.epochs"] == str(cfg.train.epochs)
    assert '"train.epochs"' in run.data.tags["splitvit.changed_on_resume"]
    # another folder, another run
    other, resumed = _open(mlflow_uri, run_uri + "-b", cfg.flat())
    assert not resumed and other.run_id != tracker.run_id


def test_epochs_are_logged_once_and_images_land_as_png(mlflow_uri):
    from PIL import Image

    tracker, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {"a": 1})
    assert tracker.log_epoch(0, {"accuracy": 0.5, "tokens_per_image": 10.0, "flag": True})
    assert tracker.log_epoch(1, {"accuracy": 0.75, "tokens_per_image": 9.0})
    # a restarted worker re-logging epoch 1 must not duplicate it
    assert not tracker.log_epoch(1, {"accuracy": 0.1, "tokens_per_image": 1.0})
    client = MlflowClient(mlflow_uri)
    history = client.get_metric_history(tracker.run_id, "accuracy")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(0, 0.5), (1, 0.75)]
    assert "flag" not in client.get_run(tracker.run_id).data.metrics  # booleans are not figures
    assert tracker.logged_epochs() == {0, 1}

    assert not tracker.has_final()
    tracker.log_final({"accuracy": 0.75})
    assert tracker.has_final()
    assert client.get_run(tracker.run_id).data.metrics["final_accuracy"] == 0.75

    tracker.log_image(Image.new("RGB", (8, 8), (255, 0, 0)), "split_maps/epoch_0001.png")
    files = [f.path for f in client.list_artifacts(tracker.run_id, "split_maps")]
    assert files == ["split_maps/epoch_0001.png"]
    local = client.download_artifacts(tracker.run_id, "split_maps/epoch_0001.png")
    assert Path(local).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_logged_model_loads_back_and_matches(mlflow_uri):
    import mlflow.pytorch

    tracker, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {"a": 1})
    model = _tiny_model().eval()
    uri = tracker.log_model(model, params={"levels": 2})
    assert uri.startswith("models:/")
    assert tracker.log_model(model) == uri  # logged once, even when asked again
    loaded = mlflow.pytorch.load_model(uri).eval()
    images = torch.rand(3, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded(images).logits, model(images).logits)
    logged = MlflowClient(mlflow_uri).get_logged_model(uri.split("/", 1)[1])
    assert logged.source_run_id == tracker.run_id and logged.experiment_id == tracker.experiment_id


def test_close_statuses(mlflow_uri):
    client = MlflowClient(mlflow_uri)
    for status, expected in (("completed", "FINISHED"), ("diverged", "FAILED"), ("interrupted", "KILLED")):
        tracker, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {})
        tracker.close(status, tags={"note": "x"})
        run = client.get_run(tracker.run_id)
        assert run.info.status == expected and run.data.tags["splitvit.status"] == status


def test_closed_on_error_ends_the_run_and_reraises(mlflow_uri):
    client = MlflowClient(mlflow_uri)
    for error, expected, status in (
        (ValueError("bad shard"), "FAILED", "failed"),
        (KeyboardInterrupt(), "KILLED", "interrupted"),
    ):
        tracker, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {})
        with pytest.raises(type(error)):
            with tracker.closed_on_error():
                raise error
        run = client.get_run(tracker.run_id)
        assert run.info.status == expected and run.data.tags["splitvit.status"] == status
        assert ("bad shard" in run.data.tags.get("splitvit.error", "")) == (status == "failed")
    tracker, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {})
    with tracker.closed_on_error():
        pass
    assert client.get_run(tracker.run_id).info.status == "RUNNING"  # success: the caller closes it


def test_experiment_gets_local_artifacts_next_to_the_store(mlflow_uri):
    from splitvit.tracking import ensure_experiment

    folder = Path(mlflow_uri[len("sqlite:///") :]).parent
    experiment_id = ensure_experiment(mlflow_uri, "local-artifacts")
    assert ensure_experiment(mlflow_uri, "local-artifacts") == experiment_id
    location = MlflowClient(mlflow_uri).get_experiment(experiment_id).artifact_location
    assert location == (folder / "mlartifacts" / "local-artifacts").as_uri()
    assert (folder / "mlflow.db").is_file()


@pytest.mark.parametrize(
    "key",
    [
        "aws_access_key_id",
        "GITHUB_TOKEN",
        "db_password",
        "client_secret",
        "data.options.aws_secret_access_key",
        "AWS_SESSION_TOKEN",
        "auth_token",
        "access_token",
        "api_token",
        "accessToken",
        "token",
        "password",
        "passwd",
        "secret",
        "api_key",
        "credentials",
    ],
)
def test_secret_names(key):
    from splitvit.tracking.runs import safe_params, safe_tags

    assert safe_params({key: "value"}) == {key: "***"}
    assert safe_tags({key: "value"}) == {key: "***"}
    assert safe_params({"storage.path": "s3://b/p", "x": None}) == {"storage.path": "s3://b/p", "x": "null"}


@pytest.mark.parametrize(
    "key",
    [
        "train.token_ratio",
        "pareto.token_ratio",
        "tokens_per_image",
        "final_tokens_per_image",
        "full_tokens",
        "max_tokens",
    ],
)
def test_token_counts_are_not_secrets(key):
    """Token figures are what a SPLIT run is about: they stay readable."""
    from splitvit.tracking.runs import safe_params, safe_tags

    assert safe_params({key: 0.25}) == {key: "0.25"}
    assert safe_tags({key: 0.25}) == {key: "0.25"}


def test_credentials_in_uris_are_redacted_but_token_figures_in_queries_are_not():
    from splitvit.tracking import safe_params

    params = safe_params(
        {
            "tracking.tracking_uri": "postgresql://user:pass@host/db",
            "source": "https://h/x?access_token=abc&tokens_per_image=12&X-Amz-Security-Token=zz&api_key=k",
        }
    )
    assert params["tracking.tracking_uri"] == "postgresql://user:***@host/db"
    assert params["source"] == "https://h/x?access_token=***&tokens_per_image=12&X-Amz-Security-Token=***&api_key=***"


def test_runs_carry_their_provenance(mlflow_uri, monkeypatch, tmp_path):
    """Source, user, the checkout's commit and the package version on every run; a job
    started from a copy without .git takes the commit its submitter passed along."""
    import subprocess

    from splitvit import __version__
    from splitvit.tracking.provenance import GIT_COMMIT_ENV, GIT_DIRTY_ENV, git_env, git_state

    monkeypatch.delenv(GIT_COMMIT_ENV, raising=False)
    # the command line that made the run, as typed (the console script by its name), its secrets masked
    argv = ["/x/.venv/bin/splitvit", "train", "c.yaml", "storage.s3.secret_key=hunter2", "data.uri=s3://u:pw@h/b"]
    monkeypatch.setattr(sys, "argv", argv)
    tracker, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {})
    tags = MlflowClient(mlflow_uri).get_run(tracker.run_id).data.tags
    assert tags["splitvit.version"] == __version__ and tags["mlflow.user"] and tags["mlflow.source.type"] == "LOCAL"
    assert tags["splitvit.command"] == "splitvit train c.yaml 'storage.s3.secret_key=***' 'data.uri=s3://u:***@h/b'"
    assert "hunter2" not in tags["splitvit.command"] and "pw@" not in tags["splitvit.command"]
    assert tags["mlflow.source.name"] == "splitvit train"  # the UI's Source column: the command
    head = subprocess.run(
        ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode == 0:  # a checkout (CI's clean clone is one)
        assert tags["mlflow.source.git.commit"] == head.stdout.strip()
        assert tags["splitvit.git_dirty"] in ("true", "false")
    # a folder that is no repository has no git state to pass on
    assert git_state(str(tmp_path)) is None and git_env(tmp_path) == {}
    monkeypatch.setenv(GIT_COMMIT_ENV, "0123abc")
    monkeypatch.setenv(GIT_DIRTY_ENV, "false")
    tracker, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {})
    tags = MlflowClient(mlflow_uri).get_run(tracker.run_id).data.tags
    assert tags["mlflow.source.git.commit"] == "0123abc" and tags["splitvit.git_dirty"] == "false"


def test_training_data_is_recorded_as_mlflow_dataset_inputs(mlflow_uri, tmp_path):
    """The run page's *Datasets used*: train and evaluation splits, named, sourced and
    digested by what decides their items; logged once (a resumed run keeps them)."""
    from splitvit.config import DataConfig

    generated = DataConfig(name="synthetic", options={"train_samples": 64}, seed=3)
    tracker, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {})
    tracker.log_datasets(generated)
    tracker.log_datasets(generated)  # again, as on a resume: no second pair
    inputs = MlflowClient(mlflow_uri).get_run(tracker.run_id).inputs.dataset_inputs
    assert [(i.dataset.name, i.tags[0].value) for i in inputs] == [
        ("synthetic/train", "training"),
        ("synthetic/val", "evaluation"),
    ]
    assert inputs[0].dataset.source_type == "code" and inputs[0].dataset.digest != inputs[1].dataset.digest

    folder = DataConfig(name="imagefolder", options={"root": str(tmp_path / "images")}, val_split="test")
    other, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {})
    other.log_datasets(folder)
    again, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {})
    again.log_datasets(folder)
    first = MlflowClient(mlflow_uri).get_run(other.run_id).inputs.dataset_inputs
    second = MlflowClient(mlflow_uri).get_run(again.run_id).inputs.dataset_inputs
    assert [i.dataset.name for i in first] == ["imagefolder/train", "imagefolder/test"]
    assert str(tmp_path / "images") in first[0].dataset.source
    assert [i.dataset.digest for i in first] == [i.dataset.digest for i in second]  # same data, same digest


def test_run_uris_resolve_to_the_runs_checkpoint_or_say_why_not(mlflow_uri, tmp_path):
    """`runs:/<id>` (what `splitvit eval` and `viz` take): the run's checkpoint and the
    thresholds it recorded; a run without a checkpoint, an unknown run or a missing
    store is one line naming the URI, and a missing SQLite store is never created."""
    from splitvit.tracking.model_uris import resolve_model_uri

    tracker, _ = _open(mlflow_uri, f"/runs/{uuid.uuid4().hex}", {"thresholds": "[0.4, 0.6]"})
    with pytest.raises(ValueError, match=rf"runs:/{tracker.run_id}: run {tracker.run_id} records no checkpoint"):
        resolve_model_uri(f"runs:/{tracker.run_id}", mlflow_uri)
    tracker.set_tags({"splitvit.checkpoint": str(tmp_path / "checkpoint_epoch0001")})
    resolved = resolve_model_uri(f"runs:/{tracker.run_id}/model", mlflow_uri)
    assert resolved.checkpoint == str(tmp_path / "checkpoint_epoch0001") and resolved.thresholds == [0.4, 0.6]
    with pytest.raises(ValueError, match="runs:/0123456789abcdef: not found in MLflow store"):
        resolve_model_uri("runs:/0123456789abcdef", mlflow_uri)
    missing = tmp_path / "nowhere" / "mlflow.db"
    with pytest.raises(ValueError, match="no MLflow store"):
        resolve_model_uri("models:/splitvit-x@best", f"sqlite:///{missing}")
    assert not missing.parent.exists()
