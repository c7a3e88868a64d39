"""The settings' old key names (before they were grouped by what they steer: issue 60)
read as the new ones wherever settings enter, through the one table
:data:`splitvit.config.LEGACY_KEYS`: a file's sections, dotted layers (``--set``, a
study's entries), flat records (a study's stored run settings), a search space's
parameters, a sweep's saved plan and a checkpoint's spec. One deprecation line per
load names each old key; both spellings in one config are an error naming both."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from splitvit import config as config_module
from splitvit.config import (
    LEGACY_KEYS,
    ConfigError,
    ExperimentConfig,
    PolicyConfig,
    inert_keys,
    legacy_flat,
    load_config,
    upgrade_flat,
    upgrade_sections,
)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "jobs" / "configs" / "smoke.yaml"

#: a value for every old key that differs from its default (so that a mapping that
#: dropped it would show), and is valid beside the others
VALUES = {
    "model.policy": "entropy",
    "model.policy_depth": 1,
    "model.policy_width": 64,
    "model.policy_level_context": True,
    "model.policy_feature_grad": True,
    "model.policy_fine_evidence": True,
    "model.policy_evidence_pooling": "soft",
    "model.budget_conditioned": True,
    "train.target_ratio": 0.3,
    "train.lambda_budget": 2.5,
    "train.penalty": "hinge",
    "train.target_ratio_range": [0.2, 0.6],
    "train.teacher": "attention",
    "train.teacher_weight": 0.5,
    "train.teacher_targets": "nested",
    "train.teacher_every": 3,
    "train.teacher_scope": "batch",
    "train.teacher_context": 0,
    "train.distill_weight": 0.7,
    "train.distill_temperature": 2.0,
    "train.warmup_epochs": 2,
    "train.warmup_min_split": 0.4,
    "train.policy_lr_scale": 5.0,
    "train.policy_epochs": 0,
    "train.policy_lead_epochs": 0,
}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees its own deprecation lines (a source warns once per process)."""
    monkeypatch.setattr(config_module, "_WARNED", set())


def _flat(config: ExperimentConfig) -> dict:
    return {k: v for k, v in config.flat(redact=False).items() if k != "storage.name"}


def _nested(dotted: dict) -> dict:
    """Dotted keys as a file's sections (``train.teacher_weight`` -> ``{train: {teacher_weight: ...}}``)."""
    raw: dict = {}
    for key, value in dotted.items():
        section, rest = key.split(".", 1)
        node = raw.setdefault(section, {})
        *parents, last = rest.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return raw


def test_every_old_key_is_in_the_table_and_has_a_test_value():
    assert set(VALUES) == set(LEGACY_KEYS)
    new_keys = set(ExperimentConfig(recipe="none").flat(redact=False))
    assert set(LEGACY_KEYS.values()) <= new_keys  # every target is a key of today's config


@pytest.mark.parametrize("old", sorted(LEGACY_KEYS))
def test_each_old_key_loads_to_the_config_its_new_key_gives(old, caplog):
    """Flat (``--set``) and nested (a file's sections): the old key's config is the new key's."""
    new = LEGACY_KEYS[old]
    value = VALUES[old]
    extra = {"recipe": "none"}  # the library's defaults under both: only the key differs
    if old == "model.policy_evidence_pooling":
        extra["model.policy.fine_evidence"] = True  # soft pooling pools the fine evidence
    with caplog.at_level(logging.WARNING, logger="splitvit.config"):
        by_new = ExperimentConfig.from_dict(None, _sets({**extra, new: value}))
    assert not [r for r in caplog.records if "old setting names" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="splitvit.config"):
        by_old_flat = ExperimentConfig.from_dict(None, _sets({**extra, old: value}))
    lines = [r.getMessage() for r in caplog.records if "old setting names" in r.getMessage()]
    assert len(lines) == 1 and f"{old} -> {new}" in lines[0]
    caplog.clear()
    nested = _nested({k: v for k, v in {**extra, old: value}.items() if k != "recipe"})
    with caplog.at_level(logging.WARNING, logger="splitvit.config"):
        by_old_nested = ExperimentConfig.from_dict({"recipe": "none", **nested}, source="file old.yaml")
    lines = [r.getMessage() for r in caplog.records if "old setting names" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("file old.yaml") and f"{old} -> {new}" in lines[0]
    assert _flat(by_old_flat) == _flat(by_new) == _flat(by_old_nested)
    assert by_new.layers[new] == by_old_flat.layers[new] == "--set"


def _sets(dotted: dict) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in dotted.items()]


