"""A sweep's reference and fine-tuned baselines, unit by unit (no Ray cluster, no
training): the ``reference:``/``evaluation:`` sections and their refusals, finding a
reference (study, checkpoint, MLflow URI) and judging its convergence, checking that
its weights fit the trials' model, the config a trained reference gets and its
digest, the trials' configs, the searcher that hands out the baselines after the
search's trials, and ``scripts/sweep_vs_recipe.py``'s figures."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import yaml
from ray.tune.search import Searcher

from splitvit.config import shared_canvas_cache
from splitvit.train.experiment import build_model
from splitvit.tune.baseline_search import BaselinesFirst, BaselinesLast
from splitvit.tune.reference import (
    STUDY_RESULT_FILE,
    Reference,
    check_reference,
    convergence_verdict,
    locate_reference,
    reference_config,
)
from splitvit.tune.space import SearchSpace, SearchSpaceError, space_from_dict
from splitvit.tune.trial import BASELINE_KEY, SweepPlan
from tests.helpers import load_script, write_fake_fashion_mnist

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# 32x32 images, 4-pixel base patches, three levels; no recipe named: the task's current
# recipe applies to the learned policy (it sets model.fine_aggregation)
BASE = {
    "model": {
        "name": "vit_tiny_patch16_224",
        "timm_kwargs": {"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
        "image_size": 32,
        "levels": 3,
        "num_classes": 4,
        "policy": {"depth": 1},
    },
    "data": {
        "name": "synthetic",
        "options": {"train_samples": 64, "val_samples": 32, "object_size": 4},
        "batch_size": 16,
    },
    "train": {"epochs": 1, "lr": 0.002},
}
PARAMETERS = {
    "train.budget.weight": {"distribution": "loguniform", "low": 0.1, "high": 10.0},
    "train.budget.target_ratio": {"distribution": "uniform", "low": 0.2, "high": 0.8},
    "model.thresholds[1]": {"distribution": "uniform", "low": 0.3, "high": 0.7},
}
FIRST_POINT = {"train.budget.weight": 2.0, "train.budget.target_ratio": 0.4, "model.thresholds[1]": 0.45}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A folder holding the base config; its storage path is ``runs`` inside it."""
    path = tmp_path_factory.mktemp("reference")
    base = {**copy.deepcopy(BASE), "storage": {"path": str(path / "runs")}}
    (path / "base.yaml").write_text(yaml.safe_dump(base))
    return path


@pytest.fixture(scope="module")
def checkpoint(folder) -> str:
    """A checkpoint of the base config's model (trials need one that exists)."""
    return str(save_model(folder / "reference" / "checkpoint_000003", make_space(folder).config().model))


def make_space(folder: Path, base: str = "base.yaml", **sections) -> SearchSpace:
    """A space over the base config in ``folder`` with ``sections`` (``reference=...``)."""
    raw = {"base": base, "parameters": copy.deepcopy(PARAMETERS), **copy.deepcopy(sections)}
    return space_from_dict(raw, source="space.yaml", root=folder)


def refused(folder: Path, **sections) -> SearchSpaceError:
    with pytest.raises(SearchSpaceError) as info:
        make_space(folder, **sections)
    return info.value


def save_model(folder: Path, model_config) -> Path:
    """A checkpoint folder holding ``model.pt`` of a freshly built model (what
    ``SplitViT.save`` writes, as ``init_weights`` reads it)."""
    folder.mkdir(parents=True, exist_ok=True)
    build_model(model_config, pretrained=False).save(folder / "model.pt")
    return folder


# ---------------------------------------------------------------------- the sections
@pytest.mark.parametrize(
    "sections,key",
    [
        ({"reference": {}}, "reference"),  # named no way
        ({"reference": {"converge_epochs": 2}}, "reference"),
        ({"reference": {"checkpoint": "/x", "study": "s"}}, "reference"),  # two ways
        ({"reference": {"study": "s", "train": {"train.epochs": 2}}}, "reference"),
        ({"reference": "study_fashion"}, "reference"),  # not a mapping
        ({"reference": {"checkpoint": "/x", "seed": 1}}, "reference.seed"),  # a seed without a study
        ({"reference": {"study": "s", "seed": -1}}, "reference.seed"),
        ({"reference": {"study": " "}}, "reference.study"),
        ({"reference": {"train": {"epochs": 3}}}, "reference.train.epochs"),  # not dotted
        ({"reference": {"train": {"recipe": "none"}}}, "reference.train.recipe"),  # no recipe
        ({"reference": {"train": {"train": {"epochs": 3}}}}, "reference.train.train"),  # a section, not a key
        ({"reference": {"train": {"optim.lr": 0.1}}}, "reference.train.optim.lr"),  # no such section
        ({"reference": {"train": {"train.bogus": 3}}}, "reference.train.train.bogus"),  # not a config key
        ({"reference": {"train": {"train.epochs": 0}}}, "reference.train.train.epochs"),  # not a valid value
        ({"reference": {"study": "s", "converge_epochs": 0}}, "reference.converge_epochs"),
        ({"reference": {"study": "s", "converge_points": 0}}, "reference.converge_points"),
        ({"reference": {"study": "s", "bogus": 1}}, "reference.bogus"),
        ({"evaluation": {"split": "bogus"}}, "evaluation.split"),
        ({"evaluation": {"samples": 0}}, "evaluation.samples"),
        ({"baselines": {"ratios": [0.5, 1.5]}}, "baselines.ratios[1]"),
        ({"baselines": {"ratios": [0.0]}}, "baselines.ratios[0]"),
        ({"baselines": {"target_ratio": 0}}, "baselines.target_ratio"),
        ({"baselines": {"target_ratio": 1.2}}, "baselines.target_ratio"),
    ],
)
def test_each_refusal_names_its_key(folder, sections, key):
    error = refused(folder, **sections)
    assert error.key == key, str(error)
    assert str(error).startswith(f"search space space.yaml: {key}: ")
    assert "\n" not in str(error)


