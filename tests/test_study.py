"""The evidence study (``splitvit study``): spec validation, aggregation and goals,
starting runs from a backbone, and a tiny study end to end on the real stack (Ray
Tune trials running Ray Train fits, an MLflow store read back, the JSON table)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient

from splitvit.bench.speed import FullTiming, MachineInfo
from splitvit.cli import main as cli
from splitvit.config import ConfigError
from splitvit.model import SplitViT
from splitvit.study.execute import StudyResult
from splitvit.study.goals import (
    GoalVerdicts,
    ParityVerdict,
    aggregate,
    check_goals,
    lever_table,
    matched_point,
    reference_convergence,
    study_time,
)
from splitvit.study.report import fine_tune_pace, lever_lines, reuse_phrase, summary_lines, training_pace_line
from splitvit.study.runs import STUDY_RESULT_FILE, BackboneRun, MethodRun, RunRequest, stale_runs, study_run
from splitvit.study.spec import Goals, StudyError, load_study
from splitvit.study.speed import MatchedSpeed, PointSpeed, SpeedComparison, StudyTimedPoint, matched_speed
from splitvit.train.checkpoints import init_weights
from splitvit.train.points import EvaluatedPoint
from splitvit.train.trial import TrainedRun

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "jobs" / "configs" / "smoke.yaml"
# the shape of `splitvit study --json` (the local runner's result has these and more: tests/test_study_local.py)
RESULT_KEYS = {
    "name",
    "source",
    "study_dir",
    "metric",
    "seeds",
    "rows",
    "runs",
    "goals",
    "speed",
    "failed",
    "mlflow_run_id",
    "tracking_uri",
    "seconds",
    "point_speed",
    "levers",
    "references_dir",
}
ROW_KEYS = {
    "method",
    "policy",
    "target_ratio",
    "seeds",
    "accuracy",
    "accuracy_std",
    "accuracy_min",
    "accuracy_max",
    "tokens_per_image",
    "token_ratio",
    "images_per_s",
    "per_seed",
}
#: a row whose point the speed step timed (the recipe's always are)
TIMED_ROW_KEYS = ROW_KEYS | {"timed_images_per_s", "speedup_vs_full"}


def untimed(rows: list[dict]) -> list[dict]:
    """Rows without the speed step's timing, which every invocation measures anew."""
    return [{k: v for k, v in r.items() if k not in TIMED_ROW_KEYS - ROW_KEYS} for r in rows]


RUN_KEYS = {
    "seed",
    "method",
    "policy",
    "checkpoint",
    "train_metrics",
    "points",
    "train_seconds",
    "eval_seconds",
    "run_uri",
    "evaluation",
    "reused",
    "reevaluated",
    "history",
}


def write_study(folder: Path, **changes) -> Path:
    """A tiny study on the smoke config (synthetic data, 32-px images, 2-block ViT)."""
    spec = {
        "base": str(SMOKE),
        "seeds": [0],
        "config": {
            "data.options": {"train_samples": 128, "val_samples": 64, "object_size": 8},
            "scaling.num_workers": 1,
            "scaling.resources_per_worker": {"CPU": 1},
            "storage.path": str(folder / "runs"),
            "tracking.split_map_images": 0,
        },
        # the reference protocol: a full-resolution backbone, its convergence checked
        "backbone": {"model.policy.kind": "full", "train.epochs": 2},
        "method": {"train.epochs": 1},
        "methods": {
            "full": {"model.policy.kind": "full"},
            "entropy": {"model.policy.kind": "entropy"},
            "split": {"model.policy.kind": "learned", "train.budget.target_ratio": 0.3},
        },
        "evaluation": {"split": "test", "samples": 64, "ratios": [0.25, 0.5], "calibration_samples": 32},
        "run": {"max_concurrent": 2, "trial_resources": {"CPU": 0.5}},
        "speed": {"batch_size": 8, "rounds": 2},
        # parity at 75% too: a share every SPLIT point of this tiny model is under (its 25%
        # point, calibrated on 32 images, may measure more than 25% on the test images)
        "goals": {
            "converge_points": 0.3,
            "converge_epochs": 1,
            "match_ratio": 0.5,
            "also_match_at": [0.75],
            "beat_range": [0.1, 0.6],
            "margin_at": 0.25,
            "max_minutes": 60,
        },
        "mlflow": {"experiment": "study-e2e"},
    }
    spec.update(changes)
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "change, key, message",
    [
        ({"colour": 1}, "colour", "unknown key"),
        ({"seeds": [0, 0]}, "seeds", "distinct"),
        ({"seeds": "zero"}, "seeds", "non-negative integers"),
        (
            {"methods": {"full": {"model.policy.kind": "full"}, "x": {"train.lr": 1.0}}},
            "methods.x",
            "needs model.policy.kind",
        ),
        ({"methods": {"split": {"model.policy.kind": "learned"}}}, "methods", "model.policy.kind: full"),
        ({"levers": {"split-x": {"train.lr": 1.0}}}, "levers.split-x", "needs model.policy.kind"),
        ({"levers": {"split": {"model.policy.kind": "learned"}}}, "levers.split", "also under methods"),
        ({"levers": ["split-x"]}, "levers", "must be a mapping"),
        ({"evaluation": {"ratios": [0.5, 1.5]}}, "evaluation.ratios", "(0, 1]"),
        ({"base": "missing.yaml"}, "base", "not found"),
        ({"speed": {"rounds": 0}}, "speed.rounds", "integer >= 1"),
        ({"speed": {"enabled": "yes"}}, "speed.enabled", "true or false"),
        ({"speed": {"colour": 1}}, "speed.colour", "unknown setting"),
        ({"goals": {"colour": 1}}, "goals.colour", "unknown goal"),
        ({"goals": {"match_ratio": 1.5}}, "goals.match_ratio", "token ratio in (0, 1]"),
        ({"goals": {"also_match_at": [0.5, 0]}}, "goals.also_match_at", "list of token ratios"),
        ({"goals": {"beat_range": [0.7, 0.1]}}, "goals.beat_range", "[low, high]"),
        ({"goals": {"converge_epochs": 0}}, "goals.converge_epochs", "integer >= 1"),
        ({"goals": {"converge_points": -1}}, "goals.converge_points", "points >= 0"),
        ({"goals": {"match_points": "half"}}, "goals.match_points", "points >= 0"),
        ({"goals": {"ratio_tolerance": 0.1}}, "goals.ratio_tolerance", "token share in [0, 0.05]"),
        ({"goals": {"max_minutes": 0}}, "goals.max_minutes", "minutes > 0"),
    ],
)
def test_bad_study_files_are_named(tmp_path, change, key, message):
    with pytest.raises(StudyError) as err:
        load_study(write_study(tmp_path, **change))
    assert key in str(err.value) and message in str(err.value)


def test_bad_config_in_a_method_names_the_key_before_ray_starts(tmp_path):
    methods = {
        "full": {"model.policy.kind": "full"},
        "split": {"model.policy.kind": "learned", "train.budget.weight": -1},
    }
    with pytest.raises(ConfigError, match="train.budget.weight"):
        load_study(write_study(tmp_path, methods=methods))
    with pytest.raises(StudyError, match="no scale 'gpu'"):
        load_study(write_study(tmp_path), scale="gpu")
    assert cli(["study", str(write_study(tmp_path)), "--set", "train.epochs=-2"]) == 2


def test_methods_keeps_only_the_named_ones_and_names_a_wrong_one(tmp_path):
    path = write_study(tmp_path)
    spec = load_study(path, methods=["split", "full"])
    assert sorted(spec.methods) == ["full", "split"]  # the rest dropped
    with pytest.raises(StudyError, match="no method 'splt'") as err:
        load_study(path, methods=["full", "splt"])
    assert all(name in str(err.value).split("the file has")[1] for name in ("full", "entropy", "split"))
    with pytest.raises(StudyError, match="model.policy.kind: full"):
        load_study(path, methods=["entropy", "split"])  # nothing left to compare against
    assert cli(["study", str(path), "--methods", "full,splt"]) == 2
    with pytest.raises(StudyError, match="--methods names no method"):
        load_study(path, methods=[])  # not "every method": an empty list is a slip
    assert cli(["study", str(path), "--methods", " , "]) == 2


