"""Recipes: the proven SPLIT settings, by name and version, with their evidence.

A recipe is one YAML file in this folder (``classification-v1.yaml``...), installed
with the package. It names its task, the settings it changes against the library's
defaults (dotted config keys, as ``--set`` takes them) and the evidence that proved
it: the study file and the committed JSON, the gap to the full-resolution control at
70% and 50% of the tokens, the speed at those points, the date and the commit.

Versions are never edited into something else: a better recipe is a new file
(``classification-v2``) and ``index.yaml`` says which version each task runs by
default (``current``), as torchvision's ``DEFAULT`` weights do. A config names one
with ``recipe: classification-v1``, the task alone (``recipe: classification``: its
current version) or ``recipe: none`` (the library's plain defaults); a learned policy
that names none gets its task's current recipe (:mod:`splitvit.config` applies it,
under every setting a file or the command line gives).

This module reads files only (no torch): the command line lists and checks recipes
in well under a second.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..jsontypes import JsonObject

FOLDER = Path(__file__).resolve().parent
INDEX_FILE = FOLDER / "index.yaml"
#: ``recipe: none``: the library's plain defaults (ablations, the old behaviour)
NO_RECIPE = "none"
_NAME = re.compile(r"^(?P<task>[a-z]+)-v(?P<version>\d+)$")


class RecipeError(ValueError):
    """An unknown recipe, a version that does not exist, or a malformed recipe file;
    the message names the recipes there are."""


@dataclass(frozen=True)
class EvidencePoint:
    """The recipe at one token share of the study that proved it (means over seeds).

    ``vs_control_points``: the recipe's quality minus the full-resolution control's,
    in points (positive: above the control); ``spread_points`` its standard deviation
    taken seed by seed. ``speed``: images/s as a multiple of full resolution's,
    measured side by side by the study's speed step (``backbone_speed``: a detector's
    backbone alone)."""

    share: float
    quality: float
    token_ratio: float
    vs_control_points: float
    spread_points: float
    speed: float | None = None
    backbone_speed: float | None = None


@dataclass(frozen=True)
class Evidence:
    """Where a recipe was proven: the study file and method, the committed result JSON
    (paths in this repository), when and at which commit it ran, and its figures.
    ``pace``: its fine-tuning images/s over the control's, seed by seed (the median
    fine-tune epoch of each, trained side by side in the study; None: not recorded).
    ``pace_result``: where ``result`` took the method's and the control's runs from an
    earlier invocation of the study, that invocation's JSON, which trained them side
    by side (the pace is read there; None: from ``result``)."""

    study: str
    method: str
    result: str
    date: str
    commit: str
    metric: str
    seeds: int
    control: float
    points: tuple[EvidencePoint, ...]
    pace: tuple[float, ...] | None = None
    pace_result: str | None = None

    def at(self, share: float) -> EvidencePoint | None:
        """The figures at ``share`` of the tokens (None where the study has none)."""
        return next((p for p in self.points if abs(p.share - share) < 1e-9), None)


@dataclass(frozen=True)
class Recipe:
    """One recipe file: ``name`` (``<task>-v<version>``), its ``task``, a one-line
    ``summary``, the ``settings`` it changes (dotted keys) and its ``evidence``."""

    name: str
    task: str
    version: int
    summary: str
    settings: JsonObject = field(hash=False)  # dotted keys, as the file gives them
    evidence: Evidence | None = None

    @property
    def current(self) -> bool:
        """Whether this is the version its task runs by default."""
        return current_recipes().get(self.task) == self.name


@functools.cache
def current_recipes() -> dict[str, str]:
    """Task -> the name of the recipe it runs by default (``index.yaml``'s ``current``)."""
    raw = _read(INDEX_FILE)
    current = raw.get("current") if isinstance(raw, dict) else None
    if not isinstance(current, dict) or not all(isinstance(v, str) for v in current.values()):
        raise RecipeError(f"{INDEX_FILE}: expected 'current: {{task: recipe-name}}'")
    return dict(current)


def recipe_names() -> list[str]:
    """Every recipe there is, by task, then version."""
    names = [p.stem for p in FOLDER.glob("*.yaml") if _NAME.match(p.stem)]
    return sorted(names, key=lambda n: (n.rsplit("-v", 1)[0], int(n.rsplit("-v", 1)[1])))


def load_recipe(name: str) -> Recipe:
    """The recipe ``name``: ``<task>-v<N>``, or a task alone for its current version.

    Raises :class:`RecipeError` naming the recipes there are for an unknown name or a
    version that does not exist."""
    name = current_recipes().get(name, name)
    return _load(name)


def resolve_name(requested: str | None, task: str) -> str | None:
    """The recipe a config runs: ``requested`` (a name, a task, ``none``) or, when it
    names none, ``task``'s current recipe. None for ``none``, and for a task with no
    recipe. Raises :class:`RecipeError` for an unknown name or a recipe of another
    task than ``task``."""
    if requested == NO_RECIPE:
        return None
    if requested is None:
        return current_recipes().get(task)
    recipe = load_recipe(requested)
    if recipe.task != task:
        same = [n for n in recipe_names() if n.startswith(f"{task}-v")]
        raise RecipeError(
            f"{recipe.name} is a {recipe.task} recipe and this config's model.task is {task}; "
            f"{task} recipes: {', '.join(same) or 'none'} (or recipe: none)"
        )
    return recipe.name


@functools.cache
def _load(name: str) -> Recipe:
    path = FOLDER / f"{name}.yaml"
    if not _NAME.match(name) or not path.is_file():
        raise RecipeError(_unknown(name))
    raw = _read(path)
    if not isinstance(raw, dict) or raw.get("name") != name:
        raise RecipeError(f"{path}: a recipe file is a mapping whose name is {name!r}")
    settings = raw.get("settings")
    if not isinstance(settings, dict) or not all(isinstance(k, str) and "." in k for k in settings):
        raise RecipeError(f"{path}: settings: expected a mapping of dotted config keys (train.lr: ...)")
    task, version = name.rsplit("-v", 1)
    if raw.get("task") != task:
        raise RecipeError(f"{path}: task: expected {task!r} (the name's), got {raw.get('task')!r}")
    return Recipe(
        name=name,
        task=task,
        version=int(version),
        summary=str(raw.get("summary") or ""),
        settings=dict(settings),
        evidence=_evidence(raw.get("evidence"), path),
    )


def _evidence(raw: Any, path: Path) -> Evidence | None:
    if raw is None:
        return None
    try:
        points = tuple(EvidencePoint(**point) for point in raw.pop("points"))
        pace = raw.pop("pace", None)
        return Evidence(**raw, points=points, pace=None if pace is None else tuple(pace))
    except KeyError as exc:  # str() of a KeyError is the bare key in quotes
        raise RecipeError(f"{path}: evidence: missing {exc.args[0]!r}") from None
    except (TypeError, AttributeError) as exc:
        raise RecipeError(f"{path}: evidence: {exc}") from None


def _unknown(name: str) -> str:
    known = recipe_names()
    match = _NAME.match(name)
    if match and any(n.startswith(f"{match['task']}-v") for n in known):
        same = [n for n in known if n.startswith(f"{match['task']}-v")]
        return f"no version v{match['version']} of the {match['task']} recipe; there are {', '.join(same)}"
    tasks = ", ".join(current_recipes())
    return f"unknown recipe {name!r}; known: {', '.join(known)} (or a task for its current version: {tasks}; or none)"


def _read(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RecipeError(f"{path}: {exc}") from None