def test_a_valid_reference_section_loads_and_is_recorded(folder):
    space = make_space(
        folder,
        reference={"study": "study_fashion", "seed": 2, "converge_epochs": 4, "converge_points": 0.5},
        evaluation={"split": "val", "samples": 16},
        baselines={"target_ratio": 0.5, "ratios": [0.3, 0.6]},
    )
    assert space.reference.enabled
    recorded = space.to_dict()
    # as a file writes it: what is set, so that the recorded space loads back
    assert recorded["reference"] == {"study": "study_fashion", "seed": 2, "converge_epochs": 4, "converge_points": 0.5}
    assert recorded["evaluation"] == {"split": "val", "samples": 16}
    assert recorded["baselines"]["target_ratio"] == 0.5
    assert list(recorded["baselines"]["ratios"]) == [0.3, 0.6]
    json.dumps(recorded)  # JSON-ready, as sweep.json stores it
    # no reference, no held-out split: both are settings a space may leave off
    plain = make_space(folder, evaluation={"split": None})
    assert not plain.reference.enabled and plain.evaluation.split is None
    assert plain.to_dict()["reference"] is None
    trained = make_space(folder, reference={"train": {"train.epochs": 4, "model.timm_kwargs.depth": 1}})
    assert trained.reference.train == {"train.epochs": 4, "model.timm_kwargs.depth": 1}
    assert "seed" not in trained.to_dict()["reference"]  # a seed only picks a study's reference


# ---------------------------------------------------------------------- finding a reference
def write_study(root: Path, study: str, seed: int, checkpoint: str, curve: list[float]) -> Path:
    """A finished study's backbone record, where ``splitvit study`` stores it."""
    run = root / study / "train" / f"backbone-s{seed}"
    run.mkdir(parents=True, exist_ok=True)
    history = [{"epoch": i, "accuracy": a, "loss": 1.0 - a} for i, a in enumerate(curve)]
    record = {"seed": seed, "checkpoint": checkpoint, "history": history, "run_id": "abc123"}
    (run / STUDY_RESULT_FILE).write_text(json.dumps(record))
    return run


def test_a_missing_study_is_refused_naming_the_path(folder):
    space = make_space(folder, reference={"study": "never_ran", "seed": 1})
    base = space.config()
    with pytest.raises(SearchSpaceError) as info:
        locate_reference(space, base, "sqlite:///unused.db")
    assert info.value.key == "reference.study"
    expected = str(folder / "runs" / "never_ran" / "train" / "backbone-s1" / STUDY_RESULT_FILE)
    assert expected in info.value.reason


def test_a_study_reference_links_the_study_run_that_recorded_it(tmp_path):
    """A study's stored result names no MLflow run: the reference's run is found by its
    storage location in the tracking store (the study's parent run, which holds every
    seed's reference curve, when the study recorded no run of the reference itself)."""
    from splitvit.tracking.runs import RunTracker

    base = {**copy.deepcopy(BASE), "storage": {"path": str(tmp_path / "runs")}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    space = make_space(tmp_path, reference={"study": "study_x", "seed": 0})
    run = write_study(tmp_path / "runs", "study_x", 0, str(tmp_path / "ckpt"), [0.5, 0.6, 0.7, 0.7])
    record = json.loads((run / STUDY_RESULT_FILE).read_text())
    del record["run_id"]  # as splitvit study stores it
    (run / STUDY_RESULT_FILE).write_text(json.dumps(record))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert locate_reference(space, space.config(), uri).run_id is None  # no store yet: none made
    parent, _ = RunTracker.open(uri, "study-x", str(tmp_path / "runs" / "study_x"), "study_x", params={})
    parent.close("completed")
    assert locate_reference(space, space.config(), uri).run_id == parent.run_id
    own, _ = RunTracker.open(uri, "other", str(run), "backbone-s0", params={})
    own.close("completed")
    assert locate_reference(space, space.config(), uri).run_id == own.run_id  # its own run first
    assert not (tmp_path / "unused.db").exists()


@pytest.mark.parametrize(
    "curve,converged,gain",
    [
        ([0.50, 0.70, 0.800, 0.801, 0.802, 0.8025], True, 0.25),  # flat over the last 3 epochs
        ([0.50, 0.70, 0.800, 0.801, 0.802, 0.8050], False, 0.5),  # the goal is under 0.3 points
        ([0.50, 0.60, 0.700, 0.750, 0.800, 0.850], False, 15.0),  # still rising
        ([0.50, 0.60, 0.700, 0.690, 0.680, 0.670], True, -3.0),  # falling is converged too
        ([0.50, 0.60, 0.700], None, None),  # three epochs: no curve over the last three to judge
        ([], None, None),
    ],
)
def test_a_study_reference_and_its_convergence(tmp_path, curve, converged, gain):
    base_file = {**copy.deepcopy(BASE), "storage": {"path": str(tmp_path / "runs")}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base_file))
    space = make_space(tmp_path, reference={"study": "study_fashion", "seed": 3})
    checkpoint = str(tmp_path / "runs" / "study_fashion" / "train" / "backbone-s3" / "checkpoint_000009")
    write_study(tmp_path / "runs", "study_fashion", 3, checkpoint, curve)
    reference = locate_reference(space, space.config(), "sqlite:///unused.db")
    assert isinstance(reference, Reference)
    assert reference.checkpoint == checkpoint
    assert reference.source == "study study_fashion, seed 3"
    assert reference.run_id == "abc123"
    assert len(reference.history) == len(curve)
    assert reference.converged is converged
    if gain is None:
        assert reference.gain_points is None
        assert convergence_verdict(space, reference) == "no recorded curve to judge its convergence by"
    else:
        assert reference.gain_points == pytest.approx(gain)
        verdict = convergence_verdict(space, reference)
        assert verdict.startswith("converged" if converged else "NOT converged"), verdict
        assert f"{gain:+.2f} points of accuracy over its last 3 epochs (goal < 0.3)" in verdict