def test_levers_run_only_when_named(tmp_path):
    """A plain study runs the headline (``methods``); a lever joins only when --methods
    names it, and a wrong name lists the levers too."""
    path = write_study(tmp_path, levers={"split-kd": {"model.policy.kind": "learned", "train.distill.weight": 1.0}})
    assert sorted(load_study(path).methods) == ["entropy", "full", "split"]
    spec = load_study(path, methods=["split-kd", "full"])
    assert list(spec.methods) == ["full", "split-kd"]  # the file's order, headline first
    assert spec.run_config(0, "split-kd", "x").train.distill.weight == 1.0
    with pytest.raises(StudyError, match="no method 'split-k'") as err:
        load_study(path, methods=["full", "split-k"])
    assert "split-kd" in str(err.value)
    with pytest.raises(StudyError, match="model.policy.kind: full"):
        load_study(path, methods=["split-kd"])  # a lever still needs its control


def test_the_shipped_studies_headline_is_the_controls_and_the_winning_recipe():
    """Both shipped studies run, by default, the controls and the winning recipe
    (aggregation, mixed targets, trained at 50%, each level judged in context), at 10
    fine-tune epochs in classification and 12 in the dense study, both (classification-v2,
    dense-v2) with the teacher on every 2nd step; the other SPLIT variants are levers."""
    headlines = {
        "study_fashion.yaml": ("split-0.5-agg-mixed-ctx-t2", 10, 2),
        "study_fashion_seg.yaml": ("split-0.5-agg-mixed-ctx-t2", 12, 2),
    }
    for name, (recipe_name, epochs, teacher_every) in headlines.items():
        spec = load_study(ROOT / "studies" / name)
        assert list(spec.methods) == ["full", "coarse", "entropy", "random", recipe_name]
        recipe = spec.run_config(0, recipe_name, "x")
        assert recipe.model.fine_aggregation and recipe.train.teacher.targets == "mixed"
        assert recipe.train.budget.target_ratio == 0.5 and recipe.model.policy.level_context
        assert recipe.train.teacher.every == teacher_every
        assert {spec.run_config(0, m, "x").train.epochs for m in spec.methods} == {epochs}
        assert "split-0.7" in load_study(ROOT / "studies" / name, methods=["full", "split-0.7"]).methods


@pytest.mark.parametrize(
    ("name", "recipe", "epochs_by_scale"),
    [
        (
            "study_fashion.yaml",
            "split-0.7",
            {"short-finetune": 2, "long-finetune": 4, "finetune-8": 8, None: 10, "finetune-12": 12},
        ),
        ("study_fashion_seg.yaml", "split-0.7", {"short-finetune": 2, "finetune-8": 8, None: 12}),
        (
            "study_fashion_det.yaml",
            "split-0.7-objects-d2-lead4-policy4-batch-fgrad-fine",
            {"finetune-3": 3, "finetune-6": 6, "finetune-10": 10, None: 15, "finetune-20": 20},
        ),
    ],
)
def test_the_fine_tune_length_lever_lengthens_every_method_the_control_too(name, recipe, epochs_by_scale):
    path = ROOT / "studies" / name
    lengths = {scale: load_study(path, scale=scale, methods=["full", recipe]) for scale in epochs_by_scale}
    for method in ("full", recipe):
        assert [spec.run_config(0, method, "x").train.epochs for spec in lengths.values()] == list(
            epochs_by_scale.values()
        )
    assert len({spec.run_config(0, None, "x").train.epochs for spec in lengths.values()}) == 1  # one reference


@pytest.mark.parametrize(
    ("name", "recipe"),
    [
        ("study_fashion.yaml", "split-0.7"),
        ("study_fashion_det.yaml", "split-0.7-objects-d2-lead4-policy4-batch-fgrad-fine"),
    ],
)
def test_the_learning_rate_lever_doubles_every_methods_rate_the_control_too(name, recipe):
    path = ROOT / "studies" / name
    default = load_study(path, methods=["full", recipe])
    faster = load_study(path, scale="finetune-lr", methods=["full", recipe])
    assert {default.run_config(0, m, "x").train.lr for m in default.methods} == {3.0e-4}
    assert {faster.run_config(0, m, "x").train.lr for m in faster.methods} == {6.0e-4}
    assert faster.run_config(0, None, "x").flat() == default.run_config(0, None, "x").flat()  # the same reference


def test_an_unfinished_run_started_with_other_settings_is_stale(tmp_path):
    """A run interrupted mid-training resumes from its checkpoint when the study runs
    again: if the study file changed meanwhile, that would train on with the old
    settings, so the stale check names it like a finished one."""
    from splitvit.train.trial import TrialFailed

    class Interrupted:  # a trainer stopped before its run finished
        def train(self, config):
            return TrainedRun("interrupted", {}, None, "stopped")

        def evaluate(self, config, fn, *args, **kwargs):
            raise AssertionError("an unfinished run is not evaluated")

    spec = load_study(write_study(tmp_path))
    storage = str(tmp_path / "study" / "train")
    backbone = tmp_path / "study" / "train" / "backbone-s0" / "model.pt"
    backbone.parent.mkdir(parents=True)
    backbone.touch()  # the trainer never reads it
    with pytest.raises(TrialFailed, match="split-s0 interrupted"):
        study_run(spec, storage, RunRequest(0, "split"), Interrupted(), backbones={0: str(backbone.parent)})
    assert stale_runs(spec, storage) == []  # the same settings: it resumes
    changed = load_study(write_study(tmp_path, method={"train.epochs": 3}))
    assert stale_runs(changed, storage) == ["split-s0 (unfinished; train.epochs)"]


def test_other_evaluation_settings_evaluate_a_finished_run_again_without_training(tmp_path):
    """Changing only how methods are evaluated (ratios, samples, calibration images)
    is not a stale run: the finished checkpoint is evaluated again and its stored
    points replaced; its training (curve, times, checkpoint) is kept."""

    class Recorded:  # a trainer whose evaluations are recorded; training is done
        def __init__(self):
            self.evaluated = []

        def train(self, config):
            return TrainedRun("completed", {"accuracy": 0.5}, "ckpt", history=[{"accuracy": 0.5}])

        def evaluate(self, config, fn, *args, **kwargs):
            self.evaluated.append(kwargs["ratios"])
            return [evaluated_point(r, r, r, r) for r in kwargs["ratios"]]

    spec = load_study(write_study(tmp_path))
    storage = str(tmp_path / "study" / "train")
    backbone = tmp_path / "study" / "train" / "backbone-s0" / "model.pt"
    backbone.parent.mkdir(parents=True)
    backbone.touch()  # the trainer never reads it
    trainer = Recorded()
    params = RunRequest(0, "split")
    first = study_run(spec, storage, params, trainer, backbones={0: str(backbone.parent)})
    assert not first.reused and not first.reevaluated and trainer.evaluated == [[0.25, 0.5]]
    assert study_run(spec, storage, params, trainer, backbones={0: str(backbone.parent)}).reevaluated is False
    assert trainer.evaluated == [[0.25, 0.5]]  # the same settings: the stored points

    evaluation = {"split": "test", "samples": 64, "ratios": [0.5, 0.7], "calibration_samples": 48}
    changed = load_study(write_study(tmp_path, evaluation=evaluation))
    assert stale_runs(changed, storage) == []
    again = study_run(changed, storage, params, trainer, backbones={0: str(backbone.parent)})
    assert again.reused and again.reevaluated and trainer.evaluated[-1] == [0.5, 0.7]
    assert [p.target_ratio for p in again.points] == [0.5, 0.7]
    assert again.history == first.history and again.train_seconds == first.train_seconds
    stored = json.loads((Path(storage) / "split-s0" / STUDY_RESULT_FILE).read_text())
    assert stored["evaluation"]["ratios"] == [0.5, 0.7] and stored["points"] == [p.to_dict() for p in again.points]
    assert "reevaluated" not in stored and "reused" not in stored
    assert study_run(changed, storage, params, trainer, backbones={0: str(backbone.parent)}).reevaluated is False

    class Gone(Recorded):  # the checkpoint was deleted since: the evaluation fails
        def evaluate(self, config, fn, *args, **kwargs):
            raise FileNotFoundError("no checkpoint at ckpt")

    stored_before = (Path(storage) / "split-s0" / STUDY_RESULT_FILE).read_text()
    other = load_study(write_study(tmp_path, evaluation={**evaluation, "ratios": [0.3]}))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        study_run(other, storage, params, Gone(), backbones={0: str(backbone.parent)})
    assert (Path(storage) / "split-s0" / STUDY_RESULT_FILE).read_text() == stored_before  # nothing lost
    assert (
        reuse_phrase([again, replace(first, reused=True), first]) == " (2 finished earlier, reused; 1 evaluated again)"
    )
    # a training setting still makes the run stale (it would mix settings in one table)
    assert stale_runs(load_study(write_study(tmp_path, method={"train.epochs": 3})), storage) == [
        "split-s0 (train.epochs)"
    ]