def test_a_file_of_old_keys_loads_as_its_new_form_with_one_line_naming_each(tmp_path, caplog):
    old = {k: v for k, v in VALUES.items()}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"recipe": "none", **_nested(old)}))
    with caplog.at_level(logging.WARNING, logger="splitvit.config"):
        loaded = load_config(path, ["train.epochs=2", "train.lambda_budget=3.0"])
    lines = [r.getMessage() for r in caplog.records if "old setting names" in r.getMessage()]
    assert len(lines) == 1, lines  # the file's and its --set items', one line naming where each was
    assert all(f"{o} -> {n}" in lines[0] for o, n in LEGACY_KEYS.items())
    assert f"in file {path}: " in lines[0] and lines[0].endswith(
        "; in --set: train.lambda_budget -> train.budget.weight"
    )
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"recipe": "none", **_nested({LEGACY_KEYS[k]: v for k, v in old.items()})}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="splitvit.config"):
        fresh = load_config(new, ["train.epochs=2", "train.budget.weight=3.0"])
    assert not [r for r in caplog.records if "old setting names" in r.getMessage()]
    assert _flat(loaded) == _flat(fresh)
    assert loaded.model.policy == PolicyConfig(
        kind="entropy",
        depth=1,
        width=64,
        level_context=True,
        feature_grad=True,
        fine_evidence=True,
        evidence_pooling="soft",
        budget_conditioned=True,
    )


@pytest.mark.parametrize(
    "raw, overrides, old, new",
    [
        ({"model": {"policy_depth": 1, "policy": {"depth": 2}}}, [], "model.policy_depth", "model.policy.depth"),
        (
            {"train": {"teacher": "attention", "teacher_weight": 1.0, "budget": {}}},
            ["train.teacher.kind=gradient"],
            None,
            None,
        ),
        ({}, ["train.lambda_budget=2", "train.budget.weight=3"], "train.lambda_budget", "train.budget.weight"),
        (
            {"train": {"target_ratio": 0.3, "budget": {"target_ratio": 0.4}}},
            [],
            "train.target_ratio",
            "train.budget.target_ratio",
        ),
        ({"train": {"teacher": {"kind": "gradient"}, "teacher_weight": 2.0}}, [], None, None),
    ],
)
def test_both_spellings_in_one_config_is_an_error_naming_both(raw, overrides, old, new):
    if old is None:  # old and new keys of different settings, or across layers: no clash
        ExperimentConfig.from_dict({"recipe": "none", **raw}, overrides)
        return
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict({"recipe": "none", **raw}, overrides)
    assert err.value.key == new and old in err.value.reason


def test_a_name_where_a_section_is_now_maps_to_its_kind_and_a_mapping_is_the_section():
    assert upgrade_flat({"model.policy": "full"}) == {"model.policy.kind": "full"}
    assert upgrade_flat({"model.policy": {"kind": "full"}}) == {"model.policy": {"kind": "full"}}
    assert upgrade_sections({"train": {"teacher": "objects"}}, warn=False) == {
        "train": {"teacher": {"kind": "objects"}}
    }
    assert upgrade_sections({"train": {"teacher": {"kind": "objects"}}}, warn=False) == {
        "train": {"teacher": {"kind": "objects"}}
    }
    # an index stays on its key; a search space's distribution under a name key is a value
    assert upgrade_flat({"train.target_ratio_range[1]": 0.9}) == {"train.budget.ratio_range[1]": 0.9}
    space = {"model.policy": {"distribution": "categorical", "choices": ["learned", "entropy"]}}
    assert list(upgrade_flat(space)) == ["model.policy.kind"]


def test_a_recipe_keeps_its_old_names_and_loads_silently(caplog):
    from splitvit.recipes import load_recipe

    assert "train.teacher" in load_recipe("classification-v1").settings  # a versioned record: never edited
    with caplog.at_level(logging.WARNING, logger="splitvit.config"):
        config = load_config(SMOKE, ["recipe=classification-v1"])
    assert config.recipe == "classification-v1" and config.train.teacher.kind == "attention"
    assert config.layers["train.teacher.kind"] == "recipe classification-v1"
    assert not [r for r in caplog.records if "old setting names" in r.getMessage()]