def test_a_checkpoint_that_does_not_exist_is_refused(folder):
    missing = str(folder / "nowhere" / "checkpoint_000001")
    space = make_space(folder, reference={"checkpoint": missing})
    with pytest.raises(SearchSpaceError) as info:
        locate_reference(space, space.config(), "sqlite:///unused.db")
    assert info.value.key == "reference.checkpoint"
    assert missing in info.value.reason


def test_an_existing_checkpoint_is_the_reference(folder):
    checkpoint = save_model(folder / "given" / "checkpoint_000002", make_space(folder).config().model)
    space = make_space(folder, reference={"checkpoint": str(checkpoint)})
    reference = locate_reference(space, space.config(), "sqlite:///unused.db")
    assert reference == Reference(str(checkpoint), str(checkpoint))
    assert reference.converged is None  # a bare checkpoint has no curve


def test_an_unknown_mlflow_run_is_refused(folder, tmp_path):
    from splitvit.tracking import ensure_experiment

    space = make_space(folder, reference={"checkpoint": "runs:/0123456789abcdef"})
    base = space.config()
    # no store at all: refused without MLflow creating one
    absent = f"sqlite:///{tmp_path}/absent.db"
    with pytest.raises(SearchSpaceError) as info:
        locate_reference(space, base, absent)
    assert info.value.key == "reference.checkpoint"
    assert "no MLflow store" in info.value.reason
    assert not (tmp_path / "absent.db").exists()
    # a fresh store that does not know the run
    fresh = f"sqlite:///{tmp_path}/fresh.db"
    ensure_experiment(fresh, "tests")
    with pytest.raises(SearchSpaceError) as info:
        locate_reference(space, base, fresh)
    assert info.value.key == "reference.checkpoint"
    assert info.value.reason.startswith("runs:/0123456789abcdef: not found in MLflow store")


# ---------------------------------------------------------------------- does it fit?
def test_a_reference_of_another_shape_is_refused_and_the_same_shape_passes(folder):
    space = make_space(folder, reference={"checkpoint": "/unused"})
    base = space.config()
    same = save_model(folder / "same", base.model)
    check_reference(space, base, Reference(str(same), "same shape"))
    wider = dataclasses.replace(base.model, timm_kwargs={**base.model.timm_kwargs, "embed_dim": 32, "num_heads": 2})
    other = save_model(folder / "wider", wider)
    with pytest.raises(SearchSpaceError) as info:
        check_reference(space, base, Reference(str(other), "a wider ViT"))
    assert info.value.key == "reference"
    assert info.value.reason.startswith("a wider ViT: does not fit the trials' model: ")
    assert "a different architecture?" in info.value.reason
    with pytest.raises(SearchSpaceError) as info:
        check_reference(space, base, Reference(str(folder / "gone"), "gone"))
    assert info.value.key == "reference"


