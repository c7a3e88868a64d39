"""Recipes: the proven settings by name and version, with their evidence (splitvit.recipes);
the layering that puts a recipe under every file (config.resolve_config); the commands that
show them (`splitvit recipes`, `splitvit config`); and the study files written against them."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from splitvit import recipes
from splitvit.cli import main
from splitvit.config import ConfigError, ExperimentConfig, Layer, load_config, resolve_config, upgrade_flat
from splitvit.recipes import load_recipe, recipe_names
from splitvit.study.spec import load_study

from .helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "jobs" / "configs" / "smoke.yaml"
STUDIES = ("studies/study_fashion.yaml", "studies/study_fashion_seg.yaml", "studies/study_fashion_det.yaml")
#: what each headline ran with, as the study files resolved it before recipes (tests/data)
HEADLINES = json.loads((Path(__file__).parent / "data" / "study_headline_settings.json").read_text())["studies"]
#: a 3-level classifier (the recipes' level context needs three levels)
LEARNED = {
    "model": {
        "name": "vit_tiny_patch16_224",
        "timm_kwargs": {"patch_size": 4, "embed_dim": 16, "depth": 2, "num_heads": 1},
        "image_size": 32,
        "levels": 3,
        "num_classes": 4,
        "policy": {"depth": 1},
    },
    "storage": {"name": "recipes"},
}


def _flat(config: ExperimentConfig) -> dict:
    """The settings a run trains with: no run name, folder, starting weights or recipe label."""
    skip = {"storage.name", "storage.path", "model.init_from", "recipe"}
    return {k: v for k, v in json.loads(json.dumps(config.flat(redact=False))).items() if k not in skip}


# ---------------------------------------------------------------------- the files and their evidence
def test_every_recipe_carries_the_figures_of_its_committed_study_json():
    evidence = load_script("recipe_evidence.py")
    assert recipe_names() == [
        "classification-v1",
        "classification-v2",
        "dense-v1",
        "dense-v2",
        "detection-v1",
        "detection-v2",
    ]
    for name in recipe_names():
        recipe = load_recipe(name)
        data = json.loads((ROOT / recipe.evidence.result).read_text())
        assert data["metric"] == recipe.evidence.metric and len(data["seeds"]) == recipe.evidence.seeds
        assert recipe.evidence.control == evidence.control_quality(data)
        stated = [{k: v for k, v in vars(p).items() if v is not None} for p in recipe.evidence.points]
        measured = [
            {k: v for k, v in p.items() if v is not None}
            for p in evidence.evidence_points(data, recipe.evidence.method)
        ]
        assert stated == measured, name
        pace = evidence.evidence_pace(data, recipe.evidence.method, evidence.pace_json(recipe))
        assert list(recipe.evidence.pace) == pace, name
        # the study file's entry (its headline or a lever) is this recipe, under the method name the JSON ran
        spec = load_study(ROOT / recipe.evidence.study, methods=["full", recipe.evidence.method], settings_only=True)
        assert spec.methods[recipe.evidence.method].recipe == name
        assert evidence.main([name, "--check"]) == 0


def test_a_pace_read_from_another_invocation_must_be_the_same_runs():
    """``evidence.pace_result`` names the invocation that trained the runs ``result``
    reused; the pace is read there only while its runs are those runs, epoch for epoch."""
    evidence = load_script("recipe_evidence.py")
    recipe = load_recipe("classification-v2")
    data = json.loads((ROOT / recipe.evidence.result).read_text())
    trained_in = evidence.pace_json(recipe)
    assert evidence.evidence_pace(data, recipe.evidence.method) is None  # reused there: no side-by-side figure
    assert evidence.evidence_pace(data, recipe.evidence.method, trained_in) == list(recipe.evidence.pace)
    other = copy.deepcopy(trained_in)
    run = next(r for r in other["runs"] if r["method"] == "full" and r["seed"] == 0)
    run["history"][-1]["train_images_per_s"] *= 2
    with pytest.raises(ValueError, match="not the same runs"):
        evidence.evidence_pace(data, recipe.evidence.method, other)


def test_a_new_recipes_evidence_block_is_written_from_its_study_json(capsys):
    """``--from STUDY.json --method M``: the block a recipe file would carry, which for
    every shipped recipe proven in one invocation is its file's own (date and commit aside)."""
    evidence = load_script("recipe_evidence.py")
    for name in recipe_names():
        recipe = load_recipe(name)
        if recipe.evidence.pace_result is not None:  # its pace was read from another invocation
            continue
        argv = ["--from", str(ROOT / recipe.evidence.result), "--method", recipe.evidence.method]
        assert evidence.main(argv) == 0
        block = yaml.safe_load(capsys.readouterr().out)["evidence"]
        # the study file as the run named it (studies/ was search_spaces/ before 2026-12-05)
        assert Path(block.pop("study")).name == Path(recipe.evidence.study).name
        stated = {k: v for k, v in vars(recipe.evidence).items() if k not in ("study", "date", "commit", "pace_result")}
        stated["pace"] = list(stated["pace"])
        stated["points"] = [{k: v for k, v in vars(p).items() if v is not None} for p in stated["points"]]
        assert block == stated, name
    proven = load_recipe("detection-v1").evidence
    with pytest.raises(SystemExit, match="no method 'nope'"):
        evidence.main(["--from", str(ROOT / proven.result), "--method", "nope"])
    with pytest.raises(SystemExit):  # the two go together
        evidence.main(["--method", proven.method])
    assert "--from and --method go together" in capsys.readouterr().err