def test_a_setting_added_after_a_run_counts_as_its_default_there(tmp_path):
    """Runs made before the code gained a setting (their stored config lacks the key)
    stay reusable while the study leaves it at its default, and are stale once the
    study sets it otherwise."""
    spec = load_study(write_study(tmp_path))
    storage = tmp_path / "study" / "train"
    config = spec.run_config(0, "split", "split-s0", str(storage)).flat()
    assert config.pop("model.policy.fine_evidence") is False  # as an older run stored it
    run = storage / "split-s0"
    run.mkdir(parents=True)
    (run / "study_started.json").write_text(json.dumps({"config": config}, default=float))
    assert stale_runs(spec, str(storage)) == []
    changed = load_study(write_study(tmp_path, method={"train.epochs": 1, "model.policy.fine_evidence": True}))
    assert stale_runs(changed, str(storage)) == ["split-s0 (unfinished; model.policy.fine_evidence)"]


def test_keys_a_run_never_reads_do_not_make_it_stale(tmp_path):
    """A control (full resolution) stored with other learned-policy or budget settings (a
    base file that moved them into its recipe) is the same run, and so is a run under
    another memory allocator; a learned run with another policy depth is not."""
    spec = load_study(write_study(tmp_path))
    storage = tmp_path / "study" / "train"
    for method, key, value in (("full", "model.policy.depth", 3), ("full", "train.budget.target_ratio", 0.4)):
        stored = {**spec.run_config(0, method, f"{method}-s0", str(storage)).flat(), key: value}
        stored.pop("recipe")  # runs made before recipes stored none
        (storage / f"{method}-s0").mkdir(parents=True, exist_ok=True)
        (storage / f"{method}-s0" / "study_started.json").write_text(json.dumps({"config": stored}, default=float))
        assert stale_runs(spec, str(storage)) == [], key
    stored = {**spec.run_config(0, "split", "split-s0", str(storage)).flat(), "scaling.allocator": "jemalloc"}
    (storage / "split-s0").mkdir()
    (storage / "split-s0" / "study_started.json").write_text(json.dumps({"config": stored}, default=float))
    assert stale_runs(spec, str(storage)) == []  # the allocator sets the pace, not the result
    stored = {**spec.run_config(0, "split", "split-s0", str(storage)).flat(), "model.policy.depth": 3}
    (storage / "split-s0" / "study_started.json").write_text(json.dumps({"config": stored}, default=float))
    assert stale_runs(spec, str(storage)) == ["split-s0 (unfinished; model.policy.depth)"]


def test_a_run_stored_under_the_old_key_names_is_the_same_run(tmp_path):
    """A run stored before the settings were grouped (``train.lambda_budget``,
    ``model.policy: learned``...) compares with today's settings by the legacy map: not
    stale while they agree, stale by the new key's name once one differs."""
    from splitvit.config import legacy_flat

    spec = load_study(write_study(tmp_path))
    storage = tmp_path / "study" / "train"
    now = spec.run_config(0, "split", "split-s0", str(storage)).flat()
    stored = legacy_flat(now)
    assert "train.lambda_budget" in stored and stored["model.policy"] == "learned"
    (storage / "split-s0").mkdir(parents=True)
    (storage / "split-s0" / "study_started.json").write_text(json.dumps({"config": stored}, default=float))
    assert stale_runs(spec, str(storage)) == []
    stored["train.lambda_budget"] = stored["train.lambda_budget"] + 1.0
    (storage / "split-s0" / "study_started.json").write_text(json.dumps({"config": stored}, default=float))
    assert stale_runs(spec, str(storage)) == ["split-s0 (unfinished; train.budget.weight)"]


def test_shipped_studies_validate_at_every_scale():
    for name in ("study_fashion", "study_fashion_seg"):
        for scale in (None, "one-gpu", "gpu"):
            spec = load_study(ROOT / "studies" / f"{name}.yaml", scale=scale)
            assert len(spec.seeds) >= 2 and {"full", "coarse", "entropy", "random", "learned"} <= {
                spec.policy(m) for m in spec.methods
            }
            config = spec.run_config(1, next(iter(spec.methods)), "x")
            assert config.data.seed == 1
            # the reference protocol: a full-resolution backbone whose convergence is checked
            assert spec.run_config(0, None, "b").model.policy.kind == "full" and spec.goals.converge_points == 0.3
            assert spec.goals.match_ratio == 0.7 and 0.8 in spec.ratios and 0.7 in spec.ratios
            assert spec.run_config(0, "full", "x").scaling.use_gpu == (scale is not None)  # GPU scales use GPUs
            assert spec.goals.max_minutes == (150 if scale is None else None)  # the 2-core machine's limit


def test_the_detection_studys_references_alone_validate_on_more_canvases():
    """The references' convergence is read from their validation AP: they validate on
    1,200 canvases, every method on the config's 300; on COCO (gpu) on the whole split."""
    path = ROOT / "studies" / "study_fashion_det.yaml"
    spec = load_study(path)
    reference, method = spec.run_config(0, None, "b"), spec.run_config(0, "full", "m")
    assert reference.data.options["val_samples"] == 1200 and method.data.options["val_samples"] == 300
    assert reference.data.options["train_samples"] == method.data.options["train_samples"] == 3000  # one key set
    assert spec.goals.converge_points == 0.5 and spec.goals.converge_epochs == 3
    gpu = load_study(path, scale="gpu").run_config(0, None, "b").data.options
    assert gpu == {"val_samples": None}  # the parquet shards' whole val/ split


# ----------------------------------------------------------------- aggregation and goals
def method_run(method, policy, seed, points=(), **optional) -> MethodRun:
    """A finished method run: its ``points`` and ``optional`` fields; the rest placeholders."""
    where = f"/runs/{method}-s{seed}"
    return MethodRun(seed, method, policy, where, {}, list(points), 0.0, 0.0, where, **optional)


def backbone_run(seed=0, metrics=None, **optional) -> BackboneRun:
    """A finished backbone: its ``metrics`` and ``optional`` fields; the rest placeholders."""
    where = f"/runs/backbone-s{seed}"
    return BackboneRun(seed, where, metrics or {}, 0.0, where, **optional)


def evaluated_point(
    target_ratio, quality, tokens_per_image, token_ratio, images_per_s=100.0, images=64, thresholds=None
):
    """What evaluate_points makes of one ratio (no task figures of its own)."""
    return EvaluatedPoint(target_ratio, quality, tokens_per_image, token_ratio, images_per_s, images, thresholds, {})


def run(method, policy, seed, points):
    return method_run(
        method,
        policy,
        seed,
        [evaluated_point(r, q, 64 * (t if r is None else r), t if r is None else r) for r, q, t in points],
    )


def test_aggregate_and_goals_are_computed_from_the_points():
    results = [
        run("full", "full", 0, [(None, 0.90, 1.0)]),
        run("full", "full", 1, [(None, 0.80, 1.0)]),
        run("split", "learned", 0, [(0.25, 0.86, None), (0.5, 0.90, None)]),
        run("split", "learned", 1, [(0.25, 0.82, None), (0.5, 0.79, None)]),
        run("entropy", "entropy", 0, [(0.25, 0.80, None), (0.5, 0.88, None)]),
        run("entropy", "entropy", 1, [(0.25, 0.80, None), (0.5, 0.86, None)]),
    ]
    rows = aggregate(results, "accuracy")
    by = {(r.method, r.target_ratio): r.to_dict() for r in rows}  # as in the JSON
    assert by[("full", None)]["accuracy"] == pytest.approx(0.85) and by[("full", None)]["seeds"] == 2
    assert by[("split", 0.25)]["accuracy"] == pytest.approx(0.84)
    assert by[("split", 0.25)]["accuracy_std"] == pytest.approx(0.0282843, rel=1e-4)
    assert (by[("split", 0.5)]["accuracy_min"], by[("split", 0.5)]["accuracy_max"]) == (0.79, 0.90)
    goals = check_goals(
        rows, Goals(match_points=0.5, match_ratio=0.5, beat_range=(0.25, 0.5), margin_at=0.25), "accuracy"
    ).to_dict()
    # best SPLIT at <= 50% tokens: 0.845 at 0.5 -> 0.5 points under full: met (<= 0.5)
    assert goals["match"]["gap_points"] == pytest.approx(0.5) and goals["match"]["met"]
    # at 0.5 SPLIT (0.845) is under entropy (0.87): not above everywhere
    assert not goals["above_baselines"]["met"]
    assert goals["above_baselines"]["worst"]["margin_points"] == pytest.approx(-2.5)
    assert goals["margin_over_entropy"]["margin_points"] == pytest.approx(4.0) and goals["margin_over_entropy"]["met"]
    point = matched_point(rows, Goals(match_points=1.0))
    assert point.row.method == "split" and point.row.target_ratio == 0.25 and point.matches_full
    assert not matched_point(rows, Goals(match_points=0.0, match_ratio=0.3)).matches_full