# ---------------------------------------------------------------------- a trained reference
def test_a_trained_reference_is_full_resolution_without_a_recipe(folder, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # each config's own default store
    space = make_space(folder, reference={"train": {"train.epochs": 4, "train.lr": 0.01}})
    base = space.config()
    assert base.recipe != "none" and base.model.fine_aggregation  # the trials' recipe
    config = reference_config(space, base.storage.resolved_path(), "the-sweep")
    assert config.recipe == "none"
    assert config.model.policy.kind == "full"
    assert config.model.fine_aggregation is False  # the library's default, not the recipe's
    assert (config.train.epochs, config.train.lr) == (4, 0.01)
    assert config.tracking.experiment == "the-sweep"
    assert config.model.timm_kwargs == base.model.timm_kwargs  # the same ViT as the trials
    # recorded in the sweep's store, not the default one of its own storage folder (where the
    # parent's link to its run would find nothing)
    assert config.tracking_uri() != base.tracking_uri()
    store = "sqlite:////elsewhere/mlflow.db"
    in_store = reference_config(space, base.storage.resolved_path(), "the-sweep", store)
    assert in_store.tracking_uri() == store and in_store.storage.run_uri() == config.storage.run_uri()
    run = config.storage.run_uri()
    assert re.fullmatch(re.escape(str(folder / "runs" / "references")) + r"/reference-[0-9a-f]{12}", run), run
    # a second call names the same folder (reused by a later sweep)
    assert reference_config(space, base.storage.resolved_path(), "the-sweep").storage.run_uri() == run
    # not trained yet: nothing to locate (the sweep trains it)
    assert locate_reference(space, base, "sqlite:///unused.db") is None


def test_the_digest_follows_the_training_settings_only(tmp_path):
    made = []

    def digest(storage: str, tracking: dict, lr: float, experiment: str = "e") -> str:
        made.append(storage)
        name = f"base-{len(made)}.yaml"
        base = {**copy.deepcopy(BASE), "storage": {"path": storage}, "tracking": tracking}
        (tmp_path / name).write_text(yaml.safe_dump(base))
        space = make_space(tmp_path, base=name, reference={"train": {"train.epochs": 4, "train.lr": lr}})
        config = reference_config(space, str(tmp_path / "root"), experiment)
        return config.storage.name.removeprefix("reference-")

    first = digest(str(tmp_path / "a"), {"split_map_images": 0}, 0.01)
    assert re.fullmatch(r"[0-9a-f]{12}", first)
    # where it is stored and recorded is not what it is
    assert digest(str(tmp_path / "b"), {"split_map_images": 4, "tracking_uri": "sqlite:///x.db"}, 0.01) == first
    assert digest(str(tmp_path / "a"), {"split_map_images": 0}, 0.01, experiment="other") == first
    # another training setting is another reference
    assert digest(str(tmp_path / "a"), {"split_map_images": 0}, 0.02) != first


# ---------------------------------------------------------------------- the trials
def test_every_trial_fine_tunes_from_the_reference(folder, checkpoint):
    space = make_space(
        folder,
        reference={"checkpoint": "/unused"},
        search={"initial_points": [FIRST_POINT]},
        baselines={"target_ratio": 0.35},
    )
    plan = SweepPlan(space=space, train_storage=str(folder / "sweep" / "train"), name="s", reference=checkpoint)
    searched = plan.trial_config({"train.budget.weight": 1.5, "train.budget.target_ratio": 0.3}, "t1")
    assert searched.model.init_from == checkpoint
    assert searched.train.budget.weight == 1.5 and searched.model.policy.kind == "learned"
    assert searched.storage.run_uri() == str(folder / "sweep" / "train" / "t1")
    assert searched.tracking.enabled is False
    for policy in ("full", "entropy", "random"):
        config = plan.trial_config({BASELINE_KEY: policy}, f"b-{policy}")
        assert config.model.init_from == checkpoint
        assert config.model.policy.kind == policy
        assert config.storage.run_uri() == str(folder / "sweep" / "train" / f"b-{policy}")
    # without a reference, trials start from the base config's own initialisation
    bare = SweepPlan(space=space, train_storage=str(folder / "sweep" / "train"), name="s")
    assert bare.trial_config({"train.budget.weight": 1.5}, "t2").model.init_from is None


def test_baseline_params_are_the_first_point_with_the_policy(folder, checkpoint):
    space = make_space(
        folder,
        reference={"checkpoint": "/unused"},
        search={"initial_points": [FIRST_POINT]},
        baselines={"target_ratio": 0.35},
    )
    plan = SweepPlan(space=space, train_storage=str(folder / "train"), name="s", reference=checkpoint)
    assert plan.baseline_params("full") == {**FIRST_POINT, "model.policy.kind": "full"}
    for policy in ("entropy", "random"):
        params = plan.baseline_params(policy)
        assert params == {
            **FIRST_POINT,
            "model.policy.kind": policy,
            "train.budget.target_ratio": 0.35,
            "model.thresholds": "auto",
        }
        config = plan.trial_config({BASELINE_KEY: policy}, policy)
        assert config.train.budget.target_ratio == 0.35 and config.model.thresholds == "auto"
    full = plan.trial_config({BASELINE_KEY: "full"}, "full")
    assert full.train.budget.target_ratio == 0.4  # the first point's, not the baselines'
    assert full.model.thresholds != "auto"
    # no initial points: the base config's own values
    plain = SweepPlan(space=make_space(folder, reference={"checkpoint": "/unused"}), train_storage="x", name="s")
    assert plain.baseline_params("full") == {"model.policy.kind": "full"}


# ---------------------------------------------------------------------- cluttered canvases, rendered once
def test_a_sweep_on_cluttered_canvases_reads_them_from_the_shared_cache(tmp_path):
    """Like a study's runs, a sweep's trials and baselines read cluttered canvases
    rendered once under the storage path (rendering one costs about a training step of
    the studies' model), the cache a study on the same storage wrote."""
    from splitvit.tune.sweep import _settle_sweep

    root = write_fake_fashion_mnist(tmp_path / "fmnist", train=60, test=20)
    base = copy.deepcopy(BASE)
    base["model"].update(
        {"image_size": 64, "num_classes": 10, "timm_kwargs": {**base["model"]["timm_kwargs"], "patch_size": 8}}
    )
    base["data"] = {"name": "cluttered-fashion-mnist", "options": {"root": str(root), "val_size": 10}, "batch_size": 8}
    base["storage"] = {"path": str(tmp_path / "runs")}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    space = {"base": "base.yaml", "parameters": copy.deepcopy(PARAMETERS), "search": {"num_samples": 1}}
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    setup = _settle_sweep(tmp_path / "space.yaml", None, name="c", resume=False, ray_address=None)
    cache = str(tmp_path / "runs" / "canvas-cache")
    assert setup.base.data.options["cache_dir"] == cache
    plan = SweepPlan(space=setup.space, train_storage=str(tmp_path / "runs" / "c" / "train"), name="c")
    assert plan.trial_config({"train.budget.weight": 1.5}, "t1").data.options["cache_dir"] == cache
    assert plan.trial_config({BASELINE_KEY: "entropy"}, "b").data.options["cache_dir"] == cache
    assert not (tmp_path / "runs" / "canvas-cache").exists()  # rendered by the first run that reads it, not here


def test_the_shared_canvas_cache_only_for_cluttered_canvases_on_local_storage(folder):
    cluttered = ["data.name=cluttered-fashion-mnist", "model.image_size=64", "model.num_classes=10"]
    config = make_space(folder).config(overrides=cluttered)
    assert shared_canvas_cache(config) == {"data.options.cache_dir": str(folder / "runs" / "canvas-cache")}
    own = make_space(folder).config(overrides=[*cluttered, "data.options.cache_dir=/elsewhere"])
    assert shared_canvas_cache(own) == {}  # the config's own cache stays
    remote = make_space(folder).config(overrides=[*cluttered, "storage.path=s3://bucket/runs"])
    assert shared_canvas_cache(remote) == {}  # every node renders its own: nothing to share on a bucket
    assert shared_canvas_cache(make_space(folder).config()) == {}  # synthetic images cost nothing to draw
    # the local study runner names its own folder (it has no storage path): the cache goes there
    assert shared_canvas_cache(remote, root=folder / "out") == {
        "data.options.cache_dir": str(folder / "out" / "canvas-cache")
    }
    assert shared_canvas_cache(own, root=folder / "out") == {}


# ---------------------------------------------------------------------- baselines last
class Recording(Searcher):
    """A searcher that hands out ``{"x": n}`` and records what it is told."""

    def __init__(self) -> None:
        super().__init__(metric="accuracy", mode="max")
        self.suggested: list[str] = []
        self.results: list[str] = []
        self.completed: list[str] = []
        self.properties: list[tuple] = []
        self.concurrency: list[int] = []

    def suggest(self, trial_id: str) -> dict:
        self.suggested.append(trial_id)
        return {"x": len(self.suggested)}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self.results.append(trial_id)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self.completed.append(trial_id)

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        self.properties.append((metric, mode, config))
        return True

    def set_max_concurrency(self, max_concurrent: int) -> bool:
        self.concurrency.append(max_concurrent)
        return True


def test_the_search_comes_first_and_the_baselines_never_reach_it():
    inner = Recording()
    search = BaselinesLast(inner, ["full", "entropy", "random"], searched=2)
    assert (search.metric, search.mode) == ("accuracy", "max")
    assert search.set_search_properties("accuracy", "max", {"a": 1}) is True
    assert search.set_max_concurrency(2) is True
    assert inner.properties == [("accuracy", "max", {"a": 1})] and inner.concurrency == [2]
    given = [search.suggest(f"t{i}") for i in range(6)]
    assert given == [
        {"x": 1},
        {"x": 2},
        {BASELINE_KEY: "full"},
        {BASELINE_KEY: "entropy"},
        {BASELINE_KEY: "random"},
        Searcher.FINISHED,
    ]
    assert inner.suggested == ["t0", "t1"]  # the search is asked for its trials only
    for trial in ("t0", "t1", "t2", "t3", "t4"):
        search.on_trial_result(trial, {"accuracy": 0.5})
    search.on_trial_complete("t1", {"accuracy": 0.6})
    search.on_trial_complete("t3", {"accuracy": 0.7})
    search.on_trial_complete("t0", None, error=True)
    assert inner.results == ["t0", "t1"]
    assert inner.completed == ["t1", "t0"]


def test_a_search_with_no_point_yet_does_not_use_up_a_trial():
    class Waiting(Recording):
        def suggest(self, trial_id: str) -> dict | None:
            return None if not self.suggested and trial_id == "t0" else super().suggest(trial_id)

    search = BaselinesLast(Waiting(), ["full"], searched=1)
    assert search.suggest("t0") is None
    assert search.suggest("t1") == {"x": 1}
    assert search.suggest("t2") == {BASELINE_KEY: "full"}


def test_a_restored_wrapper_hands_out_no_trial_twice():
    search = BaselinesLast(Recording(), ["full", "entropy", "random"], searched=2)
    given = [search.suggest(f"t{i}") for i in range(3)]
    assert given == [{"x": 1}, {"x": 2}, {BASELINE_KEY: "full"}]
    state = json.loads(json.dumps(search.get_state()))  # what Tune saves, as data
    assert state == {"searched_left": 0, "pending": ["entropy", "random"], "baseline_trials": ["t2"]}
    inner = Recording()
    restored = BaselinesLast(inner, ["full", "entropy", "random"], searched=2)
    restored.set_state(state)
    given = [restored.suggest(f"r{i}") for i in range(3)]
    assert given == [{BASELINE_KEY: "entropy"}, {BASELINE_KEY: "random"}, Searcher.FINISHED]
    assert inner.suggested == []
    # the baseline handed out before the restart is still kept from the search
    restored.on_trial_complete("t2", {"accuracy": 0.9})
    restored.on_trial_complete("t1", {"accuracy": 0.9})
    assert inner.completed == ["t1"]
    assert restored.get_state() == {"searched_left": 0, "pending": [], "baseline_trials": ["r0", "r1", "t2"]}


def test_a_sweep_saved_with_its_baselines_first_resumes_in_that_order():
    """A state saved before the baselines moved last (no ``searched_left``), restored
    into the class by its old name, as Tune unpickles it."""
    inner = Recording()
    restored = BaselinesFirst(inner, ["full", "entropy", "random"], searched=8)
    restored.set_state({"pending": ["random"], "baseline_trials": ["t0", "t1"]})
    given = [restored.suggest(f"r{i}") for i in range(3)]
    assert given == [{BASELINE_KEY: "random"}, {"x": 1}, {"x": 2}]
    restored.on_trial_complete("t1", {"accuracy": 0.9})
    restored.on_trial_complete("r1", {"accuracy": 0.9})
    assert inner.completed == ["r1"]


# ---------------------------------------------------------------------- sweep_vs_recipe.py
@pytest.fixture(scope="module")
def script():
    return load_script("sweep_vs_recipe.py")


def test_best_at_allows_half_a_point_of_token_share(script):
    curve = [(0.205, 0.70), (0.21, 0.90), (0.45, 0.80), (0.5, 0.75)]
    assert script.best_at(curve, 0.2) == 0.70  # 0.205 is within the slack, 0.21 is not
    assert script.best_at(curve, 0.3) == 0.90
    assert script.best_at(curve, 0.5) == 0.90
    assert script.best_at(curve, 0.1) is None


def test_hypervolume_is_the_area_under_the_best_staircase(script):
    assert script.hypervolume([(0.2, 0.5), (0.5, 0.7)]) == pytest.approx(0.5 * 0.3 + 0.7 * 0.3)
    # a dominated point adds nothing; one below 0.1 counts from 0.1; one above 0.8 not at all
    assert script.hypervolume([(0.2, 0.5), (0.5, 0.7), (0.6, 0.6), (0.9, 0.99)]) == pytest.approx(0.36)
    assert script.hypervolume([(0.05, 0.4)]) == pytest.approx(0.4 * 0.7)
    assert script.hypervolume([]) == 0.0


def sweep_json(points: list[tuple[float, float]]) -> dict:
    frontier = [{"extras": {"test_accuracy": q, "test_token_ratio": r}} for r, q in points]
    frontier.append({"extras": {}})  # a point without held-out figures is left out
    return {"name": "sw", "metric": "accuracy", "frontier": frontier}


STUDY = {
    "name": "st",
    "runs": [
        {"method": "full", "seed": 0, "points": [{"token_ratio": 1.0, "quality": 0.80}]},
        {"method": "full", "seed": 1, "points": [{"token_ratio": 1.0, "quality": 0.99}]},
        {
            "method": "recipe",
            "seed": 0,
            "points": [{"token_ratio": r, "quality": q} for r, q in ((0.2, 0.60), (0.3, 0.70), (0.5, 0.79))],
        },
    ],
}


def test_compare_reports_each_goal_line(script):
    # above the recipe by 2 points at 0.2 and 0.3, 0.1 point below it at 0.5, below the control at 0.5
    sweep = sweep_json([(0.2, 0.62), (0.3, 0.72), (0.5, 0.789)])
    result = script.compare(sweep, *script.from_study(STUDY, "recipe", "full", 0))
    rows = {row["ratio"]: row for row in result["rows"]}
    assert rows[0.2] == {"ratio": 0.2, "sweep": 0.62, "recipe": 0.60, "control": 0.80}
    assert rows[0.8]["sweep"] == 0.789 and rows[0.8]["recipe"] == 0.79
    goals = {g["goal"]: g for g in result["goals"]}
    met = goals["at 0.2: at least 1.0 point above the recipe"]
    assert met["met"] and met["points"] == pytest.approx(2.0)
    near = goals["at 0.5: at or above the recipe minus 0.3 points"]
    assert near["met"] and near["points"] == pytest.approx(-0.1)
    control = goals["at 0.5: at or above the control"]
    assert not control["met"] and control["points"] == pytest.approx(-1.1)
    assert "at 0.5: at least 1.0 point above the recipe" not in goals  # only at 0.2 and 0.3
    hv = result["hypervolume"]
    assert hv["sweep"] == pytest.approx(0.62 * 0.1 + 0.72 * 0.2 + 0.789 * 0.3)
    assert hv["recipe"] == pytest.approx(0.60 * 0.1 + 0.70 * 0.2 + 0.79 * 0.3)
    assert goals["hypervolume over token ratios 0.1-0.8 above the recipe's"]["met"]
    assert result["met"] is False
    # a sweep with no point at or below 0.2 misses that ratio's goals
    late = script.compare(sweep_json([(0.3, 0.9), (0.5, 0.9)]), *script.from_study(STUDY, "recipe", "full", 0))
    first = {g["goal"]: g for g in late["goals"]}["at 0.2: at or above the recipe minus 0.3 points"]
    assert first == {"goal": "at 0.2: at or above the recipe minus 0.3 points", "points": None, "met": False}
    with pytest.raises(SystemExit, match="no run of method 'recipe' for seed 1"):
        script.from_study(STUDY, "recipe", "full", 1)
    with pytest.raises(SystemExit, match="no frontier point has held-out figures"):
        script.compare(sweep_json([]), *script.from_study(STUDY, "recipe", "full", 0))


def test_a_gap_exactly_on_a_goal_line_meets_it(script):
    """3688 and 3703 of 5,000 test images: 0.3 points below, exactly the line (the
    classification sweep's 0.7 row); float subtraction gives -0.30000000000000027."""
    gap = (3688 / 5000 - 3703 / 5000) * script.POINTS
    assert gap < -0.3  # what a plain comparison would refuse
    assert script.at_least(gap, -0.3)
    assert not script.at_least(gap - 0.02, -0.3)  # one image fewer misses it
    assert not script.at_least(None, -0.3)


def test_main_prints_the_table_and_writes_json(script, tmp_path, capsys):
    (tmp_path / "sweep.json").write_text(json.dumps(sweep_json([(0.2, 0.62), (0.3, 0.72), (0.5, 0.81)])))
    (tmp_path / "study.json").write_text(json.dumps(STUDY))
    out = tmp_path / "out.json"
    code = script.main(
        [
            str(tmp_path / "sweep.json"),
            "--study",
            str(tmp_path / "study.json"),
            "--method",
            "recipe",
            "--control",
            "full",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "| token ratio | the sweep | the recipe | full resolution (control) | sweep - recipe |" in printed
    assert "| 0.2 | 62.00 | 60.00 | 80.00 | +2.00 |" in printed
    assert "| 0.5 | 81.00 | 79.00 | 80.00 | +2.00 |" in printed
    assert "* at 0.5: at or above the control: +1.00 points: met" in printed
    assert "every goal line: met" in printed
    written = json.loads(out.read_text())
    assert written["met"] is True and written["sweep"] == "sw" and written["source"].startswith("study st (recipe")


def test_a_studys_recipe_is_by_default_the_method_the_current_recipe_was_proven_as(script, tmp_path, capsys):
    """``--study`` without ``--method`` compares with the current classification recipe's
    study method (its evidence's), not a fixed name that outlives the recipe."""
    from splitvit.recipes import load_recipe

    proven = load_recipe("classification").evidence.method
    study = json.loads(json.dumps(STUDY))
    for run in study["runs"]:
        run["method"] = proven if run["method"] == "recipe" else run["method"]
    (tmp_path / "sweep.json").write_text(json.dumps(sweep_json([(0.2, 0.62), (0.5, 0.81)])))
    (tmp_path / "study.json").write_text(json.dumps(study))
    assert script.main([str(tmp_path / "sweep.json"), "--study", str(tmp_path / "study.json")]) == 0
    assert f"({proven}, control full)" in capsys.readouterr().out


def test_a_current_recipe_without_evidence_asks_for_the_method(script, monkeypatch):
    import dataclasses

    from splitvit import recipes

    bare = dataclasses.replace(recipes.load_recipe("classification"), evidence=None)
    monkeypatch.setattr(recipes, "load_recipe", lambda name: bare)
    with pytest.raises(SystemExit, match=f"recipe {bare.name} names no evidence: give --method"):
        script.current_recipe_method("classification")


def test_the_recipe_and_control_from_the_sweep_itself(script, tmp_path, capsys):
    """Without a study: the recipe is the sweep's trial at its first initial point (its
    points cached in a file, read back), the control its fine-tuned full baseline."""
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"search": {"initial_points": [{"train.lr": 3.0e-4, "train.epochs": 10}]}}))
    sweep = sweep_json([(0.2, 0.62), (0.5, 0.81)])
    sweep["space"] = str(space)
    sweep["trials"] = [
        {"trial_id": "b1", "baseline": "full", "params": {}},
        {"trial_id": "t1", "baseline": "", "params": {"train.lr": 5.0e-4, "train.epochs": 6}},
        {"trial_id": "t2", "baseline": "", "params": {"train.lr": 0.0003, "train.epochs": 10}},
    ]
    sweep["baselines"] = [
        {"baseline": "entropy", "test_accuracy": 0.4},
        {"baseline": "full", "test_accuracy": 0.8, "test_token_ratio": 1.0},
    ]
    assert script.recipe_trial(sweep)["trial_id"] == "t2"
    cached = tmp_path / "recipe.json"
    cached.write_text(json.dumps({"trial_id": "t2", "points": [{"token_ratio": 0.2, "quality": 0.6}]}))
    recipe, full, source = script.from_sweep(sweep, cached)
    assert recipe == [(0.2, 0.6)] and full == 0.8 and "recipe trial t2" in source
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    assert script.main([str(tmp_path / "sweep.json"), "--recipe-points", str(cached)]) == 0
    assert "| 0.2 | 62.00 | 60.00 | 80.00 | +2.00 |" in capsys.readouterr().out
    sweep["baselines"] = sweep["baselines"][:1]
    with pytest.raises(SystemExit, match="no fine-tuned full-resolution baseline"):
        script.from_sweep(sweep, cached)
    sweep["trials"] = sweep["trials"][:2]
    with pytest.raises(SystemExit, match="no trial at the first initial point"):
        script.recipe_trial(sweep)