def test_splitvit_recipes_lists_them_with_their_evidence(tmp_path, capsys):
    out = tmp_path / "recipes.json"
    assert main(["recipes", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    listed = json.loads(out.read_text())["recipes"]
    assert [r["name"] for r in listed] == recipe_names()
    defaults = [r["name"] for r in listed if r["default"]]  # one per task: index.yaml's
    assert sorted(defaults) == sorted(recipes.current_recipes().values())
    evidence = load_script("recipe_evidence.py")
    for record in listed:
        data = json.loads((ROOT / record["evidence"]["result"]).read_text())
        at70, at50 = evidence.evidence_points(data, record["evidence"]["method"])
        line = next(line for line in printed.splitlines() if line.startswith(record["name"]))
        assert f"{at70['vs_control_points']:+.2f} ± {at70['spread_points']:.2f}" in line
        assert f"{at50['vs_control_points']:+.2f} ± {at50['spread_points']:.2f}" in line
        assert f"{at70['speed']:.2f}x" in line and record["evidence"]["commit"] in line
        trained_in = evidence.pace_json(load_recipe(record["name"]))
        pace = evidence.evidence_pace(data, record["evidence"]["method"], trained_in)
        assert ", ".join(f"{ratio:.2f}x" for ratio in pace) in line  # the fine-tuning pace, seed by seed


def test_recipes_show_prints_every_setting_of_a_recipe_or_a_tasks_current_one(capsys):
    assert main(["recipes", "show", "detection"]) == 0  # a task: its current recipe
    printed = capsys.readouterr().out
    assert printed.startswith("detection-v1 (detection, version 1, the default)")
    for key, value in load_recipe("detection-v1").settings.items():
        assert any(line.split() == [key, str(value).lower()] for line in printed.splitlines()), key


def test_recipe_files_are_installed_with_the_package(tmp_path):
    """A wheel (what the Docker image and a pip install get) holds the recipe files."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "platform", source / "platform", ignore=shutil.ignore_patterns("__pycache__"))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", "."]
    subprocess.run(command, cwd=source, check=True, capture_output=True)
    (wheel,) = (source / "dist").glob("splitvit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"splitvit/recipes/{name}.yaml" for name in recipe_names()} | {"splitvit/recipes/index.yaml"} <= names


# ---------------------------------------------------------------------- the layering
def test_a_learned_policy_gets_its_tasks_current_recipe_under_the_files_settings():
    raw = {**LEARNED, "train": {"teacher": {"targets": "nested"}}}
    config = ExperimentConfig.from_dict(raw, ["train.teacher.kind=gradient"], source="file x.yaml")
    recipe = load_recipe("classification")
    assert config.recipe == recipe.name == "classification-v2" and config.train.teacher.every == 2
    assert config.model.fine_aggregation and config.model.policy.level_context  # the recipe's
    assert config.train.teacher.targets == "nested"  # the file's, over the recipe's mixed
    assert config.train.teacher.kind == "gradient"  # --set, over the recipe's attention
    layers = config.layers
    assert layers["model.fine_aggregation"] == "recipe classification-v2"
    assert layers["train.teacher.targets"] == "file x.yaml" and layers["model.levels"] == "file x.yaml"
    assert layers["train.teacher.kind"] == "--set" and layers["train.lr"] == "default"
    # what to_dict writes reads back to the same config (a checkpoint's, a trial's)
    again = ExperimentConfig.from_dict(config.to_dict(redact=False))
    assert again == config and again.recipe == config.recipe


def test_recipe_none_gives_the_librarys_defaults_and_other_policies_take_no_recipe():
    plain = ExperimentConfig.from_dict({**LEARNED, "recipe": "none"})
    assert plain.recipe == "none" and _flat(plain) == _flat(ExperimentConfig.from_dict({**LEARNED}, ["recipe=none"]))
    assert not plain.model.fine_aggregation and plain.train.teacher.kind == "gradient"
    assert not ExperimentConfig.from_dict({**LEARNED, "recipe": "none"}).model.policy.level_context
    full = ExperimentConfig.from_dict({**LEARNED, "recipe": "classification-v1"}, ["model.policy.kind=full"])
    assert full.recipe == "none" and not full.model.fine_aggregation  # the recipe is the learned policy's
    dense = ExperimentConfig.from_dict(LEARNED, ["model.task=dense", "model.num_classes=3"])
    assert dense.recipe == "dense-v2" and dense.train.teacher.every == 2


def test_without_drops_a_recipe_key_and_must_name_one():
    lever = Layer("method lever", {"train.budget.target_ratio": 0.7}, without=("model.policy.level_context",))
    config = resolve_config([Layer("file", LEARNED, nested=True), lever])
    assert config.recipe == "classification-v2" and config.train.budget.target_ratio == 0.7
    assert config.model.fine_aggregation and not config.model.policy.level_context
    assert config.layers["model.policy.level_context"] == "default"
    with pytest.raises(ConfigError, match="without.train.lr: not a setting of recipe classification-v2"):
        resolve_config([Layer("file", LEARNED, nested=True), Layer("m", {}, without=("train.lr",))])


def test_a_key_the_recipe_set_that_cannot_hold_says_which_recipe_set_it():
    with pytest.raises(ConfigError) as err:
        from splitvit.train.experiment import experiment_from_dict

        experiment_from_dict(LEARNED, ["model.levels=2"])
    assert err.value.key == "model.policy.level_context"
    assert "set by recipe classification-v2" in str(err.value) and "recipe: none" in str(err.value)


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "recipe=classification-v7",
            "no version v7 of the classification recipe; there are classification-v1, classification-v2",
        ),
        (
            "recipe=fast",
            "unknown recipe 'fast'; known: classification-v1, classification-v2, dense-v1, dense-v2, detection-v1, "
            "detection-v2",
        ),
        ("recipe=detection-v1", "detection-v1 is a detection recipe and this config's model.task is classification"),
        ("recipe=[1]", "expected a recipe name or none"),
    ],
)
def test_a_bad_recipe_is_one_line_naming_the_known_ones_exit_2(setting, message, capsys):
    assert main(["config", str(SMOKE), "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "config error: recipe" in err
    assert main(["train", str(SMOKE), "--set", setting, "--set", "storage.path=/nonexistent/never"]) == 2
    assert message in capsys.readouterr().err


def test_a_new_version_never_changes_what_an_old_one_resolves_to(tmp_path, monkeypatch):
    named = load_config(SMOKE).recipe  # the smoke file names its version
    before = _flat(load_config(SMOKE))
    default_before = _flat(load_config(SMOKE, ["recipe=classification"]))
    versions = [load_recipe(n).version for n in recipe_names() if n.startswith("classification-v")]
    newest = f"classification-v{max(versions) + 1}"
    folder = tmp_path / "recipes"
    shutil.copytree(recipes.FOLDER, folder, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    current = load_recipe("classification").name
    made = yaml.safe_load((folder / f"{current}.yaml").read_text())
    made.update(name=newest, evidence=None)
    made["settings"] = {**made["settings"], "train.teacher.every": 3}
    (folder / f"{newest}.yaml").write_text(yaml.safe_dump(made))
    index = yaml.safe_load((folder / "index.yaml").read_text())
    index["current"]["classification"] = newest
    (folder / "index.yaml").write_text(yaml.safe_dump(index))
    monkeypatch.setattr(recipes, "FOLDER", folder)
    monkeypatch.setattr(recipes, "INDEX_FILE", folder / "index.yaml")
    for cached in (recipes.current_recipes, recipes._load):
        cached.cache_clear()
    try:
        assert load_config(SMOKE).recipe == named and _flat(load_config(SMOKE)) == before  # a named version stays
        newer = load_config(SMOKE, ["recipe=classification"])
        assert newer.recipe == newest and newer.train.teacher.every == 3
        assert _flat(newer) == {**default_before, "train.teacher.every": 3}
        assert ExperimentConfig.from_dict(LEARNED).recipe == newest  # the default moved
    finally:
        for cached in (recipes.current_recipes, recipes._load):
            cached.cache_clear()


@pytest.mark.parametrize(
    ("malform", "message"),
    [
        (lambda evidence: evidence.update(pace=1.08), r"dense-v2.yaml: evidence: .*float"),  # one number, not per seed
        (lambda evidence: evidence.pop("points"), r"dense-v2.yaml: evidence: missing 'points'$"),
    ],
    ids=["pace-not-a-list", "points-missing"],
)
def test_a_recipe_files_malformed_evidence_is_one_error_naming_the_file(tmp_path, monkeypatch, malform, message):
    folder = tmp_path / "recipes"
    shutil.copytree(recipes.FOLDER, folder, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    made = yaml.safe_load((folder / "dense-v2.yaml").read_text())
    malform(made["evidence"])
    (folder / "dense-v2.yaml").write_text(yaml.safe_dump(made))
    monkeypatch.setattr(recipes, "FOLDER", folder)
    recipes._load.cache_clear()
    try:
        with pytest.raises(recipes.RecipeError, match=message):
            load_recipe("dense-v2")
    finally:
        recipes._load.cache_clear()


# ---------------------------------------------------------------------- studies
@pytest.mark.parametrize("study", STUDIES)
def test_each_study_headline_resolves_to_the_settings_its_committed_json_ran_with(study):
    expected = HEADLINES[study]
    spec = load_study(ROOT / study, settings_only=True)
    method = expected["method"]
    assert spec.methods[method].recipe == load_recipe(spec.task).name  # the headline is a recipe
    # a setting the code gained after the study ran counts as its default there (the
    # study runs' own staleness rule): it must still be at that default now
    defaults = _flat(ExperimentConfig())
    for seed, settings in expected["seeds"].items():
        now = _flat(spec.run_config(int(seed), method, "check", settings_only=True))
        # recorded before the keys were grouped: the old names read as the new ones
        ran = upgrade_flat({k: v for k, v in settings.items() if k != "recipe"})
        gained = {k: defaults[k] for k in now.keys() - ran.keys() if k in defaults}
        assert now == {**gained, **ran}, (study, seed)


@pytest.mark.parametrize("study", STUDIES)
def test_no_study_entry_repeats_its_recipes_settings(study):
    spec = load_study(ROOT / study, settings_only=True)
    raw = yaml.safe_load((ROOT / study).read_text())
    levers = raw["levers"]
    if isinstance(levers, str):
        levers = yaml.safe_load((ROOT / "studies" / levers).read_text())
    for name, entry in {**raw["methods"], **levers}.items():
        recipe = entry.get("recipe")
        if recipe in (None, "none"):
            continue
        settings = upgrade_flat(load_recipe(recipe).settings)  # a recipe keeps the names it was made with
        repeated = [k for k, v in entry.items() if k in settings and settings[k] == v]
        assert not repeated, f"{study}: {name} repeats {repeated} of {recipe}"
        assert all(k in settings for k in entry.get("without", [])), name
    assert spec.methods  # the file loads


def test_splitvit_config_shows_a_study_runs_layers(tmp_path, capsys):
    out = tmp_path / "config.json"
    argv = ["config", "--study", "studies/study_fashion_det.yaml", "--method", "split-0.5-objects-d2-ring8"]
    assert main([*argv, "--set", "train.lr=1e-4", "--json", str(out)]) == 0
    keys = json.loads(out.read_text())["keys"]
    assert keys["train.teacher.kind"] == {"value": "objects", "layer": "recipe detection-v1"}
    assert keys["train.budget.target_ratio"] == {"value": 0.5, "layer": "method split-0.5-objects-d2-ring8"}
    assert keys["model.policy.fine_evidence"] == {"value": False, "layer": "default"}  # without:
    assert keys["train.epochs"] == {"value": 15, "layer": "study method"}
    assert keys["model.image_size"]["layer"] == "study config"
    assert keys["model.task"]["layer"] == "file jobs/configs/fashion_det.yaml"
    assert keys["train.lr"] == {"value": 1e-4, "layer": "--set"}
    assert keys["data.seed"] == {"value": 0, "layer": "study"}
    capsys.readouterr()
    assert main(["config", "--study", "studies/study_fashion_det.yaml", "--method", "reference"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("recipe: none (model.policy.kind is full")
    assert main(["config", "--method", "full"]) == 2


def test_every_training_run_tags_its_recipe(tmp_path):
    from mlflow import MlflowClient

    from splitvit.tracking import RunTracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    configs = ROOT / "jobs" / "configs"
    for path, overrides, tags in (
        (SMOKE, [], {"splitvit.recipe": "classification-v2", "splitvit.recipe_version": "2"}),
        (configs / "fashion_mnist.yaml", [], {"splitvit.recipe": "classification-v2", "splitvit.recipe_version": "2"}),
        (configs / "fashion_mnist_seg.yaml", [], {"splitvit.recipe": "dense-v2", "splitvit.recipe_version": "2"}),
        (configs / "fashion_det.yaml", [], {"splitvit.recipe": "detection-v1", "splitvit.recipe_version": "1"}),
        (SMOKE, ["recipe=none"], {"splitvit.recipe": "none"}),
    ):
        config = load_config(path, overrides)
        run_uri = str(tmp_path / "run" / f"{path.stem}{overrides}")
        tracker, _ = RunTracker.open(uri, "recipes", run_uri, "r", config.flat())
        run = MlflowClient(uri).get_run(tracker.run_id)
        assert {k: v for k, v in run.data.tags.items() if k.startswith("splitvit.recipe")} == tags
        assert run.data.params["recipe"] == tags["splitvit.recipe"]