def _timed_point(method: str, ratio: float, speedup: float) -> StudyTimedPoint:
    return StudyTimedPoint(
        index=0,
        label=f"{method}@{ratio}",
        checkpoint=f"/runs/{method}-s0",
        policy="learned",
        thresholds=[0.4, 0.6],
        budget=ratio,
        full="full0",
        tokens_per_image=64 * ratio,
        token_ratio=ratio,
        median_s=0.01 / speedup,
        min_s=0.009 / speedup,
        images_per_s=6400.0 * speedup,
        full_images_per_s=6400.0,
        speedup_vs_full=speedup,
        speedup_vs_full_fastest=speedup * 1.1,
        speedup_vs_full_per_round={"median": speedup, "q1": speedup, "q3": speedup},
        method=method,
        target_ratio=ratio,
        seed=0,
    )


def test_the_matched_point_quotes_the_points_timing_and_is_timed_alone_only_where_it_lacks_it(tmp_path):
    """One timing per point: where the points' timing has the matched point on its seed the
    goal line reads its figures (no second timing); where it lacks it, the point is timed alone."""
    spec = load_study(write_study(tmp_path))
    runs = [
        run("full", "full", 0, [(None, 0.90, 1.0)]),
        run("split", "learned", 0, [(0.25, 0.86, None), (0.5, 0.90, None)]),
    ]
    assert [r.checkpoint for r in runs] == ["/runs/full-s0", "/runs/split-s0"]
    rows = aggregate(runs, "accuracy")
    full = FullTiming(
        key="full0",
        checkpoint="/runs/full-s0",
        policy="full",
        median_s=0.01,
        min_s=0.009,
        images_per_s=6400.0,
        tokens_per_image=64.0,
        token_ratio=1.0,
        speedup_vs_full=1.0,
    )
    record = PointSpeed(
        device="cpu",
        machine=MachineInfo(None, 1, "2", "1", "3.11", "linux", "cpu", "cpu", [0.0, 0.0, 0.0]),
        batch_size=8,
        rounds=2,
        warmup=1,
        precision="float32",
        images="the first 8 images of the test split",
        method="interleaved rounds",
        full=[full],
        points=[_timed_point("split", 0.25, 1.7), _timed_point("split", 0.5, 1.3)],
        other_processes_cpus=0.0,
        warnings=[],
        seconds=1.0,
        full_method="full",
        seed=0,
    )
    assert matched_point(rows, spec.goals).row.target_ratio == 0.5

    def no_second_timing(fn, *args, **kwargs):
        raise AssertionError("the matched point was timed again")

    speed = matched_speed(spec, rows, runs, record, run=no_second_timing)
    assert speed.timing == "points" and speed.target_ratio == 0.5 and speed.seed == 0
    assert (speed.ratio, speed.ratio_fastest_round, speed.split_images_per_s) == (1.3, 1.3 * 1.1, 6400.0 * 1.3)
    assert speed.thresholds == [0.4, 0.6] and speed.ideal_ratio == 2.0 and speed.backbone_ratio is None
    assert "as timed beside the other points" in summary_lines(GoalVerdicts("accuracy"), speed, [])[0]
    assert MatchedSpeed.from_dict(json.loads(json.dumps(speed.to_dict())), "accuracy") == speed

    calls = []
    alone = SpeedComparison(8, 2, "cpu", [0.5, 0.5], 0.5, 2.0, 7000.0, 6400.0, 1.09, 1.2)

    def timed_alone(fn, *args, **kwargs):
        calls.append((fn.__name__, args, kwargs["target_ratio"]))
        return alone

    without = replace(record, points=record.points[:1])  # the 50% point was not timed
    speed = matched_speed(spec, rows, runs, without, run=timed_alone)
    assert calls == [("speed_comparison", ("/runs/split-s0", "/runs/full-s0"), 0.5)]
    # timed with the checkpoint's own thresholds (none stored): no thresholds to quote, timed alone
    own = replace(record, points=[record.points[0], replace(record.points[1], thresholds=None)])
    assert matched_speed(spec, rows, runs, own, run=timed_alone).timing == "own" and len(calls) == 2
    # the points' timing of another seed is not this seed's
    assert matched_speed(spec, rows, runs, replace(record, seed=1), run=timed_alone).timing == "own"
    assert speed.timing == "own" and speed.ratio == 1.09
    assert "beside the other points" not in summary_lines(GoalVerdicts("accuracy"), speed, [])[0]
    assert matched_speed(spec, rows, runs, None, run=timed_alone).timing == "own"
    # a file written before the field existed reads back to itself
    legacy = {k: v for k, v in speed.to_dict().items() if k != "timing"}
    assert MatchedSpeed.from_dict(legacy, "accuracy").timing is None
    assert MatchedSpeed.from_dict(legacy, "accuracy").to_dict() == legacy


def test_the_fine_tune_pace_line_divides_each_methods_median_epoch_by_its_seeds_control():
    def trained(method, policy, seed, paces, reused=False):
        history = [{"epoch": i, "train_images_per_s": v} for i, v in enumerate(paces)]
        return method_run(method, policy, seed, history=history, reused=reused)

    runs = [
        trained("full", "full", 0, [100.0, 300.0, 290.0]),  # median 290
        trained("full", "full", 1, [200.0, 200.0, 210.0], reused=True),  # median 200
        trained("split", "learned", 0, [261.0, 250.0, 255.0]),  # median 255
        trained("split", "learned", 1, [220.0, 220.0, 230.0]),
        trained("coarse", "coarse", 0, [1000.0]),
        method_run("entropy", "entropy", 0, history=[]),  # no epochs: left out
    ]
    # the policy's own epochs (no task loss: the policy alone, far faster) are not the fine-tune's pace
    phases = [{"train_images_per_s": 900.0}, {"train_images_per_s": 250.0, "train_task_loss": 1.0}]
    phases += [{"train_images_per_s": 270.0, "train_task_loss": 0.9}, {"train_images_per_s": 950.0}]
    runs.append(method_run("lead", "learned", 0, history=phases))
    line = training_pace_line(runs)
    assert line.startswith("fine-tune pace vs full")
    # seed 1's control was trained by an earlier invocation: its ratio is starred
    assert "split 0.88x, 1.10x*; coarse 3.45x" in line and "entropy" not in line and "earlier invocation" in line
    assert "lead 0.90x" in line  # the median of 250 and 270 over 290
    paces = [(p.method, p.seed, round(p.ratio, 2), p.reused) for p in fine_tune_pace(runs)]
    assert paces[:3] == [("split", 0, 0.88, False), ("split", 1, 1.1, True), ("coarse", 0, 3.45, False)]
    assert training_pace_line([r for r in runs if r.method != "full"]) is None  # no control
    assert training_pace_line(runs[:2]) is None  # nothing beside the control
    assert summary_lines(GoalVerdicts("accuracy"), None, [], None, runs)[-1] == line