def test_the_recipe_from_the_sweep_and_the_control_from_a_study(script, tmp_path, capsys):
    """A sweep run without its baselines: the recipe is still its own trial's points,
    the control the study's full-resolution run of the reference's seed; without
    --study such a sweep is refused with a line that says what to give."""
    sweep = sweep_json([(0.2, 0.62), (0.5, 0.81)])
    sweep["baselines"] = []
    cached = tmp_path / "recipe.json"
    cached.write_text(json.dumps({"trial_id": "t2", "points": [{"token_ratio": 0.2, "quality": 0.6}]}))
    study = {
        "name": "st",
        "runs": [
            {"method": "full", "seed": 1, "points": [{"token_ratio": 1.0, "quality": 0.9}]},
            {"method": "full", "seed": 0, "points": [{"token_ratio": 1.0, "quality": 0.75}]},
        ],
    }
    (tmp_path / "study.json").write_text(json.dumps(study))
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    args = [str(tmp_path / "sweep.json"), "--recipe-points", str(cached)]
    assert script.main([*args, "--study", str(tmp_path / "study.json"), "--seed", "0"]) == 0
    printed = capsys.readouterr().out
    assert "| 0.2 | 62.00 | 60.00 | 75.00 | +2.00 |" in printed
    assert "recipe trial t2 and study st's full, seed 0" in printed
    with pytest.raises(SystemExit, match="give --study for the control"):
        script.main(args)


