"""Experiment configs: YAML + overrides, types, ranges, the model's own validators,
secrets kept out of what is logged — and errors before any Ray work."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from splitvit.config import ConfigError, ExperimentConfig, load_config, redact_uri, validate
from splitvit.train.experiment import build_model, experiment_from_dict, load_experiment, validate_experiment

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "jobs" / "configs" / "smoke.yaml"


def test_smoke_config_loads_with_overrides():
    cfg = load_experiment(
        SMOKE,
        [
            "train.epochs=5",
            "model.timm_kwargs.embed_dim=48",
            "model.thresholds=[0.3, 0.7]",
            "train.lr=1e-3",
            "storage.name=abc",
            "data.options.train_samples=64",
        ],
    )
    assert cfg.train.epochs == 5
    assert cfg.model.timm_kwargs["embed_dim"] == 48 and cfg.model.timm_kwargs["depth"] == 2
    assert cfg.model.thresholds == [0.3, 0.7]
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1e-3
    assert cfg.storage.name == "abc"
    assert cfg.data.options == {"train_samples": 64, "val_samples": 128, "object_size": 8}
    loss = cfg.train.loss_config()
    assert (loss.budget.weight, loss.budget.target_ratio, loss.budget.penalty) == (1.0, 0.5, "squared")
    flat = cfg.flat()
    assert flat["train.epochs"] == 5 and flat["model.timm_kwargs.embed_dim"] == 48
    # the model it describes builds and has the configured geometry
    model = build_model(cfg.model)
    assert model.geometry.image_size == (32, 32) and model.levels == 3 and model.policy.name == "learned"


def test_train_section_is_the_split_loss_settings_and_more():
    """The SPLIT objective's settings are declared once (SplitLossConfig) and set flat
    in the train section; the training step gets them as a plain SplitLossConfig."""
    from splitvit.config import SplitLossConfig, TrainConfig
    from splitvit.train import steps

    assert steps.SplitLossConfig is SplitLossConfig  # still importable where the training step lives
    assert issubclass(TrainConfig, SplitLossConfig)
    declared = set(vars(TrainConfig).get("__annotations__", {}))  # TrainConfig's own fields
    assert not declared & {f.name for f in dataclasses.fields(SplitLossConfig)}, "re-declared in TrainConfig"
    cfg = load_config(
        SMOKE, ["train.policy.warmup_min_split=0.6", "train.teacher.weight=0.25", "train.teacher.every=3"]
    )
    loss = cfg.train.loss_config()
    assert type(loss) is SplitLossConfig
    assert (loss.policy.warmup_min_split, loss.teacher.weight, loss.teacher.every) == (0.6, 0.25, 3)
    assert {f.name for f in dataclasses.fields(SplitLossConfig)} <= set(cfg.to_dict()["train"])  # flat YAML keys


def test_default_name_is_config_stem_and_time():
    cfg = load_config(SMOKE)
    assert cfg.storage.name.startswith("smoke-")


def test_ints_become_floats_but_not_the_reverse(tmp_path):
    cfg = ExperimentConfig.from_dict({"train": {"lr": 1, "budget": {"weight": 0}}})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict({"train": {"epochs": 2.5}})
    assert str(err.value) == "config error: train.epochs: expected int, got float 2.5"


@pytest.mark.parametrize(
    "override, key, text",
    [
        ("train.budget.weight=-1", "train.budget.weight", "must be >= 0, got -1.0"),
        ("train.teacher.weight=-0.5", "train.teacher.weight", "must be >= 0, got -0.5"),
        ("train.budget.target_ratio=1.5", "train.budget.target_ratio", "must be in (0, 1], got 1.5"),
        ("train.budget.penalty=linear", "train.budget.penalty", "must be one of"),
        (
            "train.teacher.kind=oracle",
            "train.teacher.kind",
            "must be one of gradient, attention, objects, got 'oracle'",
        ),
        ("train.policy.lr_scale=0", "train.policy.lr_scale", "must be > 0, got 0"),
        (
            "train.teacher.targets=joint",
            "train.teacher.targets",
            "must be one of per_level, nested, mixed, got 'joint'",
        ),
        ("train.teacher.scope=canvas", "train.teacher.scope", "must be one of image, batch, got 'canvas'"),
        ("train.policy.warmup_min_split=2", "train.policy.warmup_min_split", "must be in [0, 1]"),
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
        ("train.distill.weight=-0.5", "train.distill.weight", "must be >= 0, got -0.5"),
        ("train.distill.temperature=0", "train.distill.temperature", "must be > 0, got 0.0"),
        ("train.budget.ratio_range=[0.8, 0.3]", "train.budget.ratio_range", "0 < low <= high <= 1, got [0.8, 0.3]"),
        ("train.budget.ratio_range=[0.2, 0.5, 0.9]", "train.budget.ratio_range", "must be [low, high]"),
        ("train.budget.ratio_range=0.5", "train.budget.ratio_range", "expected list[float] or null"),
        ("train.policy.epochs=-1", "train.policy.epochs", "must be >= 0, got -1"),
        ("train.policy.lead_epochs=-2", "train.policy.lead_epochs", "must be >= 0, got -2"),
        ("train.teacher.context=-2", "train.teacher.context", "must be >= 0 pixels, got -2"),
        ("train.teacher.context=4", "train.teacher.context", "objects teacher's ring around each instance mask, but"),
        ("model.policy.budget_conditioned=maybe", "model.policy.budget_conditioned", "expected bool"),
        ("model.fine_aggregation=maybe", "model.fine_aggregation", "expected bool"),
        ("model.policy.level_context=maybe", "model.policy.level_context", "expected bool"),
        ("model.normalize=imagenet", "model.normalize", "must be one of auto, timm, none, got 'imagenet'"),
        (
            "model.policy.kind=smart",
            "model.policy.kind",
            "must be one of learned, entropy, random, full, coarse, got 'smart'",
        ),
        ("model.task=segmentation", "model.task", "must be one of classification, dense, detection"),
        ("model.policy.depth=3", "model.policy.depth", "must be in [0, 2]"),
        ("train.teacher.every=0", "train.teacher.every", "must be >= 1, got 0"),
        ("model.policy.width=129", "model.policy.width", "positive multiple of its 2 attention head(s)"),
        ("model.policy.width=0", "model.policy.width", "positive multiple"),
        ("model.policy.width=wide", "model.policy.width", "expected int"),
        ("model.name=not_a_model", "model.name", "unknown timm model 'not_a_model'"),
        ("model.timm_kwargs.bogus=1", "model.timm_kwargs.bogus", "unexpected keyword argument 'bogus'"),
        ("model.checkpoint_path=/nonexistent/w.pth", "model.checkpoint_path", "does not exist"),
        ("data.name=imagenet21k", "data.name", "unknown dataset 'imagenet21k'"),
        ("data.batch_size=0", "data.batch_size", "must be >= 1, got 0"),
        ("scaling.num_workers=0", "scaling.num_workers", "must be >= 1, got 0"),
        ("scaling.resources_per_worker.CPU=-1", "scaling.resources_per_worker.CPU", "must be >= 0"),
        ("scaling.allocator=mimalloc", "scaling.allocator", "unknown allocator 'mimalloc'"),
        ("data.val_split=tset", "data.val_split", "must be one of val, test, got 'tset'; did you mean test?"),
        ("scaling.placement_strategy=pack", "scaling.placement_strategy", "must be one of PACK, SPREAD, STRICT_PACK"),
        ("train.teacher.weight=.nan", "train.teacher.weight", "must be >= 0, got nan"),
        ("storage.path=gs://bucket/x", "storage.path", "must be a local folder or s3://bucket/prefix"),
        ("storage.name=a/b", "storage.name", "plain folder name"),
        ("tracking.split_map_images=-1", "tracking.split_map_images", "must be >= 0"),
        ("train.epochs", "train.epochs", "override must look like key=value"),
        ("model=3", "model", "expected a mapping"),
    ],
)
def test_bad_values_name_their_key(override, key, text):
    with pytest.raises(ConfigError) as err:
        load_experiment(SMOKE, [override])
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
    assert remote.tracking_uri().startswith("sqlite:////") and remote.storage.run_uri().startswith(
        "s3://bucket/prefix/"
    )


def test_secrets_are_redacted_from_what_is_logged():
    cfg = ExperimentConfig.from_dict(
        {
            "data": {"options": {"aws_secret_access_key": "AKIASECRET", "api_token": "tok123", "object_size": 8}},
            "tracking": {"tracking_uri": "postgresql://alice:hunter2@db.example/mlflow"},
        }
    )
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
    rc = main(["train", str(SMOKE), f"storage.path={runs}", "train.budget.weight=-1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "config error: train.budget.weight: must be >= 0, got -1.0" in err
    assert not runs.exists()


def test_thresholds_auto_or_numbers_only():
    from splitvit.config import ConfigError, ExperimentConfig

    assert ExperimentConfig.from_dict({}, ["model.thresholds=auto"]).model.thresholds == "auto"
    with pytest.raises(ConfigError, match=r"model.thresholds: must be numbers in \[0, 1\] or 'auto', got 'sometimes'"):
        ExperimentConfig.from_dict({}, ["model.thresholds=sometimes"])


def test_config_module_needs_no_model_data_or_torch():
    """``splitvit.config`` loads a repo config without importing torch, timm, the model,
    the data or the training code, not even lazily."""
    code = (
        f"import sys, json; from splitvit.config import load_config; load_config({str(SMOKE)!r}); "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    heavy = ("torch", "timm", "splitvit.model", "splitvit.train", "splitvit.tune", "splitvit.data")
    loaded = [m for m in json.loads(out) if any(m == h or m.startswith(h + ".") for h in heavy)]
    assert not loaded, f"splitvit.config imported {loaded}"


@pytest.mark.parametrize(
    "override, key, text",
    [
        ("model.name=not_a_model", "model.name", "unknown timm model 'not_a_model'"),
        ("model.image_size=40", "model.image_size", "not a multiple of the coarsest patch 16"),
        ("model.thresholds=[0.5]", "model.thresholds", "expected 2 values"),
        ("data.name=imagenet21k", "data.name", "unknown dataset 'imagenet21k'"),
    ],
)
def test_validate_experiment_checks_what_the_schema_cannot(override, key, text):
    """A config loaded schema-only (load_config) takes what only timm, the model or the
    dataset registry can judge; validate_experiment and experiment_from_dict do not."""
    cfg = load_config(SMOKE, [override])
    with pytest.raises(ConfigError) as err:
        validate_experiment(cfg)
    assert err.value.key == key and text in err.value.reason
    with pytest.raises(ConfigError) as again:
        experiment_from_dict(yaml.safe_load(SMOKE.read_text()), [override])
    assert again.value.key == key


@pytest.mark.parametrize(
    "section, field, value, text",
    [
        ("budget", "weight", -1.0, "must be >= 0, got -1.0"),
        ("teacher", "kind", "oracle", "must be one of gradient, attention, objects, got 'oracle'"),
        ("teacher", "weight", -0.5, "must be >= 0, got -0.5"),
        ("teacher", "every", 0, "must be >= 1, got 0"),
        ("policy", "lr_scale", 0.0, "must be > 0, got 0.0"),
    ],
)
def test_loss_setting_errors_name_train_keys(section, field, value, text):
    """The SPLIT objective's sections' own checks name ``train.<section>.<field>``: when
    the section is built, and when a built config was changed afterwards."""
    key = f"train.{section}.{field}"
    with pytest.raises(ConfigError) as built:
        ExperimentConfig.from_dict({"train": {section: {field: value}}})
    assert str(built.value) == f"config error: {key}: {built.value.reason}" and text in built.value.reason
    cfg = ExperimentConfig.from_dict({})
    setattr(getattr(cfg.train, section), field, value)
    for check in (validate, validate_experiment):
        with pytest.raises(ConfigError) as changed:
            check(cfg)
        assert changed.value.key == key and text in changed.value.reason


@pytest.mark.parametrize(
    "override, key, allowed, close",
    [
        ("model.policy.kind=lerned", "model.policy.kind", "learned, entropy, random, full, coarse", "learned"),
        ("model.task=dens", "model.task", "classification, dense, detection", "dense"),
        ("model.normalize=imagenet", "model.normalize", "auto, timm, none", None),
        ("model.policy.evidence_pooling=mean", "model.policy.evidence_pooling", "max, soft", None),
        ("train.budget.penalty=hinj", "train.budget.penalty", "squared, hinge", "hinge"),
        ("train.teacher.targets=nest", "train.teacher.targets", "per_level, nested, mixed", "nested"),
        ("train.teacher.scope=batches", "train.teacher.scope", "image, batch", "batch"),
    ],
)
def test_a_name_is_its_fields_type_checked_as_the_config_loads(override, key, allowed, close):
    """The allowed names are the fields' Literal types: the schema refuses another
    (load_config, before torch), listing them, with the closest as a did-you-mean."""
    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, [override])
    assert err.value.key == key and f"must be one of {allowed}, got " in err.value.reason
    assert (f"did you mean {close}?" in err.value.reason) if close else "did you mean" not in err.value.reason


def test_overrides_index_into_lists():
    """One dotted-key setter for overrides, search spaces and studies: an index sets one
    level of the thresholds (``auto`` or one number is expanded to one per level first)."""
    assert load_config(SMOKE, ["model.thresholds[1]=0.7"]).model.thresholds == [0.5, 0.7]
    assert load_config(SMOKE, ["model.thresholds=0.3", "model.thresholds[0]=0.6"]).model.thresholds == [0.6, 0.3]
    with pytest.raises(ConfigError, match=r"model.thresholds\[2\]: index 2 is out of range: model.thresholds has 2"):
        load_config(SMOKE, ["model.thresholds[2]=0.5"])
    with pytest.raises(ConfigError, match=r"train.epochs: is not a list, so train.epochs\[0\] cannot index it"):
        load_config(SMOKE, ["train.epochs[0]=1"])
    with pytest.raises(ConfigError, match=r"train.epochs: is a value, not a section; cannot set train.epochs.max"):
        load_config(SMOKE, ["train.epochs.max=1"])


def test_run_training_and_preflight_validate_a_config_built_schema_only(tmp_path, monkeypatch):
    """Library callers who build a config without validate_experiment still get the
    ConfigError, before Ray is touched."""
    import ray

    from splitvit.cluster import preflight as pf
    from splitvit.train import ray_trainer

    def forbidden(*args, **kwargs):
        raise AssertionError("Ray was touched before the config was validated")

    monkeypatch.setattr(ray, "init", forbidden)
    monkeypatch.setattr(ray_trainer, "init_ray", forbidden)
    monkeypatch.setattr(pf, "resolve_ray_address", forbidden)
    cfg = load_config(SMOKE, [f"storage.path={tmp_path / 'runs'}"])
    cfg.model.policy.kind = "smart"  # changed after the schema's check
    for run in (ray_trainer.run_training, pf.preflight):
        with pytest.raises(ConfigError, match="model.policy.kind: must be one of learned, entropy"):
            run(cfg)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("key", ["train.policy.epochs", "train.policy.lead_epochs"])
def test_policy_epochs_need_a_learned_policy_and_its_teacher(key):
    for overrides in (["model.policy.kind=entropy"], ["train.teacher.weight=0"]):
        with pytest.raises(ConfigError) as err:
            load_experiment(SMOKE, [f"{key}=1", *overrides])
        assert err.value.key == key and "trains a learned policy with its relevance teacher" in str(err.value)
    assert load_experiment(SMOKE, [f"{key}=2", "train.epochs=3"]).train.total_epochs == 5


def test_total_epochs_count_the_policys_lead_the_fine_tune_and_the_policys_tail():
    train = load_experiment(SMOKE, ["train.policy.lead_epochs=2", "train.epochs=3", "train.policy.epochs=4"]).train
    assert train.total_epochs == 9


def test_a_base_config_is_resolved_beside_the_file_that_names_it(tmp_path):
    """The ``base`` of a search space or a study: relative to the naming file's folder
    (or the working directory), or absolute; a missing one is a BaseConfigError on ``base``."""
    from splitvit.config import BaseConfigError, resolve_base_config

    (tmp_path / "base.yaml").write_text("train: {epochs: 1}\n")
    assert resolve_base_config("base.yaml", tmp_path) == (tmp_path / "base.yaml").resolve()
    assert resolve_base_config(str(tmp_path / "base.yaml"), Path("/")) == tmp_path / "base.yaml"
    for base, reason in ((None, "name the experiment config"), ("nowhere.yaml", "nowhere.yaml not found")):
        with pytest.raises(BaseConfigError, match=reason) as err:
            resolve_base_config(base, tmp_path)
        assert isinstance(err.value, ConfigError) and err.value.key == "base"


def test_validate_rechecks_names_changed_after_loading():
    """A config changed in code after it loaded is checked again by ``validate``: the
    names of the data and scaling sections by their types, as the policy's are."""
    config = load_experiment(SMOKE)
    config.data.val_split = "holdout"
    with pytest.raises(ConfigError, match=r"data\.val_split: must be one of val, test, got 'holdout'"):
        validate(config)
    config = load_experiment(SMOKE)
    config.scaling.placement_strategy = "spread"
    with pytest.raises(ConfigError, match=r"scaling\.placement_strategy: must be one of PACK"):
        validate(config)