# ----------------------------------------------------------------- init_from
def test_init_weights_carries_the_backbone_across_policies(tmp_path):
    kwargs = dict(
        levels=3, image_size=32, num_classes=4, timm_kwargs=dict(patch_size=4, embed_dim=32, depth=2, num_heads=2)
    )
    learned = SplitViT.from_timm("vit_tiny_patch16_224", policy="learned", thresholds=0.2, **kwargs)
    learned.save(tmp_path / "model.pt")
    entropy = SplitViT.from_timm("vit_tiny_patch16_224", policy="entropy", thresholds=0.7, **kwargs)
    fresh = init_weights(entropy, tmp_path)
    assert fresh == ["budget", "thresholds"]  # everything else is the backbone's; these stay the run's own
    assert torch.equal(entropy.vit.blocks[1].mlp.fc1.weight, learned.vit.blocks[1].mlp.fc1.weight)
    assert torch.allclose(entropy.thresholds, torch.tensor([0.7, 0.7]))
    other = SplitViT.from_timm(
        "vit_tiny_patch16_224",
        policy="full",
        **{**kwargs, "timm_kwargs": dict(patch_size=4, embed_dim=48, depth=2, num_heads=2)},
    )
    with pytest.raises(ValueError, match="backbone tensors"):
        init_weights(other, tmp_path)


def test_init_from_must_exist(tmp_path):
    from splitvit.config import load_config

    with pytest.raises(ConfigError, match="model.init_from"):
        load_config(SMOKE, [f"model.init_from={tmp_path / 'nothing'}"])


# ----------------------------------------------------------------- the study's one code path
class _Fitted:
    """A trainer that trains nothing: each run's checkpoint an empty ``model.pt``, its
    figures made up; ``fail`` names a method whose training raises."""

    def __init__(self, fail: str | None = None):
        self.fail = fail

    def train(self, config):
        from splitvit.train.trial import TrainedRun

        if config.storage.name.split("-s")[0] == self.fail:
            raise RuntimeError(f"{config.storage.name} broke")
        folder = Path(config.storage.resolved_path()) / config.storage.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.pt").touch()
        history = [{"epoch": e, "accuracy": 0.8, "train_images_per_s": 100.0} for e in range(2)]
        return TrainedRun("completed", history[-1], str(folder), history=history)

    def evaluate(self, config, fn, *args, **kwargs):
        ratios = kwargs["ratios"] or [None]  # full resolution: one point
        return [
            evaluated_point(r, 0.8, 64 * (r or 1.0), r or 1.0, thresholds=None if r is None else [0.5]) for r in ratios
        ]


def test_execute_study_carries_typed_runs_from_each_stage_to_the_json_and_reuses_them(tmp_path):
    """The one code path, on the local executor, with a trainer that trains nothing: the
    backbones' and method runs' records reach the result, a failed run its line, and the
    JSON reads back; a second invocation reuses every finished run."""
    from splitvit.study.execute import execute_study
    from splitvit.study.local import LocalExecutor

    spec = load_study(write_study(tmp_path, speed={"enabled": False}))
    study_dir = str(tmp_path / "study")
    result, backbones = execute_study(spec, LocalExecutor(_Fitted(fail="entropy")), name="s", study_dir=study_dir)
    assert [type(b) for b in backbones] == [BackboneRun] and backbones[0].config is not None
    assert sorted(r.method for r in result.runs) == ["full", "split"] and all(r.config is None for r in result.runs)
    assert result.failed == ["entropy seed 0: RuntimeError('entropy-s0 broke')"]
    assert result.goals.reference_converged.met and result.goals.study_time.reference_images_per_s == 100.0
    data = json.loads(json.dumps(result.to_dict()))
    assert all(set(r) == RUN_KEYS for r in data["runs"]) and StudyResult.from_dict(data).to_dict() == data
    stored = json.loads((tmp_path / "study" / "train" / "split-s0" / STUDY_RESULT_FILE).read_text())
    assert stored == {k: v for k, v in data["runs"][0].items() if k not in ("reused", "reevaluated")} | {
        "config": stored["config"]
    }

    again, _ = execute_study(spec, LocalExecutor(_Fitted()), name="s", study_dir=study_dir)
    reused = {r.method: (r.reused, r.reevaluated) for r in again.runs}
    assert reused == {"full": (True, False), "split": (True, False), "entropy": (False, False)}
    assert reuse_phrase(again.runs) == " (2 finished earlier, reused)" and not again.failed


def test_a_local_run_whose_training_finished_is_read_back_not_trained(tmp_path):
    """The local trainer's result of a run folder holding the model and its history:
    the stored curve, steps and training time, nothing trained."""
    from splitvit.study.local import fit_config_local
    from splitvit.train.checkpoints import HISTORY_FILE, MODEL_FILE
    from splitvit.train.trial import TrainedRun

    config = load_study(write_study(tmp_path)).run_config(0, None, "backbone-s0")
    folder = Path(config.storage.resolved_path()) / config.storage.name
    folder.mkdir(parents=True)
    (folder / MODEL_FILE).touch()  # never loaded
    history = [{"epoch": 0, "accuracy": 0.5}, {"epoch": 1, "accuracy": 0.6}]
    (folder / HISTORY_FILE).write_text(json.dumps({"history": history, "train_seconds": 12.5, "steps": 8}))
    assert fit_config_local(config, "cpu") == TrainedRun(
        "completed", history[-1], str(folder / MODEL_FILE), history=history, train_seconds=12.5, steps=8
    )