def test_a_held_out_split_the_data_lacks_leaves_the_sweep_whole(monkeypatch, caplog):
    """The held-out evaluation runs after every trial finished: a checkpoint it cannot
    evaluate there (a dataset without that split) is logged and skipped, the other
    points keep their figures, and nothing raises."""
    from types import SimpleNamespace

    import splitvit.tune.frontier_eval as frontier_eval
    from splitvit.train.points import EvaluatedPoint
    from splitvit.tune.pareto import Point

    def evaluate(config, fn, checkpoint, evaluations, **kwargs):
        if checkpoint == "no-test-split":
            raise ValueError("dataset coco has no split 'test'")
        point = EvaluatedPoint(None, 0.7, 10.0, 0.5, images_per_s=100.0, images=8, thresholds=[0.5], metrics={})
        return [point for _ in evaluations]

    monkeypatch.setattr(frontier_eval, "run_evaluation", evaluate)
    logged: list = []
    sweep = SimpleNamespace(
        space=SimpleNamespace(
            evaluation=SimpleNamespace(split="test", samples=None),
            search=SimpleNamespace(seed=0),
            reference=SimpleNamespace(enabled=False),
            baselines=SimpleNamespace(enabled=True),
        ),
        metric="accuracy",
        plan=SimpleNamespace(trial_config=lambda sampled, trial_id: None),
        recorder=SimpleNamespace(log_run_metrics=lambda run_id, figures: logged.append((run_id, figures))),
    )
    good = Point(0.6, 10.0, 0.5, trial_id="a", checkpoint="ok", run_id="r1", thresholds=[0.5])
    bad = Point(0.5, 8.0, 0.4, trial_id="b", checkpoint="no-test-split", run_id="r2", thresholds=[0.6])
    with caplog.at_level("WARNING", logger="splitvit.tune.frontier_eval"):
        frontier_eval.evaluate_held_out(sweep, [good, bad], [], {})
    assert good.extras["test_accuracy"] == 0.7 and "test_accuracy" not in bad.extras
    assert logged == [("r1", {"test_accuracy": 0.7, "test_tokens_per_image": 10.0, "test_token_ratio": 0.5})]
    assert "could not evaluate no-test-split on the test split" in caplog.text