def test_inert_keys_and_records_read_old_names_as_new():
    old = {"model.policy": "full", "train.lambda_budget": 2.0}
    inert = inert_keys(old)
    assert {"train.budget.weight", "model.policy.depth", "train.teacher.kind"} <= inert
    assert "train.policy.lr_scale" not in inert  # it moves SplitViT's own modules under every policy
    assert inert_keys({"model.policy.kind": "learned"}) == {"recipe"}
    # the reference digest's names: the old ones, so that a trained reference is found again
    new = upgrade_flat({**old, "train.epochs": 3})
    assert legacy_flat(new) == {**old, "train.epochs": 3}


def test_a_stored_runs_old_settings_are_not_stale_against_the_same_settings_now():
    """A study's stored run settings (committed results, run folders) from before the
    keys were grouped compare with today's resolved settings key by key."""
    now = json.loads(json.dumps(load_config(SMOKE).flat(redact=False)))
    old_names = {new: old for old, new in LEGACY_KEYS.items()}
    stored = {old_names.get(k, k): v for k, v in now.items()}
    assert "train.teacher" in stored and "model.policy_depth" in stored
    assert upgrade_flat(stored) == now


def test_an_old_checkpoint_spec_with_flat_policy_keys_loads(tmp_path):
    """A checkpoint saved before the policy's settings were one mapping (``policy:
    learned``, ``policy_depth: 1``, ``budget_conditioned: true``...) loads with them."""
    import torch

    from splitvit.model import SplitViT
    from splitvit.model.spec import checkpoint_spec, upgrade_spec

    from .helpers import tiny_model

    model = tiny_model(width=32, level_context=True, budget_conditioned=True)
    path = tmp_path / "model.pt"
    model.save(path)
    payload = torch.load(path, map_location="cpu", weights_only=False)
    assert payload["spec"]["policy"]["width"] == 32  # saved today: one mapping
    settings = payload["spec"].pop("policy")
    payload["spec"].update(
        policy=settings["kind"],
        policy_depth=settings["depth"],
        policy_width=settings["width"],
        policy_level_context=settings["level_context"],
        policy_feature_grad=settings["feature_grad"],
        policy_fine_evidence=settings["fine_evidence"],
        policy_evidence_pooling=settings["evidence_pooling"],
        budget_conditioned=settings["budget_conditioned"],
    )
    assert upgrade_spec(payload["spec"])["policy"] == settings
    torch.save(payload, path)
    loaded = SplitViT.load(path)
    assert loaded.policy_config == model.policy_config and loaded.uses_budget
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True)
    )
    # another policy by name keeps the saved settings but the kind, and leaves the policy's weights out
    assert checkpoint_spec(payload, {"policy": "entropy"}).policy == PolicyConfig(**{**settings, "kind": "entropy"})
    entropy = SplitViT.load(path, policy="entropy")
    assert entropy.policy.name == "entropy" and entropy.policy_config.depth == settings["depth"]


def test_a_sweep_plan_saved_under_the_old_names_resumes_as_the_same_space():
    """A sweep's saved plan (its space's parameters, fixed values and initial points)
    from before the keys were grouped compares with today's space by the new names."""
    from splitvit.tune.location import _upgrade_plan

    old = {
        "parameters": {
            "train.lambda_budget": {"distribution": "loguniform", "low": 0.1, "high": 10.0},
            "model.policy": {"distribution": "categorical", "choices": ["learned", "entropy"]},
        },
        "fixed": {"train.warmup_epochs": 0, "train.teacher": "attention", "train.epochs": 3},
        "search": {"num_samples": 4, "initial_points": [{"train.lambda_budget": 2.0, "model.policy": "learned"}]},
    }
    assert _upgrade_plan(old) == {
        "parameters": {
            "train.budget.weight": {"distribution": "loguniform", "low": 0.1, "high": 10.0},
            "model.policy.kind": {"distribution": "categorical", "choices": ["learned", "entropy"]},
        },
        "fixed": {"train.policy.warmup_epochs": 0, "train.teacher.kind": "attention", "train.epochs": 3},
        "search": {"num_samples": 4, "initial_points": [{"train.budget.weight": 2.0, "model.policy.kind": "learned"}]},
    }