# ----------------------------------------------------------------- end to end
def test_tiny_study_end_to_end_and_rerun_reuses_every_run(
    ray_session, mlflow_uri, tmp_path, monkeypatch, capsys, caplog
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    spec = write_study(tmp_path)
    out = tmp_path / "study.json"
    assert cli(["study", str(spec), "--name", "e2e", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert not data["failed"] and len(data["runs"]) == 3
    # the study's figures at the top level of the command's envelope
    assert set(data) == RESULT_KEYS | {"command", "status", "error", "mlflow", "wall_time_s"}
    assert data["status"] == "ok" and data["mlflow"]["run_id"] == data["mlflow_run_id"]
    # the speed step times the recipe at every evaluated ratio: each accuracy has its speed beside it
    assert all(set(r) in (ROW_KEYS, TIMED_ROW_KEYS) for r in data["rows"])
    assert all(set(r) == TIMED_ROW_KEYS for r in data["rows"] if r["policy"] in ("learned", "full"))
    assert all(r["speedup_vs_full"] > 0 for r in data["rows"] if r["policy"] == "learned")
    assert next(r for r in data["rows"] if r["policy"] == "full")["speedup_vs_full"] == 1.0
    printed = capsys.readouterr().out
    assert "timed images/s" in printed
    # every method's fine-tuning pace beside the control's, from the runs' epoch histories
    assert "fine-tune pace vs full (median epoch's training images/s, seed by seed): " in printed
    assert all(set(r) == RUN_KEYS for r in data["runs"])
    methods = {(r["method"], r["target_ratio"]) for r in data["rows"]}
    assert methods == {("full", None), ("entropy", 0.25), ("entropy", 0.5), ("split", 0.25), ("split", 0.5)}
    for row in data["rows"]:
        assert 0.0 <= row["accuracy"] <= 1.0 and row["seeds"] == 1 and row["tokens_per_image"] > 0
        if row["target_ratio"] is not None:  # calibrated on validation images, measured on test images
            assert abs(row["token_ratio"] - row["target_ratio"]) < 0.2
    full = next(r for r in data["rows"] if r["method"] == "full")
    assert full["token_ratio"] == 1.0
    assert {"match", "above_baselines", "margin_over_entropy"} <= set(data["goals"])
    assert [g["max_token_ratio"] for g in data["goals"]["match_also"]] == [0.75]
    # the reference's validation curve (2 epochs), and whether it had stopped gaining
    reference = data["goals"]["reference_converged"]["seeds"]["0"]
    assert len(reference["curve"]) == 2 and reference["gain_points"] == pytest.approx(
        (reference["curve"][1] - reference["curve"][0]) * 100
    )
    assert data["speed"]["ratio"] > 0 and data["speed"]["ideal_ratio"] >= 1.0
    # the matched point is one of the timed points: the goal line quotes the table's figure
    matched = data["speed"]
    timed_point = next(
        p
        for p in data["point_speed"]["points"]
        if (p["method"], p["target_ratio"]) == (matched["method"], matched["target_ratio"])
    )
    assert matched["timing"] == "points" and matched["seed"] == data["point_speed"]["seed"]
    assert (matched["ratio"], matched["split_images_per_s"], matched["token_fraction"]) == (
        timed_point["speedup_vs_full"],
        timed_point["images_per_s"],
        timed_point["token_ratio"],
    )
    # every method started from the seed's backbone, and says so in its config
    train = Path(data["study_dir"]) / "train"
    assert all(r["checkpoint"].startswith(str(train)) for r in data["runs"])

    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("study-e2e")
    parent = client.get_run(data["mlflow_run_id"])
    assert parent.data.tags["splitvit.kind"] == "study" and parent.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"study_table.json", "study.json", "study.png", "study_file.yaml", "base_config.yaml"} <= artifacts
    study_file = Path(client.download_artifacts(parent.info.run_id, "study_file.yaml", str(tmp_path)))
    assert study_file.read_text() == spec.read_text()  # the file as it was read
    # the experiment explains itself: its latest study, and how to read it
    exp = client.get_experiment(exp.experiment_id)
    assert exp.tags["splitvit.latest_study_run"] == parent.info.run_id
    assert "tags.splitvit.kind = 'study'" in exp.tags["mlflow.note.content"]
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert "speed_ratio" in parent.data.metrics
    curve = client.get_metric_history(parent.info.run_id, "reference_accuracy.s0")
    assert [m.value for m in sorted(curve, key=lambda m: m.step)] == pytest.approx(reference["curve"])
    assert parent.data.metrics["goal_reference_converged_met"] == float(data["goals"]["reference_converged"]["met"])
    assert "match_gap_points.r0.75" in parent.data.metrics
    # the whole invocation, timed: every run trained by it, so it has a verdict
    timed = data["goals"]["study_time"]
    assert timed["runs"] == 4 and timed["begun_earlier"] == [] and timed["cpus"] >= 1
    assert 0 < timed["minutes"] * 60 <= data["wall_time_s"] and timed["met"] is (timed["minutes"] <= 60)
    assert timed["reference_images_per_s"] > 0 and not timed["borrowed_references"]
    assert parent.data.metrics["goal_study_time_met"] == float(timed["met"])
    assert parent.data.metrics["study_minutes"] == pytest.approx(timed["minutes"])

    # every method's evaluated points timed against the full method, side by side (seed 0)
    ps = data["point_speed"]
    assert ps["seed"] == 0 and ps["device"].startswith("cpu") and ps["batch_size"] == 8 and ps["rounds"] == 2
    # the control, and the recipe's model (fine aggregation: another architecture) at full resolution
    fulls = {f["key"]: f for f in ps["full"]}
    full_timed = ps["full"][0]
    assert full_timed["method"] == "full" and full_timed["speedup_vs_full"] == 1.0 and full_timed["images_per_s"] > 0
    assert full_timed["checkpoint"] == next(r["checkpoint"] for r in data["runs"] if r["method"] == "full")
    assert len(fulls) == 2 and all(f["speedup_vs_full"] == 1.0 and f["policy"] == "full" for f in fulls.values())
    assert {(p["method"], p["target_ratio"]) for p in ps["points"]} == methods - {("full", None)}
    stored = {(r["method"], p["target_ratio"]): p for r in data["runs"] for p in r["points"]}
    for p in ps["points"]:
        assert p["images_per_s"] > 0 and p["speedup_vs_full"] > 0 and 0 < p["token_ratio"] <= 1
        assert p["speedup_vs_full"] == pytest.approx(fulls[p["full"]]["median_s"] / p["median_s"])
        assert p["thresholds"] == pytest.approx(
            stored[(p["method"], p["target_ratio"])]["thresholds"]
        )  # the evaluated point
    metrics = parent.data.metrics
    for p in ps["points"]:
        assert metrics[f"speedup_vs_full.{p['method']}.r{p['target_ratio']:g}"] == pytest.approx(p["speedup_vs_full"])
    assert metrics["speed_full_images_per_s"] == pytest.approx(full_timed["images_per_s"])
    assert parent.data.tags["splitvit.speed_device"] == ps["device"]
    assert {"point_speed.json", "study_speed.png"} <= artifacts
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        table = json.loads(Path(client.download_artifacts(parent.info.run_id, "study_table.json", folder)).read_text())
    speed_rows = {
        (r[0], r[1]): r[2]
        for r in (
            [row[table["columns"].index(k)] for k in ("method", "target_ratio", "speedup_vs_full")]
            for row in table["data"]
        )
    }
    assert speed_rows[("full", None)] == 1.0
    assert all(
        speed_rows[(p["method"], p["target_ratio"])] == pytest.approx(p["speedup_vs_full"]) for p in ps["points"]
    )
    # the JSON reads back into the result's types, and they write the same JSON
    result = StudyResult.from_dict(data)
    assert result.to_dict() == {key: data[key] for key in RESULT_KEYS}
    lines = summary_lines(result.goals, result.speed, [], result.point_speed)
    assert any(line.startswith("  split: @0.25 ") and "x (" in line for line in lines)
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["entropy-s0", "full-s0", "split-s0"]
    split = next(c for c in children if c.info.run_name == "split-s0")
    history = client.get_metric_history(split.info.run_id, "accuracy")
    assert sorted(m.step for m in history) == [0, 1]
    speedups = client.get_metric_history(split.info.run_id, "speedup_vs_full")
    assert sorted(m.step for m in speedups) == [0, 1]  # at the steps of the points they timed
    assert {m.step: m.value for m in speedups} == pytest.approx(
        {
            i: next(p["speedup_vs_full"] for p in ps["points"] if p["method"] == "split" and p["target_ratio"] == r)
            for i, r in enumerate([0.25, 0.5])
        }
    )
    assert split.data.params["model.init_from"].startswith(str(train / "backbone-s0"))

    # the same study again: every run's stored result is reported, nothing retrains,
    # and MLflow keeps one child run per method and seed
    checkpoints = sorted(p.name for p in train.rglob("checkpoint_epoch*"))
    again = tmp_path / "again.json"
    capsys.readouterr()
    assert cli(["study", str(spec), "--name", "e2e", "--json", str(again)]) == 0
    # the same figures; the speed step's timing is measured anew by every invocation
    assert untimed(json.loads(again.read_text())["rows"]) == untimed(data["rows"])
    assert [r["reused"] for r in data["runs"]] == [False] * 3 and [
        r["reused"] for r in json.loads(again.read_text())["runs"]
    ] == [True] * 3
    printed = capsys.readouterr().out
    assert "3 runs (3 finished earlier, reused)" in printed
    # ... read by the driver: no Ray Tune grid (no trial processes) for either stage
    assert "backbones: 1 of 1 runs finished earlier" in caplog.text
    assert "methods: 3 of 3 runs finished earlier" in caplog.text
    study_dir = Path(data["study_dir"])
    assert [len(list(study_dir.glob(f"{stage}-*"))) for stage in ("backbones", "methods")] == [1, 1]
    # ... and its time is not the study's: no verdict, and the line says why
    assert "met" not in json.loads(again.read_text())["goals"]["study_time"]
    assert "not timed (4 of its 4 runs begun by an earlier invocation)" in printed
    assert sorted(p.name for p in train.rglob("checkpoint_epoch*")) == checkpoints
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 3

    # changed settings under the same name: one clear error before anything starts,
    # naming the runs and keys; nothing is retrained or recorded
    runs_before = len(client.search_runs([exp.experiment_id]))
    capsys.readouterr()
    assert cli(["study", str(spec), "--name", "e2e", "--set", "train.weight_decay=0.01"]) == 2
    err = capsys.readouterr().err
    assert "backbone-s0 (train.weight_decay)" in err and "split-s0 (train.weight_decay)" in err and "--name" in err
    assert sorted(p.name for p in train.rglob("checkpoint_epoch*")) == checkpoints
    assert len(client.search_runs([exp.experiment_id])) == runs_before

    # a longer fine-tune from the same references: the methods train from e2e's backbone,
    # which is neither retrained nor copied, and the result and MLflow say where it came from
    (tmp_path / "longer").mkdir()
    longer = write_study(tmp_path / "longer", method={"train.epochs": 2})
    raw = yaml.safe_load(longer.read_text())
    raw["config"]["storage.path"] = str(tmp_path / "runs")  # the same storage path as e2e
    raw["speed"] = {"enabled": False}  # timed above; the runs' origin is what is checked here
    longer.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    args = ["study", str(longer), "--methods", "full,split", "--references-from", "e2e"]
    assert cli([*args, "--name", "e2e-longer", "--json", str(again)]) == 0
    printed = capsys.readouterr().out
    assert f"references from {tmp_path / 'runs' / 'e2e'}" in printed
    assert "not timed (references from another study)" in printed
    longer_data = json.loads(again.read_text())
    assert longer_data["goals"]["study_time"]["runs"] == 2  # its own: the borrowed one is not
    assert longer_data["goals"]["study_time"]["reference_images_per_s"] is None  # nor its pace
    assert longer_data["references_dir"] == str(tmp_path / "runs" / "e2e")
    assert {r["method"]: r["reused"] for r in longer_data["runs"]} == {"full": False, "split": False}
    for run in longer_data["runs"]:
        stored = json.loads((Path(run["run_uri"]) / STUDY_RESULT_FILE).read_text())
        assert stored["config"]["model.init_from"].startswith(str(train / "backbone-s0"))
        assert stored["config"]["train.epochs"] == 2 and len(run["history"]) == 2
    assert not (tmp_path / "runs" / "e2e-longer" / "train" / "backbone-s0").exists()
    # the borrowed backbone is read, not run as a trial: e2e-longer has a methods grid alone
    longer_dir = tmp_path / "runs" / "e2e-longer"
    assert [len(list(longer_dir.glob(f"{stage}-*"))) for stage in ("backbones", "methods")] == [0, 1]
    assert sorted(p.name for p in train.rglob("checkpoint_epoch*")) == checkpoints  # e2e's runs untouched
    assert json.loads(again.read_text())["goals"]["reference_converged"] == data["goals"]["reference_converged"]
    longer_parent = client.get_run(longer_data["mlflow_run_id"])
    assert longer_parent.data.params["references"] == str(tmp_path / "runs" / "e2e")

    # references that do not exist, or were made with other settings: one error each, before Ray starts
    runs_before = len(client.search_runs([exp.experiment_id]))
    assert cli([*args[:-1], "nowhere", "--name", "e2e-none"]) == 2
    assert "--references-from nowhere: no study of that name" in capsys.readouterr().err
    (tmp_path / "runs" / "e2e-empty").mkdir()  # a study folder with no finished reference
    assert cli([*args[:-1], "e2e-empty", "--name", "e2e-none"]) == 2
    assert "not finished for seed(s) 0" in capsys.readouterr().err
    assert cli([*args, "--name", "e2e-wd", "--set", "train.weight_decay=0.01"]) == 2
    err = capsys.readouterr().err
    assert "backbone-s0 (train.weight_decay)" in err and "same reference" in err
    assert cli([*args, "--name", "e2e"]) == 2
    assert "names this study itself" in capsys.readouterr().err
    assert len(client.search_runs([exp.experiment_id])) == runs_before
    assert not (tmp_path / "runs" / "e2e-none").exists() and not (tmp_path / "runs" / "e2e-wd").exists()


def test_backbone_policy_and_method_warm_up_follow_the_study_file(tmp_path):
    """The backbone is the learned policy's warm-up unless the study names its policy;
    methods skip the warm-up unless the study gives them one."""
    legacy = load_study(write_study(tmp_path, backbone={"train.epochs": 1, "train.policy.warmup_epochs": 1}))
    assert legacy.run_config(0, None, "b").model.policy.kind == "learned"
    assert legacy.run_config(0, None, "b").train.policy.warmup_epochs == 1
    assert legacy.run_config(0, "split", "m").train.policy.warmup_epochs == 0
    methods = {
        "full": {"model.policy.kind": "full"},
        "split": {"model.policy.kind": "learned", "train.policy.warmup_epochs": 1},
    }
    spec = load_study(write_study(tmp_path, methods=methods))
    assert spec.run_config(0, None, "b").model.policy.kind == "full"
    assert spec.run_config(0, "split", "m").train.policy.warmup_epochs == 1
    assert spec.run_config(0, "full", "m").train.policy.warmup_epochs == 0


def test_reference_convergence_is_read_from_each_backbones_curve():
    goals = Goals(converge_points=0.3, converge_epochs=3)
    flat = [{"accuracy": a} for a in (0.50, 0.70, 0.801, 0.803, 0.802, 0.803)]
    rising = [{"accuracy": a} for a in (0.50, 0.60, 0.70, 0.75, 0.78, 0.80)]
    result = reference_convergence(
        [backbone_run(0, history=flat), backbone_run(1, history=rising), backbone_run(2, history=flat[:3])],
        goals,
        "accuracy",
    )
    s0, s1, s2 = (result.seeds[k] for k in ("0", "1", "2"))
    assert s0.gain_points == pytest.approx(0.2) and s0.met  # 0.803 - 0.801 over the last 3 epochs
    assert s1.gain_points == pytest.approx(10.0) and not s1.met
    assert s2.gain_points is None and not s2.met and s2.epochs == 3  # too short to tell
    assert s0.curve == [h["accuracy"] for h in flat] and not result.met
    assert reference_convergence([backbone_run(0, history=flat)], goals, "accuracy").met
    assert reference_convergence([backbone_run(0, history=flat)], Goals(), "accuracy") is None  # no such goal
    lines = summary_lines(GoalVerdicts("accuracy", reference_converged=result), None, [])
    line = next(line for line in lines if "reference" in line)
    assert "seed 0 +0.20" in line and "seed 1 +10.00" in line and "seed 2 n/a (3 epochs)" in line
    assert line.endswith("MISSED")


def time_line(timed) -> str:
    """The summary line of a study time alone."""
    return summary_lines(GoalVerdicts("accuracy", study_time=timed), None, [])[0]


def test_study_time_has_a_verdict_only_for_a_study_run_from_the_start():
    backbones = [backbone_run(0, {"train_images_per_s": 300.0}), backbone_run(1, {"train_images_per_s": 340.0})]
    goals = Goals(max_minutes=150)
    fast = study_time(104.5 * 60, backbones, 12, goals)
    assert fast.met and fast.minutes == pytest.approx(104.5) and fast.reference_images_per_s == 320.0
    line = time_line(fast)
    assert line.startswith("study time: 104.5 minutes for 12 runs on ") and "at 320 images/s" in line
    assert line.endswith("(goal: at most 150): met")
    slow = study_time(166 * 60, backbones, 12, goals)
    assert not slow.met and time_line(slow).endswith("MISSED")
    # a part of a study: runs begun earlier, borrowed references or failed runs leave it untimed
    reused = [replace(b, reused=True) for b in backbones]  # finished earlier, or borrowed
    part = study_time(20 * 60, reused, 12, goals, begun=["backbone-s0", "full-s0"], failed=1)
    assert "met" not in part.to_dict() and part.begun_earlier == ["backbone-s0", "full-s0"]
    assert part.reference_images_per_s is None  # a reference of an earlier invocation: not this one's pace
    assert study_time(20 * 60, backbones, 12, goals, begun=["full-s0"]).reference_images_per_s == 320.0
    assert time_line(part).endswith("not timed (2 of its 12 runs begun by an earlier invocation; 1 failed)")
    borrowed = study_time(60 * 60, reused, 4, goals, borrowed_references=True)
    assert "met" not in borrowed.to_dict() and borrowed.reference_images_per_s is None
    assert time_line(borrowed).endswith("not timed (references from another study)")
    assert study_time(60.0, backbones, 12, Goals()) is None  # no such goal


def test_parity_is_checked_at_every_token_share_the_study_names():
    results = [
        run("full", "full", 0, [(None, 0.90, 1.0)]),
        run("split", "learned", 0, [(0.5, 0.85, None), (0.7, 0.897, None)]),
    ]
    goals = check_goals(aggregate(results, "accuracy"), Goals(match_ratio=0.7, also_match_at=(0.5,)), "accuracy")
    assert goals.match.gap_points == pytest.approx(0.3) and goals.match.met
    (half,) = goals.match_also
    assert half.max_token_ratio == 0.5 and half.gap_points == pytest.approx(5.0) and not half.met
    lines = summary_lines(goals, None, [])
    assert any("<= 70% tokens" in line and line.endswith("met") for line in lines)
    # the recipe ablation: each SPLIT method at each parity ratio, mean ± std and gap to the control
    rows = aggregate(results + [run("split", "learned", 1, [(0.5, 0.83, None), (0.7, 0.893, None)])], "accuracy")
    (entry,) = lever_table(rows, [0.5, 0.7])
    cells = entry.to_dict()  # as in the JSON
    assert cells["method"] == "split" and cells["r0.5"]["accuracy"] == pytest.approx(0.84)
    assert cells["r0.5"]["std"] == pytest.approx(0.0141421, rel=1e-4) and cells["r0.5"]["seeds"] == 2
    assert cells["r0.7"]["gap_points"] == pytest.approx(0.5)  # full: 0.90 (seed 0 only)
    head, line = lever_lines([entry], "accuracy")
    assert "accuracy @ 50% tokens" in head and "accuracy @ 70% tokens" in head
    assert "0.8400 ± 0.0141 (-6.00 vs full)" in line and "0.8950 ± 0.0028 (-0.50 vs full)" in line
    assert lever_table(rows, [0.3])[0].cells[0.3] is None
    assert cells["r0.7"]["gap_std_points"] is None  # one seed of the control: no seed-by-seed spread
    # with the control on both seeds, the gap's spread is taken seed by seed: the reference's
    # seed-to-seed difference (0.90 vs 0.80) lifts both, so the gap varies far less than either
    results.append(run("full", "full", 1, [(None, 0.80, 1.0)]))
    rows = aggregate(results + [run("split", "learned", 1, [(0.5, 0.73, None), (0.7, 0.79, None)])], "accuracy")
    (entry,) = lever_table(rows, [0.7])
    assert entry.cells[0.7].gap_points == pytest.approx(0.65)  # 0.85 - 0.8435
    assert entry.cells[0.7].std == pytest.approx(0.0756, abs=1e-4)  # 7.6 points between seeds ...
    assert entry.cells[0.7].gap_std_points == pytest.approx(0.4950, abs=1e-4)  # ... the gaps 0.3 and 1.0: 0.5
    assert "(-0.65 ± 0.49 vs full)" in lever_lines([entry], "accuracy")[1]
    goals = check_goals(rows, Goals(match_ratio=0.7), "accuracy")
    assert goals.match.gap_std_points == pytest.approx(0.4950, abs=1e-4)
    assert "0.65 points below full (± 0.49 over seeds)" in " ".join(summary_lines(goals, None, []))
    assert any("<= 50% tokens" in line and line.endswith("MISSED") for line in lines)


def test_a_point_counts_at_a_share_it_exceeds_only_within_the_tolerance():
    """A point calibrated to 50% of the tokens on validation images measured 50.03% on
    the test images, and the <= 50% goal read the 40% point instead: measured shares
    count within ``goals.ratio_tolerance`` (half a point by default), and say so."""
    results = [
        run("full", "full", 0, [(None, 0.90, 1.0)]),
        run("split", "learned", 0, [(0.4, 0.80, None), (0.5, 0.88, None), (0.7, 0.899, None)]),
    ]
    points = results[1].points
    points[1:] = [replace(points[1], token_ratio=0.5003), replace(points[2], token_ratio=0.711)]
    rows = aggregate(results, "accuracy")
    goals = check_goals(rows, Goals(match_ratio=0.5, also_match_at=(0.7,)), "accuracy")
    assert goals.match.target_ratio == 0.5 and goals.match.ratio_tolerance == 0.005
    # 71.1% is more than half a point over 70%: the 70% goal reads the 50% point
    assert goals.match_also[0].target_ratio == 0.5
    line = summary_lines(goals, None, [])[0]
    assert "@ 50.03% (within the 0.5% tolerance): 2.00 points below" in line
    strict = check_goals(rows, Goals(match_ratio=0.5, ratio_tolerance=0.0), "accuracy")
    assert strict.match.target_ratio == 0.4 and "tolerance" not in summary_lines(strict, None, [])[0]
    assert matched_point(rows, Goals(match_points=0.0, match_ratio=0.5)).row.target_ratio == 0.5


@pytest.mark.parametrize(
    "gap, words, verdict", [(7.55, "7.55 points below full", "MISSED"), (-0.3, "0.30 points above full", "met")]
)
def test_summary_line_states_the_gap_to_full_resolution_in_words(gap: float, words: str, verdict: str) -> None:
    match = ParityVerdict(
        method="split-0.45",
        target_ratio=0.5,
        token_ratio=0.4956,
        metric="accuracy",
        quality=0.8,
        gap_points=gap,
        gap_std_points=None,
        goal_points=0.5,
        max_token_ratio=0.5,
        ratio_tolerance=0.005,
        met=gap <= 0.5,
    )
    (line,) = summary_lines(GoalVerdicts("accuracy", match=match), None, [])
    assert words in line and line.endswith(verdict) and "49.56%" in line


def test_a_grid_stopped_by_ctrl_c_raises_interrupted_naming_what_is_kept(ray_session, tmp_path):
    """Ray Tune's own Ctrl-C handler returns from ``fit`` with runs unfinished (neither
    a result nor an error): the study stops with exit code 130 and says the finished
    runs are kept, instead of reporting the runs as failed and carrying on."""
    import os
    import signal
    import time

    from splitvit.errors import Interrupted
    from splitvit.study.ray_executor import _tune_grid
    from splitvit.train.console import RAY_TUNE_LOGGER

    spec = load_study(write_study(tmp_path))
    driver = os.getpid()

    def trainable(config):
        os.kill(driver, signal.SIGINT)  # Ctrl-C at the driver while this run trains
        time.sleep(60)

    class Records(logging.Handler):  # Ray's loggers may not propagate to caplog
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records = Records()
    tune_logger = logging.getLogger(RAY_TUNE_LOGGER)
    tune_logger.addHandler(records)
    try:
        with pytest.raises(Interrupted, match="1 of 1 methods runs unfinished; the finished ones are kept") as info:
            _tune_grid(trainable, [RunRequest(0)], spec, str(tmp_path / "tune"), "methods-now")
    finally:
        tune_logger.removeHandler(records)
    assert info.value.exit_code == 130
    # Ray Tune's "Resume experiment with: Tuner.restore(...)" is not what a CLI user runs
    assert not [m for m in records.messages if "Tuner.restore(" in m]


def test_a_grid_returns_each_runs_result_in_order_and_a_failed_run_as_its_causes_line(ray_session, tmp_path):
    """``_tune_grid`` hands each run's outcome back in the order of the runs it was given,
    and a run that raised as the message of its cause, not Ray's wrapped traceback."""
    from ray import tune

    from splitvit.study.ray_executor import RUN_KEY, _tune_grid
    from splitvit.study.runs import RunFailure
    from splitvit.train.trial import TrialFailed

    spec = load_study(write_study(tmp_path))

    def made(seed, method):
        return MethodRun(seed, method, method, "ckpt", {}, [], 1.0, 1.0, f"runs/{method}-s{seed}")

    def trainable(config):
        run = config[RUN_KEY]
        if run["method"] == "boom":
            raise TrialFailed("boom-s0 diverged: non-finite loss nan at epoch 0")
        tune.report({"done": 1, "result": json.dumps(made(run["seed"], run["method"]).to_dict())})

    runs = [RunRequest(1, "split"), RunRequest(0, "boom"), RunRequest(0, "full")]
    results = _tune_grid(trainable, runs, spec, str(tmp_path / "tune"), "methods-now")
    assert results[0] == made(1, "split") and results[2] == made(0, "full")
    assert results[1] == RunFailure(runs[1], "boom-s0 diverged: non-finite loss nan at epoch 0")


def test_committed_study_json_reads_back_to_the_same_json():
    """The typed results write the JSON the studies wrote before them: every committed
    study of the current format (the envelope's keys aside) reads back and writes out
    the same; the ones written before `gap_std_points` and `ratio_tolerance` existed
    are older formats."""
    envelope = {"command", "error", "mlflow", "status", "wall_time_s"}
    same, older = [], []
    for path in sorted((ROOT / "docs" / "measurements").rglob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not {"rows", "goals", "runs"} <= set(data):
            continue  # not a study's result (a sweep's comparison has rows and goals too)
        data = {k: v for k, v in data.items() if k not in envelope}
        try:
            result = StudyResult.from_dict(data)
        except KeyError:
            older.append(path.name)
            continue
        assert json.loads(json.dumps(result.to_dict(), default=str)) == data, path
        same.append(path.name)
    # both default studies, run from scratch, are of the current format
    assert {"study_fashion_scratch10.json", "study_fashion_seg_scratch12.json"} <= set(same)
    assert len(same) >= 19 and len(older) <= 10, (same, older)