# ---------------------------------------------------------------------- baselines kept for later sweeps
def _plan(folder: Path, checkpoint: str, name: str, root: Path | None = None, **sections) -> SweepPlan:
    """A sweep over ``folder``'s base config named ``name``, its trials under ``root``."""
    space = make_space(
        folder, reference={"checkpoint": "/unused"}, search={"initial_points": [FIRST_POINT]}, **sections
    )
    train = (root or folder) / name / "train"
    return SweepPlan(space=space, train_storage=str(train), name=name, reference=checkpoint)


def _finished_baseline(plan: SweepPlan, policy: str, trial_id: str) -> dict:
    """A baseline trial's final report where the trial writes it, its checkpoint beside it."""
    run = Path(plan.run_uri(trial_id))
    (run / "checkpoint_epoch0000").mkdir(parents=True)
    (run / "checkpoint_epoch0000" / "model.pt").write_bytes(b"weights")
    point = {"accuracy": 0.61, "tokens_per_image": 20.0, "token_ratio": 0.5, "thresholds": [0.4], "target_ratio": 0.5}
    report = {
        "accuracy": 0.7,
        "tokens_per_image": 40.0 if policy == "full" else 21.0,
        "token_ratio": 1.0 if policy == "full" else 0.52,
        "thresholds": [0.5],
        "checkpoint": str(run / "checkpoint_epoch0000"),
        "run_uri": str(run),
        "epochs": 1,
        "images": 32,
        "threshold_points": json.dumps([] if policy == "full" else [point]),
        BASELINE_KEY: policy,
    }
    (run / "sweep_trial.json").write_text(json.dumps(report))
    return report


