"""Search spaces: the shipped files load; invalid spaces stop with one clear error
naming the file and the key, before any Ray work; the Pareto math agrees with a
brute-force check."""

from __future__ import annotations

import itertools
import logging
import random
from pathlib import Path

import pytest
import yaml

from splitvit.cli import main
from splitvit.recipes import load_recipe
from splitvit.tune import SearchSpaceError, annotate, dominates, hypervolume, load_space, pareto_indices
from splitvit.tune.pareto import Point, frontier

ROOT = Path(__file__).resolve().parents[1]
SPACES = ROOT / "search_spaces"

TINY_BASE = {
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
    "train": {"epochs": 1},
}
VALID = {
    "base": "base.yaml",
    "parameters": {
        "train.budget.weight": {"distribution": "loguniform", "low": 0.1, "high": 10.0},
        "train.budget.target_ratio": {"distribution": "uniform", "low": 0.2, "high": 0.8},
        "model.thresholds[1]": {"distribution": "uniform", "low": 0.3, "high": 0.7, "step": 0.1},
        "train.policy.warmup_epochs": {"distribution": "int", "low": 0, "high": 2},
        "train.budget.penalty": {"distribution": "categorical", "choices": ["squared", "hinge"]},
        "model.timm_kwargs": {
            "distribution": "categorical",
            "choices": [
                {"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 1},
                {"patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2},
            ],
        },
        "train.epochs": 2,
    },
    "search": {"num_samples": 3, "max_concurrent": 1},
}


def write_space(folder: Path, space: dict, base: dict | None = None) -> Path:
    (folder / "base.yaml").write_text(yaml.safe_dump(base or TINY_BASE))
    path = folder / "space.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def variant(**changes) -> dict:
    """VALID with dotted changes (``parameters/train.lr`` style keys address parameters)."""
    import copy

    space = copy.deepcopy(VALID)
    for key, value in changes.items():
        section, _, name = key.partition("/")
        if name:
            space.setdefault(section, {})[name] = value
        else:
            space[section] = value
    return space


# ---------------------------------------------------------------------- the shipped spaces
STUDY_SUFFIX = {"classification": "", "dense": "_seg", "detection": "_det"}


@pytest.mark.parametrize(
    "name,metric,searched",
    [
        ("smoke", "accuracy", {"train.budget.weight", "train.budget.target_ratio", "train.lr"}),
        *[
            (name, metric, {"train.budget.target_ratio", "train.budget.weight", "train.lr", "train.epochs"})
            for name, metric in (
                ("classification_cpu", "accuracy"),
                ("dense_cpu", "miou"),
                ("detection_cpu", "box_ap"),
            )
        ],
        (
            "classification",
            "accuracy",
            {
                "train.budget.weight",
                "train.budget.target_ratio",
                "model.thresholds[0]",
                "model.thresholds[1]",
                "train.lr",
                "train.weight_decay",
                "train.epochs",
                "train.budget.penalty",
            },
        ),
        (
            "detection",
            "box_ap",
            {
                "train.budget.weight",
                "train.budget.target_ratio",
                "train.lr",
                "train.epochs",
                "train.teacher.every",
                "model.fine_aggregation",
            },
        ),
        (
            "dense",
            "miou",
            {
                "train.budget.weight",
                "train.budget.target_ratio",
                "model.thresholds[0]",
                "model.thresholds[1]",
                "train.lr",
                "train.weight_decay",
                "train.epochs",
                "train.budget.penalty",
            },
        ),
    ],
)
def test_shipped_spaces_load(name, metric, searched):
    space = load_space(SPACES / f"{name}.yaml")
    assert set(space.parameters) == searched
    assert space.quality_metric == metric
    assert Path(space.base).is_file()
    # every shipped sweep fine-tunes from a reference, its baselines too, and ends on the test split
    assert space.reference.enabled and space.baselines.enabled and space.evaluation.split == "test"
    assert space.config().train.policy.warmup_epochs == 0  # trials start from a trained model
    assert space.config().recipe == load_recipe(space.task).name  # the task's current recipe (index.yaml)
    if name == "smoke":
        # the demo: CPU-only, small, and the trial driver asks for a fraction of a CPU
        cfg = space.config()
        assert cfg.data.name == "synthetic" and not cfg.scaling.use_gpu and cfg.scaling.num_workers == 1
        assert 0 < space.search.trial_resources["CPU"] < 1
        assert space.reference.train is not None  # a tiny reference, trained by the demo
    elif name.endswith("_cpu"):
        # a study's CPU scale: its seed-0 reference, the recipe as the study ran it first
        cfg = space.config()
        assert not cfg.scaling.use_gpu and space.reference.study == f"study_fashion{STUDY_SUFFIX[space.task]}"
        assert space.search.num_samples >= 8 and space.search.initial_points
    else:
        cfg = space.config()
        assert cfg.scaling.use_gpu and space.search.sampler == "auto" and space.search.max_concurrent > 1


def test_a_point_of_the_space_becomes_a_config(tmp_path):
    space = load_space(write_space(tmp_path, VALID))
    assert space.parameters["train.budget.penalty"].encoded is False and space.parameters["model.timm_kwargs"].encoded
    dists = space.optuna_space()
    assert dists["train.budget.weight"].log and dists["train.policy.warmup_epochs"].low == 0
    assert dists["model.thresholds[1]"].step == pytest.approx(0.1)
    # Optuna stores mapping choices as JSON text; the config gets the mapping back
    sampled = {
        "train.budget.weight": 2.5,
        "train.budget.target_ratio": 0.3,
        "model.thresholds[1]": 0.6,
        "train.policy.warmup_epochs": 1,
        "train.budget.penalty": "hinge",
        "model.timm_kwargs": dists["model.timm_kwargs"].choices[1],
    }
    cfg = space.config(space.decode(sampled))
    assert (
        cfg.train.budget.weight == 2.5 and cfg.train.budget.penalty == "hinge" and cfg.train.policy.warmup_epochs == 1
    )
    assert cfg.model.thresholds == [0.5, 0.6]  # one number expanded per level, then level 1 set
    assert cfg.model.timm_kwargs["embed_dim"] == 32
    assert cfg.train.epochs == 2  # a fixed value passes through


def test_searching_one_threshold_level_fixes_the_others(tmp_path):
    """Over a base whose thresholds are calibrated (``auto``) or one number, searching
    one level sets every level: the others keep the number (or the model's 0.5)."""
    for base_value, other in (("auto", 0.5), (0.3, 0.3)):
        base = dict(TINY_BASE, model=dict(TINY_BASE["model"], thresholds=base_value))
        space = load_space(write_space(tmp_path, VALID, base=base))
        assert space.config({"model.thresholds[1]": 0.6}).model.thresholds == [other, 0.6]
    assert space.config().model.thresholds == 0.3  # not searched at this point: the base's value


def test_set_overrides_fix_config_values_and_change_settings(tmp_path):
    path = write_space(tmp_path, VALID)
    space = load_space(
        path, ["search.num_samples=7", "stage_two.points=3", "train.budget.weight=1.5", "train.epochs=1"]
    )
    assert space.search.num_samples == 7 and space.stage_two.points == 3
    assert "train.budget.weight" not in space.parameters and space.fixed["train.budget.weight"] == 1.5
    assert space.config().train.epochs == 1
    for item, message in (
        ("search.num_samplez=3", r"search\.num_samplez: unknown key; did you mean search\.num_samples\?$"),
        (
            "search.num_samples.x=1",
            r"search\.num_samples: is a value, not a section; cannot set search\.num_samples\.x$",
        ),
        ("stage_two.points", r"stage_two\.points: override must look like key=value"),
    ):
        with pytest.raises(SearchSpaceError) as info:
            load_space(path, [item])
        assert str(info.value).startswith(f"search space {path}: ")
        assert __import__("re").search(message, str(info.value)), str(info.value)


def test_settings_are_typed_by_the_config_loader(tmp_path):
    """Settings sections go through the experiment config's own loader: ints become
    floats where a float is declared, lists become the declared tuples."""
    space = load_space(
        write_space(
            tmp_path,
            variant(
                baselines={"entropy_thresholds": [0, 0.5]}, search={"trial_resources": {"CPU": 1}, "state_period_s": 2}
            ),
        )
    )
    assert space.baselines.entropy_thresholds == (0.0, 0.5) and isinstance(space.baselines.entropy_thresholds[0], float)
    assert space.search.trial_resources == {"CPU": 1.0} and isinstance(space.search.state_period_s, float)


# ---------------------------------------------------------------------- samplers and first points
NUMERIC = {k: v for k, v in VALID["parameters"].items() if k not in ("train.budget.penalty", "model.timm_kwargs")}


@pytest.mark.parametrize(
    "parameters,overrides,expected",
    [
        (NUMERIC, [], "gp"),  # every parameter a number, few trials
        (VALID["parameters"], [], "tpe"),  # a categorical parameter
        (NUMERIC, ["search.num_samples=250"], "nsga2"),  # a large budget
        (VALID["parameters"], ["search.num_samples=250"], "nsga2"),
        (VALID["parameters"], ["search.sampler=gp"], "gp"),  # named: as named
        (NUMERIC, ["search.sampler=random"], "random"),
    ],
)
def test_auto_picks_the_sampler_by_optunas_rule(tmp_path, parameters, overrides, expected):
    from splitvit.tune.space import resolve_sampler

    space = load_space(write_space(tmp_path, variant(parameters=parameters)), overrides, settings_only=True)
    assert space.search.sampler == ("auto" if not any("sampler" in o for o in overrides) else expected)
    assert resolve_sampler(space) == expected


def test_the_built_samplers_fit_the_budget(tmp_path):
    """The GP starts modelling after a third of a small budget (Optuna's 10 random
    trials would be the whole of an 8-trial sweep); TPE is multivariate."""
    import optuna

    from splitvit.tune.search import build_sampler

    path = write_space(tmp_path, variant(parameters=NUMERIC))
    for trials, startup in ((4, 2), (8, 2), (24, 8), (64, 10)):
        sampler = build_sampler(load_space(path, [f"search.num_samples={trials}"], settings_only=True))
        assert isinstance(sampler, optuna.samplers.GPSampler) and sampler._n_startup_trials == startup
    tpe = build_sampler(load_space(write_space(tmp_path, VALID), ["search.num_samples=24"], settings_only=True))
    assert isinstance(tpe, optuna.samplers.TPESampler) and tpe._multivariate and tpe._n_startup_trials == 8
    nsga2 = build_sampler(load_space(path, ["search.num_samples=300"], settings_only=True))
    assert isinstance(nsga2, optuna.samplers.NSGAIISampler) and nsga2._population_size == 50


def test_the_config_own_point_is_evaluated_first(tmp_path, caplog):
    """With no ``initial_points`` the first point is the base config's own values of
    the searched parameters; a value no range holds (``auto`` thresholds) is left to
    the sampler, and said so. ``initial_points: []`` evaluates none first."""
    from splitvit.tune.space import first_points

    base = dict(TINY_BASE, train={"epochs": 1, "budget": {"weight": 2.0, "target_ratio": 0.4, "penalty": "hinge"}})
    path = write_space(tmp_path, VALID, base=base)
    space = load_space(path, settings_only=True)
    assert space.search.initial_points is None
    own = {
        "train.budget.weight": 2.0,
        "train.budget.target_ratio": 0.4,
        "train.policy.warmup_epochs": space.config().train.policy.warmup_epochs,
        "train.budget.penalty": "hinge",
        "model.timm_kwargs": TINY_BASE["model"]["timm_kwargs"],
    }
    with caplog.at_level(logging.INFO, logger="splitvit.tune.space"):
        assert first_points(space) == [own]  # the thresholds are auto: the sampler picks them
    assert "model.thresholds[1] = 'auto'" in caplog.text
    # a threshold in range joins the point; one off the step grid does not
    for thresholds, joins in ((0.5, True), ([0.4, 0.45], False)):
        space = load_space(
            write_space(tmp_path, VALID, base=dict(base, model=dict(base["model"], thresholds=thresholds))),
            settings_only=True,
        )
        assert ("model.thresholds[1]" in first_points(space)[0]) is joins
    # a value outside its range is the sampler's too
    low = load_space(
        write_space(
            tmp_path,
            VALID,
            base=dict(base, train=dict(base["train"], budget=dict(base["train"]["budget"], weight=50.0))),
        ),
        settings_only=True,
    )
    assert "train.budget.weight" not in first_points(low)[0] and "train.budget.target_ratio" in first_points(low)[0]
    # initial_points: [] evaluates none first; given points come first as given
    assert first_points(load_space(write_space(tmp_path, variant(search={"initial_points": []})))) == []
    given = dict(own, **{"model.thresholds[1]": 0.6})
    assert first_points(load_space(write_space(tmp_path, variant(search={"initial_points": [given]}), base=base))) == [
        given
    ]


def test_the_searcher_asks_the_config_own_point_first(tmp_path):
    """The partial point (thresholds left to the sampler) is the first trial Optuna
    proposes through Tune's searcher, its missing values sampled in range."""
    from splitvit.tune.search import build_searcher
    from splitvit.tune.space import first_points

    base = dict(TINY_BASE, train={"epochs": 1, "budget": {"weight": 2.0, "target_ratio": 0.4}})
    space = load_space(write_space(tmp_path, variant(parameters=NUMERIC), base=base), settings_only=True)
    searcher = build_searcher(space)
    first = searcher.suggest("t0")
    assert first["train.budget.weight"] == 2.0 and first["train.budget.target_ratio"] == 0.4
    assert space.parameters["model.thresholds[1]"].contains(first["model.thresholds[1]"])
    # a whole point goes through Tune's own points_to_evaluate
    full = dict(first_points(space)[0], **{"model.thresholds[1]": 0.5})
    space = load_space(
        write_space(tmp_path, variant(parameters=NUMERIC, search={"initial_points": [full]}), base=base),
        settings_only=True,
    )
    assert build_searcher(space)._points_to_evaluate == [full]


# ---------------------------------------------------------------------- invalid spaces
INVALID = [
    (
        "unknown distribution",
        variant(**{"parameters/train.lr": {"distribution": "gaussian", "low": 0.1, "high": 1}}),
        r"parameters\.train\.lr: unknown distribution 'gaussian'; "
        r"expected one of uniform, loguniform, int, categorical",
    ),
    (
        "low above high",
        variant(**{"parameters/train.lr": {"distribution": "loguniform", "low": 0.1, "high": 0.01}}),
        r"parameters\.train\.lr: low \(0\.1\) > high \(0\.01\)",
    ),
    (
        "unknown config key",
        variant(**{"parameters/train.lrr": {"distribution": "loguniform", "low": 1.0e-4, "high": 1.0e-2}}),
        r"parameters\.train\.lrr: not a config key; did you mean train\.lr\?$",
    ),
    (
        "unknown config section",
        variant(**{"parameters/optimizer.lr": {"distribution": "uniform", "low": 0.1, "high": 0.2}}),
        r"parameters\.optimizer\.lr: unknown config key: optimizer is not a config section",
    ),
    (
        "bound outside the config's range",
        variant(**{"parameters/train.budget.target_ratio": {"distribution": "uniform", "low": 0.2, "high": 1.5}}),
        r"parameters\.train\.budget\.target_ratio: its high bound is not a valid config value: "
        r"train\.budget\.target_ratio: .*\(0, 1\]",
    ),
    (
        "threshold bound outside [0, 1]",
        variant(**{"parameters/model.thresholds[0]": {"distribution": "uniform", "low": -0.5, "high": 0.5}}),
        r"parameters\.model\.thresholds\[0\]: its low bound is not a valid config value: model\.thresholds",
    ),
    (
        "threshold index past the levels",
        variant(**{"parameters/model.thresholds[5]": {"distribution": "uniform", "low": 0.1, "high": 0.5}}),
        r"parameters\.model\.thresholds\[5\]: index 5 is out of range: model\.thresholds has 2 entries$",
    ),
    (
        "categorical choice the config rejects",
        variant(
            **{"parameters/train.budget.penalty": {"distribution": "categorical", "choices": ["squared", "linear"]}}
        ),
        r"parameters\.train\.budget\.penalty: choice 'linear' is not a valid config value",
    ),
    (
        "loguniform from zero",
        variant(**{"parameters/train.lr": {"distribution": "loguniform", "low": 0, "high": 0.1}}),
        r"parameters\.train\.lr\.low: a loguniform parameter needs low > 0",
    ),
    (
        "int with fractional bounds",
        variant(**{"parameters/train.epochs": {"distribution": "int", "low": 1.5, "high": 3}}),
        r"parameters\.train\.epochs\.low: an int parameter needs integer bounds",
    ),
    (
        "a setting the distribution lacks",
        variant(**{"parameters/train.lr": {"distribution": "uniform", "low": 0.1, "high": 0.2, "choices": [1]}}),
        r"parameters\.train\.lr\.choices: not a setting of a uniform parameter",
    ),
    (
        "no bounds",
        variant(**{"parameters/train.lr": {"distribution": "uniform", "low": 0.1}}),
        r"parameters\.train\.lr: a uniform parameter needs low and high",
    ),
    (
        "empty categorical",
        variant(**{"parameters/train.budget.penalty": {"distribution": "categorical", "choices": []}}),
        r"parameters\.train\.budget\.penalty\.choices: a categorical parameter needs a non-empty list",
    ),
    ("unknown section", variant(searchh={"num_samples": 2}), r"searchh: unknown section; did you mean search\?"),
    ("missing base", {k: v for k, v in VALID.items() if k != "base"}, r"base: name the experiment config"),
    ("base not found", variant(base="nowhere.yaml"), r"base: experiment config nowhere\.yaml not found"),
    ("nothing searched", variant(parameters={"train.epochs": 1}), r"parameters: nothing to search"),
    (
        "bad fixed value",
        variant(**{"parameters/train.epochs": 0}),
        r"parameters\.train\.epochs: must be >= 1",  # the key once
    ),
    (
        "stage-two thresholds outside [0, 1]",
        variant(stage_two={"low": 0.2, "high": 1.2}),
        r"stage_two: thresholds need 0 <= low <= high <= 1",
    ),
    ("unknown sampler", variant(search={"sampler": "cmaes"}), r"search\.sampler: unknown sampler 'cmaes'"),
    (
        "NSGA-II population at the trial count",
        variant(search={"num_samples": 16, "sampler": "nsga2", "population_size": 16}),
        r"search\.population_size: an NSGA-II population of 16 at or above the 16 trials never evolves: "
        r"that is random search; use sampler: auto",
    ),
    (
        "NSGA-II's default population above the trial count",
        variant(search={"num_samples": 50, "sampler": "nsga2"}),
        r"search\.sampler: an NSGA-II population of 50 \(NSGA-II's default population is 50\) at or above the 50",
    ),
    (
        "a population for another sampler",
        variant(search={"num_samples": 64, "population_size": 16}),
        r"search\.population_size: a setting of NSGA-II, and the sampler auto picks tpe for this space; remove it$",
    ),
    (
        "ASHA with two objectives",
        variant(search={"scheduler": "asha"}),
        r"search\.scheduler: ASHA is refused: it ranks one metric, .* truncated accuracy as a finished point "
        r"on the frontier; remove it$",
    ),
    (
        "an ASHA setting",
        variant(search={"grace_period": 2}),
        r"search\.grace_period: a setting of the ASHA scheduler, which the sweep no longer has: remove it$",
    ),
    ("zero trials", variant(search={"num_samples": 0}), r"search\.num_samples: must be >= 1, got 0"),
    (
        "empty trial resources",
        variant(search={"trial_resources": {"CPU": 0}}),
        r"search\.trial_resources: ask for some resource",
    ),
    (
        "initial point outside the bounds",
        variant(
            search={
                "initial_points": [
                    {
                        "train.budget.weight": 50.0,
                        "train.budget.target_ratio": 0.5,
                        "model.thresholds[1]": 0.5,
                        "train.policy.warmup_epochs": 1,
                        "train.budget.penalty": "squared",
                        "model.timm_kwargs": VALID["parameters"]["model.timm_kwargs"]["choices"][0],
                    }
                ]
            }
        ),
        r"search\.initial_points\[0\]\.train\.budget\.weight: 50\.0 is outside loguniform\[0\.1, 10\.0\]",
    ),
    (
        "reference point out of range",
        variant(pareto={"reference_point": {"accuracy": 1.5, "token_ratio": 1.0}}),
        r"pareto\.reference_point\.quality: must be in \[0, 1\]",
    ),
    (
        "unknown reference coordinate",
        variant(pareto={"reference_point": {"quality": 0.1, "token_rate": 1.0}}),
        r"pareto\.reference_point\.token_rate: unknown key; did you mean pareto\.reference_point\.token_ratio\?$",
    ),
    (
        "setting of the wrong type",
        variant(search={"num_samples": "three"}),
        r"search\.num_samples: expected int, got str 'three'$",
    ),
    (
        "list item of the wrong type",
        variant(baselines={"entropy_thresholds": [0.2, "high"]}),
        r"baselines\.entropy_thresholds\[1\]: expected float, got str 'high'$",
    ),
    (
        "choice only the model rejects",  # the space's points are fully validated, model included
        variant(**{"parameters/model.policy.kind": {"distribution": "categorical", "choices": ["learned", "smart"]}}),
        r"parameters\.model\.policy\.kind: choice 'smart' is not a valid config value: model\.policy\.kind: "
        r"must be one of learned, entropy, random, full, coarse, got 'smart'",
    ),
]


@pytest.mark.parametrize("space", [s for _, s, _ in INVALID], ids=[n for n, _, _ in INVALID])
def test_invalid_spaces_give_one_clear_error(tmp_path, space):
    expected = dict((id(s), m) for _, s, m in INVALID)[id(space)]
    path = write_space(tmp_path, space)
    with pytest.raises(SearchSpaceError) as info:
        load_space(path)
    message = str(info.value)
    assert message.startswith(f"search space {path}: "), message
    assert "\n" not in message  # one line, not a traceback's worth
    assert __import__("re").search(expected, message), message


def test_a_bad_space_stops_the_cli_before_ray(tmp_path, monkeypatch, capsys):
    """`splitvit sweep` on an invalid space exits 2 with the error, and never starts Ray."""
    import splitvit.train.ray_trainer as ray_trainer

    def no_ray(*args, **kwargs):  # pragma: no cover - reached only if validation comes too late
        raise AssertionError("Ray was started for an invalid search space")

    monkeypatch.setattr(ray_trainer, "init_ray", no_ray)
    # main() configures logging on this test's captured stderr: keep that handler out of later tests
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    bad_bounds = {"parameters/train.lr": {"distribution": "uniform", "low": 0.5, "high": 0.1}}
    path = write_space(tmp_path, variant(**bad_bounds))
    code = main(["sweep", str(path), "--set", f"storage.path={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"splitvit sweep: error: search space {path}: parameters.train.lr: low (0.5) > high (0.1)"
    assert not (tmp_path / "runs").exists()


def test_yaml_errors_and_missing_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("parameters: {train.lr: [\n")
    with pytest.raises(SearchSpaceError, match=r"<file>: not valid YAML"):
        load_space(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_space(tmp_path / "missing.yaml")


# ---------------------------------------------------------------------- the Pareto math
def test_pareto_indices_match_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        values = [(round(rng.random(), 2), float(rng.randint(1, 30))) for _ in range(rng.randint(1, 25))]
        expected = [i for i, v in enumerate(values) if not any(dominates(w, v) for w in values)]
        assert pareto_indices(values) == expected
    assert pareto_indices([(0.9, float("nan")), (0.5, 3.0)]) == [1]  # a diverged point is never on the frontier


def test_hypervolume_and_contributions():
    # two points: 0.9 accuracy at half the tokens, 0.8 at a quarter, reference (0, 1)
    assert hypervolume([(0.9, 0.5), (0.8, 0.25)]) == pytest.approx(0.9 * 0.5 + 0.8 * 0.25)
    assert hypervolume([(0.9, 0.5), (0.8, 0.25), (0.7, 0.6)]) == pytest.approx(0.65)  # a dominated point adds nothing
    assert hypervolume([(0.9, 1.2)]) == 0.0  # worse than the reference in tokens
    assert hypervolume([(0.9, 0.5)], reference=(0.5, 1.0)) == pytest.approx(0.4 * 0.5)
    points = [Point(0.9, 32.0, 0.5), Point(0.8, 16.0, 0.25), Point(0.7, 40.0, 0.6), Point(float("nan"), 1.0, 0.01)]
    total = annotate(points)
    assert total == pytest.approx(0.65)
    assert [p.on_frontier for p in points] == [True, True, False, False]
    # without the first point only the second's box (0.8 x 0.75) remains
    assert points[0].hv_contribution == pytest.approx(0.65 - 0.8 * 0.75)
    assert points[1].hv_contribution == pytest.approx(0.65 - 0.9 * 0.5)
    for a, b in itertools.combinations([p for p in points if p.on_frontier], 2):
        assert not dominates((a.quality, a.tokens_per_image), (b.quality, b.tokens_per_image))


def test_equal_points_are_one_place_on_the_frontier():
    # two threshold settings of one trial land on the same (quality, tokens): the
    # frontier keeps the first in frontier order (the trial's own evaluation), lists
    # the other as its tie, and the hypervolume contribution is the place's own
    own = Point(0.2578, 4.0, 0.25, kind="trial", trial_id="t1", thresholds=[0.5, 0.5])
    again = Point(0.2578, 4.0, 0.25, kind="threshold", trial_id="t1", thresholds=[0.7, 0.6])
    finer = Point(0.9, 16.0, 1.0, kind="trial", trial_id="t2")
    points = [again, finer, own]
    total = annotate(points)
    assert [p.on_frontier for p in points] == [False, True, True]
    assert frontier(points) == [own, finer]
    assert own.ties == [again.label()] and again.tie_of == own.label()
    assert "0.7" in again.label() and "t1" in again.label()
    # counted twice, each copy's contribution was 0; counted once, the place holds up its strip
    assert total == pytest.approx(0.2578 * 0.75)
    assert own.hv_contribution == pytest.approx(0.2578 * 0.75)
    # annotating again resets the ties (no duplicates after a second pass)
    annotate(points)
    assert own.ties == [again.label()]


def test_point_names_and_registry_aliases_read_as_budgets():
    from splitvit.tune.mlflow_records import budget_aliases, point_run_name

    assert point_run_name("ab_00003", 0.4213, [0.52, 0.611]) == "42% tokens · ab_00003 · τ 0.52/0.61"
    assert point_run_name("ab_00003", None, []) == "ab_00003"  # a point without figures yet
    points = [Point(0.8, 4.0, 0.25), Point(0.81, 4.02, 0.2512), Point(0.9, 8.0, 0.5), Point(0.9, 16.0, float("nan"))]
    # two points that round to one share stay two aliases
    assert budget_aliases(points) == ["tokens-25pct", "tokens-25pct-2", "tokens-50pct", "tokens-unknown"]
