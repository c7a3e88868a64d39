"""Experiment configs: YAML + overrides, types, ranges, the model's own validators,
secrets kept out of what is logged — and errors before any Ray work."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from splitvit.config import ConfigError, ExperimentConfig, load_config, redact_uri
from splitvit.train.experiment import build_model

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "jobs" / "configs" / "smoke.yaml"


def test_smoke_config_loads_with_overrides():
    cfg = load_config(SMOKE, ["train.epochs=5", "model.timm_kwargs.embed_dim=48", "model.thresholds=[0.3, 0.7]",
                              "train.lr=1e-3", "storage.name=abc", "data.options.train_samples=64"])
    assert cfg.train.epochs == 5
    assert cfg.model.timm_kwargs["embed_dim"] == 48 and cfg.model.timm_kwargs["depth"] == 2
    assert cfg.model.thresholds == [0.3, 0.7]
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1e-3
    assert cfg.storage.name == "abc"
    assert cfg.data.options == {"train_samples": 64, "val_samples": 128, "object_size": 8}
    loss = cfg.train.loss_config()
    assert (loss.lambda_budget, loss.target_ratio, loss.penalty) == (1.0, 0.5, "squared")
    flat = cfg.flat()
    assert flat["train.epochs"] == 5 and flat["model.timm_kwargs.embed_dim"] == 48
    # the model it describes builds and has the configured geometry
    model = build_model(cfg.model)
    assert model.geometry.image_size == (32, 32) and model.levels == 3 and model.policy.name == "learned"


def test_train_section_covers_every_split_loss_setting():
    import dataclasses

    from splitvit.config import TrainConfig
    from splitvit.train.steps import SplitLossConfig

    train = {f.name for f in dataclasses.fields(TrainConfig)}
    missing = {f.name for f in dataclasses.fields(SplitLossConfig)} - train
    assert not missing, f"SplitLossConfig settings the config cannot set: {missing}"
    cfg = load_config(SMOKE, ["train.warmup_min_split=0.6", "train.teacher_weight=0.25"])
    assert cfg.train.loss_config().warmup_min_split == 0.6 and cfg.train.loss_config().teacher_weight == 0.25


def test_default_name_is_config_stem_and_time():
    cfg = load_config(SMOKE)
    assert cfg.storage.name.startswith("smoke-")


def test_ints_become_floats_but_not_the_reverse(tmp_path):
    cfg = ExperimentConfig.from_dict({"train": {"lr": 1, "lambda_budget": 0}})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict({"train": {"epochs": 2.5}})
    assert str(err.value) == "config error: train.epochs: expected int, got float 2.5"


@pytest.mark.parametrize(
    "override, key, text",
    [
        ("train.lambda_budget=-1", "train.lambda_budget", "must be >= 0, got -1.0"),
        ("train.teacher_weight=-0.5", "train.teacher_weight", "must be >= 0, got -0.5"),
        ("train.target_ratio=1.5", "train.target_ratio", "must be in (0, 1], got 1.5"),
        ("train.penalty=linear", "train.penalty", "must be one of"),
        ("train.teacher=oracle", "train.teacher", "must be 'gradient' or 'attention'"),
        ("train.warmup_min_split=2", "train.warmup_min_split", "must be in [0, 1]"),
        ("train.epoch=3", "train.epoch", "unknown key; did you mean train.epochs?"),
        ("trian.epochs=3", "trian", "unknown key; did you mean train?"),
        ("train.epochs=three", "train.epochs", "expected int, got str 'three'"),
        ("train.amp=yes please", "train.amp", "expected bool"),
        ("model.thresholds=[0.5, 1.5]", "model.thresholds", "thresholds[1] = 1.5 is outside [0, 1]"),
        ("model.thresholds=-0.1", "model.thresholds", "outside [0, 1]"),
        ("model.thresholds=[0.5]", "model.thresholds", "expected 2 values"),
        ("model.image_size=40", "model.image_size", "image size 40x40 is not a multiple of the coarsest patch 16"),
        ("model.timm_kwargs.patch_size=3", "model.image_size", "not a multiple of the coarsest patch 12"),
        ("model.levels=1", "model.levels", "must be >= 2"),
        ("model.policy=smart", "model.policy", "unknown policy 'smart'"),
        ("model.task=detection", "model.task", "must be one of classification, dense"),
        ("model.policy_depth=3", "model.policy_depth", "must be in [0, 2]"),
        ("train.teacher_every=0", "train.teacher_every", "must be >= 1, got 0"),
        ("model.policy_width=129", "model.policy_width", "positive multiple of its 2 attention head(s)"),
        ("model.policy_width=0", "model.policy_width", "positive multiple"),
        ("model.policy_width=wide", "model.policy_width", "expected int"),
        ("model.name=not_a_model", "model.name", "unknown timm model 'not_a_model'"),
        ("model.timm_kwargs.bogus=1", "model.timm_kwargs.bogus", "unexpected keyword argument 'bogus'"),
        ("model.checkpoint_path=/nonexistent/w.pth", "model.checkpoint_path", "does not exist"),
        ("data.name=imagenet21k", "data.name", "unknown dataset 'imagenet21k'"),
        ("data.batch_size=0", "data.batch_size", "must be >= 1, got 0"),
        ("scaling.num_workers=0", "scaling.num_workers", "must be >= 1, got 0"),
        ("scaling.resources_per_worker.CPU=-1", "scaling.resources_per_worker.CPU", "must be >= 0"),
        ("storage.path=gs://bucket/x", "storage.path", "must be a local folder or s3://bucket/prefix"),
        ("storage.name=a/b", "storage.name", "plain folder name"),
        ("tracking.split_map_images=-1", "tracking.split_map_images", "must be >= 0"),
        ("train.epochs", "train.epochs", "override must look like key=value"),
        ("model=3", "model", "expected a mapping"),
    ],
)
def test_bad_values_name_their_key(override, key, text):
    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, [override])
    assert err.value.key == key
    assert text in str(err.value)
    assert str(err.value).startswith(f"config error: {key}: ")


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    top = tmp_path / "top.yaml"
    top.write_text(yaml.safe_dump({"models": {}}))
    with pytest.raises(ConfigError, match="config error: models: unknown key; did you mean model"):
        load_config(top)


def test_tracking_uri_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = ExperimentConfig.from_dict({"storage": {"path": str(tmp_path / "runs")}})
    assert cfg.tracking_uri() == f"sqlite:///{tmp_path}/runs/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert cfg.tracking_uri() == "http://mlflow.example:5000"
    explicit = ExperimentConfig.from_dict({"tracking": {"tracking_uri": "sqlite:////x/db.sqlite"}})
    assert explicit.tracking_uri() == "sqlite:////x/db.sqlite"
    # checkpoints on S3: the embedded store stays local
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    remote = ExperimentConfig.from_dict({"storage": {"path": "s3://bucket/prefix"}})
    assert remote.tracking_uri().startswith("sqlite:////") and remote.storage.run_uri().startswith("s3://bucket/prefix/")


def test_secrets_are_redacted_from_what_is_logged():
    cfg = ExperimentConfig.from_dict({
        "data": {"options": {"aws_secret_access_key": "AKIASECRET", "api_token": "tok123", "object_size": 8}},
        "tracking": {"tracking_uri": "postgresql://alice:hunter2@db.example/mlflow"},
    })
    flat = cfg.flat()
    text = repr(flat) + repr(cfg.to_dict())
    for secret in ("AKIASECRET", "tok123", "hunter2"):
        assert secret not in text
    assert flat["data.options.aws_secret_access_key"] == "***"
    assert flat["tracking.tracking_uri"] == "postgresql://alice:***@db.example/mlflow"
    assert flat["data.options.object_size"] == 8
    # the unredacted view keeps them for the code that needs them
    assert cfg.to_dict(redact=False)["data"]["options"]["api_token"] == "tok123"
    assert redact_uri("https://h/x?X-Amz-Signature=abc&token=zz&a=1") == "https://h/x?X-Amz-Signature=abc&token=***&a=1"


def test_cli_config_error_comes_before_any_ray_work(tmp_path, monkeypatch, capsys):
    """A bad value stops `splitvit train` with one line naming the key; Ray never starts
    and nothing is written to the storage folder."""
    import ray
    import ray.train.torch

    from splitvit.cli import main

    def forbidden(*args, **kwargs):
        raise AssertionError("Ray was touched before the config was validated")

    monkeypatch.setattr(ray, "init", forbidden)
    monkeypatch.setattr(ray.train.torch.TorchTrainer, "fit", forbidden)
    runs = tmp_path / "runs"
    rc = main(["train", str(SMOKE), f"storage.path={runs}", "train.lambda_budget=-1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "config error: train.lambda_budget: must be >= 0, got -1.0" in err
    assert not runs.exists()


def test_thresholds_auto_or_numbers_only():
    from splitvit.config import ConfigError, ExperimentConfig

    assert ExperimentConfig.from_dict({}, ["model.thresholds=auto"]).model.thresholds == "auto"
    with pytest.raises(ConfigError, match=r"model.thresholds: must be numbers in \[0, 1\] or 'auto', got 'sometimes'"):
        ExperimentConfig.from_dict({}, ["model.thresholds=sometimes"])