def test_the_baseline_digest_follows_what_decides_its_figures(tmp_path, folder, checkpoint):
    """Same reference, training and evaluation: the same digest, whatever the sweep is
    called or searches; another reference, baseline target, stage-two image count or
    seed: another digest. ``baselines.reuse`` itself is not part of it."""
    from splitvit.tune.baseline_store import baseline_digest

    digest = baseline_digest(_plan(folder, checkpoint, "a"), "entropy")
    assert baseline_digest(_plan(folder, checkpoint, "b"), "entropy") == digest
    assert baseline_digest(_plan(folder, checkpoint, "b", baselines={"reuse": False}), "entropy") == digest
    longer = _plan(folder, checkpoint, "a")
    search = dataclasses.replace(longer.space.search, num_samples=99, seed=7)
    longer = dataclasses.replace(longer, space=dataclasses.replace(longer.space, search=search))
    assert baseline_digest(longer, "entropy") == digest  # how long and how the search runs: not the baseline's
    assert baseline_digest(_plan(folder, checkpoint, "a"), "random") != digest
    another = str(save_model(tmp_path / "another" / "checkpoint_000001", make_space(folder).config().model))
    assert baseline_digest(_plan(folder, another, "a"), "entropy") != digest
    assert baseline_digest(_plan(folder, checkpoint, "a", baselines={"target_ratio": 0.3}), "entropy") != digest
    assert baseline_digest(_plan(folder, checkpoint, "a", stage_two={"samples": 16}), "entropy") != digest
    seeded = _plan(folder, checkpoint, "a")
    seeded = dataclasses.replace(seeded, space=dataclasses.replace(seeded.space, fixed={"data.seed": 3}))
    assert baseline_digest(seeded, "entropy") != digest


def test_a_later_sweep_reuses_the_baselines_a_finished_one_kept(tmp_path, folder, checkpoint):
    """``store_baselines`` keeps each trained baseline's final report; a later sweep with
    the same digests finds them (with their figures and checkpoints), its own sweep's
    never, one whose checkpoint is gone never (a later sweep's baseline takes its place),
    and none with ``reuse: false``. What a sweep reuses is decided at its start and read
    back on resume, whatever was kept since."""
    from splitvit.tune.baseline_store import REUSED_FILE, reusable_baselines, settle_reused, store_baselines

    storage = str(tmp_path / "runs")
    first = _plan(folder, checkpoint, "first", tmp_path)
    reports = {p: _finished_baseline(first, p, f"t-{p}") for p in ("full", "entropy", "random")}
    written = store_baselines(first, storage, {p: f"t-{p}" for p in reports})
    assert len(written) == 3 and all(Path(w).parent == tmp_path / "runs" / "baselines" for w in written)
    assert store_baselines(first, storage, {"full": "t-full"}) == []  # a kept one is never replaced

    later = _plan(folder, checkpoint, "later", tmp_path)
    found = reusable_baselines(later, storage)
    assert sorted(found) == ["entropy", "full", "random"]
    entropy = found["entropy"]
    assert (entropy.sweep, entropy.trial_id, entropy.checkpoint) == (
        "first",
        "t-entropy",
        reports["entropy"]["checkpoint"],
    )
    final = entropy.final("accuracy")
    assert (final.quality, final.tokens_per_image, final.token_ratio) == (0.7, 21.0, 0.52)
    assert [p.quality for p in final.threshold_points] == [0.61] and final.images == 32
    assert reusable_baselines(first, storage) == {}  # a sweep never reuses its own
    assert reusable_baselines(_plan(folder, checkpoint, "later", tmp_path, baselines={"reuse": False}), storage) == {}
    another = str(save_model(tmp_path / "another" / "checkpoint_000001", make_space(folder).config().model))
    assert reusable_baselines(_plan(folder, another, "later", tmp_path), storage) == {}

    (Path(reports["random"]["checkpoint"]) / "model.pt").unlink()
    Path(reports["random"]["checkpoint"]).rmdir()
    assert sorted(reusable_baselines(later, storage)) == ["entropy", "full"]  # its checkpoint is gone

    sweep_dir = tmp_path / "runs" / "later"
    sweep_dir.mkdir(parents=True)
    settled = settle_reused(later, storage, str(sweep_dir), resume=False)
    assert sorted(settled) == ["entropy", "full"] and (sweep_dir / REUSED_FILE).exists()
    # a later sweep trains random again and keeps it in place of the entry without a checkpoint
    other = _plan(folder, checkpoint, "other", tmp_path)
    _finished_baseline(other, "random", "t-random2")
    assert len(store_baselines(other, storage, {"random": "t-random2"})) == 1
    assert reusable_baselines(later, storage)["random"].sweep == "other"
    again = settle_reused(later, storage, str(sweep_dir), resume=True)
    assert {p: s.to_dict() for p, s in again.items()} == {p: s.to_dict() for p, s in settled.items()}
